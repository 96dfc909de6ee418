"""Typed records that cross process boundaries (Ray calls, captures, the run store): NVML
readings, the probe's step events, a sampler's identity. A joined step is
:class:`collector.model.step.StepRecord`.

All memory figures are bytes; all timestamps are ``time.monotonic_ns()`` of the node they were
taken on (``CLOCK_MONOTONIC`` is shared by every process of one node, so a probe's step event and
a sampler's NVML sample can be compared directly).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from collector.model.untrusted import inert

__all__ = [
    "ERROR_PREFIX",
    "INT64_MAX",
    "LEGACY_ESTIMATE_KEY",
    "STEP_EVENT_KINDS",
    "DeviceInfo",
    "MemoryInfo",
    "ProcessMemory",
    "SamplerHealth",
    "SamplerInfo",
    "Stat",
    "StepEvent",
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
INT64_MAX = (1 << 63) - 1  # what a Parquet column (and Prometheus' timestamps) can hold
# Where events and records written before ``estimate_peak`` was a field of its own kept the
# predicted peak: a ledger key. Read (and moved to the field) only; never written.
LEGACY_ESTIMATE_KEY = "estimate_peak"
MAX_NAME_CHARS = 128  # a phase name, a GPU UUID, a torch/ledger key
MAX_VALUES = 256  # keys in an event's torch or ledger mapping
MAX_WORLD = 1 << 20  # ranks in one run


def whole(v: Any, lo: int = 0, hi: int = INT64_MAX) -> bool:
    """An int (not a bool) in ``lo..hi``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def number(v: Any) -> bool:
    """A finite int or float that fits an int64 column."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return v == v and -INT64_MAX <= v <= INT64_MAX  # NaN != NaN; inf is out of range


def take_legacy_estimate(ledger: dict[str, Any], estimate_peak: Any) -> tuple[dict, Any]:
    """A ledger written before ``estimate_peak`` had its own field, and that field: the
    prediction moved out of the ledger of measured bytes."""
    if LEGACY_ESTIMATE_KEY not in ledger:
        return ledger, estimate_peak
    ledger = dict(ledger)
    legacy = ledger.pop(LEGACY_ESTIMATE_KEY)
    return ledger, estimate_peak if estimate_peak is not None else legacy


@dataclass
class StepEvent:
    """A mark the training side sends at a step boundary or a phase change inside a step.

    ``torch`` holds allocator figures read at that moment (``torch.cuda.memory_stats`` keys such as
    ``allocated_bytes.all.current``, flattened, plus ``mem_get_info``'s free/total); for ``phase``
    and ``end`` events it also holds the peaks since the previous mark. ``ledger`` (bytes by
    :class:`collector.model.kinds.MemoryKind`, and the :class:`~collector.model.kinds.LedgerFigure`
    sizes) is present on ``end`` events only, as is ``estimate_peak``: the allocated peak an
    estimate predicted for the step (a probe given one), None otherwise.

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
    estimate_peak: int | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field (events arrive from other processes
        and from files anyone can edit): every number must fit an int64 column, names are
        bounded, values are finite."""
        if self.kind not in STEP_EVENT_KINDS:
            raise ValueError(f"step event kind {self.kind!r} is not one of {STEP_EVENT_KINDS}")
        if not whole(self.step):
            raise ValueError(f"step event step {self.step!r} is not an integer in 0..2^63-1")
        if not whole(self.t_ns, 1):
            raise ValueError(f"step event t_ns {self.t_ns!r} is not an integer in 1..2^63-1")
        for name in ("seq", "pid"):
            if not whole(getattr(self, name)):
                raise ValueError(f"step event {name} {getattr(self, name)!r} is not an integer")
        if not whole(self.world_size, 1, MAX_WORLD):
            raise ValueError(f"step event world_size {self.world_size!r} is not in 1..{MAX_WORLD}")
        if not whole(self.rank, 0, self.world_size - 1):
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
                isinstance(k, str) and len(k) <= MAX_NAME_CHARS and number(v)
                for k, v in values.items()
            ):
                raise ValueError(
                    f"step event {name} must map names to finite numbers that fit an int64"
                )
        if self.estimate_peak is not None and not whole(self.estimate_peak):
            raise ValueError(
                f"step event estimate_peak {self.estimate_peak!r} is not a whole number of bytes"
            )

    def to_dict(self) -> dict[str, Any]:
        # by hand: dataclasses.asdict deep-copies recursively, ~10x slower on the probe's path
        d = {
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
        if self.estimate_peak is not None:
            d["estimate_peak"] = self.estimate_peak
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepEvent:
        """An event from its dict form, validated (events are untrusted data), its names made
        inert (no control characters); one written before ``estimate_peak`` had its own field
        gets it from its ledger."""
        if not isinstance(d, dict):
            raise ValueError(f"step event must be a mapping, got {type(d).__name__}")
        known = {k: d[k] for k in _EVENT_FIELDS if k in d}
        missing = {"kind", "step", "t_ns", "gpu_uuid"} - known.keys()
        if missing:
            raise ValueError(f"step event lacks {sorted(missing)}")
        if isinstance(known.get("ledger"), dict):
            known["ledger"], known["estimate_peak"] = take_legacy_estimate(
                known["ledger"], known.get("estimate_peak")
            )
        ev = cls(**known)
        ev.validate()
        ev.phase, ev.gpu_uuid = inert(ev.phase), inert(ev.gpu_uuid)  # printed later: inert
        return ev


_EVENT_FIELDS = tuple(f.name for f in fields(StepEvent))


class Stat:
    """The allocator figures a step event's ``torch`` mapping carries (``torch.cuda.memory_stats``
    keys, ``mem_get_info``'s, and the probe's own), spelled here once. Readers use the named
    accessors of :class:`collector.model.step.StepRecord` (``reserved_end``, ``allocated_end``,
    …)."""

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


@dataclass
class SamplerInfo:
    """Who a sampler actor is and how it samples, as ``info()`` returns it and a run's
    ``meta.json`` keeps it (``samplers``). ``node_id`` is the node it was placed for,
    ``actor_node_id`` where it really runs; ``index`` NVML's index (labels only); ``error``
    says why it could not start (a port in use), empty when it did; ``processes`` the training
    processes that reported to it (pid → Ray name). Stores written by earlier versions may lack
    any field but the four :meth:`from_untrusted` requires."""

    gpu_uuid: str
    node_id: str
    index: int
    total_bytes: int
    name: str = ""
    driver: str = ""
    actor_node_id: str = ""
    backend: str = ""
    memory_info_version: int | None = None
    rate_hz: float = 0.0
    resolution_ns: int = 0
    run_id: str = ""
    workload: str = ""
    targets: str = ""
    metrics_addr: str = ""
    metrics_port: int = 0
    capacity: int = 0
    ring_bytes: int = 0
    pid: int = 0
    started_ns: int | None = None
    wall_offset_ns: int = 0
    replay_origin_ns: int | None = None
    replay_speed: float | None = None
    error: str = ""
    processes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_untrusted(cls, d: Any, where: str, max_bytes: int) -> SamplerInfo:
        """A sampler's info as a run store or a records file keeps it, checked (one line
        naming the field otherwise, ``ValueError``): the identity fields must be there and of
        their type; any other field of a wrong type takes its default."""
        if not isinstance(d, dict):
            raise ValueError(f"{where} is not an object")
        for k, ok in (
            ("gpu_uuid", lambda v: isinstance(v, str) and v),
            ("node_id", lambda v: isinstance(v, str)),
            ("index", whole),
            ("total_bytes", lambda v: whole(v) and 0 < v <= max_bytes),
        ):
            if not ok(d.get(k)):
                raise ValueError(f"{where}.{k} is missing or of the wrong type")
        kept: dict[str, Any] = {}
        for f in fields(cls):
            v = d.get(f.name)
            if v is None:
                continue
            if f.name == "processes":
                if isinstance(v, dict):
                    kept[f.name] = {inert(str(k)): inert(str(x)) for k, x in v.items()}
            elif isinstance(v, _FIELD_TYPES.get(f.name, str)) and not isinstance(v, bool):
                kept[f.name] = inert(v) if isinstance(v, str) else v
        return cls(**kept)


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "index": int,
    "total_bytes": int,
    "memory_info_version": int,
    "rate_hz": (int, float),
    "resolution_ns": int,
    "metrics_port": int,
    "capacity": int,
    "ring_bytes": int,
    "pid": int,
    "started_ns": int,
    "wall_offset_ns": int,
    "replay_origin_ns": int,
    "replay_speed": (int, float),
}


@dataclass(frozen=True)
class SamplerHealth:
    """How a sampler fared, as ``health()`` and ``stop()`` return it and a run's ``meta.json``
    keeps it (``health``, one a sampler): whether it still samples (``alive``; ``stopped_by``
    what ended it, e.g. ``gpu_lost``), samples taken, NVML errors by kind, deadlines missed, the
    niceness its thread ran at, the rate achieved (last window, and over the run), step events
    received and rejected by reason, steps pending a join and still open, the spool's malformed
    lines and failed writers, steps joined, remote write's figures (``stats()`` of the writer)
    and the per-process readings (``taken``, ``errors`` by kind). ``unreachable``: the sampler
    could not be asked at the end of the run (``error`` names why). A figure a store does not
    hold (an earlier version, a broken file) is ``None``: not known, never zero."""

    gpu_uuid: str = ""
    alive: bool = False
    stopped_by: str | None = None
    samples_total: int | None = None
    errors: dict[str, int] = field(default_factory=dict)
    missed_deadlines: int | None = None
    sampler_niceness: int | None = None
    rate_hz: float | None = None
    mean_rate_hz: float | None = None
    events_received: int | None = None
    events_rejected: dict[str, int] = field(default_factory=dict)
    steps_pending: int | None = None
    steps_open: int | None = None
    spool_malformed: int | None = None
    spool_failed_writers: int | None = None
    steps_joined: int | None = None
    remote_write: dict[str, Any] | None = None
    process_readings: dict[str, Any] = field(default_factory=dict)
    unreachable: bool = False
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def unreached(cls, gpu_uuid: str, exc: BaseException) -> SamplerHealth:
        """The health of a sampler that could not be asked (killed, its node gone)."""
        return cls(gpu_uuid=gpu_uuid, unreachable=True, error=type(exc).__name__)

    @classmethod
    def from_untrusted(cls, d: Any, gpu_uuid: str = "") -> SamplerHealth:
        """A sampler's health as a run store keeps it: a figure of the wrong type, or a number
        that is not finite, is not known (``None``); strings made inert; a store written before
        health named its GPU gets ``gpu_uuid`` (its sampler's, by position)."""
        if not isinstance(d, dict):
            return cls(gpu_uuid=gpu_uuid)
        kept: dict[str, Any] = {}
        for f in fields(cls):
            v = d.get(f.name)
            want = _HEALTH_TYPES.get(f.name, str)
            if v is None or isinstance(v, bool) != (want is bool) or not isinstance(v, want):
                continue
            if isinstance(v, float) and not math.isfinite(v):
                continue
            if isinstance(v, dict):
                v = _counts(v) if f.name in ("errors", "events_rejected") else _inert_tree(v)
            kept[f.name] = inert(v) if isinstance(v, str) else v
        kept.setdefault("gpu_uuid", inert(gpu_uuid))
        return cls(**kept)


_HEALTH_TYPES: dict[str, type | tuple[type, ...]] = {
    "alive": bool,
    "unreachable": bool,
    "samples_total": int,
    "errors": dict,
    "missed_deadlines": int,
    "sampler_niceness": int,
    "rate_hz": (int, float),
    "mean_rate_hz": (int, float),
    "events_received": int,
    "events_rejected": dict,
    "steps_pending": int,
    "steps_open": int,
    "spool_malformed": int,
    "spool_failed_writers": int,
    "steps_joined": int,
    "remote_write": dict,
    "process_readings": dict,
}


def _counts(d: dict[Any, Any]) -> dict[str, int]:
    """Counts by reason, as a store keeps them: whole numbers under inert names."""
    return {inert(str(k))[:64]: v for k, v in list(d.items())[:256] if whole(v)}


def _inert_tree(v: Any, depth: int = 0) -> Any:
    if depth > 4:
        return None
    if isinstance(v, dict):
        return {inert(str(k))[:64]: _inert_tree(x, depth + 1) for k, x in list(v.items())[:256]}
    if isinstance(v, list):
        return [_inert_tree(x, depth + 1) for x in v[:256]]
    return inert(v) if isinstance(v, str) else v
