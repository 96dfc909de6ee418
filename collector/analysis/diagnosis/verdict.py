"""The verdict: one to three lines that say what happened and the number that matters, from the
findings (never from anything the findings do not say)."""

from __future__ import annotations

from collector.analysis.diagnosis.kinds import Finding, FindingKind
from collector.analysis.diagnosis.text import steps_text
from collector.model.kinds import Gap
from collector.model.units import gib, size

__all__ = ["verdict"]


K = FindingKind


def _ending(by_kind: dict[FindingKind, Finding]) -> list[str]:
    """How the run ended, when it did not: an OOM, a failed step, a stop."""
    if K.OOM in by_kind:
        f = by_kind[K.OOM]
        peak = f.numbers.get("peak")
        return [
            f"Out of memory in step {f.numbers['step']}"
            + (f" (NVML peaked at {gib(peak)} inside it)." if peak is not None else ".")
        ]
    if K.FAILED in by_kind:
        f = by_kind[K.FAILED]
        return [f"Step {f.numbers['step']} failed with {f.numbers['error']}."]
    if K.INTERRUPTED in by_kind:
        return [f"Stopped during step {by_kind[K.INTERRUPTED].numbers['step']}."]
    u = by_kind.get(K.UNMEASURED)
    if (
        u is not None
        and u.numbers["steps"] == u.numbers["of"]
        and u.numbers["gaps"] == [Gap.STAND_IN.value]
    ):
        return [
            "No NVML figure: CPU processes stood in for the GPU (a replay beside them); the "
            "steps and the ledger below are theirs."
        ]
    if u is not None and u.numbers["steps"] == u.numbers["of"]:
        return [
            "No NVML sample in any step: every NVML figure is unknown (steps shorter than the "
            "sampling period?)."
        ]
    return []


def _trend(by_kind: dict[FindingKind, Finding]) -> list[str]:
    """Where end-of-step memory went: a leak, growth, fragmentation, a steady state."""
    if K.LEAK in by_kind:
        n = by_kind[K.LEAK].numbers
        line = (
            f"Leaking: live tensors grow {size(n['bytes_per_step'])} a step (steps "
            f"{n['from_step']}–{n['to_step']})"
        )
        site = n.get("site")
        return [line + (f"; {site.split(': ', 1)[-1]}." if site else ".")]
    if K.GROWING in by_kind:
        n = by_kind[K.GROWING].numbers
        return [
            f"Still growing: {n['pool']} grows {size(n['bytes_per_step'])} a step (steps "
            f"{n['from_step']}–{n['to_step']})."
        ]
    if K.FRAGMENTATION in by_kind and "bytes_per_step" in by_kind[K.FRAGMENTATION].numbers:
        n = by_kind[K.FRAGMENTATION].numbers
        return [
            f"Fragmentation: torch reserved grows {size(n['bytes_per_step'])} a step while live "
            "tensors do not."
        ]
    if K.STEADY in by_kind:
        n = by_kind[K.STEADY].numbers
        return [
            f"Steady from step {n['step']}: NVML {gib(n['nvml_end'] or 0)} at step end"
            + (f", torch reserved {gib(n['reserved_end'])}." if n.get("reserved_end") else ".")
        ]
    if K.UNSTEADY in by_kind:
        return ["No steady state, and no growth over the run: memory moves from step to step."]
    return []


def _peak(findings: list[Finding], by_kind: dict[FindingKind, Finding]) -> list[str]:
    """The largest peak against the card, and the phase that made it."""
    if K.HEADROOM not in by_kind:
        return []
    n = by_kind[K.HEADROOM].numbers
    line = (
        f"Peak {gib(n['peak'])} in step {n['step']}, {100 * n['peak'] / n['total']:.1f} % of "
        f"the card (headroom {gib(n['total'] - n['peak'])})"
    )
    t = next(
        (
            f
            for f in findings
            if f.kind is K.TRANSIENT
            and f.numbers.get("phase")
            and n["step"] in f.numbers["phase_steps"]
        ),
        None,
    )
    if t is not None:
        line += (
            f", made by the {t.numbers['phase'].replace('_', '/')} phase of step"
            f"{'s' if len(t.numbers['phase_steps']) > 1 else ''} "
            f"{steps_text(t.numbers['phase_steps'])}"
        )
    if n.get("peak_gap"):
        line += f" — at least: step {n['step']}'s sampling missed part of it ({n['peak_gap']})"
    elif n.get("blind_steps"):
        k = len(n["blind_steps"])
        line += f" — at least: {k} step{'s' if k > 1 else ''} missed part of their sampling"
    return [line + "."]


def _cause(findings: list[Finding], by_kind: dict[FindingKind, Finding], lines: list[str]):
    """The jump's cause (the state that appeared), else the fragmentation's summary."""
    jump = next(
        (
            f
            for f in findings
            if f.kind is K.JUMP and f.numbers.get("cause") == "peak" and f.numbers.get("new_state")
        ),
        None,
    )
    frag = by_kind.get(K.FRAGMENTATION)
    if jump is not None:
        n = jump.numbers
        kinds = " and ".join(
            f"{kind.replace('_', ' ')} ({gib(b)})" for kind, b in n["new_kinds"].items()
        )
        return [
            f"The step {n['from_step']}→{n['to_step']} jump (+{gib(n['reserved_jump'])} "
            f"reserved) is {kinds} appearing in step {n['from_step']}."
        ]
    if frag is not None and not any(x.startswith("Fragmentation") for x in lines):
        return [frag.numbers.get("summary") or frag.text]
    return []


def verdict(findings: list[Finding]) -> list[str]:
    by_kind: dict[FindingKind, Finding] = {}
    for f in findings:
        by_kind.setdefault(f.kind, f)
    if K.EMPTY in by_kind:
        return ["No complete step was recorded: nothing to judge."]
    lines = _ending(by_kind) + _trend(by_kind) + _peak(findings, by_kind)
    if len(lines) < 3:
        lines += _cause(findings, by_kind, lines)
    return lines[:3]
