"""The sampler actor, launching one per GPU on every node, and looking one up.

Placement rules (see DESIGN.md, "Placement"):

* one actor per physical GPU, ``num_cpus=0, num_gpus=0`` — a fractional GPU request would pack
  every sampler onto GPU 0's share and could block training workers from being scheduled;
* pinned with ``NodeAffinitySchedulingStrategy(node_id, soft=False)``;
* named ``stepmem:<node_id>:<gpu_uuid>`` in namespace ``stepmem``, so any process of the cluster
  finds the sampler of (its node, its GPU) by name;
* owned by the launching driver (dies with the job) unless ``detached=True``.

The backend is chosen per actor: ``nvml`` reads the node's GPUs; ``replay`` plays committed
captures as simulated GPUs (for machines and CI without GPUs).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from collector.errors import StepmemError
from collector.nvml import LiveBackend, NvmlUnavailable
from collector.records import StepEvent
from collector.replay import ReplayBackend
from collector.sampler import DEFAULT_CAPACITY, Sampler, StepJoiner

__all__ = [
    "NAMESPACE",
    "BackendSpec",
    "SamplerActor",
    "SamplerOptions",
    "find_sampler",
    "launch_samplers",
    "sampler_name",
]

log = logging.getLogger(__name__)

NAMESPACE = "stepmem"
JOIN_INTERVAL_S = 0.05
MAX_EVENTS_PER_CALL = 10_000


def sampler_name(node_id: str, gpu_uuid: str) -> str:
    return f"stepmem:{node_id}:{gpu_uuid}"


@dataclass
class BackendSpec:
    """Which backend a sampler actor builds, in a form that travels to other processes.

    ``kind`` is ``"nvml"`` or ``"replay"``. For replay: ``captures`` (names or paths), ``gpus``
    per node (default: one per capture), ``speed`` and ``origin_ns`` (monotonic time at which
    every replayed GPU of a node starts playing; default: when the launcher ran).
    """

    kind: str = "nvml"
    captures: list[str] = field(default_factory=list)
    gpus: int | None = None
    speed: float = 1.0
    origin_ns: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("nvml", "replay"):
            raise ValueError(f"backend must be 'nvml' or 'replay', got {self.kind!r}")
        if self.kind == "replay" and not self.captures:
            raise ValueError("the replay backend needs at least one capture")

    def build(self, node_id: str) -> LiveBackend | ReplayBackend:
        if self.kind == "nvml":
            return LiveBackend()
        return ReplayBackend(
            self.captures, self.gpus, node_id=node_id, origin_ns=self.origin_ns, speed=self.speed
        )


def new_run_id() -> str:
    """A run id for labels: UTC time and 4 random hex digits (bounded: one per run)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + os.urandom(2).hex()


@dataclass
class SamplerOptions:
    """How each sampler actor samples and exports.

    ``metrics_addr`` None binds ``/metrics`` to the node's own IP address (never all interfaces
    unless ``"0.0.0.0"`` is asked for); ``metrics_port`` 0 lets the OS pick a free port (the
    actor reports it in ``info()`` and the launcher writes it to the ``file_sd`` file); a
    non-zero ``metrics_port`` is a base: the sampler of the GPU with NVML index ``i`` serves on
    ``metrics_port + i`` (fixed ports, for a Kubernetes PodMonitor).
    ``remote_write`` (a :class:`collector.export.remote_write.RemoteWriteConfig`) pushes every
    step record with its step-end timestamp; with ``push_samples`` also the raw NVML trace as
    per-millisecond maxima (``job="stepmem-samples"``).
    """

    rate_hz: float = 1000.0
    capacity: int = DEFAULT_CAPACITY
    run_id: str = ""
    workload: str = ""
    window_s: float = 15.0
    metrics_addr: str | None = None
    metrics_port: int = 0
    remote_write: Any = None
    push_samples: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port must be 0..65535, got {self.metrics_port}")
        if not self.window_s > 0:
            raise ValueError(f"window must be > 0 s, got {self.window_s}")
        if self.rate_hz < 0:
            raise ValueError(f"rate must be >= 0 Hz (0 = max), got {self.rate_hz}")


@ray.remote(num_cpus=0, num_gpus=0, max_restarts=3, max_task_retries=3)
class SamplerActor:
    """Samples one GPU and joins the step events the training side sends it.

    ``record_events`` is meant to be called fire-and-forget (``actor.record_events.remote(batch)``
    with the ref dropped): it validates each event, counts what it rejects and never raises.

    Restarts: a dead sampler is restarted by Ray (``max_restarts=3``) with a fresh ring, and calls
    made while it restarts are retried on the new process (``max_task_retries=3``), so the
    probe's events are not lost; steps that began before the restart are flagged
    ``sampler_started`` in their records.
    """

    def __init__(
        self, node_id: str, gpu_uuid: str, spec: BackendSpec, options: SamplerOptions
    ) -> None:
        from collector.export.prometheus import SamplerCollector, serve

        self.node_id = node_id
        self.spec = spec
        self.options = options
        self.device = spec.build(node_id).open(gpu_uuid)
        self.sampler = Sampler(self.device, rate_hz=options.rate_hz, capacity=options.capacity)
        self.joiner = StepJoiner(self.sampler)
        self.events_received = 0
        self.events_rejected: Counter[str] = Counter()
        self.labels = {
            "node": node_id,
            "gpu": str(self.device.info.index),
            "gpu_uuid": self.device.info.uuid,
            "run": options.run_id,
            "workload": options.workload,
        }
        self.writer = None
        self._sample_cursor = 0
        if options.remote_write is not None:
            from collector.export.remote_write import RemoteWriter

            self.writer = RemoteWriter(options.remote_write)
        addr = options.metrics_addr or ray.util.get_node_ip_address()
        port = options.metrics_port + self.device.info.index if options.metrics_port else 0
        self.metrics_addr, self.metrics_port = addr, port
        # A port in use or an address not on this node: the actor stays up to say so in
        # ``info()`` (one line for the user), samples nothing, and the launcher removes it.
        self.init_error = ""
        try:
            self._server, self.metrics_port = serve(
                SamplerCollector(lambda: [self.snapshot()]), addr, port
            )
        except OSError as exc:
            self._server = None
            self.init_error = f"cannot serve /metrics on {addr}:{port}: {exc.strerror or exc}"
        else:
            self.sampler.start()
        self._stop = threading.Event()
        self._join_thread = threading.Thread(
            target=self._join_loop, name="stepmem-join", daemon=True
        )
        self._join_thread.start()

    def _join_loop(self) -> None:
        while not self._stop.wait(JOIN_INTERVAL_S):
            try:
                self._publish(self.joiner.poll())
            except Exception:  # never let the join thread die silently
                log.exception("step join failed")

    def _publish(self, records: list[Any], final: bool = False) -> None:
        if self.writer is None:
            return
        offset = time.time_ns() - time.monotonic_ns()
        for rec in records:
            self.writer.push_step(self.labels, rec.to_dict(), offset)
        if self.options.push_samples:
            w, nxt = self.sampler.ring.since(self._sample_cursor)
            if w.lost:
                self.writer.dropped["ring_overrun"] += w.lost
            held = self.writer.push_samples(self.labels, w.t_ns, w.used, offset, final=final)
            self._sample_cursor = nxt - held

    def snapshot(self) -> Any:
        """What ``/metrics`` shows for this GPU now (see :mod:`collector.export.prometheus`)."""
        from collector.export.prometheus import Snapshot

        s, ring = self.sampler, self.sampler.ring
        last = ring.last()
        snap = Snapshot(
            labels=self.labels,
            total_bytes=self.device.info.total_bytes,
            window_s=self.options.window_s,
            samples_total=ring.count,
            errors=dict(s.errors),
            missed_deadlines=s.missed,
            dropped=dict(self.events_rejected) | dict(self.joiner.rejected),
            rate_hz=s.achieved_rate_hz(),
            target_rate_hz=s.rate_hz,
            up=s.alive,
            steps_joined=self.joiner.joined,
            last_record=newest.to_dict() if (newest := self.joiner.newest()) else None,
            remote_write=self.writer.stats() if self.writer is not None else {},
        )
        if last is not None:
            snap.used_bytes, snap.reserved_bytes = last[1], last[2]
            w = ring.window(last[0] - int(self.options.window_s * 1e9), last[0])
            snap.window_max_bytes, snap.window_min_bytes = int(w.used.max()), int(w.used.min())
        return snap

    def info(self) -> dict[str, Any]:
        d = self.device.info
        return {
            "node_id": self.node_id,
            "actor_node_id": ray.get_runtime_context().get_node_id(),  # where it really runs
            "gpu_uuid": d.uuid,
            "index": d.index,
            "name": d.name,
            "total_bytes": d.total_bytes,
            "driver": d.driver,
            "backend": self.device.backend,
            "memory_info_version": self.device.memory_info_version,
            "rate_hz": self.sampler.rate_hz,
            "run_id": self.options.run_id,
            "workload": self.options.workload,
            "metrics_addr": self.metrics_addr,
            "metrics_port": self.metrics_port,
            "capacity": self.sampler.ring.capacity,
            "ring_bytes": self.sampler.ring.nbytes,
            "pid": os.getpid(),
            "started_ns": self.sampler.started_ns,
            "wall_offset_ns": time.time_ns() - time.monotonic_ns(),
            "replay_origin_ns": getattr(self.device, "origin_ns", None),
            "replay_speed": getattr(self.device, "speed", None),
            "error": self.init_error,
        }

    def record_events(self, events: list[dict[str, Any]]) -> int:
        """Take a batch of step events (dicts). Returns how many were accepted."""
        if not isinstance(events, list):
            self.events_rejected["malformed"] += 1
            return 0
        if len(events) > MAX_EVENTS_PER_CALL:
            self.events_rejected["batch_too_large"] += len(events)
            return 0
        accepted = 0
        for raw in events:
            self.events_received += 1
            try:
                ev = StepEvent.from_dict(raw)
            except (ValueError, TypeError):
                self.events_rejected["malformed"] += 1
                continue
            if ev.gpu_uuid != self.device.uuid:
                self.events_rejected["wrong_gpu"] += 1
                continue
            self.joiner.add(ev)
            accepted += 1
        return accepted

    def step_records(self, since_step: int = -1, flush: bool = False) -> list[dict[str, Any]]:
        """Joined step records with ``step > since_step``; ``flush`` joins pending steps now."""
        self._publish(self.joiner.poll(force=flush))
        return [r.to_dict() for r in self.joiner.records_since(since_step)]

    def last(self) -> tuple[int, int, int] | None:
        return self.sampler.ring.last()

    def window_stats(self, seconds: float) -> dict[str, int] | None:
        """Max and min NVML used over the trailing ``seconds`` (ending at the newest sample)."""
        last = self.sampler.ring.last()
        if last is None:
            return None
        w = self.sampler.ring.window(last[0] - int(seconds * 1e9), last[0])
        return {
            "max": int(w.used.max()),
            "min": int(w.used.min()),
            "samples": len(w),
            "begin_ns": int(w.t_ns[0]),
            "end_ns": int(w.t_ns[-1]),
        }

    def samples_since(self, seq: int) -> dict[str, Any]:
        w, nxt = self.sampler.ring.since(seq)
        return {"t_ns": w.t_ns, "used": w.used, "reserved": w.reserved, "lost": w.lost, "next": nxt}

    def replay_from(self, origin_ns: int) -> None:
        """Replay backend: restart playback so capture time 0 falls at monotonic ``origin_ns``
        (the job aligns every replayed GPU of a node after they have all started)."""
        if not hasattr(self.device, "origin_ns"):
            raise TypeError("replay_from is for the replay backend")
        self.device.origin_ns = int(origin_ns)

    def inject_fault(self, kind: str, every: int = 1) -> None:
        """Replay backend only: make NVML reads fail (see ``ReplayDevice.inject``)."""
        if not hasattr(self.device, "inject"):
            raise TypeError("fault injection is for the replay backend")
        self.device.inject(kind, every, time.monotonic_ns())

    def thread_cpu_s(self) -> float:
        return self.sampler.thread_cpu_s()

    def health(self) -> dict[str, Any]:
        s = self.sampler
        return {
            "alive": s.alive,
            "stopped_by": s.stopped_by,
            "samples_total": s.ring.count,
            "errors": dict(s.errors),
            "missed_deadlines": s.missed,
            "rate_hz": s.achieved_rate_hz(),
            "events_received": self.events_received,
            "events_rejected": dict(self.events_rejected) | dict(self.joiner.rejected),
            "steps_pending": self.joiner.pending,
            "steps_joined": self.joiner.joined,
            "remote_write": self.writer.stats() if self.writer is not None else None,
        }

    def stop(self) -> dict[str, Any]:
        """Stop sampling, join every pending step, flush remote write, return the final health."""
        self.sampler.stop()
        self._stop.set()
        self._publish(self.joiner.poll(force=True), final=True)
        if self.writer is not None:
            self.writer.mark_stale()  # the run is over: its series end now, not 5 min later
            self.writer.close()
        return self.health()


@ray.remote(num_cpus=0, num_gpus=0)
def _node_gpus() -> list[dict[str, Any]]:
    try:
        return [d.__dict__ for d in LiveBackend().devices()]
    except NvmlUnavailable:
        return []


def _alive_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def _gpus_on(node_id: str, spec: BackendSpec) -> list[dict[str, Any]]:
    if spec.kind == "replay":
        return [d.__dict__ for d in spec.build(node_id).devices()]
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.get(_node_gpus.options(scheduling_strategy=strategy).remote(), timeout=60)


@dataclass
class PlacedSampler:
    node_id: str
    gpu_uuid: str
    name: str
    handle: Any
    info: dict[str, Any]


def launch_samplers(
    spec: BackendSpec,
    options: SamplerOptions | None = None,
    detached: bool = False,
    nodes: list[str] | None = None,
) -> list[PlacedSampler]:
    """Place one sampler actor per GPU on every alive node (or on ``nodes``).

    Idempotent: an actor that already exists under the same name is reused, not doubled. Raises
    ``RuntimeError`` when no node has a GPU for the chosen backend.
    """
    options = options or SamplerOptions()
    if not options.run_id:
        options.run_id = new_run_id()
    if spec.kind == "replay" and spec.origin_ns is None:
        spec.origin_ns = time.monotonic_ns()
    found = [
        (node_id, gpu) for node_id in nodes or _alive_nodes() for gpu in _gpus_on(node_id, spec)
    ]
    if options.metrics_port and found:
        top = options.metrics_port + max(gpu["index"] for _, gpu in found)
        if top > 65535:
            raise StepmemError(
                f"--metrics-port {options.metrics_port}: GPU index "
                f"{top - options.metrics_port} would serve on port {top}; the largest is 65535"
            )
    placed = []
    for node_id, gpu in found:
        name = sampler_name(node_id, gpu["uuid"])
        handle = SamplerActor.options(
            name=name,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached" if detached else None,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_id, gpu["uuid"], spec, options)
        placed.append(PlacedSampler(node_id, gpu["uuid"], name, handle, {}))
    if not placed:
        raise StepmemError(
            "no GPU found on any alive Ray node for the nvml backend; on a machine without GPUs "
            "use the replay backend (--backend replay)"
        )
    infos = ray.get([p.handle.info.remote() for p in placed], timeout=120)
    for p, info in zip(placed, infos, strict=True):
        p.info = info
    failed = [p for p in placed if p.info.get("error")]
    if failed:
        for p in placed:  # none of this launch's samplers stays behind
            if p.info.get("run_id") == options.run_id:
                ray.kill(p.handle, no_restart=True)
        first = failed[0]
        raise StepmemError(
            f"the sampler of GPU {first.info['index']} on node {first.node_id[:12]} "
            f"{first.info['error']}"
            + (f" ({len(failed)} samplers failed)" if len(failed) > 1 else "")
        )
    return placed


_cache: dict[tuple[str, str], tuple[Any, float]] = {}
_misses: dict[tuple[str, str], float] = {}
MISS_RETRY_S = 10.0
HANDLE_TTL_S = 10.0


def find_sampler(gpu_uuid: str, node_id: str | None = None) -> Any | None:
    """The sampler actor for (``node_id`` or this node, ``gpu_uuid``), or None if there is none.

    A found handle is reused for :data:`HANDLE_TTL_S` seconds, then looked up again (a sampler
    killed and launched anew under the same name is a new actor; a restarted one keeps its
    handle). A miss is remembered for :data:`MISS_RETRY_S` seconds so a probe without a sampler
    does not ask the GCS every step. Called from the probe's sender thread, never the hot path.
    """
    if node_id is None:
        node_id = ray.get_runtime_context().get_node_id()
    key = (node_id, gpu_uuid)
    now = time.monotonic()
    cached = _cache.get(key)
    if cached is not None and now - cached[1] < HANDLE_TTL_S:
        return cached[0]
    if now - _misses.get(key, -MISS_RETRY_S) < MISS_RETRY_S:
        return None
    try:
        handle = ray.get_actor(sampler_name(node_id, gpu_uuid), namespace=NAMESPACE)
    except ValueError:
        _cache.pop(key, None)
        _misses[key] = now
        return None
    _cache[key] = (handle, now)
    _misses.pop(key, None)
    return handle


def forget_samplers() -> None:
    """Drop cached handles (after ``ray.shutdown`` or in tests)."""
    _cache.clear()
    _misses.clear()


def list_samplers() -> list[str]:
    """Names of every stepmem sampler actor alive in the cluster (no dashboard needed)."""
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"] for a in named if a["namespace"] == NAMESPACE and a["name"].startswith("stepmem:")
    )
