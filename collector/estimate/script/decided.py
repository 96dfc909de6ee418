"""Whether a placeholder decided what a script's trace allocated.

Values read from fake tensors (``loss.item()``, ``int(i)`` of an index, ``bool(mask.any())``) have
no data behind them: the child answers them with placeholders. A placeholder that chooses a shape,
a length or a branch chooses the figures — silently, unless it is caught. It is caught by
tracing the script a second time with other placeholders (each read its own integer and float,
booleans true: :class:`collector.estimate.fakes.Reads`) and comparing: the same figures, and no
placeholder decided them; other figures, and the first read after which the two traces'
allocations part is named (each read carries a digest of the allocations before it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from collector.model.prediction import Estimate
from collector.model.units import size
from collector.model.untrusted import inert

__all__ = ["Trace", "decided"]

TRAIL_READ_MAX = 5000  # reads read back from a child's result (it keeps as many)


@dataclass(frozen=True)
class Trace:
    """One child's trace: its estimate (None: no step traced), the error that stopped it ("":
    none), how many values it answered with placeholders, each read's ``(place, digest)`` and
    the digest of all its allocations."""

    estimate: Estimate | None
    error: str = ""
    answered: int = 0
    trail: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    end: str = ""

    @classmethod
    def reads_from(cls, d: Any) -> dict[str, Any]:
        """The ``reads`` part of a child's result, as untrusted data (bounded, inert)."""
        if not isinstance(d, dict):
            return {}
        trail = []
        for x in list(d.get("trail") or [])[:TRAIL_READ_MAX]:
            if isinstance(x, (list, tuple)) and len(x) == 2:
                trail.append((inert(str(x[0]))[:200], str(x[1])[:32]))
        return {
            "answered": max(0, int(d.get("answered") or 0)),
            "trail": tuple(trail),
            "end": str(d.get("end") or "")[:32],
        }


def _figures(e: Estimate | None) -> Any:
    """What the user acts on: per-kind peaks of both steps, what stays, torch's peaks."""
    if e is None:
        return None
    steps = [(s.allocated_peak, s.reserved_peak, s.allocated_end) for s in e.steps]
    return (e.first, e.steady, e.at_end, e.optimizer_state_managed, steps)


def _parting(a: Trace, b: Trace) -> str | None:
    """The place of the read after which the two traces' allocations part ("": the read's place
    is not known; None: they part before any value was read)."""
    for i, ((_, da), (_, db)) in enumerate(zip(a.trail, b.trail, strict=False)):
        if da != db:
            return a.trail[i - 1][0] if i else None
    n = min(len(a.trail), len(b.trail))
    return a.trail[n - 1][0] if n else None


def _peak(e: Estimate | None) -> str:
    if e is None:
        return "no step traced"
    r = e.reserved_peak
    return f"torch reserved {size(r)}" if r is not None else f"a peak of {size(e.largest_peak)}"


def decided(a: Trace, b: Trace) -> str:
    """The line that says which read decided the figures and how far apart the two traces are
    ("" when trace ``b``, with other placeholders, gives ``a``'s figures)."""
    if _figures(a.estimate) == _figures(b.estimate) and bool(a.error) == bool(b.error):
        return ""
    where = _parting(a, b)
    if where is None:
        return (
            "two traces of the script allocated differently before it read any value: its "
            "shapes are not the same from run to run (a random length, batch or branch), so "
            "these figures are one run's"
        )
    at = f"at {where}" if where else "in a library the script calls"
    if b.error and not a.error:
        other = f"an error ({b.error.split(': ', 1)[-1][:160]})"
    else:
        other = _peak(b.estimate)
    return (
        f"a value read from a fake tensor {at} decides what is allocated (the estimate has no "
        f"data: it answers such reads with placeholders, and other placeholders give {other} "
        f"where these give {_peak(a.estimate)}); the real run's values decide it: make the "
        "value from host data (NumPy, Python) where the script can"
    )
