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
    "STEP_EVENT_KINDS",
    "DeviceInfo",
    "MemoryInfo",
    "ProcessMemory",
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


@dataclass
class StepEvent:
    """A mark the training side sends at a step boundary or a phase change inside a step.

    ``torch`` holds allocator figures read at that moment (``torch.cuda.memory_stats`` keys such as
    ``allocated_bytes.all.current``, flattened, plus ``mem_get_info``'s free/total); for ``phase``
    and ``end`` events it also holds the peaks since the previous mark. ``ledger`` is present on
    ``end`` events only.
    """

    kind: str
    step: int
    t_ns: int
    gpu_uuid: str
    phase: str = ""
    torch: dict[str, int] = field(default_factory=dict)
    ledger: dict[str, int] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field (events arrive from other processes)."""
        if self.kind not in STEP_EVENT_KINDS:
            raise ValueError(f"step event kind {self.kind!r} is not one of {STEP_EVENT_KINDS}")
        if not isinstance(self.step, int) or isinstance(self.step, bool) or self.step < 0:
            raise ValueError(f"step event step {self.step!r} is not a non-negative integer")
        if not isinstance(self.t_ns, int) or isinstance(self.t_ns, bool) or self.t_ns <= 0:
            raise ValueError(f"step event t_ns {self.t_ns!r} is not a positive integer")
        if not isinstance(self.gpu_uuid, str) or not self.gpu_uuid:
            raise ValueError(f"step event gpu_uuid {self.gpu_uuid!r} is empty")
        for name in ("torch", "ledger"):
            values = getattr(self, name)
            if not isinstance(values, dict) or not all(
                isinstance(k, str) and isinstance(v, int | float) for k, v in values.items()
            ):
                raise ValueError(f"step event {name} must map names to numbers")

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
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepEvent:
        if not isinstance(d, dict):
            raise ValueError(f"step event must be a mapping, got {type(d).__name__}")
        known = {
            k: d[k]
            for k in ("kind", "step", "t_ns", "gpu_uuid", "phase", "torch", "ledger")
            if k in d
        }
        missing = {"kind", "step", "t_ns", "gpu_uuid"} - known.keys()
        if missing:
            raise ValueError(f"step event lacks {sorted(missing)}")
        ev = cls(**known)
        ev.validate()
        return ev


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
    ``"stall"`` (two consecutive samples further apart than the sampler's gap threshold).
    ``torch_*_peak_bytes`` are the allocator's peaks over the whole step (the largest of the peaks
    each phase mark carried); None when the probe had no allocator statistics. ``error`` names the
    exception a failed step raised (``OutOfMemoryError``), ``""`` for a step that ended.
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

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.begin_ns) / 1e9

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
