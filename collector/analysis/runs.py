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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collector.model.errors import InputError
from collector.model.records import SamplerHealth, SamplerInfo
from collector.model.step import MAX_BYTES, StepRecord
from collector.model.untrusted import inert

if TYPE_CHECKING:  # the store (pyarrow) is imported when a run directory is read
    from collector.store import RunStore

__all__ = [
    "Run",
    "Stream",
    "check_meta",
    "check_records",
    "load_meta",
    "load_run",
    "number_records",
]

STATUSES = ("running", "complete", "failed", "interrupted", "incomplete")


def check_records(records: Any, source: str, notes: list[str] | None = None) -> list[StepRecord]:
    """``records`` (a records file's list, or typed records) as typed :class:`StepRecord`
    objects, each checked as untrusted data (:meth:`StepRecord.from_untrusted`); otherwise
    :class:`InputError` naming the first bad record and field. A process's steps whose sequence
    numbers repeat are all kept, numbered again, and ``notes`` gets a sentence saying so."""
    if not isinstance(records, list):
        raise InputError(f"{source}: 'records' must be a list, got {type(records).__name__}")
    out = []
    for i, r in enumerate(records):
        try:
            out.append(
                r
                if isinstance(r, StepRecord)
                else StepRecord.from_untrusted(r, f"{source}: record {i}")
            )
        except (TypeError, ValueError) as exc:
            raise InputError(str(exc)) from None
    note = _no_step_twice(out, source)
    if note and notes is not None:
        notes.append(note)
    return out


def _no_step_twice(records: list[StepRecord], source: str) -> str:
    """Records of one process that share a sequence number (two probes in one process — train
    then evaluate, a notebook cell run again — before each process numbered its steps once)
    are all kept: that process's steps are numbered again in time order; a record stored twice
    (the same step, the same times) is read once. Returns the sentence saying so ("" when
    nothing repeats); ``records`` is changed in place."""
    once: dict[tuple[Any, ...], StepRecord] = {}
    for r in records:  # the very same step stored twice (same process, same times): one
        once.setdefault((r.gpu_uuid, r.pid, r.begin_ns, r.end_ns, r.step), r)
    copies = len(records) - len(once)
    records[:] = list(once.values())
    seen: set[tuple[Any, ...]] = set()
    again: set[tuple[str, int]] = set()
    for r in records:
        key = (r.gpu_uuid, r.pid, r.seq or ("step", r.step, r.begin_ns))
        if key in seen:
            again.add((r.gpu_uuid, r.pid))
        seen.add(key)
    said = f"{source}: {copies} step record(s) stored twice were read once" if copies else ""
    if not again:
        return said
    for gpu, pid in again:
        mine = sorted((r for r in records if (r.gpu_uuid, r.pid) == (gpu, pid)),
                      key=lambda r: r.begin_ns)  # fmt: skip
        for n, r in enumerate(mine, 1):
            r.seq = n
    pids = ", ".join(str(pid) for _, pid in sorted(again))
    return "; ".join(
        x
        for x in (
            said,
            f"{source}: process {pids} numbered its steps twice over (two probes in one "
            "process?): every step is kept, numbered again in time order",
        )
        if x
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
        try:
            SamplerInfo.from_untrusted(smp, f"{source}: samplers[{i}]", MAX_BYTES)
        except ValueError as exc:
            raise InputError(str(exc)) from None
    for k in ("banner", "status", "run_id", "error"):
        if meta.get(k) is not None and not isinstance(meta[k], str):
            raise InputError(f"{source}: {k} must be a string")
        if meta.get(k):
            meta[k] = inert(meta[k])  # printed: no terminal escapes
    for k in ("health", "problems"):
        if meta.get(k) is not None and not (
            isinstance(meta[k], list) and all(isinstance(x, dict | str) for x in meta[k])
        ):
            raise InputError(f"{source}: {k} must be a list")
    meta["problems"] = [inert(x) if isinstance(x, str) else x for x in meta.get("problems") or []]
    return meta


def _health(raw: list[Any], samplers: list[SamplerInfo]) -> list[SamplerHealth]:
    """Each sampler's final health (a run that just ended hands them typed; a store's are data,
    read by :meth:`SamplerHealth.from_untrusted`). A store written before health named its GPU
    pairs them with its samplers by position."""
    named = any(
        isinstance(h, SamplerHealth) or (isinstance(h, dict) and isinstance(h.get("gpu_uuid"), str))
        for h in raw
    )
    out = []
    for i, h in enumerate(raw):
        if isinstance(h, SamplerHealth):
            out.append(h)
        elif isinstance(h, dict):
            at = "" if named or i >= len(samplers) else samplers[i].gpu_uuid
            out.append(SamplerHealth.from_untrusted(h, at))
    return out


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


def replay_speed(meta: dict[str, Any]) -> float:
    """The speed a run's steps were replayed at (``replay_speed`` in its meta, a number in
    1e-6..1e12), else 1."""
    v = meta.get("replay_speed")
    if isinstance(v, int | float) and not isinstance(v, bool) and 1e-6 <= v <= 1e12:
        return float(v)
    return 1.0


MAX_LOST_LISTED = 1_000  # runs of lost sequence numbers a stream lists


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

    @property
    def lost(self) -> list[tuple[int, int]]:
        """The runs of sequence numbers (first, last) this process gave steps that no record
        holds — a sampler killed with steps in flight, events dropped on the way: the probe
        numbers a process's steps 1, 2, … so a gap is a step that ran and was not kept. At
        most :data:`MAX_LOST_LISTED` runs (a hostile seq of 2^62 is one run, not a loop)."""
        out: list[tuple[int, int]] = []
        prev = 0
        for k in sorted({r.seq for r in self.records if r.seq}):
            if k > prev + 1:
                out.append((prev + 1, k - 1))
                if len(out) >= MAX_LOST_LISTED:
                    break
            prev = k
        return out

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
            if r.processes is None or not any(p.pid in names for p in r.procs):
                continue
            renamed = [dataclasses.replace(p, name=names.get(p.pid, p.name)) for p in r.procs]
            r.processes = dataclasses.replace(r.processes, procs=renamed)


class Run:
    """One run's step records: per GPU (``by_gpu``, in sampler index order, then any GPU the
    records name that no sampler lists) and per stream (``streams``), and the GPUs' capacities."""

    def __init__(
        self,
        name: str,
        meta: dict[str, Any],
        records: list[StepRecord],
        *,
        root: Path | None = None,
        store: RunStore | None = None,
        source: str | None = None,
    ) -> None:
        self.name = name
        self.meta = meta
        self.root = root  # the run directory, when read from the run store
        self.source = name if source is None else source  # what the user gave (a path)
        self._store = store
        self.traces: dict[str, Any] = {}  # a capture's samples (DataFrames), by GPU
        typed = number_records(list(records))
        # checked by check_meta (a file) or made by this stepmem (a run that just ended)
        infos = (
            s if isinstance(s, SamplerInfo) else SamplerInfo.from_untrusted(s, "", MAX_BYTES)
            for s in meta.get("samplers", [])
        )
        once = {s.gpu_uuid: s for s in infos}  # a GPU listed twice is one GPU
        self.samplers = sorted(once.values(), key=lambda s: (s.node_id, s.index))
        self.gpus = [s.gpu_uuid for s in self.samplers]
        self.gpus += sorted({r.gpu_uuid for r in typed} - set(self.gpus))
        self.totals = {s.gpu_uuid: s.total_bytes for s in self.samplers}
        self.health = _health(meta.get("health") or [], self.samplers)
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
            for s in by_pid.values():
                # the rank a process settled on: a probe's first step may run before its
                # process group exists (rank 0 of 1), its later ones know
                last = s.records[-1]
                s.rank, s.world_size = last.rank, last.world_size
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

    @classmethod
    def from_store(cls, store: RunStore, path: Path) -> Run:
        """The run a run store at ``path`` holds: its meta checked, its records each checked as
        read, and what cannot be read said (a step twice, torn parts) in the run's own meta —
        the store's is left as it is."""
        meta = dict(store.meta)
        check_meta(meta, str(path / "meta.json"))
        records = store.records()
        note = _no_step_twice(records, str(path))
        if note:
            meta["read_notes"] = [*(meta.get("read_notes") or []), note]
        torn = store.unreadable_parts("events")
        if torn:  # the steps are whole: report them, and say what cannot be read
            meta["problems"] = [
                *(meta.get("problems") or []),
                f"{len(torn)} part(s) of the probe's events cannot be read ({', '.join(torn)}); "
                "the step records below are unaffected",
            ]
        torn = [p for g in store.gpus() for p in store.unreadable_parts(f"samples/{g}")]
        if torn:
            meta["problems"] = [
                *(meta.get("problems") or []),
                f"{len(torn)} part(s) of the NVML samples cannot be read ({', '.join(torn[:4])}"
                f"{', …' if len(torn) > 4 else ''}); the step records below are unaffected, the "
                "timeline (--png, --html) cannot be drawn",
            ]
        return cls(path.name, meta, records, root=path, store=store, source=str(path))

    @classmethod
    def from_capture(cls, path: Path) -> Run:
        """A capture's recorded steps, joined with its samples as the live join would."""
        import pandas as pd

        from collector.analysis.offline import capture_run_meta, records_from_capture
        from collector.replay import Capture

        cap = Capture.load(path)  # validated: a capture is untrusted data too
        name = path.name.removesuffix(".capture.parquet")
        run = cls(name, capture_run_meta(path, cap), records_from_capture(cap), source=str(path))
        run.traces[str(cap.device["uuid"])] = pd.DataFrame(
            {"t_ns": cap.t_ns, "used": cap.used, "reserved": cap.reserved}
        )
        return run

    @classmethod
    def from_records_file(cls, path: Path) -> Run:
        """A records file (``stepmem run --out``), every record checked."""
        doc = _records_file(path)
        check_meta(doc, str(path))
        notes: list[str] = []
        records = check_records(doc["records"], str(path), notes)
        doc["read_notes"] = [*(doc.get("read_notes") or []), *notes]
        return cls(path.stem, doc, records, source=str(path))

    @property
    def store(self) -> RunStore | None:
        """The run store this run was read from (opened once; None: a records file)."""
        if self._store is None and self.root is not None:
            from collector.store import RunStore

            self._store = RunStore(self.root)
        return self._store

    def samples(self, uuid: str) -> Any:
        """GPU ``uuid``'s NVML samples: from the run store, or a capture's own (None: none
        kept, or a records file)."""
        if uuid in self.traces:
            return self.traces[uuid]
        store = self.store
        return None if store is None else store.samples(uuid)

    @property
    def status(self) -> str:
        return str(self.meta.get("status") or "complete")

    @property
    def time_scale(self) -> float:
        """A replay's speed: its steps took 1/N of the recorded run's time, and the findings
        give times inside a step as the recorded run's (1: a live run, a stand-in, a store
        written before runs said)."""
        return replay_speed(self.meta)

    @property
    def workload_summary(self) -> dict[str, Any]:
        """What the runner said of its workload (a store's ``workload_summary``; a records
        file keeps it as ``workload``); empty when none."""
        for key in ("workload_summary", "workload"):
            v = self.meta.get(key)
            if isinstance(v, dict) and v:
                return v
        return {}

    @property
    def workload_label(self) -> str:
        """What ran: the samplers' ``workload`` label (``finetune``, ``script:train``,
        ``replay:adamw_8bit``), else a store's ``workload``, else the runner's summary's (a
        records file written before its samplers carried the label); empty when unknown."""
        labels = sorted({s.workload for s in self.samplers if s.workload})
        if labels:
            return "+".join(labels)
        v = self.meta.get("workload")
        if isinstance(v, str) and v:
            return v
        return str(self.workload_summary.get("workload") or "")

    def streams_of(self, uuid: str) -> list[Stream]:
        return [s for s in self.streams if s.gpu_uuid == uuid]


def load_run(path: str | Path) -> Run:
    """Read a run directory or a records JSON. Raises :class:`InputError` naming what is
    wrong."""
    path = Path(path)
    if path.is_dir():
        from collector.store import RunStore

        return Run.from_store(RunStore(path), path)
    if not path.is_file():
        raise InputError(f"{path} is neither a run directory nor a records file")
    if path.name.endswith(".capture.parquet"):
        return Run.from_capture(path)
    return Run.from_records_file(path)


def _records_file(path: Path) -> dict[str, Any]:
    """A records file (``stepmem run --out``) as JSON data, not yet checked beyond its shape."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise InputError(f"{path} is not a stepmem records file ({why})") from None
    if not isinstance(doc, dict) or "records" not in doc:
        raise InputError(f"{path} is not a stepmem records file (no 'records')")
    return doc


def load_meta(path: str | Path) -> dict[str, Any]:
    """A run's metadata alone, checked (:func:`check_meta`), its records not read: a run
    directory's ``meta.json`` or a records file's header; a capture has none (``{}``)."""
    path = Path(path)
    if path.is_dir():
        from collector.store import RunStore

        return check_meta(RunStore(path).meta, str(path / "meta.json"))
    if not path.is_file():
        raise InputError(f"{path} is neither a run directory nor a records file")
    if path.name.endswith(".capture.parquet"):
        return {}
    doc = _records_file(path)
    return check_meta({k: v for k, v in doc.items() if k != "records"}, str(path))
