"""Plans that make a step fit (``stepmem estimate --plan``): the knobs a plan turns
(:class:`Knob`, one vocabulary: what it changes, whether the training stays the same, what it
costs), a plan traced and held against the card (:class:`Plan`), and the search's record
(:class:`PlanResult`). Built by :mod:`collector.estimate.plans`; rendered there too."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

__all__ = ["KNOBS", "Knob", "Plan", "PlanResult"]


class Knob(str, Enum):
    """A setting a plan changes. ``same``: the training stays the same (the same model,
    optimizer math and global batch: what is learned does not change, only how the GPU holds
    it); ``rank``: how much it asks of the user, cheapest first (the search's order and the
    tie-break of its ranking); ``flag``: the ``stepmem estimate`` flag it sets."""

    def __new__(cls, value: str, doc: str, same: bool, rank: int, flag: str) -> Knob:
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.__doc__ = doc
        obj.same = same  # type: ignore[attr-defined]
        obj.rank = rank  # type: ignore[attr-defined]
        obj.flag = flag  # type: ignore[attr-defined]
        return obj

    __str__ = str.__str__
    __format__ = str.__format__

    ALLOCATOR = (
        "allocator",
        "The caching allocator's expandable segments (PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:True): segments grow in place, no cached block is stranded.",
        True,
        0,
        "--alloc-conf",
    )
    MICRO_BATCH = (
        "micro_batch",
        "A smaller micro-batch, more of them accumulated: the global batch kept.",
        True,
        1,
        "--batch/--grad-accum",
    )
    CHECKPOINTING = (
        "checkpointing",
        "Activation checkpointing of every decoder layer: its forward recomputed in backward.",
        True,
        2,
        "--no-checkpointing dropped",
    )
    FSDP2 = (
        "fsdp2",
        "FSDP2 over more GPUs: parameters, gradients and optimizer state sharded.",
        True,
        3,
        "--shard/--world-size",
    )
    OPTIMIZER_8BIT = (
        "adamw_8bit",
        "bitsandbytes' 8-bit AdamW: the moments quantised block-wise.",
        False,
        4,
        "--optim",
    )
    PAGED_8BIT = (
        "paged_adamw_8bit",
        "bitsandbytes' paged 8-bit AdamW: large tensors' state in CUDA managed memory.",
        False,
        5,
        "--optim",
    )
    LORA = ("lora", "LoRA adapters on a frozen base (peft).", False, 6, "--lora-r")
    QLORA = (
        "qlora",
        "QLoRA: LoRA adapters on a frozen bitsandbytes NF4 base.",
        False,
        7,
        "--lora-r/--load-in-4bit",
    )
    SEQ_LEN = ("seq_len", "Shorter sequences (the last resort).", False, 8, "--seq-len")


KNOBS = tuple(k.value for k in Knob)


@dataclass(frozen=True)
class Plan:
    """A plan traced and held against the card: the knobs it turns and each change in words,
    the ``stepmem estimate`` arguments that check it, whether its step fits, torch's reserved
    peak (``need``) and NVML's, the headroom left, one step's FLOPs as torch's FLOP formulas
    counted them (None: not counted), what it costs in words, and whether its figures are a
    re-hold of another plan's trace (the allocator's settings differ only)."""

    knobs: tuple[Knob, ...]
    changes: tuple[str, ...]
    command: tuple[str, ...]
    fits: bool
    need: int
    nvml_peak: int | None
    headroom: int
    step_flops: int | None
    cost: str
    reheld: bool = False

    @property
    def same_training(self) -> bool:
        return all(k.same for k in self.knobs)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["knobs"] = [k.value for k in self.knobs]
        out["same_training"] = self.same_training
        return out


@dataclass(frozen=True)
class PlanResult:
    """A plan search: the card and what torch may use of it, the step as asked (its need and
    FLOPs), the plans that fit, ranked (the same training first, then the cheapest change),
    the plans traced that did not fit, the knobs not searched and why, and the work done
    (steps traced, plans re-held from a trace, seconds)."""

    card: str
    usable: int
    need: int
    fits: bool
    step_flops: int | None
    plans: tuple[Plan, ...]
    tried: tuple[Plan, ...]
    not_offered: tuple[str, ...]
    traces: int
    reheld: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["plans"] = [p.to_dict() for p in self.plans]
        out["tried"] = [p.to_dict() for p in self.tried]
        return out
