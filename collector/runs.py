"""Reading a run back: a run-store directory (``runs/<run id>``) or the records JSON of
``stepmem run --out``, checked as the untrusted data it is, grouped into streams.

A *stream* is one training process's steps on one GPU (a rank; several may share a GPU), in
time order. Every record is keyed by (GPU, pid, seq): the probe's own sequence number, so steps
whose caller numbers repeat (an epoch restarting ``enumerate(loader)``, a resumed run) are
never merged or lost. Records written before ``seq`` existed get one here, in time order.

Nothing read is ever executed: JSON, Parquet and numbers only, each field checked before use
(:func:`check_records`, :func:`check_meta`), one line naming the first bad one otherwise.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collector.errors import InputError
from collector.records import StepRecord

__all__ = ["Run", "Stream", "check_meta", "check_records", "load_run", "number_records"]

MAX_BYTES = 1 << 53  # no memory figure of one GPU comes near this (8 PiB)
_INT_FIELDS = ("begin_ns", "end_ns", "samples")
_BYTE_FIELDS = (
    "nvml_peak_bytes",
    "nvml_min_bytes",
    "nvml_end_bytes",
    "nvml_begin_bytes",
    "nvml_reserved_bytes",
    "torch_allocated_peak_bytes",
    "torch_reserved_peak_bytes",
)
_OPTIONAL_INT_FIELDS = ("nvml_peak_t_ns",)
_WHO = ("seq", "pid", "rank", "world_size")
STATUSES = ("running", "complete", "failed", "interrupted", "incomplete")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    return (
        isinstance(v, int | float)
        and not isinstance(v, bool)
        and not (isinstance(v, float) and not math.isfinite(v))
        and abs(v) <= MAX_BYTES * 1024
    )


def check_records(records: Any, source: str) -> list[StepRecord]:
    """``records`` as typed :class:`StepRecord` objects if they are step records stepmem can read;
    otherwise :class:`InputError` naming the first bad record and field (records come from files
    anyone can edit): types, byte figures that are whole, not negative and not absurd, finite
    allocator figures, and no step given twice."""
    if not isinstance(records, list):
        raise InputError(f"{source}: 'records' must be a list, got {type(records).__name__}")
    seen: set[tuple[Any, ...]] = set()
    for i, r in enumerate(records):
        where = f"{source}: record {i}"
        if not isinstance(r, dict):
            raise InputError(f"{where} is not an object")
        if not isinstance(r.get("gpu_uuid"), str) or not r["gpu_uuid"]:
            raise InputError(f"{where}: gpu_uuid must be a non-empty string")
        if not _is_int(r.get("step")) or r["step"] < 0:
            raise InputError(f"{where}: step must be a non-negative integer, got {r.get('step')!r}")
        for k in _INT_FIELDS:
            if k in r and not (_is_int(r[k]) and r[k] >= 0):
                raise InputError(f"{where}: {k} must be a non-negative integer, got {r[k]!r}")
        for k in _OPTIONAL_INT_FIELDS:
            if r.get(k) is not None and not _is_int(r[k]):
                raise InputError(f"{where}: {k} must be an integer or null, got {r[k]!r}")
        for k in _BYTE_FIELDS:
            v = r.get(k)
            if v is not None and not (_is_int(v) and 0 <= v <= MAX_BYTES):
                raise InputError(
                    f"{where}: {k} must be a whole, non-negative number of bytes or null, got {v!r}"
                )
        for k in _WHO:
            v = r.get(k)
            if v is not None and not (_is_int(v) and v >= (1 if k == "world_size" else 0)):
                raise InputError(f"{where}: {k} must be a non-negative integer, got {v!r}")
        if r.get("rank", 0) >= r.get("world_size", 1):
            raise InputError(
                f"{where}: rank {r.get('rank')} is outside world size {r.get('world_size', 1)}"
            )
        for k in ("torch_end", "torch_begin", "ledger"):
            v = r.get(k)
            if v is not None and not (isinstance(v, dict) and all(map(_finite, v.values()))):
                raise InputError(f"{where}: {k} must map names to finite numbers")
        if r.get("phases") is not None and not (
            isinstance(r["phases"], list)
            and all(isinstance(p, dict) and _phase_ok(p) for p in r["phases"])
        ):
            raise InputError(f"{where}: phases must be a list of objects with numeric figures")
        if r.get("processes") is not None and not _processes_ok(r["processes"]):
            raise InputError(
                f"{where}: processes must be {{t_ns, device_used, procs: [[pid, "
                "bytes, name], ...]}}"
            )
        for k in ("gap", "error"):
            if r.get(k) is not None and not isinstance(r[k], str):
                raise InputError(f"{where}: {k} must be a string, got {r[k]!r}")
        key = (
            r["gpu_uuid"],
            r.get("pid", 0),
            r.get("seq") or ("step", r["step"], r.get("begin_ns")),
        )
        if key in seen:
            raise InputError(
                f"{where}: step {r['step']} of GPU {r['gpu_uuid']} is given twice (same process, "
                "same sequence number)"
            )
        seen.add(key)
    out = []
    for i, r in enumerate(records):
        try:
            out.append(StepRecord.from_dict({k: v for k, v in r.items() if v is not None}))
        except (TypeError, ValueError) as exc:
            raise InputError(f"{source}: record {i}: {exc}") from None
    return out


def _phase_ok(p: dict[str, Any]) -> bool:
    if not isinstance(p.get("phase", ""), str):
        return False
    return all(
        v is None or (_is_int(v) and abs(v) <= MAX_BYTES * 1024)
        for k, v in p.items()
        if k != "phase"
    )


def _processes_ok(v: Any) -> bool:
    if not isinstance(v, dict):
        return False
    procs = v.get("procs", [])
    return (
        isinstance(procs, list)
        and all(
            isinstance(p, list)
            and len(p) >= 2
            and _is_int(p[0])
            and (p[1] is None or (_is_int(p[1]) and 0 <= p[1] <= MAX_BYTES))
            and (len(p) < 3 or isinstance(p[2], str))
            for p in procs
        )
        and all(v.get(k) is None or _is_int(v[k]) for k in ("t_ns", "device_used", "baseline"))
    )


def check_meta(meta: Any, source: str) -> dict[str, Any]:
    """Run metadata (``meta.json`` or a records file's header) stepmem can read, else
    :class:`InputError` naming the field."""
    if not isinstance(meta, dict):
        raise InputError(f"{source}: must be a JSON object, got {type(meta).__name__}")
    samplers = meta.get("samplers", [])
    if not isinstance(samplers, list):
        raise InputError(f"{source}: 'samplers' must be a list")
    for i, smp in enumerate(samplers):
        if not isinstance(smp, dict):
            raise InputError(f"{source}: samplers[{i}] is not an object")
        for k, ok in (
            ("gpu_uuid", lambda v: isinstance(v, str) and v),
            ("node_id", lambda v: isinstance(v, str)),
            ("index", _is_int),
            ("total_bytes", lambda v: _is_int(v) and 0 < v <= MAX_BYTES),
        ):
            if not ok(smp.get(k)):
                raise InputError(f"{source}: samplers[{i}].{k} is missing or of the wrong type")
    for k in ("banner", "status", "run_id", "error"):
        if meta.get(k) is not None and not isinstance(meta[k], str):
            raise InputError(f"{source}: {k} must be a string")
    for k in ("health", "problems"):
        if meta.get(k) is not None and not (
            isinstance(meta[k], list) and all(isinstance(x, dict | str) for x in meta[k])
        ):
            raise InputError(f"{source}: {k} must be a list")
    return meta


def number_records(records: list[StepRecord]) -> list[StepRecord]:
    """Records without a ``seq`` (written before it existed) get one: 1, 2, … in time order per
    GPU and process. Records are returned in (GPU, time) order."""
    out = sorted(records, key=lambda r: (r.gpu_uuid, r.begin_ns))
    seen: Counter[tuple[str, int]] = Counter()
    for r in out:
        if not r.seq:
            seen[(r.gpu_uuid, r.pid)] += 1
            r.seq = seen[(r.gpu_uuid, r.pid)]
    return out


@dataclass
class Stream:
    """One training process's steps on one GPU, in time order."""

    gpu_uuid: str
    gpu: int  # the report's number of the GPU (sampler index order)
    pid: int
    rank: int
    world_size: int
    records: list[StepRecord] = field(default_factory=list)

    @property
    def steps_repeat(self) -> bool:
        """The caller's step numbers are not one increasing series (epochs restarted them)."""
        steps = [r.step for r in self.records]
        return any(b <= a for a, b in itertools.pairwise(steps))

    def numbered(self) -> list[StepRecord]:
        """The records as the diagnosis reads them: by the caller's step numbers when those
        name each step once and grow; otherwise by the probe's sequence number (the table
        shows both)."""
        if not self.steps_repeat:
            return self.records
        return [dataclasses.replace(r, step=r.seq) for r in self.records]

    def label(self, several: bool) -> str:
        """`` rank 1 (pid 4242)`` when the GPU has several streams or the run several ranks."""
        if not several and self.world_size <= 1:
            return ""
        who = f"rank {self.rank}" + (f" of {self.world_size}" if self.world_size > 1 else "")
        return f" {who}" + (f" (pid {self.pid})" if self.pid else "")


def _name_ranks(streams: list[Stream]) -> None:
    """In each record's per-process reading, the processes that are this run's other ranks on
    the GPU are named as such (NVML knows them only by pid and command line)."""
    names = {s.pid: f"rank {s.rank} of this run" for s in streams if s.pid}
    for s in streams:
        for r in s.records:
            procs = r.processes.get("procs")
            if not procs or not any(p[0] in names for p in procs):
                continue
            renamed = [[p[0], p[1], names.get(p[0], p[2] if len(p) > 2 else "")] for p in procs]
            r.processes = {**r.processes, "procs": renamed}


class Run:
    """One run's step records: per GPU (``by_gpu``, in sampler index order, then any GPU the
    records name that no sampler lists) and per stream (``streams``), and the GPUs' capacities."""

    def __init__(
        self, name: str, meta: dict[str, Any], records: list[StepRecord] | list[dict[str, Any]]
    ) -> None:
        self.name = name
        self.meta = meta
        self.root: Path | None = None  # the run directory, when read from the run store
        self.source = name  # what the user gave (a path to show in commands)
        if records and isinstance(records[0], dict):  # built in code: checked like a file
            records = check_records(records, name)
        typed = number_records(list(records))  # type: ignore[arg-type]
        samplers = sorted(meta.get("samplers", []), key=lambda s: (s["node_id"], s["index"]))
        self.gpus = [s["gpu_uuid"] for s in samplers]
        self.gpus += sorted({r.gpu_uuid for r in typed} - set(self.gpus))
        self.totals = {s["gpu_uuid"]: s["total_bytes"] for s in samplers}
        self.by_gpu: dict[str, list[StepRecord]] = {u: [] for u in self.gpus}
        for r in typed:
            self.by_gpu[r.gpu_uuid].append(r)
        self.streams: list[Stream] = []
        for i, uuid in enumerate(self.gpus):
            by_pid: dict[int, Stream] = {}
            for r in self.by_gpu[uuid]:
                s = by_pid.get(r.pid)
                if s is None:
                    s = by_pid[r.pid] = Stream(uuid, i, r.pid, r.rank, r.world_size)
                s.records.append(r)
            self.streams += sorted(by_pid.values(), key=lambda s: (s.rank, s.pid))
            if not by_pid:
                self.streams.append(Stream(uuid, i, 0, 0, 1))
            if len(by_pid) > 1:  # ranks sharing the GPU see each other in NVML's process list
                _name_ranks(list(by_pid.values()))
        for uuid, recs in self.by_gpu.items():
            total = self.totals.get(uuid)
            for r in recs:
                for k in ("nvml_peak_bytes", "nvml_end_bytes"):
                    v = getattr(r, k)
                    if total and (v or 0) > total:
                        raise InputError(
                            f"{name}: step {r.step} of GPU {uuid}: {k} {v} is more than the "
                            f"card's {total} bytes"
                        )

    @property
    def status(self) -> str:
        return str(self.meta.get("status") or "complete")

    def streams_of(self, uuid: str) -> list[Stream]:
        return [s for s in self.streams if s.gpu_uuid == uuid]


def load_run(path: str | Path) -> Run:
    """Read a run directory or a records JSON. Raises :class:`InputError` naming what is
    wrong."""
    path = Path(path)
    if path.is_dir():
        from collector.store import RunStore

        store = RunStore(path)
        check_meta(store.meta, str(path / "meta.json"))
        records = store.records()
        meta = dict(store.meta)
        torn = store.unreadable_parts("events")
        if torn:  # the steps are whole: report them, and say what cannot be read
            meta["problems"] = [
                *(meta.get("problems") or []),
                f"{len(torn)} part(s) of the probe's events cannot be read ({', '.join(torn)}); "
                "the step records below are unaffected",
            ]
        run = Run(path.name, meta, check_records([r.to_dict() for r in records], str(path)))
        run.root = path
        run.source = str(path)
        return run
    if not path.is_file():
        raise InputError(f"{path} is neither a run directory nor a records file")
    if path.name.endswith(".capture.parquet"):
        from collector.offline import capture_run_meta, records_from_capture
        from collector.replay import Capture

        cap = Capture.load(path)  # validated: a capture is untrusted data too
        recs = records_from_capture(cap)
        run = Run(path.name.removesuffix(".capture.parquet"), capture_run_meta(path, cap), recs)
        run.source = str(path)
        return run
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise InputError(f"{path} is not a stepmem records file ({why})") from None
    if not isinstance(doc, dict) or "records" not in doc:
        raise InputError(f"{path} is not a stepmem records file (no 'records')")
    check_meta(doc, str(path))
    run = Run(path.stem, doc, check_records(doc["records"], str(path)))
    run.source = str(path)
    return run
