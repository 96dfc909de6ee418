"""A joined step: :class:`StepRecord` (one step of one training process on one GPU, its NVML
samples joined with the probe's marks), with its phases (:class:`PhaseReading`) and the
per-process reading taken when it was joined (:class:`ProcessesReading`).

A record read back from a file (a run store, a records JSON) is untrusted data:
:meth:`StepRecord.from_untrusted` checks every field and names the first bad one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from collector.model.kinds import Gap, MemoryKind
from collector.model.records import (
    MAX_WORLD,
    ProcessMemory,
    Stat,
    take_legacy_estimate,
    whole,
)
from collector.model.untrusted import inert

__all__ = ["MAX_BYTES", "PhaseReading", "ProcessesReading", "StepRecord"]

MAX_BYTES = 1 << 53  # no memory figure of one GPU comes near this (8 PiB)


def _finite(v: Any) -> bool:
    return (
        isinstance(v, int | float)
        and not isinstance(v, bool)
        and not (isinstance(v, float) and not math.isfinite(v))
        and abs(v) <= MAX_BYTES * 1024
    )


@dataclass
class PhaseReading:
    """One phase of a step: from the mark that opens it (the begin mark, or a phase mark) to
    the one that closes it. NVML figures are None where the phase has no sample;
    ``nvml_begin_bytes`` and ``torch_reserved_begin_bytes`` are the device and torch's pool at
    the opening mark; the torch peaks are the allocator's over the phase (the closing mark's)."""

    phase: str
    begin_ns: int
    end_ns: int
    nvml_peak_bytes: int | None = None
    nvml_peak_t_ns: int | None = None
    nvml_begin_bytes: int | None = None
    torch_reserved_begin_bytes: int | None = None
    torch_allocated_peak_bytes: int | None = None
    torch_reserved_peak_bytes: int | None = None

    def holds(self, t_ns: int) -> bool:
        return self.begin_ns <= t_ns <= self.end_ns

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_untrusted(cls, d: Any) -> PhaseReading:
        """``ValueError`` unless ``d`` is a phase: a string name, whole begin and end marks,
        whole figures or null; keys this version does not know are left out."""
        if not isinstance(d, dict) or not isinstance(d.get("phase", ""), str):
            raise ValueError("not a phase")
        kept = {}
        for f in fields(cls):
            v = d.get(f.name)
            if f.name == "phase":
                kept["phase"] = inert(v or "")
            elif v is None:
                if f.name in ("begin_ns", "end_ns"):
                    raise ValueError(f"a phase lacks {f.name}")
            elif not (whole(v, -MAX_BYTES * 1024, MAX_BYTES * 1024)):
                raise ValueError(f"a phase's {f.name} is not a whole number")
            else:
                kept[f.name] = v
        return cls(**kept)


@dataclass
class ProcessesReading:
    """NVML's per-process memory on the step's GPU, read when the step was joined (shortly after
    its end): ``t_ns`` when, ``device_used`` the device's used memory at that moment, ``procs``
    every process with its used bytes and name; ``baseline`` (live runs) the smallest memory
    this step's process had held outside torch so far, by the sampler."""

    t_ns: int | None = None
    device_used: int | None = None
    procs: list[ProcessMemory] = field(default_factory=list)
    baseline: int | None = None

    def of(self, pid: int | None) -> ProcessMemory | None:
        """Process ``pid``'s reading (None: not listed)."""
        return next((p for p in self.procs if pid is not None and p.pid == pid), None)

    def to_dict(self) -> dict[str, Any]:
        """The stored form: ``{"t_ns", "device_used", "procs": [[pid, bytes, name], ...]}``
        (and ``baseline`` when known)."""
        d: dict[str, Any] = {
            "t_ns": self.t_ns,
            "device_used": self.device_used,
            "procs": [[p.pid, p.used_bytes, p.name] for p in self.procs],
        }
        if self.baseline is not None:
            d["baseline"] = self.baseline
        return d

    @classmethod
    def from_untrusted(cls, v: Any) -> ProcessesReading:
        """``ValueError`` unless ``v`` is the stored form (:meth:`to_dict`); a process's name
        may be missing (readings recorded before names were kept)."""
        if not isinstance(v, dict):
            raise ValueError("not a mapping")
        procs = v.get("procs", [])
        if not isinstance(procs, list):
            raise ValueError("procs is not a list")
        out = []
        for p in procs:
            if not (
                isinstance(p, list)
                and len(p) >= 2
                and whole(p[0], -(1 << 62), 1 << 62)
                and (p[1] is None or whole(p[1], 0, MAX_BYTES))
                and (len(p) < 3 or isinstance(p[2], str))
            ):
                raise ValueError("a process is not [pid, bytes, name]")
            out.append(ProcessMemory(p[0], p[1], inert(p[2]) if len(p) > 2 else ""))
        kept = {}
        for k in ("t_ns", "device_used", "baseline"):
            x = v.get(k)
            if x is not None and not whole(x, -(1 << 62), 1 << 62):
                raise ValueError(f"{k} is not an integer")
            kept[k] = x
        return cls(procs=out, **kept)


@dataclass
class StepRecord:
    """One step on one GPU: NVML samples joined with the step's begin/end events.

    **NVML figures** are device ``used`` (v2: without driver-reserved memory) over the samples
    taken between ``begin_ns`` and ``end_ns`` inclusive; None where not measured (never 0).
    ``nvml_end_bytes`` (``nvml_begin_bytes`` at the begin mark, each phase's at its opening) is
    the lower of the last sample at or before the mark and the first after it, if that came
    within the mark window (2 ms, or two sampling periods): memory released just before the
    mark counts as gone, memory the next step allocates just after it does not.

    **gap** names why the window may have missed samples (:class:`collector.model.kinds.Gap`,
    space-separated; ``""``: none): ``no_samples``; ``sampler_started`` (the sampler started
    after the step began); ``overrun`` (the ring no longer holds the window's start); ``stall``
    (two samples further apart than the gap threshold); with any of these ``undersampled``
    (fewer than half the samples the rate promised) and ``stale_end`` (the first sample after
    the end mark came late: the end reading rests on an older sample); ``stand_in`` (CPU
    processes stood in for a replayed GPU: the capture's NVML is not their memory, and the step
    has no NVML figure).

    **Torch figures**: ``torch_*_peak_bytes`` are the allocator's peaks over the step (the
    largest of the phases'); ``torch_begin``/``torch_end`` the event's mappings (keys in
    :class:`collector.model.records.Stat`, read through the accessors below). ``ledger``: bytes
    by :class:`collector.model.kinds.MemoryKind` at the end. ``estimate_peak_bytes``: the
    allocated peak an estimate predicted (None: no estimate).

    **Who**: ``error`` names the exception a failed step raised (``OutOfMemoryError``), ``""``
    for one that ended; ``seq``, ``pid``, ``rank`` and ``world_size`` are the step event's: the
    key is (``gpu_uuid``, ``pid``, ``seq``); ``step`` is the caller's number, which may repeat.
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
    phases: list[PhaseReading] = field(default_factory=list)
    ledger: dict[str, int] = field(default_factory=dict)
    error: str = ""
    processes: ProcessesReading | None = None
    seq: int = 0
    pid: int = 0
    rank: int = 0
    world_size: int = 1
    estimate_peak_bytes: int | None = None

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
        return self.nvml_end_bytes is not None and not self.has_gap(Gap.STALE_END)

    @property
    def nvml_end(self) -> int | None:
        """The end-of-step NVML reading every figure and finding uses: None when there is
        none or it is stale (``stale_end``: it rests on a sample from before the end mark and
        cannot show memory released in between). ``nvml_end_bytes`` keeps what was read."""
        return self.nvml_end_bytes if self.end_known else None

    def has_gap(self, flag: Gap) -> bool:
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
        ``mem_get_info`` before training subtracts on the same footing. Never below 0: a
        baseline larger than all that is outside torch now (read while another rank held memory
        it has since freed) leaves nothing beyond it."""
        if self.reserved_end is None or self.nvml_end is None:
            return None
        return max(0, self.nvml_end - self.reserved_end - (self.context_baseline or 0))

    def ledger_of(self, kind: str) -> int:
        """Bytes of a :class:`MemoryKind` (or a ledger figure) at the step's end; 0 unknown."""
        return int(self.ledger.get(kind, 0))

    @property
    def managed(self) -> int:
        """Optimizer state in CUDA managed (paged) memory, by the ledger."""
        return self.ledger_of(MemoryKind.OPTIMIZER_STATE_MANAGED)

    @property
    def procs(self) -> list[ProcessMemory]:
        """The per-process reading's processes (empty: none was read)."""
        return self.processes.procs if self.processes is not None else []

    def phase_at(self, t_ns: int | None) -> PhaseReading | None:
        """The phase whose window holds ``t_ns`` (None: no phase marks, or no time)."""
        if t_ns is None:
            return None
        return next((ph for ph in self.phases if ph.holds(t_ns)), None)

    @property
    def peak_phase(self) -> PhaseReading | None:
        """The phase whose window holds the step's NVML peak."""
        return self.phase_at(self.nvml_peak_t_ns)

    @property
    def allocated_peak_phase(self) -> str | None:
        """The phase with the highest torch allocated peak (None: no phase has one)."""
        phases = [p for p in self.phases if p.torch_allocated_peak_bytes is not None]
        if not phases:
            return None
        return max(phases, key=lambda p: p.torch_allocated_peak_bytes or 0).phase

    @property
    def key(self) -> tuple[str, int, int]:
        """What tells this step from every other of the run: (GPU, process, sequence)."""
        return self.gpu_uuid, self.pid, self.seq

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON data (a records file, a store row before flattening)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["torch_begin"] = dict(self.torch_begin)
        d["torch_end"] = dict(self.torch_end)
        d["ledger"] = dict(self.ledger)
        d["phases"] = [p.to_dict() for p in self.phases]
        d["processes"] = self.processes.to_dict() if self.processes is not None else {}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRecord:
        """A record from :meth:`to_dict`'s form, checked (:meth:`from_untrusted`)."""
        return cls.from_untrusted(d, "step record")

    @classmethod
    def from_untrusted(cls, r: Any, where: str) -> StepRecord:
        """A record from its JSON form (a records file, a store row unflattened), checked as the
        untrusted data it is: types, byte figures that are whole, not negative and not absurd,
        finite allocator figures, a rank inside its world. ``ValueError`` names ``where`` and
        the first bad field. Fields this version does not know are left out, missing optional
        ones take their defaults; a ledger's old ``estimate_peak`` key becomes the field."""
        _check(r, where)
        kept = {f.name: r[f.name] for f in fields(cls) if r.get(f.name) is not None}
        try:
            kept["phases"] = [PhaseReading.from_untrusted(p) for p in r.get("phases") or []]
        except ValueError:
            raise ValueError(
                f"{where}: phases must be a list of objects with numeric figures"
            ) from None
        procs = r.get("processes")
        try:
            kept["processes"] = ProcessesReading.from_untrusted(procs) if procs else None
        except ValueError:
            raise ValueError(
                f"{where}: processes must be {{t_ns, device_used, procs: [[pid, "
                "bytes, name], ...]}}"
            ) from None
        for k in ("gap", "error", "gpu_uuid"):  # printed: no terminal escapes
            if k in kept:
                kept[k] = inert(kept[k])
        kept["ledger"], kept["estimate_peak_bytes"] = take_legacy_estimate(
            dict(r.get("ledger") or {}), r.get("estimate_peak_bytes")
        )
        for k in ("torch_begin", "torch_end"):
            kept[k] = dict(kept.get(k) or {})
        return cls(**kept)


_INT_FIELDS = ("begin_ns", "end_ns", "samples")
BYTE_FIELDS = (
    "nvml_peak_bytes",
    "nvml_min_bytes",
    "nvml_end_bytes",
    "nvml_begin_bytes",
    "nvml_reserved_bytes",
    "torch_allocated_peak_bytes",
    "torch_reserved_peak_bytes",
    "estimate_peak_bytes",
)
_WHO = ("seq", "pid", "rank", "world_size")


def _check(r: Any, where: str) -> None:
    """:meth:`StepRecord.from_untrusted`'s checks of the flat fields, in order."""
    if not isinstance(r, dict):
        raise ValueError(f"{where} is not an object")
    if not isinstance(r.get("gpu_uuid"), str) or not r["gpu_uuid"]:
        raise ValueError(f"{where}: gpu_uuid must be a non-empty string")
    if not whole(r.get("step")):
        raise ValueError(f"{where}: step must be a non-negative integer, got {r.get('step')!r}")
    for k in _INT_FIELDS:
        if k in r and not whole(r[k]):
            raise ValueError(f"{where}: {k} must be a non-negative integer, got {r[k]!r}")
        if k not in r:
            raise ValueError(f"{where}: a step record needs {k}")
    if r.get("nvml_peak_t_ns") is not None and not whole(r["nvml_peak_t_ns"], -(1 << 63)):
        raise ValueError(
            f"{where}: nvml_peak_t_ns must be an integer or null, got {r['nvml_peak_t_ns']!r}"
        )
    for k in BYTE_FIELDS:
        v = r.get(k)
        if v is not None and not whole(v, 0, MAX_BYTES):
            raise ValueError(
                f"{where}: {k} must be a whole, non-negative number of bytes or null, got {v!r}"
            )
    for k in _WHO:
        v = r.get(k)
        top = MAX_WORLD if k in ("rank", "world_size") else (1 << 63) - 1
        if v is not None and not whole(v, 1 if k == "world_size" else 0, top):
            raise ValueError(f"{where}: {k} must be a non-negative integer, got {v!r}")
    if (r.get("rank") or 0) >= (r.get("world_size") or 1):
        raise ValueError(
            f"{where}: rank {r.get('rank')} is outside world size {r.get('world_size', 1)}"
        )
    for k in ("torch_end", "torch_begin", "ledger"):
        v = r.get(k)
        if v is not None and not (isinstance(v, dict) and all(map(_finite, v.values()))):
            raise ValueError(f"{where}: {k} must map names to finite numbers")
    for k in ("gap", "error"):
        if r.get(k) is not None and not isinstance(r[k], str):
            raise ValueError(f"{where}: {k} must be a string, got {r[k]!r}")
