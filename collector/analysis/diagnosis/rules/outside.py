"""Memory outside the allocator at the last step that has an end reading: managed (paged)
optimizer state when the ledger holds it; otherwise split by NVML's per-process readings (this
process outside torch, other processes by pid, memory charged to no process), or said to be
unsplit when there are none. Components under the noise floor are left out of the text."""

from __future__ import annotations

from collector.analysis.diagnosis.kinds import Finding, FindingKind
from collector.analysis.diagnosis.steps import Steps
from collector.model.kinds import Component
from collector.model.units import gib


def who(s: Steps) -> str:
    """How the training process was known, when it was not from the probe."""
    if s.pid_source == "identified":
        return f" Pid {s.pid} holds torch's pool: the training process (the probe did not name it)."
    return ""


def rule(s: Steps) -> list[Finding]:
    if not s.ended or not s.has_torch:
        return []
    last = s.ended[-1]
    nt = last.nontorch_end
    if nt is None:
        return []
    th = s.th
    managed = last.managed
    if managed > th.managed_bytes:
        return [
            Finding(
                FindingKind.NONTORCH,
                f"{gib(nt)} of NVML used at step end is outside the torch allocator; managed "
                f"(paged) optimizer state accounts for {gib(managed)} of it: absent from torch's "
                "figures, present in NVML used once its pages sit on the GPU.",
                {"nontorch": nt, "managed": managed},
                steps=(last.step, last.step),
            )
        ]
    accs = s.accounts
    a = next((x for x in reversed(accs) if x.step == last.step), None)
    nums = {"nontorch": nt, "managed": managed}
    if a is None or a.unsplit is not None:
        return [
            Finding(
                FindingKind.NONTORCH,
                f"{gib(nt)} of NVML used at step end is outside the torch allocator beyond the "
                "probe's reading before training; with no per-process reading it cannot be "
                "split into this process's own (NCCL, cuBLAS, raw cudaMalloc), other processes "
                "and managed memory.",
                nums,
                steps=(last.step, last.step),
                minor=not s.shown(nt),
            )
        ]
    comp = a.components()
    base = comp[Component.BASELINE]
    # the table's non-torch figure, split: one baseline everywhere (the CUDA context before
    # training, or for an older capture this process's smallest over the run)
    beyond = a.device_used - a.reserved - base
    nums.update(outside=a.outside, others=a.other_processes, no_process=a.no_process)
    parts = []
    first = comp.get(Component.FIRST_USE, 0)
    if first >= th.first_use_bytes or (first and s.shown(first)):
        nums["first_use"] = first
        parts.append(f"{gib(first)} kept since first use (cuBLAS, NCCL)")
    if s.shown(a.outside):
        parts.append(f"{gib(a.outside or 0)} in this process (NCCL, cuBLAS, raw cudaMalloc)")
    others = [(pid, n, b) for pid, n, b in a.others if s.shown(b)]
    if others:
        listed = ", ".join(f"pid {pid} {n[:40]!r} {gib(b)}" for pid, n, b in others)
        parts.append(f"{gib(a.other_processes)} in other processes ({listed})")
    if s.shown(a.no_process):
        parts.append(f"{gib(a.no_process or 0)} charged to no process (CUDA managed/UVM memory)")
    what = (
        "CUDA context before training"
        if Component.FIRST_USE in comp
        else "this process's least over the run"
    )
    text = (
        f"At step {a.step}'s end, {gib(beyond)} lies outside torch beyond the baseline "
        f"({what}, {gib(base)})" + (f": {'; '.join(parts)}." if parts else ".")
    )
    f = Finding(FindingKind.NONTORCH, text, nums, steps=(a.step, a.step), minor=not parts)
    if who(s):
        f.add(who(s))
    return [f]
