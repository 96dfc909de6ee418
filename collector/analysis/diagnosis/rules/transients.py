"""What came and went inside steps, which no end-of-step reading shows:

* steps whose NVML within-step peak exceeds their end-of-step reading by ``transient_bytes``
  (and ``transient_share`` of it), grouped by the phase that holds each peak, the largest split
  (:func:`collector.model.account.peak_split`) into torch's reserved peak and memory outside torch
  that came and went;
* steps whose torch allocated peak lies that far above the typical step's (the median) in a
  phase that is not where the typical step peaks: a phase that runs in some steps only (an eval
  pass every few steps) drives the peak. The caching allocator keeps what it reserved for it, so
  NVML shows it at every later step's end too, and only the phase marks tell where it came
  from."""

from __future__ import annotations

from collector.analysis.diagnosis.kinds import Finding, FindingKind
from collector.analysis.diagnosis.steps import Steps
from collector.analysis.diagnosis.text import steps_text
from collector.model.account import peak_split
from collector.model.step import StepRecord
from collector.model.units import gib


def peak_where(r: StepRecord, s: Steps) -> str:
    """``in its optimizer phase, 812 ms in`` for a step's NVML peak (empty: unknown)."""
    ph = r.peak_phase
    parts = [f"in its {ph.phase.replace('_', '/')} phase"] if ph else []
    if r.nvml_peak_t_ns is not None:
        parts.append(f"{s.ms(r.nvml_peak_t_ns - r.begin_ns)} ms in")
    return ", ".join(parts)


def phase_peaks(s: Steps) -> list[Finding]:
    import statistics
    from collections import Counter

    th = s.th
    recs = [r for r in s.recs if r.torch_allocated_peak_bytes is not None and r.phases]
    if len(recs) < 3:
        return []
    typical = statistics.median(r.torch_allocated_peak_bytes or 0 for r in recs)
    usual = Counter(r.allocated_peak_phase for r in recs).most_common(1)[0][0]
    high = [
        r
        for r in recs
        if (r.torch_allocated_peak_bytes or 0) - typical
        > max(th.transient_bytes, th.transient_share * typical)
        and r.allocated_peak_phase != usual
    ]
    if not high:
        return []
    phase = Counter(r.allocated_peak_phase for r in high).most_common(1)[0][0] or ""
    group = [r for r in high if r.allocated_peak_phase == phase]
    top = max(group, key=lambda r: r.torch_allocated_peak_bytes or 0)
    label, many = phase.replace("_", "/"), len(group) > 1
    text = (
        f"Step{'s' if many else ''} {steps_text([r.step for r in group])} peak"
        f"{'' if many else 's'} in {'their' if many else 'its'} {label} phase: torch allocated "
        f"up to {gib(top.torch_allocated_peak_bytes or 0)} (step {top.step}) against "
        f"{gib(typical)} in a typical step's {(usual or 'step').replace('_', '/')}"
    )
    if top.reserved_end is not None:
        text += (
            "; the allocator keeps what it reserved for it (torch reserved "
            f"{gib(top.reserved_end)} at step {top.step}'s end), so later end-of-step readings "
            "carry it too"
        )
    return [
        Finding(
            FindingKind.TRANSIENT,
            text + ".",
            {
                "steps": len(group),
                "largest_step": top.step,
                "largest_bytes": (top.torch_allocated_peak_bytes or 0) - int(typical),
                "phase": phase or None,
                "phase_steps": [r.step for r in group],
                "typical_peak": int(typical),
                "view": "allocated",
            },
            steps=(group[0].step, group[-1].step),
        )
    ]


def rule(s: Steps) -> list[Finding]:
    return nvml_transients(s) + phase_peaks(s)


def nvml_transients(s: Steps) -> list[Finding]:
    th = s.th
    spikes = [
        r
        for r in s.peaked
        if r.nvml_end is not None
        and (r.nvml_peak_bytes or 0) - r.nvml_end
        > max(th.transient_bytes, th.transient_share * r.nvml_end)
    ]
    if not spikes:
        return []

    def rise(r: StepRecord) -> int:
        return (r.nvml_peak_bytes or 0) - (r.nvml_end or 0)

    groups: dict[str, list[StepRecord]] = {}  # by the phase holding the peak
    for r in spikes:
        ph = r.peak_phase
        groups.setdefault(ph.phase if ph else "", []).append(r)
    big = max(spikes, key=rise)
    phase = big.peak_phase
    name = phase.phase if phase else ""
    group = groups[name]
    ms = (
        f", {s.ms(big.nvml_peak_t_ns - big.begin_ns)} ms in"
        if big.nvml_peak_t_ns is not None
        else ""
    )
    label = name.replace("_", "/")
    many = len(group) > 1
    if name and len(groups) == 1:
        text = (
            f"Step{'s' if many else ''} {steps_text([r.step for r in group])} peak"
            f"{'' if many else 's'} above the end-of-step reading in "
            f"{'their' if many else 'its'} {label} phase, by up to {gib(rise(big))} (step "
            f"{big.step}{ms}), and fall{'' if many else 's'} back inside the step"
        )
    elif name:
        text = (
            f"{len(spikes)} of {len(s.peaked)} measured steps peak well above their end-of-step "
            f"reading; the largest rise, {gib(rise(big))} in step {big.step}{ms}, is in its "
            f"{label} phase, as in step{'s' if many else ''} {steps_text([r.step for r in group])}"
        )
    else:
        text = (
            f"{len(spikes)} of {len(s.peaked)} measured steps peak well above their end-of-step "
            f"reading; the largest, step {big.step}, rose {gib(rise(big))} ({ms.removeprefix(', ')}"
            ") and fell back inside the step"
        ).replace(" ()", "")
    split = peak_split(big)
    splits = [p for p in map(peak_split, spikes) if p is not None]
    outside = [p for p in splits if p.transient_outside > th.transient_outside_bytes]
    if split is not None and big.reserved_end is not None:
        above = split.reserved_peak - big.reserved_end
        text += f": torch's reserved pool peaked {gib(above)} above its end"
        if split.transient_outside and s.shown(split.transient_outside):
            text += f", and at least {gib(split.transient_outside)} more lay outside torch"
    text += "."
    most = max(outside, key=lambda p: p.transient_outside) if outside else None
    if most is not None and most.step != big.step:
        text += (
            f" In {len(outside)} step(s) memory outside torch came and went, up to at least "
            f"{gib(most.transient_outside)} (step {most.step})."
        )
    return [
        Finding(
            FindingKind.TRANSIENT,
            text,
            {
                "steps": len(spikes),
                "largest_step": big.step,
                "largest_bytes": rise(big),
                "phase": name or None,
                "phase_steps": [r.step for r in group],
                "splits": [vars(p) for p in splits],
                "view": "nvml",
            },
            steps=(spikes[0].step, spikes[-1].step),
        )
    ]
