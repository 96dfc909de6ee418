"""The verdict: one to three lines that say what happened and the number that matters, from the
findings (never from anything the findings do not say)."""

from __future__ import annotations

from collector.diagnosis.kinds import Finding, FindingKind
from collector.diagnosis.text import g, size, steps_text

__all__ = ["verdict"]


def verdict(findings: list[Finding]) -> list[str]:
    by_kind: dict[FindingKind, Finding] = {}
    for f in findings:
        by_kind.setdefault(f.kind, f)
    lines: list[str] = []
    k = FindingKind
    if k.EMPTY in by_kind:
        return ["No complete step was recorded: nothing to judge."]
    if k.OOM in by_kind:
        f = by_kind[k.OOM]
        peak = f.numbers.get("peak")
        lines.append(
            f"Out of memory in step {f.numbers['step']}"
            + (f" (NVML peaked at {g(peak)} inside it)." if peak is not None else ".")
        )
    elif k.FAILED in by_kind:
        f = by_kind[k.FAILED]
        lines.append(f"Step {f.numbers['step']} failed with {f.numbers['error']}.")
    elif k.INTERRUPTED in by_kind:
        lines.append(f"Stopped during step {by_kind[k.INTERRUPTED].numbers['step']}.")
    if k.LEAK in by_kind:
        n = by_kind[k.LEAK].numbers
        line = (
            f"Leaking: live tensors grow {size(n['bytes_per_step'])} a step (steps "
            f"{n['from_step']}–{n['to_step']})"
        )
        site = n.get("site")
        lines.append(line + (f"; {site.split(': ', 1)[-1]}." if site else "."))
    elif k.GROWING in by_kind:
        n = by_kind[k.GROWING].numbers
        lines.append(
            f"Still growing: {n['pool']} grows {size(n['bytes_per_step'])} a step (steps "
            f"{n['from_step']}–{n['to_step']})."
        )
    elif k.FRAGMENTATION in by_kind and "bytes_per_step" in by_kind[k.FRAGMENTATION].numbers:
        n = by_kind[k.FRAGMENTATION].numbers
        lines.append(
            f"Fragmentation: torch reserved grows {size(n['bytes_per_step'])} a step while live "
            "tensors do not."
        )
    elif k.STEADY in by_kind:
        n = by_kind[k.STEADY].numbers
        lines.append(
            f"Steady from step {n['step']}: NVML {g(n['nvml_end'] or 0)} at step end"
            + (f", torch reserved {g(n['reserved_end'])}." if n.get("reserved_end") else ".")
        )
    elif k.UNSTEADY in by_kind:
        lines.append("No steady state, and no growth over the run: memory moves from step to step.")
    if k.HEADROOM in by_kind:
        n = by_kind[k.HEADROOM].numbers
        line = (
            f"Peak {g(n['peak'])} in step {n['step']}, {100 * n['peak'] / n['total']:.1f} % of "
            f"the card (headroom {g(n['total'] - n['peak'])})"
        )
        t = next(
            (
                f
                for f in findings
                if f.kind is k.TRANSIENT
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
        lines.append(line + ".")
    if len(lines) < 3:
        jump = next(
            (
                f
                for f in findings
                if f.kind is k.JUMP
                and f.numbers.get("cause") == "peak"
                and f.numbers.get("new_state")
            ),
            None,
        )
        frag = by_kind.get(k.FRAGMENTATION)
        if jump is not None:
            n = jump.numbers
            kinds = " and ".join(
                f"{kind.replace('_', ' ')} ({g(b)})" for kind, b in n["new_kinds"].items()
            )
            lines.append(
                f"The step {n['from_step']}→{n['to_step']} jump (+{g(n['reserved_jump'])} "
                f"reserved) is {kinds} appearing in step {n['from_step']}."
            )
        elif frag is not None and not any(x.startswith("Fragmentation") for x in lines):
            lines.append(frag.numbers.get("summary") or frag.text)
    return lines[:3]
