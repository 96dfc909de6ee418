"""Every byte at a step's end, accounted for instead of guessed.

For one GPU at the end of a step::

    NVML device used = baseline + torch reserved + outside torch (this process)
                       + other processes + no process + remainder

* **torch reserved**: live tensors (by ledger kind when the probe watched the model and
  optimizer: parameters, gradients, optimizer state, other live) + cached-free + inactive split;
* **baseline**: this process's memory outside torch at its smallest over the run (the CUDA
  context, libraries loaded before step 1); without per-process readings, the probe's reading
  before training (device used − reserved then, which also holds other processes of that time);
* **outside torch (this process)**: NVML per-process used − reserved − baseline: NCCL buffers,
  cuBLAS workspaces, raw ``cudaMalloc``, another library's own allocator;
* **other processes**: NVML per-process used of every other process on the GPU, by pid and name;
* **no process**: device used − Σ per-process used — memory no process is charged for, such as
  CUDA managed (UVM) memory resident on the GPU: a paged optimizer's state (NVML's per-process
  figure does not count it; seen on the H200);
* **remainder**: what moved between the end mark and the per-process reading (it is read when
  the step is joined, shortly after its end; a capture's snapshot a few ms after the mark).
  It may sit in any component, so each is known to within it, and a change between two
  steps' ends to within twice it. A reading whose remainder exceeds :data:`TRUSTED_REMAINDER`,
  half of :data:`CHANGE_BYTES` (the smallest change reported), could make a change up on its
  own: it does not describe that step's end (the next step had begun allocating), and its split
  is dropped (one unsplit figure, with the reason), not guessed.

Without per-process readings (captures recorded before them, an NVML that refuses) everything
outside torch and the baseline is one figure, said to be unsplit. The process is known by the
pid the probe puts in its begin event; a capture recorded before the probe did that is matched
to the one listed process that holds at least torch's reserved pool at every step
(:func:`identify_process`), and the report says so.

With the caching allocator off (``PYTORCH_NO_CUDA_MEMORY_CACHING``) torch's figures read 0:
tensors go straight to the driver. What torch holds is then the ledger's tensors (parameters,
gradients, optimizer state, DDP's buckets: a lower bound, activations are not in it), the
baseline is measured against it, and no "other allocated" is derived from the zero figures.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from collector.records import Stat, StepRecord

__all__ = [
    "Account",
    "PeakSplit",
    "account",
    "accounts",
    "allocator_mode",
    "changes",
    "identify_process",
    "locate",
    "mark_points",
    "outside_share",
    "peak_phase",
    "peak_split",
]

MIB = 1 << 20
CHANGE_BYTES = 256 * MIB  # the smallest step-to-step change of a component reported
TRUSTED_REMAINDER = CHANGE_BYTES // 2
LEDGER_TENSORS = ("parameters", "gradients", "optimizer_state", "gradient_buckets")


def _ledger_tensors(r: StepRecord) -> int:
    return sum(r.ledger_of(k) for k in LEDGER_TENSORS)


def held_by_torch(r: StepRecord, caching_off: bool) -> int | None:
    """What torch holds on the device at the step's end: its reserved pool; with the caching
    allocator off (every figure 0), the ledger's tensors (0 without a ledger)."""
    if caching_off:
        return _ledger_tensors(r)
    return r.reserved_end


def identify_process(recs: Sequence[StepRecord]) -> tuple[int | None, str]:
    """The training process's pid, and how it is known: from the probe (its begin event), or,
    for records whose probe did not say (captures recorded before it did), the one process of
    NVML's per-process readings that holds at least torch's reserved pool at every step that
    has a reading. ``(None, why)`` when neither tells."""
    for r in recs:
        if r.process_pid:
            return r.process_pid, "probe"
    candidates: set[int] | None = None
    for r in recs:
        procs = r.processes.get("procs")
        reserved = r.reserved_end
        if not procs or reserved is None:
            continue
        holding = {int(p[0]) for p in procs if p[1] is not None and int(p[1]) >= reserved}
        candidates = holding if candidates is None else candidates & holding
    if candidates is not None and len(candidates) == 1:
        return next(iter(candidates)), "identified"
    return None, "ambiguous" if candidates else "none"


@dataclass
class Account:
    """One GPU at the end of one step (bytes). ``None``: not known for this step."""

    step: int
    device_used: int
    baseline: int
    reserved: int  # what torch holds (its reserved pool; caching off: the ledger's tensors)
    allocated: int
    inactive_split: int
    live: dict[str, int] = field(default_factory=dict)  # ledger kinds, when watched
    outside: int | None = None  # this process, outside torch
    others: list[tuple[int, str, int]] = field(default_factory=list)  # pid, name, bytes
    no_process: int | None = None
    unsplit: int | None = None  # outside torch, all kinds together (no usable reading)
    unsplit_why: str = ""  # why it is unsplit: no per-process reading, or one that moved
    remainder: int = 0
    read_after_ms: float | None = None  # the per-process reading's delay after the end mark
    outside_all: int = 0  # everything outside torch's reserved pool beyond the probe's baseline
    before: int | None = None  # the probe's reading before training (device used - reserved)
    caching_off: bool = False

    @property
    def first_use(self) -> int:
        """Of the baseline, what appeared outside torch after the probe's reading before
        training and stayed: libraries that allocate on first use (NCCL's communicator
        buffers at the first collective, cuBLAS workspaces). 0 when unknown."""
        if self.before is None or self.unsplit is not None:
            return 0
        return max(0, self.baseline - self.before)

    @property
    def cached_free(self) -> int:
        return max(0, self.reserved - self.allocated - self.inactive_split)

    @property
    def other_processes(self) -> int:
        return sum(b for _, _, b in self.others)

    def components(self) -> dict[str, int]:
        """Named components, summing to ``device_used``."""
        out = {"baseline": self.baseline, "torch reserved": self.reserved}
        if self.unsplit is not None:
            out["outside torch (unsplit)"] = self.unsplit
        else:
            out["outside torch, this process"] = self.outside or 0
            out["other processes"] = self.other_processes
            out["no process (managed/UVM)"] = self.no_process or 0
        out["remainder"] = self.remainder
        return out


def account(
    r: StepRecord, pid: int | None, baseline: int | None, caching_off: bool = False
) -> Account | None:
    """The account of record ``r`` (None without an end-of-step NVML reading or torch stats).
    ``baseline``: this process's smallest memory outside torch (:func:`accounts` finds it)."""
    used = r.nvml_end_bytes
    held = held_by_torch(r, caching_off)
    if used is None or held is None or r.reserved_end is None:
        return None
    allocated = held if caching_off else (r.allocated_end or 0)
    before = None if caching_off else r.context_baseline
    a = Account(
        step=r.step,
        device_used=used,
        baseline=0,
        reserved=held,
        allocated=allocated,
        inactive_split=0 if caching_off else r.inactive_split_end,
        outside_all=used - held - (before or 0),
        caching_off=caching_off,
    )
    if r.ledger:
        a.live = {
            k: r.ledger_of(k)
            for k in LEDGER_TENSORS
            if k in r.ledger and (r.ledger[k] or k in LEDGER_TENSORS[:3])
        }
        other = r.ledger_of("other_allocated")
        if not caching_off and other >= 0:  # caching off: allocated reads 0, nothing to derive
            a.live["other_allocated"] = other
    procs = r.processes.get("procs")
    snap_used = r.processes.get("device_used")
    mine = [p for p in procs or [] if pid is not None and int(p[0]) == pid]
    moved = abs(used - snap_used) if snap_used is not None else None
    if mine and moved is not None and moved <= TRUSTED_REMAINDER and baseline is not None:
        this = int(mine[0][1] or 0)
        a.baseline = baseline
        a.before = before
        a.outside = this - held - baseline
        a.others = [
            (int(p[0]), str(p[2]) if len(p) > 2 else "", int(p[1] or 0))
            for p in procs
            if int(p[0]) != pid
        ]
        a.no_process = snap_used - sum(int(p[1] or 0) for p in procs)
        a.remainder = used - snap_used
        t = r.processes.get("t_ns")
        if t is not None:
            a.read_after_ms = (t - r.end_ns) / 1e6
    else:
        a.baseline = before or 0
        a.unsplit = a.outside_all
        if moved is not None and moved > TRUSTED_REMAINDER:
            a.unsplit_why = (
                f"NVML moved {moved / MIB:.0f} MiB between the end mark and the per-process reading"
            )
        elif not mine:
            a.unsplit_why = "no per-process reading" if not procs else "no reading of this process"
        else:
            a.unsplit_why = "NVML gave no figure for this process"
    return a


def outside_share(procs: list[list[Any]], pid: int | None, reserved: int) -> int | None:
    """Process ``pid``'s NVML used memory outside torch's reserved pool (None: not listed);
    its smallest over the steps is the baseline."""
    for p in procs:
        if pid is not None and int(p[0]) == pid and p[1] is not None:
            return int(p[1]) - reserved
    return None


def accounts(recs: Sequence[StepRecord], pid: int | None = None) -> list[Account]:
    """The account of every step of one GPU that has one, in step order. ``pid``: the training
    process (default: :func:`identify_process`)."""
    if pid is None:
        pid, _ = identify_process(recs)
    caching_off = allocator_mode(recs)["caching_disabled"]
    base = None
    for r in recs:
        procs = r.processes.get("procs") or []
        held = held_by_torch(r, caching_off)
        v = outside_share(procs, pid, held) if held is not None else None
        if v is not None:
            base = v if base is None else min(base, v)
    out = [account(r, pid, base, caching_off) for r in recs if not r.failed]
    return [a for a in out if a is not None]


def allocator_mode(recs: Sequence[StepRecord]) -> dict[str, Any]:
    """How the allocator ran: from the probe's reading of the run's environment, and from the
    figures themselves (caching off: torch's statistics stay 0 while NVML moves)."""
    flags: dict[str, Any] = {}
    for r in recs:
        if Stat.CACHING_DISABLED in r.torch_begin:
            flags = r.torch_begin
            break
    with_torch = [r for r in recs if r.torch_end]
    zero = all(
        not r.reserved_end
        and not r.end_stat(Stat.RESERVED_PEAK)
        and not r.end_stat(Stat.DEVICE_ALLOCS)
        for r in with_torch
    )
    stats_zero = any(r.measured for r in recs) and zero and bool(with_torch)
    return {
        "caching_disabled": bool(flags.get(Stat.CACHING_DISABLED)) or stats_zero,
        "from_environment": bool(flags),
        "stats_zero": stats_zero,
        "expandable_segments": bool(flags.get(Stat.EXPANDABLE_SEGMENTS)),
    }


def changes(accs: list[Account], threshold: int = CHANGE_BYTES) -> list[dict[str, Any]]:
    """Each component's change above ``threshold`` from one step's end to a later one's, in
    step order. With per-process readings: between consecutive steps that have them (an
    unsplit step has another baseline, so the two are never compared; ``since`` is the step
    it is measured from), and, for a move outside torch that falls where no such pair covers
    it, ``"outside torch (unsplit)"`` from one step to the next. Without any: every component
    from one step to the next."""
    split = [a for a in accs if a.unsplit is None]
    out = []
    for prev, cur in itertools.pairwise(split or accs):
        a, b = prev.components(), cur.components()
        found = [
            {"step": cur.step, "since": prev.step, "component": name, "delta": b[name] - a[name]}
            for name in b
            if name != "remainder" and name in a and abs(b[name] - a[name]) > threshold
        ]
        if split:
            pa = {(pid, n) for pid, n, _ in prev.others}
            pb = {(pid, n) for pid, n, _ in cur.others}
            who = [f"pid {pid} {n[:40]!r} came" for pid, n in sorted(pb - pa)]
            who += [f"pid {pid} {n[:40]!r} left" for pid, n in sorted(pa - pb)]
            for c in found:
                if c["component"] == "other processes" and who:
                    c["who"] = who
        out += found
    if split:
        outside = [c for c in out if c["component"] != "torch reserved"]
        for prev, cur in itertools.pairwise(accs):
            d = cur.outside_all - prev.outside_all
            if abs(d) > threshold and not any(c["since"] < cur.step <= c["step"] for c in outside):
                out.append(
                    {
                        "step": cur.step,
                        "since": prev.step,
                        "component": "outside torch (unsplit)",
                        "delta": d,
                    }
                )
    return sorted(out, key=lambda c: c["step"])


# -- inside a step: where a change happened, and what the within-step peak was made of --------


def _outside_unsplit(nvml: int | None, reserved: int | None) -> int | None:
    """Device memory outside torch's reserved pool (baseline included: it cancels out of every
    difference taken here)."""
    return None if nvml is None or reserved is None else nvml - reserved


def mark_points(r: StepRecord | None) -> list[tuple[str, int, int | None]]:
    """(what opens here, t_ns, memory outside torch) at each mark of step ``r``: its begin (or
    each phase's opening mark), then its end (``"end"``); none without a record."""
    pts: list[tuple[str, int, int | None]] = []
    if r is None:
        return pts
    for ph in r.phases:
        pts.append(
            (
                ph["phase"],
                ph["begin_ns"],
                _outside_unsplit(ph.get("nvml_begin_bytes"), ph.get("torch_reserved_begin_bytes")),
            )
        )
    if not pts:
        pts.append(("step", r.begin_ns, _outside_unsplit(r.nvml_begin_bytes, r.reserved_begin)))
    pts.append(("end", r.end_ns, _outside_unsplit(r.nvml_end_bytes, r.reserved_end)))
    return pts


def locate(change: dict[str, Any], by_step: dict[int, StepRecord]) -> dict[str, Any] | None:
    """Where between the end of step ``since`` and the end of step ``step`` the memory outside
    torch moved by at least half of ``change["delta"]``: the first stretch between two marks
    that did. ``{"step", "phase", "from_ns", "to_ns"}``; ``phase`` is ``"between steps"`` for
    the stretch from the step before's end to this step's begin. None when the marks' readings
    are missing or no single stretch holds half of it (it came in pieces)."""
    prev = mark_points(by_step.get(change["since"]))
    if not prev:
        return None
    last = prev[-1]
    half = abs(change["delta"]) / 2
    sign = 1 if change["delta"] > 0 else -1
    for s in range(change["since"] + 1, change["step"] + 1):
        pts = mark_points(by_step.get(s))
        if not pts:
            return None
        opened = "between steps"
        for name, t, v in pts:
            if last[2] is not None and v is not None and (v - last[2]) * sign >= half:
                return {"step": s, "phase": opened, "from_ns": last[1], "to_ns": t}
            opened, last = name, (name, t, v)
    return None


@dataclass
class PeakSplit:
    """A step's within-step NVML peak, split: torch's reserved peak of the phase that holds it,
    memory outside torch as at the step's end, and the rest: memory outside torch's allocator
    that came and went inside the step (this process or another; per-process memory is read
    at step ends only). Torch's figure is its peak over the phase, so ``transient_outside`` is
    the least that can have been outside torch at the peak."""

    step: int
    peak: int
    t_ns: int | None
    phase: str | None
    reserved_peak: int
    outside_at_end: int
    transient_outside: int


def peak_phase(r: StepRecord) -> dict[str, Any] | None:
    """The phase of step ``r`` whose window holds its NVML peak (None: no phase marks, or no
    peak time)."""
    t = r.nvml_peak_t_ns
    if t is None:
        return None
    return next((ph for ph in r.phases if ph["begin_ns"] <= t <= ph["end_ns"]), None)


def peak_split(r: StepRecord) -> PeakSplit | None:
    peak, end, res_end = r.nvml_peak_bytes, r.nvml_end_bytes, r.reserved_end
    if peak is None or end is None or res_end is None:
        return None
    ph = peak_phase(r)
    res_peak = r.torch_reserved_peak_bytes
    if ph is not None:
        res_peak = ph.get("torch_reserved_peak_bytes", res_peak)
    res_peak = max(int(res_peak or 0), res_end)
    outside_end = end - res_end
    return PeakSplit(
        step=r.step,
        peak=peak,
        t_ns=r.nvml_peak_t_ns,
        phase=None if ph is None else ph["phase"],
        reserved_peak=res_peak,
        outside_at_end=outside_end,
        transient_outside=max(0, peak - res_peak - outside_end),
    )
