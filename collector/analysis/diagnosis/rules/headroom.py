"""The largest within-step NVML peak against the card's capacity."""

from __future__ import annotations

from collector.analysis.diagnosis.kinds import Finding, FindingKind
from collector.analysis.diagnosis.rules.transients import peak_where
from collector.analysis.diagnosis.steps import Steps
from collector.analysis.diagnosis.text import steps_text
from collector.model.kinds import Gap
from collector.model.units import gib

# flags of a step with samples whose sampling missed part of its time: a transient there is
# not seen, so its peak (and the run's) may be higher than measured
BLIND = frozenset({Gap.STALL, Gap.HOLE, Gap.UNDERSAMPLED, Gap.OVERRUN, Gap.SAMPLER_STARTED})


def rule(s: Steps) -> list[Finding]:
    if not s.total_bytes or not s.peaked:
        return []
    top = max(s.peaked, key=lambda r: r.nvml_peak_bytes or 0)
    peak, total = top.nvml_peak_bytes or 0, s.total_bytes
    unseen = len(s.all_steps) - len(s.peaked)
    of = f" (of the {len(s.peaked)} steps with samples)" if unseen else ""
    where = peak_where(top, s)
    ph = top.peak_phase
    blind = [r for r in s.peaked if BLIND & set(r.gap.split())]
    at_least = ""
    if blind:
        flags = sorted({g for r in blind for g in r.gap.split() if g in BLIND})
        at_least = (
            f" A lower bound: {len(blind)} step{'s' if len(blind) > 1 else ''} with samples "
            f"missed part of {'their' if len(blind) > 1 else 'its'} time (step "
            f"{steps_text([r.step for r in blind])}; "
            f"{', '.join(flags)}), where a higher transient would not be seen."
        )
    return [
        Finding(
            FindingKind.HEADROOM,
            f"Largest within-step peak{of}: {gib(peak)} in step {top.step}"
            + (f" ({where})" if where else "")
            + f", {100 * peak / total:.1f} % of the card's {gib(total)}; "
            f"headroom {gib(total - peak)}.{at_least}",
            {
                "peak": peak,
                "total": total,
                "step": top.step,
                "phase": ph.phase if ph else None,
                "blind_steps": [r.step for r in blind],
                "peak_gap": " ".join(g for g in top.gap.split() if g in BLIND),
            },
            steps=(top.step, top.step),
        )
    ]
