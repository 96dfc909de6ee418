"""How step events leave the training process: :class:`Outbox` batches them per GPU and a
sender thread of its own submits them to each GPU's sampler actor, never waited on; this
process's Ray name (:func:`ray_process_label`) and the sampler lookup (:class:`RaySamplers`).

A process that is not connected to Ray (a rank started by ``torchrun`` or
``torch.multiprocessing.spawn`` under ``stepmem run --command/--script``) cannot call an actor.
When the run gave it a spool folder (``STEPMEM_SPOOL``, inherited from the job), its sender
appends the events to ``<spool>/events-<pid>.jsonl`` instead, and the run's samplers on that
node read them from there (:class:`SpoolReader`): the same events, the same join, no Ray in
the training process."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from collector.model.records import StepEvent
from collector.model.step import StepRecord

__all__ = ["EVENTS_KEPT", "SPOOL_ENV", "Outbox", "RaySamplers", "SpoolReader", "ray_process_label"]

log = logging.getLogger(__name__)

EVENTS_KEPT = 1024  # the newest events an outbox keeps for inspection (``Outbox.events``)
SPOOL_ENV = "STEPMEM_SPOOL"  # a folder where a process without Ray leaves its events
SPOOL_READ_MAX = 4 << 20  # bytes a sampler reads from one spool file per look


class Outbox:
    """Batches step events per GPU and sends them from a background thread; keeps every event.

    The training thread only appends (:meth:`put`, a dict append under a lock) and nudges
    (:meth:`maybe_flush`). A daemon sender thread does the rest off the hot path: every
    ``flush_interval_s``, or as soon as a GPU has ``batch_max`` events waiting, it writes the
    events to ``events_file`` (JSON lines) and submits ``handle.record_events.remote(batch)`` to
    the GPU's sampler, dropping the returned reference — nothing ever waits on an actor, and a Ray
    call that stalls stalls only the sender. A batch that cannot be submitted (no sampler, an
    unusable handle) is counted in ``dropped``; the events stay in ``events`` for the run store.
    """

    def __init__(
        self,
        resolve: Callable[[str], Any] | None,
        batch_max: int = 64,
        flush_interval_s: float = 0.5,
        events_file: str | Path | None = None,
        spool: str | Path | None = None,
    ) -> None:
        self._resolve = resolve
        self.batch_max = batch_max
        self.flush_interval_s = flush_interval_s
        # the newest EVENTS_KEPT events, for inspection; what the run keeps is the samplers'
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self.sent = 0
        if spool is None:
            spool = os.environ.get(SPOOL_ENV) or None
        self._spool = Path(spool) if spool else None
        self._spool_file: Any = None
        self._spool_broken = False
        self.dropped: Counter[str] = Counter()
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._unwritten: list[dict[str, Any]] = []
        self._file = open(events_file, "a") if events_file else None  # noqa: SIM115
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        # The newest joined step record of each GPU, fetched by the sender thread once
        # something asked for it (:meth:`StepProbe.metrics`): never waited on.
        self.want_newest = False
        self.newest: dict[str, StepRecord] = {}
        self._asks: dict[str, Any] = {}  # GPU → ObjectRef of a newest_record call in flight
        self._registered: set[str] = set()  # samplers told this process's Ray name

    def put(self, ev: StepEvent) -> dict[str, Any]:
        d = ev.to_dict()
        with self._lock:
            self.events.append(d)
            self._pending.setdefault(ev.gpu_uuid, []).append(d)
            if self._file is not None:
                self._unwritten.append(d)
        if self._file is not None:
            # under `stepmem capture` the sender writes each mark at once: the capture takes
            # its per-process snapshot at the mark (an Event.set here, the write on the sender)
            self._wake.set()
        return d

    def maybe_flush(self) -> None:
        """Start the sender on first use; wake it early when a batch is full, or at every step
        end when events go to the spool (a rank that crashes or is killed has then lost at
        most the step it was in: a file append on the sender thread, nothing on this one).
        Never blocks."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="stepmem-outbox", daemon=True)
            self._thread.start()
        if self._spooling() or any(len(v) >= self.batch_max for v in self._pending.values()):
            self._wake.set()

    def _spooling(self) -> bool:
        """Whether this process's events go to the spool (it has one, and no Ray)."""
        if self._spool is None:
            return False
        ray = sys.modules.get("ray")
        return ray is None or not ray.is_initialized()

    def wake(self) -> None:
        """Have the sender run now (started on first use). Never blocks."""
        self.maybe_flush()
        self._wake.set()

    def drain(self, timeout_s: float = 2.0) -> bool:
        """Wake the sender and wait up to ``timeout_s`` for everything pending to be sent (a
        failing step's last events, before the process dies). True when nothing is pending."""
        self.wake()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.01)
        return False

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Write and send everything pending now (the sender thread calls this; so does close)."""
        with self._send_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
                unwritten, self._unwritten = self._unwritten, []
            self._write(unwritten)
            for uuid, batch in pending.items():
                self._send(uuid, batch)
            if self.want_newest:
                self._ask_newest({e["gpu_uuid"] for b in pending.values() for e in b})

    def _ask_newest(self, sent_to: set[str]) -> None:
        """Collect the answers that have arrived (without waiting) and ask again, for every GPU
        this outbox sends to."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return
        for uuid in sent_to | set(self._asks):
            ref = self._asks.get(uuid)
            try:
                if ref is not None:
                    ready, _ = ray.wait([ref], timeout=0)
                    if not ready:
                        continue
                    rec = ray.get(ref, timeout=0)
                    if rec is not None:
                        self.newest[uuid] = rec
                handle = self._resolve(uuid) if self._resolve is not None else None
                self._asks[uuid] = handle.newest_record.remote() if handle is not None else None
            except Exception as exc:  # a tracker key missing costs nothing else
                self._asks[uuid] = None
                self.dropped["newest_record"] += 1
                log.debug("newest record from %s failed: %s", uuid, exc)

    def _write(self, events: list[dict[str, Any]]) -> None:
        if self._file is None or not events:
            return
        try:
            self._file.write("".join(json.dumps(d) + "\n" for d in events))
            self._file.flush()
        except OSError as exc:
            self.dropped["events_file"] += len(events)
            log.warning("step events file write failed: %s", exc)

    def _send(self, uuid: str, batch: list[dict[str, Any]]) -> None:
        handle = None
        if self._resolve is not None:
            try:
                handle = self._resolve(uuid)
            except Exception as exc:  # lookup trouble is the sampler's problem, not training's
                log.debug("sampler lookup for %s failed: %s", uuid, exc)
        if handle is None:
            if self._spool is not None:
                if not self._to_spool(batch):
                    self.dropped["spool_failed"] += len(batch)
                return
            if not self.dropped["no_sampler"]:  # said once; every one is counted
                what = "this CPU-only process" if uuid == "cpu" else f"GPU {uuid}"
                log.warning(
                    "stepmem: no sampler for %s reachable (no stepmem run or daemon here, or no "
                    "Ray connection and no spool folder): its step events are counted as "
                    "unsent; training goes on",
                    what,
                )
            self.dropped["no_sampler"] += len(batch)
            return
        try:
            handle.record_events.remote(batch)
            self.sent += len(batch)
            if uuid not in self._registered:  # once per sampler: who this process is
                handle.register_process.remote(os.getpid(), ray_process_label())
                self._registered.add(uuid)
        except Exception as exc:
            self.dropped["send_failed"] += len(batch)
            log.debug("sending %d events to %s failed: %s", len(batch), uuid, exc)

    def _to_spool(self, batch: list[dict[str, Any]]) -> bool:
        """Append ``batch`` to this process's spool file (the sender thread only). False when
        the folder cannot be written (counted by the caller as unsent)."""
        try:
            if self._spool_file is None:
                assert self._spool is not None
                self._spool.mkdir(mode=0o700, parents=True, exist_ok=True)
                path = self._spool / f"events-{os.getpid()}.jsonl"
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                self._spool_file = os.fdopen(fd, "a")
            self._spool_file.write("".join(json.dumps(d) + "\n" for d in batch))
            self._spool_file.flush()
        except OSError as exc:
            self._spool_failed(exc)
            return False
        return True

    def _spool_failed(self, exc: OSError) -> None:
        """Said once, marked once: a ``failed-<pid>`` file in the spool folder (an empty file
        needs no room on a full disk) tells the run's sampler, and through it the run, that
        this process's steps are missing; every lost event is counted."""
        if self._spool_broken:
            return
        self._spool_broken = True
        why = exc.strerror or type(exc).__name__
        log.warning(
            "stepmem: cannot write step events to the spool folder %s (%s): this process's "
            "steps are counted as unsent and the run will say its record is incomplete; "
            "training goes on",
            self._spool,
            why,
        )
        try:
            assert self._spool is not None
            fd = os.open(self._spool / f"failed-{os.getpid()}", os.O_WRONLY | os.O_CREAT, 0o600)
            with contextlib.suppress(OSError):
                os.write(fd, why.encode()[:200])
            os.close(fd)
        except OSError:
            pass

    def close(self, timeout: float = 5.0) -> None:
        """Stop the sender and send what is left (bounded by ``timeout`` for the thread)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.flush()
        for name in ("_file", "_spool_file"):
            f = getattr(self, name)
            if f is not None:
                setattr(self, name, None)
                try:
                    f.close()  # flushes what a failed write left buffered
                except OSError as exc:  # a full disk: those events were counted when they failed
                    if name == "_spool_file":
                        self._spool_failed(exc)
                    else:
                        log.warning("step events file close failed: %s", exc)


def ray_process_label() -> str:
    """This process's name in Ray, for the per-process memory series: a named actor's name,
    ``train_rank_<N>`` in a Ray Train worker, ``actor`` (unnamed), ``driver`` or ``task``.
    Bounded by the training processes of a GPU, unlike a pid."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "driver"
    ctx = ray.get_runtime_context()
    if ctx.get_actor_id():
        if ctx.get_actor_name():
            return ctx.get_actor_name()
        train = sys.modules.get("ray.train")  # a Train worker has it imported; never import it
        try:
            return f"train_rank_{train.get_context().get_world_rank()}" if train else "actor"
        except Exception:  # an actor that is not a Train worker
            return "actor"
    return "driver" if ctx.worker.mode == ray.SCRIPT_MODE else "task"


class RaySamplers:
    """Resolves a GPU UUID to this node's sampler, once the process is connected to Ray (a
    process that never imported Ray has no sampler to talk to). Each outbox owns one, with its
    own lookup cache."""

    def __init__(self) -> None:
        self._lookup: Any = None

    def __call__(self, uuid: str) -> Any:
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return None
        if self._lookup is None:
            from collector.lookup import SamplerLookup

            self._lookup = SamplerLookup()
        return self._lookup.find(uuid)


class SpoolReader:
    """What the processes of one node without Ray left in a spool folder (the sampler side):
    each call returns the events appended since the last, for one GPU (others' are skipped),
    reading at most :data:`SPOOL_READ_MAX` bytes a file a call. Lines that are not JSON
    objects are counted in ``malformed``; the files are another process's output, so they
    are data only (validated by the caller as any event)."""

    def __init__(self, folder: str | Path, gpu_uuid: str) -> None:
        self.folder, self.gpu_uuid = Path(folder), gpu_uuid
        self.malformed = 0
        self.failed_writers = 0  # processes that said they could not write here (failed-<pid>)
        self._offsets: dict[str, int] = {}
        self._tails: dict[str, bytes] = {}

    def read(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            files = sorted(p for p in self.folder.glob("events-*.jsonl") if p.is_file())
            self.failed_writers = sum(1 for _ in self.folder.glob("failed-*"))
        except OSError:
            return out
        for path in files:
            key = path.name
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(key, 0))
                    chunk = f.read(SPOOL_READ_MAX)
            except OSError:
                continue
            self._offsets[key] = self._offsets.get(key, 0) + len(chunk)
            lines = (self._tails.get(key, b"") + chunk).split(b"\n")
            self._tails[key] = lines.pop()[-SPOOL_READ_MAX:]
            for line in lines:
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                except (ValueError, RecursionError):
                    self.malformed += 1
                    continue
                if not isinstance(d, dict):
                    self.malformed += 1
                elif d.get("gpu_uuid") == self.gpu_uuid:
                    out.append(d)
        return out
