"""What a plan costs, said plainly: the step's FLOPs against the step as asked (each counted
with torch's FLOP formulas on the traced shapes: matrix products, convolutions, attention — a
count of work, not a time), what the knob changes of the training, and FSDP2's traffic."""

from __future__ import annotations

from typing import Any

from collector.model.kinds import MemoryKind
from collector.model.plans import Knob
from collector.model.prediction import Estimate
from collector.model.units import gib

__all__ = ["cost"]

_CHANGED = {
    Knob.OPTIMIZER_8BIT: "the moments kept in 8 bits, quantised block-wise (the update's "
    "arithmetic changes)",
    Knob.PAGED_8BIT: "8-bit moments, large tensors' state in managed memory the driver may page "
    "to the host (slower steps when it does)",
    Knob.LORA: "only the adapters train: the base model is frozen",
    Knob.QLORA: "only the adapters train, on a base rounded to 4 bits",
    Knob.SEQ_LEN: "each sample sees less context",
}


def cost(turn: tuple[tuple[Knob, Any], ...], est: Estimate, base: Estimate) -> str:
    """``turn``'s cost as a sentence: FLOPs against ``base`` (the step as asked), and what it
    changes or adds."""
    parts = [_flops(est.step_flops, base.step_flops, dict(turn))]
    for knob, v in turn:
        if knob is Knob.FSDP2:
            shards = (
                int(base.spec.get("world_size") or 1) if base.spec.get("shard") == "fsdp2" else 1
            )
            params = base.at_end.get(MemoryKind.PARAMETERS, 0) * shards  # the whole model's
            world = int(v)
            moved = 3 * params * (world - 1) // world
            parts.append(
                f"{world} GPUs; each rank moves about {gib(moved)} a micro-batch (the parameters "
                "all-gathered for forward and for backward, the gradients reduce-scattered)"
            )
        elif knob in _CHANGED:
            parts.append(_CHANGED[knob])
    return "; ".join(parts)


def _flops(mine: int | None, base: int | None, knobs: dict[Knob, Any]) -> str:
    if not mine or not base:
        return "FLOPs not counted"
    ratio = mine / base
    why = []
    if Knob.CHECKPOINTING in knobs:
        why.append("each layer's forward recomputed in backward")
    if Knob.MICRO_BATCH in knobs:
        _b, g = knobs[Knob.MICRO_BATCH]
        why.append(f"the same work in {g} smaller micro-batches, each kernel less busy")
    if Knob.ALLOCATOR in knobs and len(knobs) == 1:
        why.append("no extra work")
    said = f"{ratio:.2f}× the FLOPs of the step as asked"
    return said + (f" ({'; '.join(why)})" if why else "")
