"""One phenomenon, one finding: the rules look at a run from several sides (growth over the
run, jumps between steps, the cache at the end), so the same memory can show in more than one.
:func:`reconcile` folds them together so that no two findings disagree about a cause, and
:func:`contradictions` says what still would (the golden cases and the tests assert none)."""

from __future__ import annotations

from collector.analysis.diagnosis.kinds import Finding, FindingKind, Pool
from collector.model.units import size

__all__ = ["contradictions", "reconcile"]

_OVER_THE_RUN = (FindingKind.STEADY, FindingKind.LEAK, FindingKind.GROWING, FindingKind.UNSTEADY)


def _within(f: Finding, lo: int, hi: int) -> bool:
    return f.steps is not None and lo <= f.steps[0] and f.steps[1] <= hi


def reconcile(findings: list[Finding]) -> list[Finding]:
    """* Under a **leak**, the jumps that live tensors made (cause ``live``) are the leak: they
      are folded into it (``numbers["jumps"]``); so is reserved growth beyond the live tensors
      (the leak finding says it), which leaves fragmentation only its other evidence (split
      blocks, retries) or nothing.
    * **Fragmentation** is the allocator's jumps (cause ``allocator``) and a torch-reserved
      growth while live tensors stay: those are folded into it.
    * A **growth** outside torch is also seen as step-to-step increases of that component: those
      are the growth."""
    out = list(findings)
    leak = next((f for f in out if f.kind is FindingKind.LEAK), None)
    frag = next((f for f in out if f.kind is FindingKind.FRAGMENTATION), None)
    if leak is not None and leak.steps is not None:
        lo, hi = leak.steps[0] - 1, leak.steps[1]
        folded = [
            f
            for f in out
            if f.kind is FindingKind.JUMP
            and f.numbers.get("cause") == "live"
            and _within(f, lo, hi)
        ]
        if folded:
            leak.numbers["jumps"] = sum(f.numbers.get("jumps", 1) for f in folded)
            out = [f for f in out if f not in folded]
        if frag is not None:
            if frag.numbers.get("inactive_split_named") or frag.numbers.get("retries"):
                frag.numbers["growth_in_leak"] = frag.numbers.pop("unexplained_growth", 0)
                frag.text = frag.numbers.get("text_without_growth", frag.text)
            else:
                out.remove(frag)
                frag = None
    growing = next((f for f in out if f.kind is FindingKind.GROWING), None)
    if growing is not None and growing.numbers.get("component"):
        # the growth outside torch, seen step by step: the same memory, one finding
        same = [
            f
            for f in out
            if f.kind is FindingKind.COMPONENT_CHANGE
            and f.numbers.get("component") == growing.numbers["component"]
            and all(c.delta > 0 for c in f.numbers.get("changes", []))
        ]
        out = [f for f in out if f not in same]
    if frag is not None:
        jumps = [
            f for f in out if f.kind is FindingKind.JUMP and f.numbers.get("cause") == "allocator"
        ]
        if jumps:
            frag.numbers["jumps"] = [
                (f.numbers["from_step"], f.numbers["to_step"], f.numbers["reserved_jump"])
                for f in jumps
            ]
            out = [f for f in out if f not in jumps]
        growing = [
            f
            for f in out
            if f.kind is FindingKind.GROWING and f.numbers.get("pool") is Pool.RESERVED
        ]
        for f in growing:
            rate = f.numbers["bytes_per_step"]
            frag.numbers["bytes_per_step"] = rate
            frag.text = (
                f"No steady state: torch reserved grows {size(rate)} a step while live tensors "
                f"do not. {frag.text}"
            )
            out.remove(f)
    return out


def contradictions(findings: list[Finding]) -> list[str]:
    """What two findings of one stream would disagree about (empty: nothing)."""
    out = []
    over = [f for f in findings if f.kind in _OVER_THE_RUN]
    if len(over) > 1:
        out.append("more than one verdict over the run: " + ", ".join(f.rule for f in over))
    leak = next((f for f in findings if f.kind is FindingKind.LEAK), None)
    if leak is not None:
        for f in findings:
            if "live tensors do not" in f.text:
                out.append(f"a leak, and {f.rule} says live tensors do not grow")
            if (
                f.kind is FindingKind.JUMP
                and f.numbers.get("cause") == "live"
                and leak.steps
                and _within(f, leak.steps[0] - 1, leak.steps[1])
            ):
                out.append(f"a leak, and a jump of live tensors at step {f.steps} told apart")
    frag = [f for f in findings if f.kind is FindingKind.FRAGMENTATION]
    if frag and any(
        f.kind is FindingKind.GROWING and f.numbers.get("pool") is Pool.RESERVED for f in findings
    ):
        out.append("fragmentation, and a cache growth told apart")
    return out
