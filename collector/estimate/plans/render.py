"""A plan search as text: the plans that fit, ranked, each as the command that checks it with
its figures and cost; what was traced and did not fit; what was not searched, and why."""

from __future__ import annotations

from collector.estimate.plans.command import shell
from collector.model.plans import Plan, PlanResult
from collector.model.units import size as gib

__all__ = ["render_plans"]

TRIED = 6  # plans that do not fit, listed by name


def render_plans(r: PlanResult) -> str:
    head = f"Plans for {r.card} (torch may use {gib(r.usable)} with the margin)"
    lines = [head, "─" * len(head)]
    if r.fits:
        lines.append(f"The step fits as asked ({gib(r.need)} of {gib(r.usable)}): no plan needed.")
    elif not r.plans:
        lines.append(
            f"No plan found fits: the step as asked needs {gib(r.need)}; every plan traced is "
            "listed below with what it needs."
        )
    else:
        lines.append(
            f"The step as asked needs {gib(r.need)}. These fit, each traced (the same training "
            "first, then the mildest change):"
        )
    for i, p in enumerate(r.plans, 1):
        lines += _plan(i, p)
    if r.tried:
        lines += ["", "Traced, and do not fit:"]
        lines += [f"  · {'; '.join(p.changes)}: needs {gib(p.need)}" for p in r.tried[:TRIED]]
        if len(r.tried) > TRIED:
            lines.append(f"  · and {len(r.tried) - TRIED} more (--json lists every one)")
    if r.not_offered:
        lines += ["", "Not searched:"] + [f"  · {w}" for w in r.not_offered]
    lines += [
        "",
        f"{r.traces} step(s) traced, {r.reheld} held again under other allocator settings "
        f"from a trace's allocation log, in {r.seconds:g} s. A plan fits when its reserved peak "
        "stays under the limit without the allocator freeing its cache; FLOPs are counted "
        "with torch's FLOP formulas on the traced shapes (work, not time).",
    ]
    return "\n".join(lines)


def _plan(i: int, p: Plan) -> list[str]:
    kind = "same training" if p.same_training else "changes the training"
    nvml = f", NVML {gib(p.nvml_peak)}" if p.nvml_peak is not None else ""
    return [
        "",
        f"{i}. {'; '.join(p.changes)}  [{kind}]",
        f"   reserved {gib(p.need)}{nvml}, headroom {gib(p.headroom)}",
        f"   cost: {p.cost}",
        f"   {shell(p.command)}",
    ]
