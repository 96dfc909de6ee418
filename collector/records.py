"""Typed records that cross process boundaries (Ray calls, captures, the run store).

All memory figures are bytes; all timestamps are ``time.monotonic_ns()`` of the node they were
taken on (``CLOCK_MONOTONIC`` is shared by every process of one node, so a probe's step event and
a sampler's NVML sample can be compared directly).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = [
    "ERROR_PREFIX",
    "ESTIMATE_KEY",
    "INT64_MAX",
    "STEP_EVENT_KINDS",
    "DeviceInfo",
    "MemoryInfo",
    "ProcessMemory",
    "Stat",
    "StepEvent",
    "StepRecord",
]


@dataclass(frozen=True)
class MemoryInfo:
    """One NVML memory reading. ``version`` is the NVML struct version it came from (1 or 2):
    under v1 ``used`` includes driver-reserved memory and ``reserved`` is 0."""

    total: int
    free: int
    used: int
    reserved: int
    version: int


@dataclass(frozen=True)
class ProcessMemory:
    """NVML's per-process used memory. ``used_bytes`` is None where NVML cannot tell."""

    pid: int
    used_bytes: int | None
    name: str = ""  # the process's command line, shortened (empty where it cannot be read)


@dataclass(frozen=True)
class DeviceInfo:
    """A GPU as NVML names it. ``index`` is NVML's index (labels only; never used to open it)."""

    uuid: str
    index: int
    name: str
    total_bytes: int
    driver: str = ""


STEP_EVENT_KINDS = ("begin", "phase", "end")
ERROR_PREFIX = "error:"  # an ``end`` event whose phase starts so ends a step that raised
INT64_MAX = (1 << 63) - 1
# the ledger key of a step's predicted allocated peak (`stepmem estimate`, a probe given one)
ESTIMATE_KEY = "estimate_peak"  # what a Parquet column (and Prometheus' timestamps) can hold
MAX_NAME_CHARS = 128  # a phase name, a GPU UUID, a torch/ledger key
MAX_VALUES = 256  # keys in an event's torch or ledger mapping
MAX_WORLD = 1 << 20  # ranks in one run


def _whole(v: Any, lo: int = 0, hi: int = INT64_MAX) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _number(v: Any) -> bool:
    """A finite int or float that fits an int64 column."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return v == v and -INT64_MAX <= v <= INT64_MAX  # NaN != NaN; inf is out of range


@dataclass
class StepEvent:
    """A mark the training side sends at a step boundary or a phase change inside a step.

    ``torch`` holds allocator figures read at that moment (``torch.cuda.memory_stats`` keys such as
    ``allocated_bytes.all.current``, flattened, plus ``mem_get_info``'s free/total); for ``phase``
    and ``end`` events it also holds the peaks since the previous mark. ``ledger`` is present on
    ``end`` events only.

    Who and which step: ``step`` is the caller's own step number (it may repeat: an epoch that
    restarts ``enumerate(loader)``, a resumed run); ``seq`` is the probe's own sequence number
    of the step (1, 2, 3, … per process, never repeated), ``pid`` the training process, ``rank``
    and ``world_size`` its place in a distributed run. A step is keyed by (GPU, pid, seq).
    Events written before these fields existed have ``seq`` 0 and ``pid`` 0: the join numbers
    their steps in the order they begin.
    """

    kind: str
    step: int
    t_ns: int
    gpu_uuid: str
    phase: str = ""
    torch: dict[str, int] = field(default_factory=dict)
    ledger: dict[str, int] = field(default_factory=dict)
    seq: int = 0
    pid: int = 0
    rank: int = 0
    world_size: int = 1

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field (events arrive from other processes
        and from files anyone can edit): every number must fit an int64 column, names are
        bounded, values are finite."""
        if self.kind not in STEP_EVENT_KINDS:
            raise ValueError(f"step event kind {self.kind!r} is not one of {STEP_EVENT_KINDS}")
        if not _whole(self.step):
            raise ValueError(f"step event step {self.step!r} is not an integer in 0..2^63-1")
        if not _whole(self.t_ns, 1):
            raise ValueError(f"step event t_ns {self.t_ns!r} is not an integer in 1..2^63-1")
        for name in ("seq", "pid"):
            if not _whole(getattr(self, name)):
                raise ValueError(f"step event {name} {getattr(self, name)!r} is not an integer")
        if not _whole(self.world_size, 1, MAX_WORLD):
            raise ValueError(f"step event world_size {self.world_size!r} is not in 1..{MAX_WORLD}")
        if not _whole(self.rank, 0, self.world_size - 1):
            raise ValueError(
                f"step event rank {self.rank!r} is not in 0..{self.world_size - 1} "
                f"(world size {self.world_size})"
            )
        if not isinstance(self.gpu_uuid, str) or not 0 < len(self.gpu_uuid) <= MAX_NAME_CHARS:
            raise ValueError(f"step event gpu_uuid {self.gpu_uuid!r} is empty or too long")
        if not isinstance(self.phase, str) or len(self.phase) > MAX_NAME_CHARS:
            raise ValueError(f"step event phase must be a string of at most {MAX_NAME_CHARS}")
        for name in ("torch", "ledger"):
            values = getattr(self, name)
            if not isinstance(values, dict) or len(values) > MAX_VALUES:
                raise ValueError(f"step event {name} must map at most {MAX_VALUES} names")
            if not all(
                isinstance(k, str) and len(k) <= MAX_NAME_CHARS and _number(v)
                for k, v in values.items()
            ):
                raise ValueError(
                    f"step event {name} must map names to finite numbers that fit an int64"
                )

    def to_dict(self) -> dict[str, Any]:
        # by hand: dataclasses.asdict deep-copies recursively, ~10x slower on the probe's path
        return {
            "kind": self.kind,
            "step": self.step,
            "t_ns": self.t_ns,
            "gpu_uuid": self.gpu_uuid,
            "phase": self.phase,
            "torch": self.torch,
            "ledger": self.ledger,
            "seq": self.seq,
            "pid": self.pid,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepEvent:
        if not isinstance(d, dict):
            raise ValueError(f"step event must be a mapping, got {type(d).__name__}")
        known = {k: d[k] for k in _EVENT_FIELDS if k in d}
        missing = {"kind", "step", "t_ns", "gpu_uuid"} - known.keys()
        if missing:
            raise ValueError(f"step event lacks {sorted(missing)}")
        ev = cls(**known)
        ev.validate()
        return ev


_EVENT_FIELDS = (
    "kind",
    "step",
    "t_ns",
    "gpu_uuid",
    "phase",
    "torch",
    "ledger",
    "seq",
    "pid",
    "rank",
    "world_size",
)


class Stat:
    """The allocator figures a step event's ``torch`` mapping carries (``torch.cuda.memory_stats``
    keys, ``mem_get_info``'s, and the probe's own), spelled here once. Readers use the named
    accessors of :class:`StepRecord` (``reserved_end``, ``allocated_end``, …)."""

    ALLOCATED = "allocated_bytes.all.current"
    ALLOCATED_PEAK = "allocated_bytes.all.peak"
    RESERVED = "reserved_bytes.all.current"
    RESERVED_PEAK = "reserved_bytes.all.peak"
    ACTIVE = "active_bytes.all.current"
    ACTIVE_PEAK = "active_bytes.all.peak"
    INACTIVE_SPLIT = "inactive_split_bytes.all.current"
    INACTIVE_SPLIT_PEAK = "inactive_split_bytes.all.peak"
    SEGMENTS = "segment.all.current"
    RETRIES = "num_alloc_retries"
    OOMS = "num_ooms"
    DEVICE_ALLOCS = "num_device_alloc"
    DEVICE_FREES = "num_device_free"
    MEM_FREE = "mem_free_bytes"
    MEM_TOTAL = "mem_total_bytes"
    # the probe's own, in every event
    CONTEXT_BASELINE = "context_baseline_bytes"  # device used − reserved before training
    PROCESS_PID = "process_pid"  # begin events: the training process
    CACHING_DISABLED = "allocator_caching_disabled"  # begin events: PYTORCH_NO_CUDA_MEMORY_CACHING
    EXPANDABLE_SEGMENTS = "allocator_expandable_segments"  # begin events: PYTORCH_CUDA_ALLOC_CONF


GAP_FLAGS = ("no_samples", "sampler_started", "overrun", "stall", "undersampled", "stale_end")


@dataclass
class StepRecord:
    """One step on one GPU: NVML samples joined with the step's begin/end events.

    NVML figures are device ``used`` (v2: without driver-reserved memory) over the samples taken
    between ``begin_ns`` and ``end_ns`` inclusive. ``nvml_end_bytes`` (and ``nvml_begin_bytes``
    at the begin mark, each phase's ``nvml_begin_bytes`` at its opening mark) is the lower of the
    last sample at or before the mark and the first after it, if that came within 2 ms (or two
    sampling periods): memory released just before the mark (a final ``empty_cache``) counts as
    gone, memory the next step allocates just after it does not count, so the end reading never
    exceeds the step's peak.
    A step without samples (``gap == "no_samples"``) has no NVML figures: peak, peak time,
    minimum and the end reading are None ("not measured", never 0 bytes).
    ``gap`` names why the window may have missed samples: ``""`` (none),
    ``"no_samples"``, ``"sampler_started"`` (the sampler started after the step began, e.g. after a
    restart), ``"overrun"`` (the ring buffer no longer holds the start of the window) or
    ``"stall"`` (two consecutive samples further apart than the sampler's gap threshold), and
    with any of these ``"undersampled"`` (fewer than half the samples the rate promised: a
    sampler starved of CPU, whose peak may miss a short transient) and ``"stale_end"`` (the
    first sample after the end mark came later than the mark window, or none came near the mark:
    the end reading rests on an older sample, which cannot show memory released just before the
    mark), space-separated.
    ``torch_*_peak_bytes`` are the allocator's peaks over the whole step (the largest of the peaks
    each phase mark carried); None when the probe had no allocator statistics. ``error`` names the
    exception a failed step raised (``OutOfMemoryError``), ``""`` for a step that ended.
    ``seq``, ``pid``, ``rank`` and ``world_size`` are the step event's (:class:`StepEvent`): the
    record's key is (``gpu_uuid``, ``pid``, ``seq``); ``step`` is the caller's number, which may
    repeat.
    """

    gpu_uuid: str
    step: int
    begin_ns: int
    end_ns: int
    samples: int
    nvml_peak_bytes: int | None = None
    nvml_peak_t_ns: int | None = None
    nvml_min_bytes: int | None = None
    nvml_end_bytes: int | None = None
    nvml_reserved_bytes: int | None = None
    gap: str = ""
    nvml_begin_bytes: int | None = None
    torch_allocated_peak_bytes: int | None = None
    torch_reserved_peak_bytes: int | None = None
    torch_begin: dict[str, int] = field(default_factory=dict)
    torch_end: dict[str, int] = field(default_factory=dict)
    phases: list[dict[str, Any]] = field(default_factory=list)
    ledger: dict[str, int] = field(default_factory=dict)
    error: str = ""
    # NVML per-process memory read when the step was joined (shortly after its end):
    # {"t_ns", "device_used", "procs": [[pid, used_bytes, name], ...]}; {} where not read
    processes: dict[str, Any] = field(default_factory=dict)
    seq: int = 0
    pid: int = 0
    rank: int = 0
    world_size: int = 1

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.begin_ns) / 1e9

    # -- named readings (the torch mappings' keys live in :class:`Stat`) ----------------------

    def end_stat(self, key: str) -> int | None:
        """An allocator figure at the step's end mark (None: not read)."""
        v = self.torch_end.get(key)
        return None if v is None else int(v)

    def begin_stat(self, key: str) -> int | None:
        """An allocator figure at the step's begin mark (None: not read)."""
        v = self.torch_begin.get(key)
        return None if v is None else int(v)

    @property
    def has_torch(self) -> bool:
        """Whether the probe read the allocator (a CUDA process)."""
        return Stat.RESERVED in self.torch_end

    @property
    def allocated_end(self) -> int | None:
        return self.end_stat(Stat.ALLOCATED)

    @property
    def reserved_end(self) -> int | None:
        return self.end_stat(Stat.RESERVED)

    @property
    def allocated_begin(self) -> int | None:
        return self.begin_stat(Stat.ALLOCATED)

    @property
    def reserved_begin(self) -> int | None:
        return self.begin_stat(Stat.RESERVED)

    @property
    def inactive_split_end(self) -> int:
        return self.end_stat(Stat.INACTIVE_SPLIT) or 0

    @property
    def segments_end(self) -> int:
        return self.end_stat(Stat.SEGMENTS) or 0

    @property
    def retries(self) -> int:
        """Allocation retries (the allocator freed its cache to satisfy a request) so far."""
        return self.end_stat(Stat.RETRIES) or 0

    @property
    def ooms(self) -> int:
        """CUDA out-of-memory errors the allocator counted so far."""
        return self.end_stat(Stat.OOMS) or 0

    @property
    def context_baseline(self) -> int | None:
        """Device used − torch reserved when the probe started (the CUDA context, others)."""
        return self.end_stat(Stat.CONTEXT_BASELINE)

    @property
    def process_pid(self) -> int:
        """The training process: the record's pid, or (records written before it had one) the
        pid the probe put in the begin event; 0 when neither is known."""
        return self.pid or self.begin_stat(Stat.PROCESS_PID) or 0

    @property
    def measured(self) -> bool:
        """Whether NVML has a sample inside the step (its NVML figures are known)."""
        return self.nvml_peak_bytes is not None

    @property
    def end_known(self) -> bool:
        """Whether the end-of-step NVML reading describes the end (``stale_end``: an older
        sample only)."""
        return self.nvml_end_bytes is not None and not self.has_gap("stale_end")

    def has_gap(self, flag: str) -> bool:
        return flag in self.gap.split()

    @property
    def failed(self) -> bool:
        return bool(self.error)

    @property
    def out_of_memory(self) -> bool:
        return "OutOfMemory" in self.error

    @property
    def interrupted(self) -> bool:
        return self.error == "KeyboardInterrupt"

    @property
    def nontorch_end(self) -> int | None:
        """NVML used − torch reserved − the probe's baseline at the step's end (None without
        either reading). NVML v2 ``used`` equals CUDA's ``total − free`` (both leave out
        driver-reserved memory; measured equal on the H200), so the baseline the probe took with
        ``mem_get_info`` before training subtracts on the same footing."""
        if self.reserved_end is None or self.nvml_end_bytes is None:
            return None
        return self.nvml_end_bytes - self.reserved_end - (self.context_baseline or 0)

    def ledger_of(self, kind: str) -> int:
        return int(self.ledger.get(kind, 0))

    @property
    def estimate_peak(self) -> int | None:
        """The allocated peak an estimate predicted for this step (None: no estimate)."""
        v = self.ledger.get(ESTIMATE_KEY)
        return None if v is None else int(v)

    @property
    def managed(self) -> int:
        """Optimizer state in CUDA managed (paged) memory, by the ledger."""
        return self.ledger_of("optimizer_state_managed")

    @property
    def key(self) -> tuple[str, int, int]:
        """What tells this step from every other of the run: (GPU, process, sequence)."""
        return self.gpu_uuid, self.pid, self.seq

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRecord:
        """A record from :meth:`to_dict`'s form (a records file, a store row unflattened);
        fields this version does not know are left out, missing optional ones take their
        defaults."""
        names = {f.name for f in fields(cls)}
        missing = [k for k in ("gpu_uuid", "step", "begin_ns", "end_ns", "samples") if k not in d]
        if missing:
            raise ValueError(f"a step record needs {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})
