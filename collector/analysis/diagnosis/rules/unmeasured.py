"""Steps the sampler did not measure (no NVML sample inside them), and a sampler that fell
behind (``undersampled``, ``stale_end``): named, counted, and left out of every NVML figure."""

from __future__ import annotations

from collector.analysis.diagnosis.kinds import Finding, FindingKind
from collector.analysis.diagnosis.steps import Steps
from collector.analysis.diagnosis.text import steps_text
from collector.model.kinds import Gap
from collector.model.step import StepRecord
from collector.model.units import have


def rule(s: Steps) -> list[Finding]:
    recs = s.all_steps
    return [*_stand_ins(recs), *_unmeasured(recs), *_behind(recs)]


def _stand_ins(recs: list[StepRecord]) -> list[Finding]:
    stand_ins = [r for r in recs if r.has_gap(Gap.STAND_IN)]
    out = []
    if stand_ins:
        out.append(
            Finding(
                FindingKind.UNMEASURED,
                f"{len(stand_ins)} of {len(recs)} steps ran in CPU processes standing in for a "
                f"replayed GPU (step {steps_text([r.step for r in stand_ins])}; stand_in): the "
                "capture that played beside them is not their memory, so they have no NVML "
                "figure; their steps, phases and ledger are their own.",
                {"steps": len(stand_ins), "of": len(recs), "gaps": [Gap.STAND_IN.value]},
            )
        )
    return out


def _unmeasured(recs: list[StepRecord]) -> list[Finding]:
    missing = [r for r in recs if not r.measured and not r.has_gap(Gap.STAND_IN)]
    out = []
    if missing:
        why = sorted({r.gap or "no_samples" for r in missing})
        out.append(
            Finding(
                FindingKind.UNMEASURED,
                f"{len(missing)} of {len(recs)} steps {have(len(missing))} no NVML samples "
                "(step "
                f"{steps_text([r.step for r in missing])}; {', '.join(why)}): their NVML "
                "figures are unknown, not zero, and are left out below.",
                {"steps": len(missing), "of": len(recs), "gaps": why},
                detail=(
                    f"{len(missing)} of {len(recs)} steps {have(len(missing))} no NVML samples "
                    "(step "
                    f"{steps_text([r.step for r in missing])}; {', '.join(why)}): the sampler "
                    "read nothing inside them — steps shorter than the sampling period (a "
                    "replay sped up with --speed, a fast workload at a low --rate), a sampler "
                    "starved of CPU, or NVML errors. Their NVML figures are unknown, not zero; "
                    "the findings below leave them out."
                ),
            )
        )
    return out


def _behind(recs: list[StepRecord]) -> list[Finding]:
    """A sampler that fell behind: too few samples, holes, stalls, a stale end reading."""
    out = []
    under = [r for r in recs if r.has_gap(Gap.UNDERSAMPLED)]
    holes = [r for r in recs if r.has_gap(Gap.HOLE)]
    stale = [r for r in recs if r.has_gap(Gap.STALE_END)]
    stalls = [r for r in recs if r.measured and r.has_gap(Gap.STALL)]
    if under or stale or holes or stalls:
        parts = []
        if stalls:
            parts.append(
                f"{len(stalls)} of {len(recs)} steps {have(len(stalls))} a stall, a stretch with "
                "no sample "
                f"(step {steps_text([r.step for r in stalls])}): a transient inside it is "
                "not seen"
            )
        if under:
            parts.append(
                f"{len(under)} of {len(recs)} steps got under half the samples the rate promised "
                f"(step {steps_text([r.step for r in under])}): a short transient may be missed"
            )
        if holes:
            parts.append(
                f"{len(holes)} of {len(recs)} steps {have(len(holes))} a hole of several "
                "sampling periods "
                f"between two samples (step {steps_text([r.step for r in holes])}): a transient "
                "inside it is not seen"
            )
        if stale:
            parts.append(
                f"{len(stale)} end reading{' is' if len(stale) == 1 else 's are'} older than "
                f"the end mark (step {steps_text([r.step for r in stale])}): left out of "
                "the table and every finding"
            )
        out.append(
            Finding(
                FindingKind.STARVED,
                "The sampler fell behind (too little CPU, or a stalled NVML): "
                + "; ".join(parts)
                + ".",
                {
                    "undersampled": len(under),
                    "hole": len(holes),
                    "stale_end": len(stale),
                    "stall": len(stalls),
                    "of": len(recs),
                },
            )
        )
    return out
