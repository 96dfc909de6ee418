"""Prometheus pull: a custom collector that builds metric families at scrape time, and its server.

:class:`SamplerCollector` reads :class:`Snapshot` objects (one per GPU) when Prometheus scrapes
and emits every family of :data:`collector.metrics.METRICS` it has data for: the sampler's own
figures here, each process's newest step through the per-step series table
(:data:`collector.model.series.SERIES`). Its ``describe()`` is the table itself, so the
registry checks the names once, when the collector is registered. A snapshot that fails to
build is logged and skipped — a collector never breaks a scrape. The HTTP server
serves prometheus-client's WSGI app (``GET /metrics`` and ``HEAD`` only; nothing accepts
writes) with bounds of its own: at most :data:`MAX_CONNECTIONS` connections at once, and
:data:`IDLE_TIMEOUT_S` for a client to send its request, so idle or slow clients cannot pile up
threads; a newcomer finding every slot taken takes over the oldest connection whose request is
not yet in (:class:`BoundedServer`), so slow clients cannot keep a scrape out either.

Scrape cost: a handful of dict lookups per GPU plus one window max/min over the ring (at 1 kHz
and a 15 s window, 15,000 int64s); see ``benchmarks/export_cost.py``.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from collector.metrics import (
    DROP_REASONS,
    ERROR_KINDS,
    METRICS,
    REMOTE_WRITE_DROP_REASONS,
)
from collector.model.series import GPU_LABELS, step_values
from collector.model.settings import DEFAULT_WINDOW_S
from collector.model.step import StepRecord

__all__ = ["SamplerCollector", "Snapshot", "serve"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16  # concurrent /metrics connections; Prometheus needs one per scrape
TAKE_OVER_WAIT_S = 1.0  # a newcomer waits this long for the slot of the connection it cut
IDLE_TIMEOUT_S = 5.0  # a connection that sends nothing this long is closed
REQUEST_DEADLINE_S = 10.0  # a connection is cut this long after it was accepted, whatever it sent


@dataclass
class Snapshot:
    """What one GPU's sampler knows at scrape time."""

    labels: dict[str, str]  # GPU_LABELS → values
    total_bytes: int
    used_bytes: int | None = None
    reserved_bytes: int | None = None
    window_s: float = DEFAULT_WINDOW_S
    window_max_bytes: int | None = None
    window_min_bytes: int | None = None
    last_records: list[StepRecord] = field(default_factory=list)  # the newest per rank
    samples_total: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    missed_deadlines: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    rate_hz: float = 0.0
    target_rate_hz: float = 0.0
    up: bool = True
    steps_joined: int = 0
    remote_write: dict[str, Any] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)  # process label → bytes

    @property
    def last_record(self) -> StepRecord | None:
        """The newest step of any process on this GPU."""
        return max(self.last_records, key=lambda r: r.end_ns, default=None)


def _values(s: Snapshot) -> Iterable[tuple[str, dict[str, str], float]]:
    if s.used_bytes is not None:
        yield "stepmem_nvml_used_bytes", {}, s.used_bytes
        yield "stepmem_nvml_reserved_bytes", {}, s.reserved_bytes or 0
    yield "stepmem_nvml_total_bytes", {}, s.total_bytes
    for process, used in sorted(s.processes.items()):
        yield "stepmem_process_used_bytes", {"process": process}, used
    yield "stepmem_window_seconds", {}, s.window_s
    if s.window_max_bytes is not None:
        yield "stepmem_nvml_used_window_max_bytes", {}, s.window_max_bytes
        yield "stepmem_nvml_used_window_min_bytes", {}, s.window_min_bytes or 0
    for rec in s.last_records:  # one process's newest step each (ranks sharing the GPU)
        yield from step_values(rec)
    yield "stepmem_sampler_samples_total", {}, s.samples_total
    for kind, n in (dict.fromkeys(ERROR_KINDS, 0) | s.errors).items():
        yield "stepmem_sampler_errors_total", {"kind": kind}, n
    yield "stepmem_sampler_missed_deadlines_total", {}, s.missed_deadlines
    for reason, n in (dict.fromkeys(DROP_REASONS, 0) | s.dropped).items():
        yield "stepmem_sampler_dropped_total", {"reason": reason}, n
    yield "stepmem_sampler_rate_hz", {}, s.rate_hz
    yield "stepmem_sampler_target_rate_hz", {}, s.target_rate_hz
    yield "stepmem_sampler_up", {}, 1 if s.up else 0
    yield "stepmem_steps_joined_total", {}, s.steps_joined
    rw = s.remote_write
    if rw:
        yield "stepmem_remote_write_samples_total", {}, rw.get("sent", 0)
        yield "stepmem_remote_write_pending", {}, rw.get("pending", 0)
        dropped = dict.fromkeys(REMOTE_WRITE_DROP_REASONS, 0) | rw.get("dropped", {})
        for reason, n in dropped.items():
            yield "stepmem_remote_write_dropped_total", {"reason": reason}, n


class SamplerCollector:
    """A prometheus-client collector over ``snapshots()`` (one :class:`Snapshot` per GPU)."""

    def __init__(self, snapshots: Callable[[], list[Snapshot]]) -> None:
        self._snapshots = snapshots

    def describe(self) -> list[Metric]:
        """Every family this collector can emit, empty (the registry checks their names at
        registration; no snapshot is read then)."""
        return list(_families().values())

    def collect(self) -> Iterable[Metric]:
        families = _families()
        try:
            snapshots = self._snapshots()
        except Exception:
            log.exception("stepmem: building metric snapshots failed; scrape served empty")
            snapshots = []
        for snap in snapshots:
            try:
                base = [str(snap.labels[k]) for k in GPU_LABELS]
                for name, extra, value in _values(snap):
                    fam = families[name]
                    fam.add_metric(base + [str(v) for v in extra.values()], float(value))
            except Exception:
                log.exception("stepmem: metrics for %s skipped", snap.labels.get("gpu_uuid"))
        return [f for f in families.values() if f.samples]


def _families() -> dict[str, Metric]:
    """An empty family for every metric of the table this collector emits (the baseline
    recording rule's is Prometheus' own)."""
    families: dict[str, Metric] = {}
    for m in METRICS:
        if "workload" not in m.labels or "gpu" not in m.labels:
            continue
        cls = CounterMetricFamily if m.type == "counter" else GaugeMetricFamily
        # CounterMetricFamily wants the name without _total; it adds the suffix back.
        name = m.name.removesuffix("_total") if m.type == "counter" else m.name
        families[m.name] = cls(name, m.help, labels=list(m.labels))
    return families


class _QuietHandler(WSGIRequestHandler):
    timeout = IDLE_TIMEOUT_S  # socket timeout for every read: an idle client is dropped

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:  # its whole request is in: no longer a connection a newcomer may take over
            self.server.received(self.request)  # type: ignore[attr-defined]
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        pass


class BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``max_connections`` at once; each connection times out
    when idle and is cut at its whole-request deadline. When every slot is taken, a newcomer
    takes the slot of the oldest connection that has still not sent its whole request (a slow
    or stalled client: ``taken_over``), so clients that trickle bytes and reconnect cannot keep
    out a scrape, which sends its request at once; only when every connection is being
    answered is the newcomer closed (``refused``)."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS
    # the listen backlog (socketserver's default is 5): a burst of connections waits to be
    # accepted — and closed at once when every slot is taken — instead of having its SYNs
    # dropped and retried a second later (a scrape arriving in such a burst included)
    request_queue_size = 128

    def server_activate(self) -> None:
        super().server_activate()
        self.refused = 0
        self.failed: Counter[str] = Counter()  # connections that ended in an error, by kind
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.taken_over = 0
        # connection -> [the socket, its deadline, its whole request received]; in the order
        # they were opened (the oldest first)
        self._open: dict[int, list[Any]] = {}
        self._open_lock = threading.Lock()
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="stepmem-metrics-deadline", daemon=True).start()

    def shutdown(self) -> None:
        self._done.set()
        super().shutdown()

    def received(self, request: Any) -> None:
        with self._open_lock:
            entry = self._open.get(id(request))
            if entry is not None:
                entry[2] = True

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False) and not self._take_over():
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed (an idle client timed out, a reset): counted, not printed
        (socketserver prints a traceback per connection: anyone who reaches the port could
        fill the job's log)."""
        import sys

        exc = sys.exc_info()[1]
        self.failed[type(exc).__name__ if exc else "unknown"] += 1

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        # a whole-request deadline: a client that trickles a byte now and then (never idle
        # for IDLE_TIMEOUT_S) still loses its slot, so a few slow clients cannot keep
        # Prometheus out for as long as they like
        with self._open_lock:
            self._open[id(request)] = [request, time.monotonic() + REQUEST_DEADLINE_S, False]
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open.pop(id(request), None)
            self._slots.release()

    def _watch(self) -> None:
        """One thread for every connection's deadline (not a timer each: the threads stay
        bounded by the connections)."""
        while not self._done.wait(min(0.5, REQUEST_DEADLINE_S / 4)):
            now = time.monotonic()
            with self._open_lock:
                late = [r for r, t, _ in self._open.values() if t <= now]
            for r in late:
                _cut(r, self)

    def _take_over(self) -> bool:
        """Cut the oldest connection whose request is not yet in, and wait (briefly: its thread
        sees the end at its next read) for its slot. False: every connection is being answered."""
        with self._open_lock:
            victim = next((r for r, _, got in self._open.values() if not got), None)
        if victim is None:
            return False
        _cut(victim, self, "taken_over")
        if not self._slots.acquire(timeout=TAKE_OVER_WAIT_S):
            return False
        self.taken_over += 1
        return True


def _cut(request: Any, server: BoundedServer, why: str = "deadline") -> None:
    """End a connection that outlived its deadline, or whose slot a newcomer takes (its
    handler's next read sees the end)."""
    server.failed[why] += 1
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


def serve(collector: SamplerCollector, addr: str, port: int = 0) -> tuple[Any, int]:
    """Serve ``collector`` on ``http://addr:port/metrics`` (port 0: the OS picks one), on a
    :class:`BoundedServer` in a daemon thread.

    Returns the server and the port it bound. ``addr`` is the node's own address by default at
    the call sites; pass ``0.0.0.0`` only when all interfaces are really wanted.
    """
    registry = CollectorRegistry()
    registry.register(collector)  # describe(): names checked now, duplicates refused
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    server_cls = type("Server", (BoundedServer,), {"address_family": family[0][0]})
    server = make_server(
        family[0][4][0], port, make_wsgi_app(registry), server_cls, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, name="stepmem-metrics", daemon=True).start()
    return server, server.server_port
