"""What a quantised weight holds besides itself: its quantisation state, which is part of the
weight (the probe's ledger and the estimate count it as parameters, where torch's tracker would
not see it or take it for activations).

bitsandbytes 0.50.2 lays a 4-bit weight (``Params4bit``) out as the packed uint8 weight (half a
byte an element) and a ``quant_state``: ``absmax`` (float32 per block of 64, or with double
quantisation uint8, with a nested ``state2`` of its own ``absmax`` per 256 blocks and the
256-entry dynamic ``code``), the 16-entry NF4/FP4 ``code`` and an ``offset``; an 8-bit weight
(``Int8Params``) keeps its scales in ``SCB``. Read by attribute, without importing torch or
bitsandbytes: the probe's process may have neither loaded.
"""

from __future__ import annotations

from typing import Any

__all__ = ["parameter_counts", "quantisation_tensors"]

_STATE_TENSORS = ("absmax", "code", "offset")


def _tensor(x: Any) -> bool:
    return x is not None and hasattr(x, "untyped_storage") and hasattr(x, "element_size")


def quantisation_tensors(weight: Any) -> list[Any]:
    """The tensors of ``weight``'s quantisation state (empty: not a quantised weight)."""
    out = []
    qs = getattr(weight, "quant_state", None)
    for state in (qs, getattr(qs, "state2", None)):
        if state is None:
            continue
        for name in _STATE_TENSORS:
            t = getattr(state, name, None)
            if _tensor(t):
                out.append(t)
    scb = getattr(weight, "SCB", None)
    if _tensor(scb):
        out.append(scb)
    return out


def _elements(weight: Any) -> int:
    """Elements of ``weight`` as the model has them: a 4-bit weight's packed uint8 holds two
    per byte, and its ``quant_state.shape`` is the weight's own shape."""
    shape = getattr(getattr(weight, "quant_state", None), "shape", None)
    if shape is not None:
        n = 1
        for d in shape:
            n *= int(d)
        return n
    return int(weight.numel())


def parameter_counts(params: Any) -> tuple[int, int]:
    """(parameters, trainable ones) of ``params``, each counted once, as peft's
    ``print_trainable_parameters`` counts them: a 4-bit base by its weights' shapes."""
    seen = {id(p): p for p in params}
    total = sum(_elements(p) for p in seen.values())
    trainable = sum(_elements(p) for p in seen.values() if getattr(p, "requires_grad", False))
    return total, trainable
