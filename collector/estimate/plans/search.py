"""The plan search: the step as asked traced once, then each turn of
:func:`~collector.estimate.plans.knobs.walk` made a request (the user's flags with the knobs
set, planned by :func:`~collector.estimate.request.plan_estimate` like any command line),
traced, and held against the card — and held again under expandable segments from the same
allocation log, no second trace. A turn that changes at least what a fitting one changes is
not traced. The search ends when :data:`SAME_WANTED` plans keeping the training and
:data:`CHANGED_WANTED` changing it fit, or after :data:`MAX_TRACES` traces.

A plan fits when its reserved peak stays under what torch may use, less the margin, *without*
the allocator freeing its cache to get by: on an H100 the allocator model let two sizes
through by freeing the cache that really ran out (``benchmarks/results/cuda_search``), so a
plan printed as fitting does not stand on that path."""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import collector.estimate.plans.knobs as knobs
from collector.estimate.alloc_log import AllocationLog
from collector.estimate.limits import time_limited
from collector.estimate.plans.command import argv
from collector.estimate.plans.cost import cost
from collector.estimate.request import EstimateRequest, plan_estimate
from collector.estimate.spec import MAX_SEQ
from collector.estimate.trace import estimate
from collector.estimate.tracing import hold_steps
from collector.model.errors import EstimateError
from collector.model.plans import Knob, Plan, PlanResult
from collector.model.prediction import Estimate
from collector.model.units import gib

__all__ = ["CHANGED_WANTED", "MAX_TRACES", "SAME_WANTED", "find_plans", "fits"]

SAME_WANTED = 3  # plans keeping the training the search looks for
CHANGED_WANTED = 2  # and plans changing it
MAX_TRACES = 12  # steps traced beyond the one asked


def fits(e: Estimate) -> bool:
    """Fits with the margin and without the allocator freeing its cache (see the module doc)."""
    return bool(e.fit and e.fit.fits and e.fit.headroom >= 0)


@dataclass
class _Search:
    """One search's state: its request, the traces by spec (each estimate with its log), the
    plans found, and the counts said at the end."""

    req: EstimateRequest
    say: Callable[[str], None]
    conf: str
    traces: dict[str, tuple[Estimate, AllocationLog | None]]
    fitting: list[tuple[knobs.Turn, Plan]]
    tried: list[Plan]
    not_offered: list[str]
    traced: int = 0
    reheld: int = 0
    refused: set[Knob] = field(default_factory=set)  # knobs whose requests were refused
    tried_turns: dict[knobs.Turn, Plan | None] = field(default_factory=dict)

    def trace(self, r: EstimateRequest) -> Estimate:
        """``r``'s step, traced once per spec (held under ``r``'s allocator settings)."""
        spec = r.spec
        assert spec is not None
        key = json.dumps(asdict(spec), sort_keys=True, default=str)
        if key not in self.traces:
            logs: list[AllocationLog] = []
            what = f"{spec.size or 'the config'} at batch {spec.batch} × {spec.seq_len}"
            with time_limited(r.time_limit, what):
                est = estimate(spec, allocator=r.allocator, target=r.target, logs=logs)
            self.traces[key] = (est, logs[0] if logs else None)
            self.traced += 1
            return est
        est, log = self.traces[key]
        if log is None:
            return est
        self.reheld += 1
        held = copy.deepcopy(est)
        hold_steps(held, log, r.allocator, r.target)
        return held


def _conf(req: EstimateRequest) -> str:
    flags = req.origin[0] if req.origin else None
    if flags is not None and flags.alloc_conf is not None:
        return flags.alloc_conf
    env = os.environ
    return env.get("PYTORCH_CUDA_ALLOC_CONF", env.get("PYTORCH_ALLOC_CONF", ""))


def find_plans(
    req: EstimateRequest, progress: Callable[[str], None] | None = None
) -> tuple[Estimate, PlanResult]:
    """The step ``req`` asks for, estimated, and the plans that make it fit ``req.target``
    (see the module doc). ``req`` is a ``--plan`` request of a spec (``req.origin`` set)."""
    assert req.spec is not None and req.target is not None and req.origin is not None
    assert req.plan is not None
    t0 = time.monotonic()
    s = _Search(req, progress or (lambda _m: None), _conf(req), {}, [], [], [])
    spec = req.spec
    what = f"{spec.size or 'the config'}, batch {spec.batch} × {spec.seq_len}"
    s.say(f"tracing the step as asked ({what}), then the plans: each a trace of its own")
    original = s.trace(req)
    turns, s.not_offered = knobs.walk(spec, req.plan)
    expandable = not req.allocator.expandable_segments and Knob.ALLOCATOR not in req.plan
    if not expandable:
        why = "set already" if req.allocator.expandable_segments else "kept as asked (--keep)"
        s.not_offered.insert(0, f"{Knob.ALLOCATOR.value}: expandable segments {why}")
    if fits(original):
        s.say("the step fits as asked: no plan needed")
    else:
        _walk(s, original, [(), *turns], expandable)
    ranked = sorted((p for _t, p in s.fitting), key=lambda p: _order(p, original.step_flops))
    return original, PlanResult(
        card=req.target.card.name,
        usable=req.target.usable,
        need=original.fit.need if original.fit else 0,
        fits=fits(original),
        step_flops=original.step_flops,
        plans=tuple(ranked),
        tried=tuple(s.tried),
        not_offered=tuple(s.not_offered),
        traces=s.traced,
        reheld=s.reheld,
        seconds=round(time.monotonic() - t0, 1),
    )


def _walk(s: _Search, original: Estimate, turns: list[knobs.Turn], expandable: bool) -> None:
    """The turns a group at a time (the same training, then each change), each group's
    strongest turn first (:func:`_bound`): where even that does not fit, no turn of the group
    is traced. Then each turn in order, and its expandable-segments twin, until enough fit or
    the budget is spent."""
    groups: dict[frozenset[Knob], list[knobs.Turn]] = {}
    for t in turns:
        groups.setdefault(frozenset(k for k, _ in t if not k.same), []).append(t)
    for changed, group in groups.items():
        wanted = CHANGED_WANTED if changed else SAME_WANTED
        if sum(1 for _t, p in s.fitting if p.same_training == (not changed)) >= wanted:
            continue
        if s.traced > MAX_TRACES:
            s.say(f"the plan search stops at {MAX_TRACES} traces")
            break
        tried = list(_variants(s, original, _bound(group), expandable)) if len(group) > 1 else []
        if tried and all(p is not None and not p.fits for _v, p in tried):  # traced: too big
            what = (
                " + ".join(k.value for k in sorted(changed, key=list(Knob).index))
                or "the same training"
            )
            s.say(f"{what}: not even its strongest plan fits; its other plans are not traced")
            continue
        for t in group:
            if sum(1 for _t, p in s.fitting if p.same_training == (not changed)) >= wanted:
                break
            for variant, plan in _variants(s, original, t, expandable):
                if plan is not None and plan.fits:
                    s.fitting.append((variant, plan))
                    break  # its expandable twin changes more


def _bound(group: list[knobs.Turn]) -> knobs.Turn:
    """The group's strongest turn: the most knobs, then the smallest micro-batch, then the
    shortest sequence."""

    def strength(t: knobs.Turn) -> tuple[int, int, int]:
        d = dict(t)
        return (len(t), -d.get(Knob.MICRO_BATCH, (MAX_SEQ,))[0], -d.get(Knob.SEQ_LEN, MAX_SEQ))

    return max(group, key=strength)


def _variants(s: _Search, original: Estimate, t: knobs.Turn, expandable: bool) -> Any:
    """``t`` and its expandable twin with their plans, each tried in turn (lazily: the twin
    only when ``t`` does not fit); a plan None where the turn is pointless (a fitting plan
    changes less) or refused."""
    for variant in (t, knobs.turn(*t, (Knob.ALLOCATOR, True))) if expandable else (t,):
        pointless = not variant or any(k in s.refused for k, _ in variant)
        if pointless or knobs.dominated(variant, [f for f, _p in s.fitting]):
            yield variant, None
            continue
        plan = _try(s, original, variant)
        yield variant, plan
        if plan is not None and plan.fits:
            return


def _try(s: _Search, original: Estimate, t: knobs.Turn) -> Plan | None:
    """One turn traced (or held again) and judged, once; None: the flags it gives are
    refused."""
    if t not in s.tried_turns:
        s.tried_turns[t] = _judge(s, original, t)
    return s.tried_turns[t]


def _judge(s: _Search, original: Estimate, t: knobs.Turn) -> Plan | None:
    req, spec = s.req, s.req.spec
    assert req.origin is not None and spec is not None
    flags, like, cuda = req.origin
    plan_flags = knobs.flags_of(flags, t, s.conf)
    try:
        r = plan_estimate(plan_flags, cuda, like)
    except EstimateError as exc:
        _refused(s, t, exc)
        return None
    changes = knobs.words(t, spec, req.allocator)
    try:
        est = s.trace(r)
    except EstimateError as exc:  # a trace over its time limit, a model LoRA cannot adapt
        _refused(s, t, exc)
        return None
    assert est.fit is not None
    plan = Plan(
        knobs=tuple(k for k, _ in t),
        changes=changes,
        command=argv(plan_flags),
        fits=fits(est),
        need=est.fit.need,
        nvml_peak=est.nvml_peak,
        headroom=est.fit.headroom,
        step_flops=est.step_flops,
        cost=cost(t, est, original),
        reheld=any(k is Knob.ALLOCATOR for k, _ in t),
    )
    s.say(
        f"plan {'; '.join(changes)}: needs {gib(plan.need)} of {gib(req.target.usable)} — "  # type: ignore[union-attr]
        + ("fits" if plan.fits else "does not fit")
    )
    if not plan.fits:
        s.tried.append(plan)
    return plan


def _refused(s: _Search, t: knobs.Turn, exc: EstimateError) -> None:
    """A turn its request or trace refused: said once per knob it changes of the training
    (or, keeping it, per turn), and every later turn with that knob skipped."""
    changed = [k for k, _ in t if not k.same]
    name = changed[-1].value if changed else " + ".join(k.value for k, _ in t)
    if all(not w.startswith(f"{name}: ") for w in s.not_offered):
        s.not_offered.append(f"{name}: {exc}")
    s.refused.update(changed)


def _order(p: Plan, base: int | None) -> tuple[Any, ...]:
    """The same training first; then the fewest extra FLOPs (against the step as asked, whose
    count is ``base``), the cheapest knobs, the most headroom. Changes to the training: the
    mildest knob first."""
    flops = round(p.step_flops / base, 2) if p.step_flops and base else 1.0
    ranks = sorted((k.rank for k in p.knobs), reverse=True)  # type: ignore[attr-defined]
    if p.same_training:
        return (0, flops, ranks, -p.headroom)
    return (1, ranks, flops, -p.headroom)
