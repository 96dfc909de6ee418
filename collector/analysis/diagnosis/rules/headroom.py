"""The largest within-step NVML peak against the card's capacity."""

from __future__ import annotations

from collector.analysis.diagnosis.kinds import Finding, FindingKind
from collector.analysis.diagnosis.rules.transients import peak_where
from collector.analysis.diagnosis.steps import Steps
from collector.model.units import gib


def rule(s: Steps) -> list[Finding]:
    if not s.total_bytes or not s.peaked:
        return []
    top = max(s.peaked, key=lambda r: r.nvml_peak_bytes or 0)
    peak, total = top.nvml_peak_bytes or 0, s.total_bytes
    unseen = len(s.all_steps) - len(s.peaked)
    of = f" (of the {len(s.peaked)} steps with samples)" if unseen else ""
    where = peak_where(top)
    ph = top.peak_phase
    return [
        Finding(
            FindingKind.HEADROOM,
            f"Largest within-step peak{of}: {gib(peak)} in step {top.step}"
            + (f" ({where})" if where else "")
            + f", {100 * peak / total:.1f} % of the card's {gib(total)}; "
            f"headroom {gib(total - peak)}.",
            {"peak": peak, "total": total, "step": top.step, "phase": ph.phase if ph else None},
            steps=(top.step, top.step),
        )
    ]
