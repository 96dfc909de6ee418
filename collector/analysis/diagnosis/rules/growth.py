"""Steady state, or growth: the first step from which end-of-step torch reserved and NVML used
move by less than ``steady_bytes`` a step to the end of the run; if there is none and memory
grew over the run, by how much a step and in which pool, as one finding:

* **leak** — torch allocated at step end (live tensors) grows: something keeps references past
  each step. Whatever else grows with it (reserved, NVML) is the same phenomenon and is said in
  the same finding, never as a second cause. A leak is named when live tensors grow by at least
  ``steady_bytes`` over the run and by at least ``leak_share`` of the fastest-growing pool.
* **growing** — otherwise the most specific pool growing at least ``pool_share`` of the fastest:
  torch reserved (the allocator's cache; :mod:`.cache` says whether that is fragmentation),
  outside the allocator (split by NVML's per-process readings), or NVML used.
* **unsteady** — memory moves from step to step without growing over the run.

Rates are per step over every step from the first to the last compared, measured or not (a step
without NVML samples still happened)."""

from __future__ import annotations

from collector.analysis.diagnosis.kinds import Finding, FindingKind, Pool
from collector.analysis.diagnosis.steps import Steps
from collector.model.kinds import Component
from collector.model.step import StepRecord
from collector.model.units import gib, size


def steady_from(s: Steps) -> StepRecord | None:
    """The first ended step from which reserved and NVML at step end stay within
    ``steady_bytes`` a step (at least two steps to the end)."""
    ended = s.ended
    if len(ended) < 3:
        return None

    def series(r: StepRecord) -> tuple[int, int]:
        return (r.reserved_end or 0, r.nvml_end_bytes or 0)

    start = None
    for i in range(len(ended) - 1, 0, -1):
        a, b = series(ended[i - 1]), series(ended[i])
        if all(abs(y - x) < s.th.steady_bytes for x, y in zip(a, b, strict=True)):
            start = i - 1
        else:
            break
    if start is None or len(ended) - start < 2:
        return None
    return ended[start]


def kept_sites(s: Steps, top: int = 1) -> str:
    """``workloads/cases.py:69 (run) → …/modeling_llama.py:480 (forward) 0.24 GiB`` — where
    the memory a recorded step allocated and the next step still held was allocated (the
    allocation history), the largest ``top``; empty without a history."""
    # the latest recorded step that kept something: the first step also creates what is meant
    # to stay (optimizer state), a later one only what the leak keeps
    for step in sorted(s.sites, reverse=True):
        kept = s.sites[step].get("kept_to_next") or []
        if kept:
            rows = "; ".join(f"{k['site']} {gib(k['bytes'])}" for k in kept[:top])
            return f"allocated in step {step}, still live at step {step + 1}'s end: {rows}"
    return ""


def _steady(r: StepRecord, s: Steps) -> Finding:
    return Finding(
        FindingKind.STEADY,
        f"Steady state from step {r.step}: end-of-step memory moves less than "
        f"{s.th.steady_bytes >> 20} MiB a step (torch reserved {gib(r.reserved_end or 0)}, "
        f"NVML {gib(r.nvml_end_bytes or 0)}).",
        {"step": r.step, "nvml_end": r.nvml_end_bytes, "reserved_end": r.reserved_end},
        steps=(r.step, s.recs[-1].step),
    )


Totals = dict[Pool, tuple[int, int, StepRecord, StepRecord]]  # growth, steps, first, last


def _totals(s: Steps) -> Totals:
    """How much each pool grew over the run, over how many steps, from which to which."""
    totals: dict[Pool, tuple[int, StepRecord, StepRecord]] = {}
    torch_recs = [r for r in s.recs if r.reserved_end is not None]
    if len(torch_recs) >= 3 and not s.mode.caching_disabled:
        a, b = torch_recs[0], torch_recs[-1]
        totals[Pool.ALLOCATED] = ((b.allocated_end or 0) - (a.allocated_end or 0), a, b)
        totals[Pool.RESERVED] = ((b.reserved_end or 0) - (a.reserved_end or 0), a, b)
    e0, e1 = s.ended[0], s.ended[-1]
    if s.has_torch and e0.nontorch_end is not None and e1.nontorch_end is not None:
        totals[Pool.OUTSIDE] = (e1.nontorch_end - e0.nontorch_end, e0, e1)
    totals[Pool.NVML] = ((e1.nvml_end_bytes or 0) - (e0.nvml_end_bytes or 0), e0, e1)
    return {k: (v, max(1, s.span(a, b)), a, b) for k, (v, a, b) in totals.items()}


def _unsteady(s: Steps) -> Finding:
    th, e0, e1 = s.th, s.ended[0], s.ended[-1]
    return Finding(
        FindingKind.UNSTEADY,
        f"No steady state: end-of-step memory moves by {th.steady_bytes >> 20} MiB or "
        f"more between steps {e0.step}–{e1.step} without growing over them (NVML "
        f"{gib(e0.nvml_end_bytes or 0)} at the first, {gib(e1.nvml_end_bytes or 0)} at the "
        "last).",
        {"first": e0.step, "last": e1.step},
        steps=(e0.step, e1.step),
    )


def _leak(s: Steps, totals: Totals) -> Finding:
    _, n, a, b = totals[Pool.ALLOCATED]
    rate = totals[Pool.ALLOCATED][0] / n
    text = (
        f"Leak: live tensors grow {size(rate)} a step (torch allocated at step end "
        f"{gib(a.allocated_end or 0)} → {gib(b.allocated_end or 0)}, steps {a.step}–{b.step})"
    )
    res_rate = totals[Pool.RESERVED][0] / totals[Pool.RESERVED][1]
    nums = {
        "pool": Pool.ALLOCATED,
        "bytes_per_step": rate,
        "from_step": a.step,
        "to_step": b.step,
        "reserved_per_step": res_rate,
    }
    site = kept_sites(s)
    f = Finding(FindingKind.LEAK, text, nums, steps=(a.step, b.step))
    if site:
        nums["site"] = site
        f.text = f"{text}; {site}."
        f.detail = f"{text}; {kept_sites(s, top=3)}."
    else:
        f.text = f.detail = f"{text}: something keeps references to them past each step."
    if res_rate - rate >= s.th.steady_bytes:
        f.add(f" Torch reserved grows with them, {size(res_rate)} a step.")
    return f


def _growing(s: Steps, totals: Totals, fastest: int) -> Finding:
    pool = next(p for p in totals if totals[p][0] >= s.th.pool_share * fastest)
    grown, n, a, b = totals[pool]
    rate = grown / n
    why = {
        Pool.ALLOCATED: "live tensors",  # (not reached: a leak above)
        Pool.RESERVED: "the allocator's cache, while live tensors do not grow",
        Pool.OUTSIDE: _outside_growth(s),
        Pool.NVML: "device memory",
    }[pool]
    if s.mode.caching_disabled and pool in (Pool.OUTSIDE, Pool.NVML):
        why += " (the caching allocator is off: tensors come from the driver directly)"
    nums = {"pool": pool, "bytes_per_step": rate, "from_step": a.step, "to_step": b.step}
    if pool is Pool.OUTSIDE:
        grew = _outside_grew(s)
        nums["component"] = max(grew, key=lambda k: grew[k]) if grew else None
    return Finding(
        FindingKind.GROWING,
        f"No steady state: end-of-step memory still grows; {pool} grows "
        f"{size(rate)} a step over steps {a.step}–{b.step}: {why}.",
        nums,
        steps=(a.step, b.step),
    )


def rule(s: Steps) -> list[Finding]:
    first_steady = steady_from(s)
    if first_steady is not None:
        return [_steady(first_steady, s)]
    if len(s.ended) < 3:
        return []
    totals = _totals(s)
    fastest = max(totals.values(), key=lambda t: t[0])[0]
    if fastest < s.th.steady_bytes:  # it moves from step to step but does not grow over the run
        return [_unsteady(s)]
    alloc = totals.get(Pool.ALLOCATED)
    if alloc is not None and alloc[0] >= max(s.th.steady_bytes, s.th.leak_share * fastest):
        return [_leak(s, totals)]
    return [_growing(s, totals, fastest)]


def _outside_grew(s: Steps) -> dict[Component, int]:
    """How much each component outside torch grew from the first step with a per-process
    reading to the last (empty: fewer than two)."""
    accs = [a for a in s.accounts if a.unsplit is None]
    if len(accs) < 2:
        return {}
    first, last = accs[0].components(), accs[-1].components()
    inside = (
        Component.BASELINE,
        Component.FIRST_USE,
        Component.TORCH_RESERVED,
        Component.REMAINDER,
    )
    return {k: last[k] - first[k] for k in last if k not in inside}


def _outside_growth(s: Steps) -> str:
    """Which component outside torch grows, by the accounting (no cause named without a
    reading)."""
    grew = _outside_grew(s)
    if not grew:
        return "memory outside torch's allocator (no per-process reading splits it)"
    accs = [a for a in s.accounts if a.unsplit is None]
    name = max(grew, key=lambda k: grew[k])
    return (
        f"by NVML's per-process readings {name} ({gib(grew[name])} from step {accs[0].step} to "
        f"{accs[-1].step})"
    )
