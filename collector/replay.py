"""NVML captures recorded on real GPUs, and a backend that plays them.

A capture is one Parquet file (zstd) per recorded GPU:

* columns ``t_ns`` (int64, nanoseconds since the capture's first sample), ``used`` and
  ``reserved`` (int64 bytes, NVML v2 as :mod:`collector.nvml` documents them);
* schema metadata key ``stepmem.capture``: JSON with ``format`` (1), ``device`` (uuid, index,
  name, total_bytes, driver, memory_info_version), ``rate_hz`` requested, ``command`` (the exact
  command that recorded it), ``recorded_at``, ``processes`` (NVML per-process snapshots:
  ``[{"t_ns", "procs": [[pid, used_bytes, name], ...]}]``, ``name`` since the accounting
  captures; a snapshot taken at a step mark also has ``"at": [step, kind]``), ``events`` (the
  step probe's events, with ``t_ns`` on the capture's clock) and free-form ``notes``.

:class:`ReplayBackend` plays captures through the same interface as
:class:`collector.nvml.LiveBackend`: ``read()`` returns the value *in force* at the replay clock's
position — the last captured sample at or before it — so a sampler reading faster than the
capture was recorded sees every captured value. ``speed`` > 1 plays faster than real time.
Replayed devices get UUIDs derived from the capture's UUID, the node and the slot, so N simulated
GPUs on M nodes never collide; the derivation is stable across processes.
"""

from __future__ import annotations

import functools
import json
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from collector.capture_meta import CaptureError, check_events, check_meta
from collector.model.errors import InputError
from collector.model.files import atomic_write
from collector.model.records import DeviceInfo, MemoryInfo, ProcessMemory
from collector.nvml import (
    NvmlGpuLost,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlUnavailable,
    NvmlUnknown,
)

__all__ = [
    "CAPTURE_DIR",
    "Capture",
    "CaptureError",
    "ReplayBackend",
    "ReplayDevice",
    "builtin_captures",
    "resolve_capture",
]

META_KEY = b"stepmem.capture"
_FAULTS = {
    "gpu_lost": NvmlGpuLost,
    "not_supported": NvmlNotSupported,
    "unavailable": NvmlUnavailable,
    "unknown": NvmlUnknown,
}
PARQUET = {"compression": "zstd", "compression_level": 9, "use_dictionary": False}  # samples
FORMAT = 1
MAX_ROWS = 10_000_000  # samples a replayed capture may hold (24 bytes each, per simulated GPU)
CAPTURE_DIR = Path(__file__).resolve().parent.parent / "captures"
_NAMESPACE = uuidlib.UUID("5f0c3b8e-2f61-4a57-9a7e-7d0d3e2f9a11")


class ReplayHeld(NvmlUnavailable):
    """A replayed GPU read before its run aligned it (:meth:`ReplayDevice.hold`): nothing to
    read yet, which is no error of the device's; the sampler skips it without counting."""

    kind = "held"


@dataclass
class Capture:
    """One GPU's recorded NVML trace (plus what else was recorded alongside)."""

    t_ns: np.ndarray
    used: np.ndarray
    reserved: np.ndarray
    device: dict[str, Any]
    rate_hz: float = 0.0
    command: str = ""
    recorded_at: str = ""
    processes: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    @property
    def duration_ns(self) -> int:
        return int(self.t_ns[-1]) if len(self.t_ns) else 0

    @property
    def total_bytes(self) -> int:
        return int(self.device["total_bytes"])

    def max_in_force(self, begin_ns: int, end_ns: int) -> int:
        """The largest ``used`` value in force at any time in [begin_ns, end_ns] (capture clock)."""
        lo = max(0, int(np.searchsorted(self.t_ns, begin_ns, "right")) - 1)
        hi = int(np.searchsorted(self.t_ns, end_ns, "right"))
        return int(self.used[lo : max(hi, lo + 1)].max())

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if len(self.t_ns) == 0:
            raise CaptureError("refusing to save an empty capture")
        meta = {
            "format": FORMAT,
            "device": self.device,
            "rate_hz": self.rate_hz,
            "command": self.command,
            "recorded_at": self.recorded_at,
            "processes": self.processes,
            "events": self.events,
            "notes": self.notes,
        }
        table = pa.table(
            {
                "t_ns": pa.array(self.t_ns, pa.int64()),
                "used": pa.array(self.used, pa.int64()),
                "reserved": pa.array(self.reserved, pa.int64()),
            }
        )
        table = table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
        encoding = dict.fromkeys(table.column_names, "DELTA_BINARY_PACKED")
        atomic_write(
            path, lambda tmp: pq.write_table(table, tmp, **PARQUET, column_encoding=encoding)
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> Capture:
        """Read and check a capture (a file anyone can edit: every field it holds is checked
        before anything plays it). Raises :class:`CaptureError` naming the first problem.
        Reads of one unchanged file are shared within a process (:func:`_load_cached`)."""
        path = Path(path)
        if not path.is_file():
            raise CaptureError(f"capture {path} does not exist")
        st = path.stat()
        return _load_cached(str(path.resolve()), st.st_size, st.st_mtime_ns)

    @classmethod
    def _read(cls, path: Path) -> Capture:
        try:
            pf = pq.ParquetFile(path)
            raw = (pf.schema_arrow.metadata or {}).get(META_KEY)
            rows = pf.metadata.num_rows
        except (OSError, pa.ArrowException) as exc:
            raise CaptureError(f"capture {path} is not a readable Parquet file: {exc}") from None
        if raw is None:
            raise CaptureError(
                f"{path} is a Parquet file but not a stepmem capture (no stepmem.capture metadata)"
            )
        try:
            meta = json.loads(raw)
        except (ValueError, RecursionError):
            raise CaptureError(f"capture {path} has corrupt metadata") from None
        check_meta(meta, path)
        if meta.get("format") != FORMAT:
            raise CaptureError(
                f"capture {path} has format {meta.get('format')!r}; "
                f"this stepmem reads format {FORMAT}"
            )
        missing = {"t_ns", "used", "reserved"} - set(pf.schema_arrow.names)
        if missing:
            raise CaptureError(f"capture {path} lacks columns {sorted(missing)}")
        for name in ("t_ns", "used", "reserved"):
            if not pa.types.is_integer(pf.schema_arrow.field(name).type):
                raise CaptureError(
                    f"capture {path}: column {name} holds {pf.schema_arrow.field(name).type}, "
                    "not integers"
                )
        if rows == 0:
            raise CaptureError(f"capture {path} holds no samples")
        if rows > MAX_ROWS:
            raise CaptureError(
                f"capture {path} holds {rows:,} samples; a replay plays at most {MAX_ROWS:,} "
                "(each simulated GPU keeps them in memory)"
            )
        try:
            table = pf.read(columns=["t_ns", "used", "reserved"])
        except (OSError, pa.ArrowException) as exc:
            raise CaptureError(f"capture {path} is not a readable Parquet file: {exc}") from None
        cols = {}
        for name in ("t_ns", "used", "reserved"):
            col = table.column(name)
            if col.null_count:
                raise CaptureError(f"capture {path}: column {name} has missing values")
            cols[name] = col.to_numpy().astype(np.int64)
        t, used, reserved = cols["t_ns"], cols["used"], cols["reserved"]
        total = int(meta["device"]["total_bytes"])
        if t[0] != 0 or np.any(np.diff(t) < 0):
            raise CaptureError(
                f"capture {path} has timestamps out of order (they start at 0 and never go back)"
            )
        for name, v in (("used", used), ("reserved", reserved)):
            if int(v.min()) < 0 or int(v.max()) > total:
                raise CaptureError(
                    f"capture {path}: {name} holds values outside 0..{total} bytes (the card's "
                    f"total): {int(v.min())}..{int(v.max())}"
                )
        check_events(meta.get("events", []), int(t[-1]), path)
        dev = meta["device"]
        return cls(
            t_ns=t,
            used=used,
            reserved=reserved,
            device=dev,
            rate_hz=float(meta.get("rate_hz", 0.0)),
            command=str(meta.get("command", "")),
            recorded_at=str(meta.get("recorded_at", "")),
            processes=meta.get("processes", []),
            events=meta.get("events", []),
            notes=meta.get("notes", {}),
            name=path.name.removesuffix(".parquet").removesuffix(".capture"),
        )


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, size: int, mtime_ns: int) -> Capture:
    """One read of an unchanged capture file per process (the job checks, places and plays
    the same capture; a 10-million-row file is read once, not four times)."""
    return Capture._read(Path(path))


def _info_version(v: Any) -> int:
    return int(v) if v in (1, 2) else 2


def builtin_captures() -> dict[str, Path]:
    """The captures committed with stepmem, by short name (``idle``, ``adamw_8bit``, ...)."""
    return {
        p.name.removesuffix(".capture.parquet"): p
        for p in sorted(CAPTURE_DIR.glob("*.capture.parquet"))
    }


def resolve_capture(name_or_path: str) -> Path:
    """A committed capture's short name, or a path. Raises :class:`CaptureError`."""
    builtin = builtin_captures()
    if name_or_path in builtin:
        return builtin[name_or_path]
    path = Path(name_or_path)
    if path.is_file():
        return path
    known = ", ".join(builtin) or "none"
    raise CaptureError(
        f"capture {name_or_path!r} is neither a file nor a committed capture (committed: {known})"
    )


def replay_uuid(capture_uuid: str, node_id: str, slot: int) -> str:
    """The UUID a replayed GPU gets: stable, NVML-shaped, distinct per node and slot."""
    return "GPU-" + str(uuidlib.uuid5(_NAMESPACE, f"{capture_uuid}/{node_id}/{slot}"))


class ReplayDevice:
    """A captured GPU played back on the monotonic clock from ``origin_ns``."""

    backend = "replay"

    def __init__(
        self,
        capture: Capture,
        info: DeviceInfo,
        origin_ns: int,
        speed: float = 1.0,
        loop: bool = True,
        clock=time.monotonic_ns,
    ) -> None:
        if not speed > 0:
            raise InputError(f"replay speed must be > 0, got {speed}")
        self.capture = capture
        self.info = info
        self.origin_ns = origin_ns
        self.speed = speed
        self.loop = loop
        self._clock = clock
        self._t = capture.t_ns
        self._used = capture.used  # numpy, shared with the capture: 8 bytes a value
        self._reserved = capture.reserved
        self._period = capture.duration_ns + max(
            1, int(np.median(np.diff(capture.t_ns))) if len(capture.t_ns) > 1 else 1
        )
        self.memory_info_version = _info_version(capture.device.get("memory_info_version", 2))
        self._fault: tuple[type, int, int] | None = None
        self._reads = 0
        self._held = False  # restarted by Ray: read nothing until aligned again
        step = int(np.median(np.diff(capture.t_ns))) if len(capture.t_ns) > 1 else 0
        self._resolution = int(step / speed)

    @property
    def uuid(self) -> str:
        return self.info.uuid

    @property
    def resolution_ns(self) -> int:
        """The capture's own sampling period (median), at this replay's speed: a sampler
        reading faster sees each captured value several times, not finer detail."""
        return self._resolution

    def position_ns(self, t_ns: int | None = None) -> int:
        """Where on the capture's clock the replay is at monotonic time ``t_ns`` (default: now)."""
        pos = int(((self._clock() if t_ns is None else t_ns) - self.origin_ns) * self.speed)
        if pos < 0:
            return 0
        return pos % self._period if self.loop else min(pos, self._period)

    def monotonic_of(self, capture_t_ns: int, lap: int = 0) -> int:
        """The monotonic time at which the replay reaches ``capture_t_ns`` (on lap ``lap``)."""
        return self.origin_ns + int((capture_t_ns + lap * self._period) / self.speed)

    def inject(self, kind: str, every: int = 1, from_ns: int = 0) -> None:
        """Fault injection: from monotonic ``from_ns`` on, every ``every``-th read raises the
        typed NVML error of ``kind`` (``gpu_lost``, ``not_supported``, ``unknown``, ...)."""
        if kind not in _FAULTS:
            raise ValueError(f"fault kind {kind!r} is not one of {sorted(_FAULTS)}")
        if every < 1:
            raise ValueError("every must be >= 1")
        self._fault = (_FAULTS[kind], every, from_ns)
        self._reads = 0

    def lose_at(self, t_ns: int) -> None:
        """Fault injection: from monotonic ``t_ns`` on, every read raises ``NvmlGpuLost``."""
        self.inject("gpu_lost", 1, t_ns)

    def align(self, origin_ns: int, loop: bool) -> None:
        """Play so that capture time 0 falls at monotonic ``origin_ns``, once or in a loop."""
        self.origin_ns, self.loop, self._held = origin_ns, loop, False

    def hold(self) -> None:
        """Read nothing (NVML ``unavailable``) until :meth:`align` says where to play: a
        sampler that Ray restarted lost its alignment, and a misaligned replay would show
        values from the wrong moment as if measured."""
        self._held = True

    def _index(self, now: int) -> int:
        if self._held:
            raise ReplayHeld(f"{self.uuid}: the replay waits for the run to align it")
        if self._fault is not None and now >= self._fault[2]:
            self._reads += 1
            if self._reads % self._fault[1] == 0:
                raise self._fault[0](f"{self.uuid}: replayed fault")
        return max(0, int(np.searchsorted(self._t, self.position_ns(now), "right")) - 1)

    def used_at(self, t_ns: int) -> int:
        """The capture's used value in force at monotonic ``t_ns`` (no fault injection): what a
        per-process snapshot taken then is paired with."""
        i = max(0, int(np.searchsorted(self._t, self.position_ns(t_ns), "right")) - 1)
        return int(self._used[i])

    def read(self) -> tuple[int, int]:
        return self.read_at(self._clock())

    def read_at(self, t_ns: int) -> tuple[int, int]:
        """The values in force at monotonic ``t_ns``."""
        i = self._index(t_ns)
        return int(self._used[i]), int(self._reserved[i])

    def sample_at(self, t_ns: int) -> tuple[int, int, int, int]:
        """The captured sample in force at monotonic ``t_ns``, as ``(key, stamp, used,
        reserved)``: ``key`` tells one captured sample (on one lap) from another, ``stamp`` is
        the monotonic time that sample was taken at on the replay's clock (never later than
        ``t_ns``). The sampler keeps each captured sample once, at its own time, so a replay
        holds the capture's readings and nothing between them: a value the capture held from
        −2.4 ms to +1.2 ms around a step mark is one sample at −2.4 ms, not a reading at
        +0.3 ms that the GPU never gave."""
        i = self._index(t_ns)
        pos = int((t_ns - self.origin_ns) * self.speed)
        lap = pos // self._period if self.loop and pos > 0 else 0
        stamp = min(t_ns, self.monotonic_of(int(self._t[i]), lap))
        return lap * len(self._t) + i, stamp, int(self._used[i]), int(self._reserved[i])

    def memory(self) -> MemoryInfo:
        used, reserved = self.read()
        total = self.capture.total_bytes
        return MemoryInfo(
            total=total,
            free=max(0, total - used - reserved),
            used=used,
            reserved=reserved,
            version=self.memory_info_version,
        )

    def processes(self) -> list[ProcessMemory]:
        """The per-process snapshot in force now (the last one taken at or before)."""
        snaps = self.capture.processes
        if not snaps:
            return []
        pos = self.position_ns()
        chosen = snaps[0]
        for snap in snaps:
            if snap["t_ns"] <= pos:
                chosen = snap
        return _procs(chosen)

    def processes_reading(self, t_ns: int) -> tuple[int, int, list[ProcessMemory]]:
        """The capture's per-process snapshot taken nearest monotonic ``t_ns`` (a step's end:
        captures take one a few ms after each step mark): when it was taken (monotonic), the
        device's used memory then, and the processes."""
        snaps = self.capture.processes
        if not snaps:
            return t_ns, self.used_at(t_ns), []
        pos = self.position_ns(t_ns)
        chosen = min(snaps, key=lambda s: abs(s["t_ns"] - pos))
        t = t_ns - int((pos - chosen["t_ns"]) / self.speed)  # capture position pos is t_ns
        return t, self.used_at(t), _procs(chosen)


def _procs(snap: dict[str, Any]) -> list[ProcessMemory]:
    return [
        ProcessMemory(pid=int(p[0]), used_bytes=p[1], name=str(p[2]) if len(p) > 2 else "")
        for p in snap["procs"]
    ]


class ReplayBackend:
    """Simulated GPUs playing captures: GPU ``k`` of a node plays ``captures[k % len]``."""

    name = "replay"

    def __init__(
        self,
        captures: list[str | Path],
        gpus: int | None = None,
        node_id: str = "local",
        origin_ns: int | None = None,
        speed: float = 1.0,
        loop: bool = True,
    ) -> None:
        if not captures:
            raise CaptureError("replay needs at least one capture")
        self.captures = [Capture.load(resolve_capture(str(c))) for c in captures]
        self.gpus = len(self.captures) if gpus is None else gpus
        if self.gpus < 1:
            raise InputError(f"replay needs at least 1 simulated GPU, got {self.gpus}")
        if not speed > 0:
            raise InputError(f"replay speed must be > 0, got {speed}")
        self.node_id = node_id
        self.origin_ns = time.monotonic_ns() if origin_ns is None else origin_ns
        self.speed = speed
        self.loop = loop

    def devices(self) -> list[DeviceInfo]:
        out = []
        for k in range(self.gpus):
            cap = self.captures[k % len(self.captures)]
            out.append(
                DeviceInfo(
                    uuid=replay_uuid(cap.device["uuid"], self.node_id, k),
                    index=k,
                    name=f"{cap.device.get('name', 'GPU')} (replay of {cap.name})",
                    total_bytes=cap.total_bytes,
                    driver=cap.device.get("driver", ""),
                )
            )
        return out

    def capture_for(self, uuid: str) -> Capture:
        for k, info in enumerate(self.devices()):
            if info.uuid == uuid:
                return self.captures[k % len(self.captures)]
        raise NvmlNotFound(f"no replayed GPU with UUID {uuid} on node {self.node_id}")

    def open(self, uuid: str) -> ReplayDevice:
        for k, info in enumerate(self.devices()):
            if info.uuid == uuid:
                return ReplayDevice(
                    self.captures[k % len(self.captures)],
                    info,
                    self.origin_ns,
                    self.speed,
                    self.loop,
                )
        raise NvmlNotFound(f"no replayed GPU with UUID {uuid} on node {self.node_id}")
