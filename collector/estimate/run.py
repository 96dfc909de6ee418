"""The estimate's entry: a planned :class:`~collector.estimate.request.EstimateRequest` run —
a spec traced (:func:`collector.estimate.trace.estimate`), searched for its largest size that
fits (:func:`collector.estimate.largest.largest`), given plans that make it fit
(:mod:`collector.estimate.plans`), or a user's script estimated in a child
process (:mod:`collector.estimate.script`, which nothing else imports)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from collector.estimate.largest import largest, largest_of
from collector.estimate.limits import time_limited
from collector.estimate.request import EstimateRequest
from collector.estimate.trace import estimate
from collector.model.errors import EstimateError
from collector.model.plans import PlanResult
from collector.model.prediction import Estimate, SearchResult

__all__ = ["Outcome", "run_estimate"]


@dataclass(frozen=True)
class Outcome:
    """What an estimate gave: the estimate (None: none was made — no step traced, or nothing
    searched fits), the error that stopped a script early ("": none), and a search's record."""

    estimate: Estimate | None
    error: str = ""
    search: SearchResult | None = None
    plans: PlanResult | None = None  # --plan: the plans that make the step fit


def run_estimate(req: EstimateRequest, progress: Callable[[str], None] | None = None) -> Outcome:
    """Run ``req`` (see the module doc); ``progress`` hears what is being done, a line a time."""
    say = progress or (lambda _m: None)
    if req.script is not None:
        if req.search is not None and req.target is not None:
            return _script_search(req, say)
        from collector.estimate.script import estimate_script

        est, error = estimate_script(req, progress=say)
        return Outcome(est, error)
    spec = req.spec
    assert spec is not None
    if req.plan is not None:
        from collector.estimate.plans.search import find_plans

        est, plans = find_plans(req, say)
        return Outcome(est, plans=plans)
    model = spec.size or (spec.config or {}).get("model_type", "a config")
    say(
        f"tracing {model} ({spec.optim}, batch {spec.batch} × {spec.seq_len}) for two steps on "
        "fake tensors: seconds for a small model, under a minute for a 7B"
    )

    def trace(s: Any, progress: Callable[[str], None] | None = None) -> Estimate:
        with time_limited(req.time_limit, f"{model} at batch {s.batch} × {s.seq_len}"):
            return estimate(s, progress=progress, allocator=req.allocator, target=req.target)

    if req.search is not None and req.target is not None:
        say(
            f"searching the largest {'micro-batch' if req.search == 'batch' else 'sequence length'}"
        )
        est, search = largest(spec, req.search, req.target, trace, progress=say)
        if est is not None:
            est.largest = search
        return Outcome(est, search=search)
    return Outcome(trace(spec, say))


def _script_search(req: EstimateRequest, say: Callable[[str], None]) -> Outcome:
    """The largest value of the script's own option (``--batch-arg``/``--seq-len-arg``) whose
    step fits: the script traced at each size the search names, as ``--config``'s search
    traces its spec. A size the script cannot be traced at, stopped early at, or whose figures
    a placeholder decided ends the search with that, said (no answer stands on it)."""
    from collector.estimate.script import estimate_script

    script, target, axis = req.script, req.target, req.search
    assert script is not None and script.search_arg is not None
    assert target is not None and axis is not None
    arg = script.search_arg

    def trace_at(v: int) -> Estimate:
        est, error = estimate_script(replace(req, subject=script.at(v), search=None), say)
        if error or est is None:
            raise EstimateError(f"{script.path.name} {arg} {v}: {error or 'no step traced'}")
        if est.undecided:
            raise EstimateError(
                f"{script.path.name} {arg} {v}: not trustworthy ({est.undecided}): the search "
                "cannot stand on figures a placeholder decided"
            )
        return est

    what = "micro-batch" if axis == "batch" else "sequence length"
    say(f"searching the largest {what} of {script.path.name} ({arg})")
    est, search = largest_of(script.value() or 1, axis, target, trace_at, progress=say)
    if est is not None:
        est.largest = search
        est.notes.append(
            f"the search set the script's {arg}: the largest that fits is {arg} {search.largest}"
        )
    return Outcome(est, search=search)
