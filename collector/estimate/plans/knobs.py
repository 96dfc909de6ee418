"""What a plan turns: a :data:`Turn` (each :class:`~collector.model.plans.Knob` with its
value), the order they are tried in (:func:`walk`: the same training before a changed one,
cheap knobs before dear ones, singles before combinations), the flags each turn gives
(:func:`flags_of`), what it changes in words (:func:`words`) and which turns a fitting one makes
pointless (:func:`dominated`: a plan that changes more than one that already fits)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from collector.estimate.allocator_config import AllocatorConfig
from collector.estimate.request import EstimateFlags
from collector.estimate.spec import MAX_ACCUM, Spec
from collector.model.plans import Knob

__all__ = ["LORA_R", "Turn", "dominated", "flags_of", "walk", "with_expandable", "words"]

Turn = tuple[tuple[Knob, Any], ...]  # knobs and their values, in Knob order
LORA_R = 16  # the adapters' rank a LoRA or QLoRA plan trains (peft's examples use 8 to 64)
SEQ_FLOOR = 64  # the shortest sequence a plan offers
WORLDS = (2, 4, 8)  # FSDP2 plans: GPUs the model is sharded over
# a knob that does what another does and more: a plan with it changes at least as much
_IMPLIES = {Knob.QLORA: Knob.LORA, Knob.PAGED_8BIT: Knob.OPTIMIZER_8BIT}


def turn(*pairs: tuple[Knob, Any]) -> Turn:
    return tuple(sorted(pairs, key=lambda p: list(Knob).index(p[0])))


def micro_batches(spec: Spec) -> list[tuple[int, int]]:
    """Smaller micro-batches keeping the global batch: ``(batch, grad_accum)``, each about half
    the one before, each dividing the global batch."""
    total, out, b = spec.batch * spec.grad_accum, [], spec.batch
    while b > 1:
        b = max(d for d in range(1, b // 2 + 1) if total % d == 0)
        if total // b <= MAX_ACCUM:
            out.append((b, total // b))
    return out


def walk(spec: Spec, kept: frozenset[Knob]) -> tuple[list[Turn], list[str]]:
    """The turns to try for ``spec``, in order (see the module doc), none turning a knob in
    ``kept``; and the knobs not tried, each with why. The allocator's expandable segments are
    not in the walk: every traced turn is also held again with them (no trace of its own)."""
    said: list[str] = [f"{k.value}: kept as asked (--keep)" for k in sorted(kept, key=_rank)]
    micro = [] if Knob.MICRO_BATCH in kept else micro_batches(spec)
    if Knob.MICRO_BATCH not in kept and not micro:
        said.append(f"{Knob.MICRO_BATCH.value}: the micro-batch is {spec.batch} already")
    ckpt = not spec.checkpointing and Knob.CHECKPOINTING not in kept
    same: list[Turn] = [turn((Knob.MICRO_BATCH, m)) for m in micro]
    if ckpt:
        same.append(turn((Knob.CHECKPOINTING, True)))
        same += [turn((Knob.CHECKPOINTING, True), (Knob.MICRO_BATCH, m)) for m in micro]
    same += _fsdp2(spec, kept, said)
    changed: list[Turn] = []
    for knob, value in _changes(spec, kept, said):
        changed.append(turn((knob, value)))
        if ckpt:
            changed.append(turn((knob, value), (Knob.CHECKPOINTING, True)))
        changed += [
            turn(
                (knob, value),
                *([(Knob.CHECKPOINTING, True)] if ckpt else []),
                (Knob.MICRO_BATCH, m),
            )
            for m in micro[:2]
        ]
    said += [
        "bf16 weights: not modelled (the finetune workload keeps fp32 weights under bf16 autocast)",
        "the optimizer's foreach/fused implementation: not modelled (torch's default is traced)",
    ]
    return same + changed, said


def _rank(k: Knob) -> int:
    return k.rank  # type: ignore[attr-defined,no-any-return]


def _fsdp2(spec: Spec, kept: frozenset[Knob], said: list[str]) -> list[Turn]:
    if Knob.FSDP2 in kept:
        return []
    if spec.lora_r or spec.load_in_4bit:
        said.append(f"{Knob.FSDP2.value}: LoRA and 4-bit bases under FSDP2 are not modelled")
        return []
    if spec.optim != "adamw_torch":
        said.append(f"{Knob.FSDP2.value}: bitsandbytes' optimizers under FSDP2 are not modelled")
        return []
    now = spec.world_size if spec.shard == "fsdp2" else 1
    return [turn((Knob.FSDP2, n * now)) for n in WORLDS]


def _changes(spec: Spec, kept: frozenset[Knob], said: list[str]) -> list[tuple[Knob, Any]]:
    """The knobs that change the training, each once, cheapest first."""
    out: list[tuple[Knob, Any]] = []
    sharded = spec.shard != "none"
    for knob, optim in ((Knob.OPTIMIZER_8BIT, "adamw_8bit"), (Knob.PAGED_8BIT, "paged_adamw_8bit")):
        if (
            knob in kept
            or spec.optim == optim
            or (knob is Knob.OPTIMIZER_8BIT and spec.optim != "adamw_torch")
        ):
            continue
        if sharded:
            said.append(f"{knob.value}: bitsandbytes' optimizers under FSDP2 are not modelled")
            continue
        out.append((knob, optim))
    for knob, already in ((Knob.LORA, spec.lora_r > 0), (Knob.QLORA, spec.load_in_4bit)):
        if knob in kept or already:
            continue
        if sharded or spec.workload != "finetune":
            said.append(f"{knob.value}: LoRA is modelled for the finetune workload on one GPU")
            continue
        out.append((knob, (spec.lora_r or LORA_R, _lora_targets(spec))))
    if Knob.SEQ_LEN not in kept:
        s = spec.seq_len // 2 // SEQ_FLOOR * SEQ_FLOOR
        while s >= SEQ_FLOOR and len([k for k, _ in out if k is Knob.SEQ_LEN]) < 2:
            out.append((Knob.SEQ_LEN, s))
            s = s // 2 // SEQ_FLOOR * SEQ_FLOOR
    return out


def _lora_targets(spec: Spec) -> str | None:
    """The modules a LoRA plan adapts: the user's, else stepmem's default (every projection of
    a Llama-style model), else — a model without those names — peft's own default for its
    model type (GPT-2: ``c_attn``). None: the default."""
    if spec.lora_targets:
        return ",".join(spec.lora_targets)
    kind = (spec.config or {}).get("model_type")
    if not kind:
        return None
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    except ImportError:
        return None
    from collector.estimate.lora import DEFAULT_TARGETS

    names = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(kind)
    if not names or set(names) <= set(DEFAULT_TARGETS):
        return None
    return ",".join(names)


def with_expandable(conf: str) -> str:
    """An allocator setting string with ``expandable_segments:True`` (replacing a False)."""
    items = [
        i
        for i in (x.strip() for x in conf.split(","))
        if i and not i.replace(" ", "").startswith("expandable_segments:")
    ]
    return ",".join([*items, "expandable_segments:True"])


def flags_of(flags: EstimateFlags, t: Turn, conf: str) -> EstimateFlags:
    """The flags of a plan: the user's (``conf``: the allocator settings the estimate used,
    as a string) with ``t``'s knobs set; no search, no plan (the command checks one step)."""
    out = replace(flags, plan=False, keep=None)
    for knob, v in t:
        if knob is Knob.MICRO_BATCH:
            out = replace(out, batch=v[0], grad_accum=v[1])
        elif knob is Knob.CHECKPOINTING:
            out = replace(out, no_checkpointing=False)
        elif knob is Knob.FSDP2:
            out = replace(out, shard="fsdp2", world_size=v)
        elif knob in (Knob.OPTIMIZER_8BIT, Knob.PAGED_8BIT):
            out = replace(out, optim=v)
        elif knob in (Knob.LORA, Knob.QLORA):
            out = replace(out, lora_r=v[0], lora_targets=v[1] or flags.lora_targets)
            out = replace(out, load_in_4bit=True) if knob is Knob.QLORA else out
        elif knob is Knob.SEQ_LEN:
            out = replace(out, seq_len=v)
        elif knob is Knob.ALLOCATOR:
            out = replace(out, alloc_conf=with_expandable(conf))
    return out


def words(t: Turn, spec: Spec, allocator: AllocatorConfig) -> tuple[str, ...]:
    """What ``t`` changes of ``spec``, a phrase a knob."""
    out = []
    for knob, v in t:
        if knob is Knob.MICRO_BATCH:
            out.append(
                f"micro-batch {v[0]} × {v[1]} accumulated (was {spec.batch} × {spec.grad_accum}; "
                f"global batch {spec.batch * spec.grad_accum} kept)"
            )
        elif knob is Knob.CHECKPOINTING:
            out.append("activation checkpointing on")
        elif knob is Knob.FSDP2:
            out.append(f"FSDP2 over {v} GPUs")
        elif knob in (Knob.OPTIMIZER_8BIT, Knob.PAGED_8BIT):
            out.append(f"optimizer {v} (was {spec.optim})")
        elif knob in (Knob.LORA, Knob.QLORA):
            on = f" of {v[1]}" if v[1] else ""
            base = "a frozen NF4 base" if knob is Knob.QLORA else "a frozen base"
            out.append(f"{'QLoRA: ' if knob is Knob.QLORA else ''}LoRA rank {v[0]}{on} on {base}")
        elif knob is Knob.SEQ_LEN:
            out.append(f"sequence length {v} (was {spec.seq_len})")
        elif knob is Knob.ALLOCATOR:
            out.append(
                "expandable_segments:True"
                + (" (was " + allocator.describe() + ")" if allocator.max_split_size else "")
            )
    return tuple(out)


def dominated(t: Turn, fitting: list[Turn]) -> bool:
    """Whether ``t`` changes at least what a fitting turn changes (and as far): pointless."""
    mine = dict(t)
    for knob, implied in _IMPLIES.items():
        if knob in mine:
            mine.setdefault(implied, mine[knob])
    return any(all(k in mine and _as_far(k, mine[k], v) for k, v in f) for f in fitting)


def _as_far(k: Knob, mine: Any, theirs: Any) -> bool:
    if k is Knob.MICRO_BATCH:
        return bool(mine[0] <= theirs[0])
    if k is Knob.SEQ_LEN:
        return bool(mine <= theirs)
    if k is Knob.FSDP2:
        return bool(mine >= theirs)
    return True
