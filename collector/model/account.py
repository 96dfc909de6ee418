"""Every byte at a step's end, accounted for instead of guessed; and a step's within-step peak,
split. Per step: the sampler actor and the exporters need it as much as the report (the
run-level half — a run's baseline, its changes, where they happened — is
:mod:`collector.analysis.accounting`).

For one GPU at the end of a step::

    NVML device used = baseline + torch reserved + first use + outside torch (this process)
                       + other processes + no process + remainder

* **torch reserved**: live tensors (by ledger kind when the probe watched the model and
  optimizer: parameters, gradients, optimizer state, other live) + cached-free + inactive split;
* **baseline**: the CUDA context as the probe read it before training (device used − reserved
  then, which also holds other processes of that time) — the one baseline of the report's
  table, its findings and ``stepmem_step_account_bytes``; a capture recorded before the probe
  read it: this process's memory outside torch at its smallest over the run;
* **first use**: what this process added outside torch after that reading and kept — its
  memory outside torch at its smallest over the run, less the baseline (cuBLAS workspaces,
  NCCL's buffers at the first collective);
* **outside torch (this process)**: NVML per-process used − reserved − its smallest over the
  run: what came and went beyond first use (raw ``cudaMalloc``, another library's own
  allocator, NCCL buffers that grow);
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
outside torch and the baseline is one figure, said to be unsplit.

With the caching allocator off (``PYTORCH_NO_CUDA_MEMORY_CACHING``) torch's figures read 0:
tensors go straight to the driver. What torch holds is then the ledger's tensors (parameters,
gradients, optimizer state, DDP's buckets: a lower bound, activations are not in it), the
baseline is measured against it, and no "other allocated" is derived from the zero figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from collector.model.kinds import LIVE_KINDS, Component, MemoryKind
from collector.model.records import ProcessMemory
from collector.model.step import StepRecord
from collector.model.units import MIB

__all__ = [
    "CHANGE_BYTES",
    "TRUSTED_REMAINDER",
    "Account",
    "PeakSplit",
    "account",
    "held_by_torch",
    "mark_points",
    "outside_share",
    "peak_split",
]

CHANGE_BYTES = 256 * MIB  # the smallest step-to-step change of a component reported
TRUSTED_REMAINDER = CHANGE_BYTES // 2


def _ledger_tensors(r: StepRecord) -> int:
    return sum(r.ledger_of(k) for k in LIVE_KINDS)


def held_by_torch(r: StepRecord, caching_off: bool) -> int | None:
    """What torch holds on the device at the step's end: its reserved pool; with the caching
    allocator off (every figure 0), the ledger's tensors (0 without a ledger)."""
    if caching_off:
        return _ledger_tensors(r)
    return r.reserved_end


@dataclass
class Account:
    """One GPU at the end of one step (bytes). ``None``: not known for this step."""

    step: int
    device_used: int
    baseline: int
    reserved: int  # what torch holds (its reserved pool; caching off: the ledger's tensors)
    allocated: int
    inactive_split: int
    live: dict[MemoryKind, int] = field(default_factory=dict)  # ledger kinds, when watched
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

    def components(self) -> dict[Component, int]:
        """Named components, summing to ``device_used``. One baseline everywhere: the CUDA
        context as the probe read it before training (what the table's non-torch column and
        :attr:`StepRecord.nontorch_end` subtract); what this process added outside torch on
        first use and kept is its own component, :attr:`Component.FIRST_USE`."""
        first = self.first_use
        out = {Component.BASELINE: self.baseline - first, Component.TORCH_RESERVED: self.reserved}
        if self.unsplit is None and self.before is not None:
            out[Component.FIRST_USE] = first
        if self.unsplit is not None:
            out[Component.OUTSIDE_UNSPLIT] = self.unsplit
        else:
            out[Component.OUTSIDE_TORCH] = self.outside or 0
            out[Component.OTHER_PROCESSES] = self.other_processes
            out[Component.NO_PROCESS] = self.no_process or 0
        out[Component.REMAINDER] = self.remainder
        return out


def _live(r: StepRecord, caching_off: bool) -> dict[MemoryKind, int]:
    """The ledger's live kinds at the step's end (a bucket figure of 0 left out) and what the
    allocator held beyond them (not with caching off: allocated reads 0)."""
    live = {
        k: r.ledger_of(k)
        for k in LIVE_KINDS
        if k in r.ledger and (r.ledger[k] or k is not MemoryKind.GRADIENT_BUCKETS)
    }
    other = r.ledger_of(MemoryKind.OTHER_ALLOCATED)
    if not caching_off and other >= 0:
        live[MemoryKind.OTHER_ALLOCATED] = other
    return live


def account(
    r: StepRecord, pid: int | None, baseline: int | None, caching_off: bool = False
) -> Account | None:
    """The account of record ``r`` (None without an end-of-step NVML reading or torch stats).
    ``baseline``: this process's smallest memory outside torch (the run's, by
    :func:`collector.analysis.accounting.accounts`; the sampler's so far, live)."""
    used = r.nvml_end  # a stale end reading is left out
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
        a.live = _live(r, caching_off)
    reading = r.processes
    procs = r.procs
    snap_used = reading.device_used if reading is not None else None
    mine = reading.of(pid) if reading is not None else None
    moved = abs(used - snap_used) if snap_used is not None else None
    # a per-process figure below torch's own pool does not describe this moment (an older
    # capture's reading of the GPU's processes, taken apart from the ranks' own): unsplit
    below = mine is not None and mine.used_bytes is not None and mine.used_bytes < held
    if (
        mine
        and not below
        and moved is not None
        and moved <= TRUSTED_REMAINDER
        and baseline is not None
    ):
        a.baseline = baseline
        a.before = before
        a.outside = (mine.used_bytes or 0) - held - baseline
        a.others = [(p.pid, p.name, p.used_bytes or 0) for p in procs if p.pid != pid]
        a.no_process = snap_used - sum(p.used_bytes or 0 for p in procs)
        a.remainder = used - snap_used
        if reading.t_ns is not None:
            a.read_after_ms = (reading.t_ns - r.end_ns) / 1e6
    else:
        a.baseline = before or 0
        if a.outside_all < 0:  # the probe's reading before training held more than is outside
            # torch now (another rank's memory, since freed): it is all the baseline there is
            a.baseline, a.outside_all = used - held, 0
        a.unsplit = a.outside_all
        a.unsplit_why = _why_unsplit(below, moved, mine, procs)
    return a


def _why_unsplit(
    below: bool, moved: int | None, mine: ProcessMemory | None, procs: list[ProcessMemory]
) -> str:
    """Why a step's memory outside torch is not split by process."""
    if below:
        return "NVML's figure for this process is below torch's own pool"
    if moved is not None and moved > TRUSTED_REMAINDER:
        return f"NVML moved {moved / MIB:.0f} MiB between the end mark and the per-process reading"
    if not mine:
        return "no per-process reading" if not procs else "no reading of this process"
    return "NVML gave no figure for this process"


def outside_share(procs: list[ProcessMemory], pid: int | None, reserved: int) -> int | None:
    """Process ``pid``'s NVML used memory outside torch's reserved pool (None: not listed);
    its smallest over the steps is the baseline."""
    for p in procs:
        if pid is not None and p.pid == pid and p.used_bytes is not None:
            # below torch's own pool: not a reading of this moment (see :func:`account`)
            return p.used_bytes - reserved if p.used_bytes >= reserved else None
    return None


# -- inside a step: the marks' readings, and what the within-step peak was made of -----------


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
                ph.phase,
                ph.begin_ns,
                _outside_unsplit(ph.nvml_begin_bytes, ph.torch_reserved_begin_bytes),
            )
        )
    if not pts:
        pts.append(("step", r.begin_ns, _outside_unsplit(r.nvml_begin_bytes, r.reserved_begin)))
    pts.append(("end", r.end_ns, _outside_unsplit(r.nvml_end, r.reserved_end)))
    return pts


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


def peak_split(r: StepRecord) -> PeakSplit | None:
    peak, end, res_end = r.nvml_peak_bytes, r.nvml_end, r.reserved_end
    if peak is None or end is None or res_end is None:
        return None
    ph = r.peak_phase
    res_peak = r.torch_reserved_peak_bytes
    if ph is not None and ph.torch_reserved_peak_bytes is not None:
        res_peak = ph.torch_reserved_peak_bytes
    res_peak = max(int(res_peak or 0), res_end)
    outside_end = end - res_end
    return PeakSplit(
        step=r.step,
        peak=peak,
        t_ns=r.nvml_peak_t_ns,
        phase=None if ph is None else ph.phase,
        reserved_peak=res_peak,
        outside_at_end=outside_end,
        transient_outside=max(0, peak - res_peak - outside_end),
    )
