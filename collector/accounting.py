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
pid the probe puts in its begin event.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Account",
    "PeakSplit",
    "account",
    "accounts",
    "allocator_mode",
    "changes",
    "locate",
    "mark_points",
    "nontorch_bytes",
    "outside_share",
    "peak_phase",
    "peak_split",
]

MIB = 1 << 20
CHANGE_BYTES = 256 * MIB  # the smallest step-to-step change of a component reported
TRUSTED_REMAINDER = CHANGE_BYTES // 2


def _t(r: dict[str, Any], part: str, key: str) -> int | None:
    v = (r.get(part) or {}).get(key)
    return None if v is None else int(v)


def nontorch_bytes(rec: dict[str, Any]) -> int | None:
    """NVML used − torch reserved − CUDA-context baseline at step end; None without torch stats.

    NVML v2 ``used`` equals CUDA's ``total − free`` (both leave out driver-reserved memory;
    measured equal on the H200), so the baseline the probe took with ``mem_get_info`` before
    training subtracts on the same footing.
    """
    te = rec.get("torch_end") or {}
    if "reserved_bytes.all.current" not in te or rec.get("nvml_end_bytes") is None:
        return None
    return (
        rec["nvml_end_bytes"]
        - te["reserved_bytes.all.current"]
        - te.get("context_baseline_bytes", 0)
    )


def _pid(recs: list[dict[str, Any]]) -> int | None:
    for r in recs:
        pid = _t(r, "torch_begin", "process_pid")
        if pid:
            return pid
    return None


@dataclass
class Account:
    """One GPU at the end of one step (bytes). ``None``: not known for this step."""

    step: int
    device_used: int
    baseline: int
    reserved: int
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


def account(r: dict[str, Any], pid: int | None, baseline: int | None) -> Account | None:
    """The account of record ``r`` (None without an end-of-step NVML reading or torch stats).
    ``baseline``: this process's smallest memory outside torch (:func:`accounts` finds it)."""
    used = r.get("nvml_end_bytes")
    reserved = _t(r, "torch_end", "reserved_bytes.all.current")
    if used is None or reserved is None:
        return None
    allocated = _t(r, "torch_end", "allocated_bytes.all.current") or 0
    a = Account(
        step=r["step"],
        device_used=used,
        baseline=0,
        reserved=reserved,
        allocated=allocated,
        inactive_split=_t(r, "torch_end", "inactive_split_bytes.all.current") or 0,
        outside_all=nontorch_bytes(r) or 0,  # known: used and reserved are
    )
    led = r.get("ledger") or {}
    if led:
        kinds = ("parameters", "gradients", "optimizer_state", "gradient_buckets")
        a.live = {k: int(led.get(k, 0)) for k in kinds if k in led and (led[k] or k in kinds[:3])}
        a.live["other_allocated"] = int(led.get("other_allocated", 0))
    procs = (r.get("processes") or {}).get("procs")
    snap_used = (r.get("processes") or {}).get("device_used")
    mine = [p for p in procs or [] if pid is not None and int(p[0]) == pid]
    moved = abs(used - snap_used) if snap_used is not None else None
    if mine and moved is not None and moved <= TRUSTED_REMAINDER and baseline is not None:
        this = int(mine[0][1] or 0)
        a.baseline = baseline
        a.before = _t(r, "torch_end", "context_baseline_bytes")
        a.outside = this - reserved - baseline
        a.others = [
            (int(p[0]), str(p[2]) if len(p) > 2 else "", int(p[1] or 0))
            for p in procs
            if int(p[0]) != pid
        ]
        a.no_process = snap_used - sum(int(p[1] or 0) for p in procs)
        a.remainder = used - snap_used
        t = (r.get("processes") or {}).get("t_ns")
        if t is not None:
            a.read_after_ms = (t - r["end_ns"]) / 1e6
    else:
        a.baseline = _t(r, "torch_end", "context_baseline_bytes") or 0
        a.unsplit = a.outside_all
        if moved is not None and moved > TRUSTED_REMAINDER:
            a.unsplit_why = (
                f"NVML moved {moved / MIB:.0f} MiB between the end mark and the per-process reading"
            )
        elif not mine:
            a.unsplit_why = "no per-process reading"
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


def accounts(recs: list[dict[str, Any]]) -> list[Account]:
    """The account of every step of one GPU that has one, in step order."""
    pid = _pid(recs)
    base = None
    for r in recs:
        procs = (r.get("processes") or {}).get("procs") or []
        reserved = _t(r, "torch_end", "reserved_bytes.all.current")
        v = outside_share(procs, pid, reserved) if reserved is not None else None
        if v is not None:
            base = v if base is None else min(base, v)
    out = [account(r, pid, base) for r in recs if not r.get("error")]
    return [a for a in out if a is not None]


def allocator_mode(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """How the allocator ran: from the probe's reading of the run's environment, and from the
    figures themselves (caching off: torch's statistics stay 0 while NVML moves)."""
    flags = {}
    for r in recs:
        tb = r.get("torch_begin") or {}
        if "allocator_caching_disabled" in tb:
            flags = tb
            break
    zero = all(
        not _t(r, "torch_end", "reserved_bytes.all.peak")
        and not _t(r, "torch_end", "num_device_alloc")
        for r in recs
        if r.get("torch_end")
    )
    moving = [r["nvml_peak_bytes"] for r in recs if r.get("nvml_peak_bytes") is not None]
    stats_zero = bool(moving) and zero and any(r.get("torch_end") for r in recs)
    return {
        "caching_disabled": bool(flags.get("allocator_caching_disabled")) or stats_zero,
        "from_environment": bool(flags),
        "stats_zero": stats_zero,
        "expandable_segments": bool(flags.get("allocator_expandable_segments")),
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


def mark_points(r: dict[str, Any]) -> list[tuple[str, int, int | None]]:
    """(what opens here, t_ns, memory outside torch) at each mark of step ``r``: its begin (or
    each phase's opening mark), then its end (``"end"``); none for a record without mark
    times."""
    pts: list[tuple[str, int, int | None]] = []
    if r.get("begin_ns") is None or r.get("end_ns") is None:
        return pts
    for ph in r.get("phases") or []:
        pts.append(
            (
                ph["phase"],
                ph["begin_ns"],
                _outside_unsplit(ph.get("nvml_begin_bytes"), ph.get("torch_reserved_begin_bytes")),
            )
        )
    if not pts:
        pts.append(
            (
                "step",
                r["begin_ns"],
                _outside_unsplit(
                    r.get("nvml_begin_bytes"), _t(r, "torch_begin", "reserved_bytes.all.current")
                ),
            )
        )
    pts.append(
        (
            "end",
            r["end_ns"],
            _outside_unsplit(
                r.get("nvml_end_bytes"), _t(r, "torch_end", "reserved_bytes.all.current")
            ),
        )
    )
    return pts


def locate(change: dict[str, Any], by_step: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """Where between the end of step ``since`` and the end of step ``step`` the memory outside
    torch moved by at least half of ``change["delta"]``: the first stretch between two marks
    that did. ``{"step", "phase", "from_ns", "to_ns"}``; ``phase`` is ``"between steps"`` for
    the stretch from the step before's end to this step's begin. None when the marks' readings
    are missing or no single stretch holds half of it (it came in pieces)."""
    prev = mark_points(by_step.get(change["since"]) or {})
    if not prev:
        return None
    last = prev[-1]
    half = abs(change["delta"]) / 2
    sign = 1 if change["delta"] > 0 else -1
    for s in range(change["since"] + 1, change["step"] + 1):
        pts = mark_points(by_step.get(s) or {})
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


def peak_phase(r: dict[str, Any]) -> dict[str, Any] | None:
    """The phase of step ``r`` whose window holds its NVML peak (None: no phase marks, or no
    peak time)."""
    t = r.get("nvml_peak_t_ns")
    if t is None:
        return None
    return next((ph for ph in r.get("phases") or [] if ph["begin_ns"] <= t <= ph["end_ns"]), None)


def peak_split(r: dict[str, Any]) -> PeakSplit | None:
    peak, end = r.get("nvml_peak_bytes"), r.get("nvml_end_bytes")
    res_end = _t(r, "torch_end", "reserved_bytes.all.current")
    if peak is None or end is None or res_end is None:
        return None
    t = r.get("nvml_peak_t_ns")
    ph = peak_phase(r)
    res_peak = r.get("torch_reserved_peak_bytes")
    if ph is not None:
        res_peak = ph.get("torch_reserved_peak_bytes", res_peak)
    res_peak = max(int(res_peak or 0), res_end)
    outside_end = end - res_end
    return PeakSplit(
        step=r["step"],
        peak=peak,
        t_ns=t,
        phase=None if ph is None else ph["phase"],
        reserved_peak=res_peak,
        outside_at_end=outside_end,
        transient_outside=max(0, peak - res_peak - outside_end),
    )
