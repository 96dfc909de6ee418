"""The largest micro-batch (``--max-batch``) or sequence length (``--max-seq-len``) whose step
fits a GPU (:class:`~collector.estimate.fit.Target`), found by tracing a few sizes.

What a step needs (torch's reserved peak, from the allocator model) grows about linearly with
the batch and, with flash or memory-efficient attention, with the sequence length. So: trace two
sizes, extrapolate the line to the usable bytes, trace the size it names, and keep going —
each new size between the largest that fits and the smallest that does not, read off the line
through the two nearest traces — until those two are one step apart (a sequence, 64 tokens).
Usually four traces: the two to draw the line, the answer, and the one above it that does not
fit. Inside the bracket every other try halves it, so a line that misses (a step that fits only
by the allocator freeing its cache, whose reserved peak is above the limit) still closes in
within the trace budget. Every answer is a traced one: nothing
extrapolated is reported as fitting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from collector.estimate.fit import Target
from collector.estimate.spec import Spec
from collector.model.errors import EstimateError
from collector.model.prediction import Estimate, SearchResult, Traced
from collector.model.units import gib

__all__ = ["AXES", "MAX_TRACES", "SEQ_STEP", "largest", "largest_of"]

AXES = ("batch", "seq_len")
SEQ_STEP = 64  # sequence lengths are searched in multiples of this
MAX_TRACES = 12
MAX_VALUE = 1 << 20  # the most sequences a micro-batch, or tokens a sequence, searched


def _fits(e: Estimate) -> bool:
    return bool(e.fit and e.fit.fits)


def _need(e: Estimate) -> int:
    return e.fit.need if e.fit is not None else 0


def largest(
    spec: Spec,
    axis: str,
    target: Target,
    trace: Callable[[Spec], Estimate],
    progress: Callable[[str], None] | None = None,
) -> tuple[Estimate | None, SearchResult]:
    """The estimate of the largest ``axis`` value that fits ``target`` (None: not even the
    smallest does) and the search as data (each traced value, its need and whether it fit).
    ``trace(spec)`` estimates one spec held against ``target``."""
    return largest_of(
        getattr(spec, axis),
        axis,
        target,
        lambda v: trace(dataclasses.replace(spec, **{axis: v})),
        progress,
    )


def largest_of(
    start: int,
    axis: str,
    target: Target,
    trace_at: Callable[[int], Estimate],
    progress: Callable[[str], None] | None = None,
) -> tuple[Estimate | None, SearchResult]:
    """:func:`largest` of anything traced at a size: ``trace_at(v)`` estimates size ``v`` of
    ``axis`` held against ``target`` (a spec's, or a script's own option set to ``v``), the
    search starting from ``start``."""
    if axis not in AXES:
        raise EstimateError(f"cannot search {axis!r}: one of {', '.join(AXES)}")
    step = 1 if axis == "batch" else SEQ_STEP
    say = progress or (lambda _m: None)
    traced: dict[int, Estimate] = {}

    def run(v: int) -> Estimate:
        if v not in traced:
            e = trace_at(v)
            traced[v] = e
            say(
                f"{axis.replace('_', ' ')} {v}: needs {gib(_need(e))} of "
                f"{gib(target.usable)} — {'fits' if _fits(e) else 'does not fit'}"
            )
        return traced[v]

    first = max(step, start // step * step)
    run(first)
    if not _fits(traced[first]) and first != step:
        run(step)
    if not _fits(traced[min(traced)]):
        return None, _record(axis, step, target, traced, None)
    second = max(traced) * 2 if _fits(traced[max(traced)]) else (min(traced) + max(traced)) // 2
    run(_on_grid(second, step))
    bisect = False
    while len(traced) < MAX_TRACES:
        lo = max((v for v, e in traced.items() if _fits(e)), default=None)
        hi = min((v for v, e in traced.items() if not _fits(e)), default=None)
        if lo is None or (hi is not None and hi - lo <= step) or lo >= MAX_VALUE:
            break
        nxt = _next(lo, hi, traced, target.usable, step)
        if hi is not None and bisect:  # every other try inside the bracket halves it
            nxt = max(lo + step, min(hi - step, _on_grid((lo + hi) // 2, step)))
        bisect = hi is not None and not bisect
        if nxt in traced:
            break
        run(nxt)
    lo = max(v for v, e in traced.items() if _fits(e))
    return traced[lo], _record(axis, step, target, traced, lo)


def _on_grid(v: int, step: int) -> int:
    return max(step, min(MAX_VALUE, v // step * step))


def _next(lo: int, hi: int | None, traced: dict[int, Estimate], usable: int, step: int) -> int:
    """The size the line through the two traces nearest the boundary names, kept strictly
    between the largest that fits (``lo``) and the smallest that does not (``hi``)."""
    below = sorted(v for v in traced if v <= lo)[-2:]
    pts = [*below[-1:], *([hi] if hi is not None else below[:-1])]
    a, b = sorted(pts) if len(pts) == 2 else (lo, lo)
    na, nb = _need(traced[a]), _need(traced[b])
    slope = (nb - na) / (b - a) if b != a and nb > na else 0.0
    guess = a + (usable - na) / slope if slope else 2 * lo  # no slope to read: double
    v = _on_grid(int(guess), step)
    if hi is not None and not lo < v < hi:  # the line misses the bracket (a step that fits
        v = _on_grid((lo + hi) // 2, step)  # only by freeing the cache): halve it
    elif hi is None and v <= lo and _need(traced[lo]) > usable:  # fits only by retrying:
        v = _on_grid(lo + max(step, lo // 4), step)  # the line cannot say how far; gallop
    if v <= lo:
        v = lo + step  # confirm the boundary: the size above the largest that fits
    return v


def _record(
    axis: str, step: int, target: Target, traced: dict[int, Estimate], found: int | None
) -> SearchResult:
    return SearchResult(
        axis=axis,
        step=step,
        largest=found,
        converged=found is not None
        and any(not _fits(e) and v <= found + step for v, e in traced.items() if e.fit),
        usable=target.usable,
        margin=target.margin,
        traced=tuple(Traced(v, _need(e), _fits(e)) for v, e in sorted(traced.items())),
    )
