"""The run store: everything a run recorded, on disk, readable with pandas.

Layout of a run directory (``runs/<run_id>/`` by default)::

    meta.json                         run id, command, backend, GPUs (uuid, index, name, total),
                                      versions, sampler settings, achieved rates, status
    samples/<gpu_uuid>/part-NNNNN.parquet   full-rate NVML samples: t_ns, used, reserved (int64)
    steps/part-NNNNN.parquet          step records, one row per step per GPU (columns below)
    events/part-NNNNN.parquet         the probe's step events: kind, step, t_ns, gpu_uuid, phase,
                                      torch (JSON), ledger (JSON)

Timestamps are the node's ``CLOCK_MONOTONIC`` in nanoseconds; ``meta.json`` keeps each sampler's
``wall_offset_ns`` (wall = monotonic + offset). Step columns: one per field of
:class:`collector.model.step.StepRecord` (:data:`STEP_COLUMNS`: ``gpu_uuid, step, begin_ns, end_ns,
samples, nvml_peak_bytes``…), every ``torch_end.<key>``, ``torch_begin.<key>`` and
``ledger.<kind>`` flattened, and ``phases`` and ``processes`` (JSON).

Written incrementally: each flush writes new part files, each one to a temporary name renamed
into place, so a crash loses at most what arrived since the last flush and never leaves a torn
file; ``meta.json`` is rewritten the same way. A run killed mid-way reads like any other, with
``status`` still ``running``. Write failures (disk full, read-only, a value a column cannot
hold) are counted in ``write_errors`` and logged once; they never reach the training loop. The
writer sets aside ``RESERVE_BYTES`` at the start (``.reserve``) and frees it just before the
final ``meta.json``, so a full disk still gets the run's status and its write errors written:
``complete``, ``failed``, ``interrupted``, or ``incomplete`` (the run ended but its record
did not: ``problems`` says why). The store is private to its owner (folders 0700, files 0600):
it holds command lines and the names of the GPU's processes.

Stores written before ``seq`` existed (their steps numbered by the caller only) read back with
``seq`` given in time order per GPU and process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import stat
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from collector.model.errors import StepmemError
from collector.model.files import atomic_write
from collector.model.records import StepEvent
from collector.model.step import StepRecord
from collector.model.untrusted import MAX_DEPTH, depth, read_json

__all__ = ["STEP_COLUMNS", "RunStore", "RunWriter", "StoreError", "flatten_record"]

log = logging.getLogger(__name__)

FORMAT = 1
MAX_META_BYTES = 64 << 20  # a run's meta.json: a few KB a GPU
RESERVE_BYTES = 256 << 10  # room kept free for the final meta.json on a disk that fills up


class StoreError(StepmemError, ValueError):
    """A path that is not a readable run directory."""


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, data, private=True)


def _write_table(path: Path, table: pa.Table) -> None:
    atomic_write(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"), private=True)


# How each StepRecord field is stored: the dicts of numbers as one column per key
# (``torch_end.<key>``), the nested ones as JSON; every other field is a column of its own.
_FLAT_DICTS = ("torch_end", "torch_begin", "ledger")
_JSON = ("phases", "processes")
STEP_COLUMNS = tuple(
    f.name for f in dataclasses.fields(StepRecord) if f.name not in _FLAT_DICTS + _JSON
)


def flatten_record(rec: StepRecord) -> dict[str, Any]:
    """A step record as one flat row (see the module docstring for the columns). A field added
    to :class:`StepRecord` is a column here without a change to this function."""
    row = {k: getattr(rec, k) for k in STEP_COLUMNS}
    for name in _FLAT_DICTS:
        for k, v in getattr(rec, name).items():
            row[f"{name}.{k}"] = v
    row["phases"] = json.dumps([p.to_dict() for p in rec.phases])
    row["processes"] = json.dumps(rec.processes.to_dict() if rec.processes is not None else {})
    return row


def unflatten_record(row: dict[str, Any]) -> dict[str, Any]:
    """A flat row (:func:`flatten_record`) back as a record dict; a missing value (NaN, a
    column other rows have) is left out."""
    rec: dict[str, Any] = {name: {} for name in _FLAT_DICTS}
    for k, v in row.items():
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        name, dot, key = k.partition(".")
        if dot and name in _FLAT_DICTS:
            rec[name][key] = int(v)
        elif k in _JSON:
            rec[k] = _json_cell(v, k)
        else:
            v = v.item() if hasattr(v, "item") else v
            # an integer column with a missing value reads back as floats
            rec[k] = int(v) if isinstance(v, float) and v.is_integer() else v
    return rec


def _json_cell(v: Any, column: str) -> Any:
    """A JSON column's value, as data: ``ValueError`` for what is not JSON or nests deeper
    than any stepmem writes (a hand-made store)."""
    try:
        doc = json.loads(v)
    except RecursionError:
        raise ValueError(f"column {column} is nested too deeply") from None
    except (TypeError, ValueError):
        raise ValueError(f"column {column} is not JSON") from None
    if depth(doc) > MAX_DEPTH:
        raise ValueError(f"column {column} is nested too deeply")
    return doc


def _safe_name(uuid: str) -> str:
    """A GPU UUID as a folder name (UUIDs come from events: never a path)."""
    if not uuid or uuid in (".", "..") or "/" in uuid or "\\" in uuid or "\0" in uuid:
        raise ValueError(f"GPU UUID {uuid!r} cannot name a folder")
    return uuid


class RunWriter:
    """Appends a run's samples, step records and events to a run directory."""

    def __init__(self, root: str | Path, meta: dict[str, Any]) -> None:
        self.root = Path(root)
        self.meta = {"format": FORMAT, "status": "running", **meta}
        self.write_errors: Counter[str] = Counter()
        self.first_error = ""  # the first write failure, in words
        self.rows_written: Counter[str] = Counter()
        self._samples: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._steps: list[dict[str, Any]] = []
        self._events: list[dict[str, Any]] = []
        self._parts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._warned = False
        if (self.root / "meta.json").exists():
            raise StoreError(f"{self.root} already holds a run; a run never overwrites another")
        made = not self.root.exists()
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            self.root.mkdir(mode=0o700, exist_ok=True)
            for part in ("samples", "steps", "events"):
                (self.root / part).mkdir(mode=0o700, exist_ok=True)
            _atomic_write_bytes(self.root / ".reserve", bytes(RESERVE_BYTES))
            _atomic_write_bytes(
                self.root / "meta.json", json.dumps(self.meta, indent=1, default=str).encode()
            )
        except OSError as exc:
            if made:  # what this writer made holds no run: it must not block the run id
                shutil.rmtree(self.root, ignore_errors=True)
            raise StoreError(
                f"cannot create the run store at {self.root}: {exc.strerror or exc}"
            ) from None

    def add_samples(self, gpu_uuid: str, t_ns: Any, used: Any, reserved: Any) -> None:
        if len(t_ns):
            with self._lock:
                self._samples.setdefault(gpu_uuid, []).append(
                    (np.asarray(t_ns), np.asarray(used), np.asarray(reserved))
                )

    def add_records(self, records: list[StepRecord]) -> None:
        with self._lock:
            self._steps.extend(flatten_record(r) for r in records)

    def add_events(self, events: list[StepEvent]) -> None:
        with self._lock:
            self._events.extend(
                {
                    **e.to_dict(),
                    "torch": json.dumps(e.torch),
                    "ledger": json.dumps(e.ledger),
                }
                for e in events
            )

    def _part(self, folder: Path, key: str) -> Path:
        self._parts[key] += 1
        return folder / f"part-{self._parts[key]:05d}.parquet"

    def _guard(self, what: str, n: int, fn) -> None:
        try:
            fn()
            self.rows_written[what] += n
        except Exception as exc:  # a full disk, a value no column can hold: counted, never raised
            self.write_errors[what] += max(n, 1)
            if not self.first_error:
                self.first_error = f"{type(exc).__name__}: {exc}"[:300]
            if not self._warned:
                self._warned = True
                log.error(
                    "stepmem: run store write failed (%s); training goes on, what could "
                    "not be written is counted in write_errors",
                    exc,
                )

    def flush(self) -> None:
        """Write everything buffered as new part files (atomically, one file at a time)."""
        with self._lock:
            samples, self._samples = self._samples, {}
            steps, self._steps = self._steps, []
            events, self._events = self._events, []
        for uuid, chunks in samples.items():
            t, u, r = (np.concatenate([c[i] for c in chunks]) for i in range(3))

            def write(uuid=uuid, t=t, u=u, r=r) -> None:
                folder = self.root / "samples" / _safe_name(uuid)
                folder.mkdir(mode=0o700, exist_ok=True)
                cols = {"t_ns": t, "used": u, "reserved": r}
                table = pa.table({k: v.astype(np.int64) for k, v in cols.items()})
                _write_table(self._part(folder, uuid), table)

            self._guard("samples", len(t), write)
        if steps:
            self._guard(
                "steps",
                len(steps),
                lambda: _write_table(
                    self._part(self.root / "steps", "steps"), pa.Table.from_pylist(steps)
                ),
            )
        if events:
            self._guard(
                "events",
                len(events),
                lambda: _write_table(
                    self._part(self.root / "events", "events"), pa.Table.from_pylist(events)
                ),
            )

    def _write_meta(self) -> None:
        self.meta["write_errors"] = dict(self.write_errors)
        self.meta["rows_written"] = dict(self.rows_written)
        self._guard(
            "meta",
            0,
            lambda: _atomic_write_bytes(
                self.root / "meta.json", json.dumps(self.meta, indent=1, default=str).encode()
            ),
        )

    def close(self, status: str = "complete", **fields: Any) -> None:
        """Flush, then mark the run ``status`` in ``meta.json`` (written into the room set
        aside at the start, so a full disk still records how the run ended). A run whose own
        parts could not all be written is ``incomplete``, whatever ``status`` says."""
        self.flush()
        if self.write_errors and status == "complete":
            status = "incomplete"
        (self.root / ".reserve").unlink(missing_ok=True)
        self.meta.update(fields, status=status)
        self._write_meta()


def number_steps(recs: list[StepRecord]) -> list[StepRecord]:
    """Give records without a ``seq`` (written before it existed) one: 1, 2, … in time order
    per GPU and process (records are in time order per GPU already)."""
    seen: Counter[tuple[str, int]] = Counter()
    for r in recs:
        if not r.seq:
            seen[(r.gpu_uuid, r.pid)] += 1
            r.seq = seen[(r.gpu_uuid, r.pid)]
    return recs


class RunStore:
    """A run directory, read back (pandas DataFrames)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        meta_path = self.root / "meta.json"
        if not meta_path.is_file():
            raise StoreError(f"{self.root} is not a stepmem run directory (no meta.json)")
        try:
            self.meta = read_json(meta_path, MAX_META_BYTES, str(meta_path))
        except OSError as exc:
            raise StoreError(f"{meta_path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise StoreError(f"{meta_path} is corrupt ({str(exc).split(': ', 1)[-1]})") from None
        if not isinstance(self.meta, dict):
            raise StoreError(f"{meta_path}: must be a JSON object, got {type(self.meta).__name__}")
        if self.meta.get("format") != FORMAT:
            raise StoreError(
                f"{self.root}: run store format {self.meta.get('format')!r}, "
                f"this stepmem reads {FORMAT}"
            )

    def _read(self, folder: Path) -> Any:
        parts = sorted(folder.glob("part-*.parquet"))
        if not parts:
            return None
        odd = [p.name for p in parts if not _regular(p)]
        if odd:  # a folder is read by pyarrow as an (empty) dataset: steps gone with no word
            raise StoreError(
                f"{folder}: {', '.join(odd[:4])} {'is' if len(odd) == 1 else 'are'} not a "
                "regular file (a part is one Parquet file); the store is not read"
            )
        try:
            return pa.concat_tables(
                [pq.read_table(p) for p in parts], promote_options="default"
            ).to_pandas()
        except (OSError, pa.ArrowException) as exc:
            raise StoreError(f"{folder} holds an unreadable part: {exc}") from None

    def unreadable_parts(self, folder: str = "events") -> list[str]:
        """Part files of ``folder`` whose Parquet footer cannot be read (a torn copy, a disk
        error), by name; reading the footer only, so it is quick on a large store."""
        bad = []
        for p in sorted((self.root / folder).glob("part-*.parquet")):
            if not _regular(p):
                bad.append(f"{folder}/{p.name}")
                continue
            try:
                pq.ParquetFile(p).metadata  # noqa: B018 - the read is the check
            except (OSError, pa.ArrowException):
                bad.append(f"{folder}/{p.name}")
        return bad

    def gpus(self) -> list[str]:
        folder = self.root / "samples"
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []

    def samples(self, gpu_uuid: str) -> Any:
        return self._read(self.root / "samples" / gpu_uuid)

    def records(self) -> list[StepRecord]:
        """The run's step records, typed and checked as the untrusted data a store is
        (:meth:`StepRecord.from_untrusted`), in (GPU, time) order, one per step: a store written
        before ``seq`` existed gets it here (1, 2, … in time order per GPU and process); a step
        stored twice (a sampler restarted by Ray joined again a step the old one had joined:
        its events were retried on the new one) is kept once, with the most samples."""
        df = self.steps()
        if df is None:
            return []
        try:
            recs = [
                StepRecord.from_untrusted(unflatten_record(r), f"{self.root}: record {i}")
                for i, r in enumerate(df.to_dict("records"))
            ]
        except (ValueError, TypeError) as exc:
            raise StoreError(str(exc)) from None
        best: dict[tuple[Any, ...], StepRecord] = {}
        for r in number_steps(recs):
            key = (*r.key, r.begin_ns)
            if key not in best or r.samples > best[key].samples:
                best[key] = r
        return sorted(best.values(), key=lambda r: (r.gpu_uuid, r.begin_ns))

    def steps(self) -> Any:
        df = self._read(self.root / "steps")
        if df is None:
            return None
        return df.sort_values(["gpu_uuid", "begin_ns"], kind="stable").reset_index(drop=True)

    def events(self) -> Any:
        return self._read(self.root / "events")


def _regular(p: Path) -> bool:
    """A regular file (a link to one too): never a folder, a FIFO or a device."""
    try:
        return stat.S_ISREG(p.stat().st_mode)
    except OSError:
        return False
