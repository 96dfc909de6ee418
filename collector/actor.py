"""The sampler actor: one per GPU, sampling it, joining the step events the training side sends,
serving ``/metrics`` and pushing remote write. :mod:`collector.placement` places them;
:mod:`collector.lookup` finds one by name.

Restarts: a dead sampler is restarted by Ray (``max_restarts=3``) with a fresh ring, and calls
made while it restarts are retried on the new process (``max_task_retries=3``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import Counter, deque
from typing import Any

import ray

from collector.backends import BackendSpec, ReplayControl
from collector.join import StepJoiner
from collector.metrics import gpu_labels
from collector.model.account import outside_share
from collector.model.records import SamplerHealth, SamplerInfo, Stat, StepEvent
from collector.model.settings import SamplerOptions
from collector.model.step import ProcessesReading, StepRecord
from collector.probe.outbox import SpoolReader
from collector.procwatch import ProcessWatch, as_reading
from collector.sampler import Sampler

__all__ = ["SamplerActor"]

log = logging.getLogger(__name__)

JOIN_INTERVAL_S = 0.05
RAY_GAUGES_INTERVAL_S = 1.0
MAX_EVENTS_PER_CALL = 10_000
EVENTS_KEPT = 50_000  # accepted events kept for a run store's drain (the newest)


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
        sampling = options.sampling
        self.sampler = Sampler(self.device, sampling.rate, capacity=sampling.capacity)
        self.joiner = StepJoiner(self.sampler, processes=self._processes_for)
        self._baseline: int | None = None
        self.process_read_errors = 0
        self.process_labels: dict[int, str] = {}  # pid → Ray name of a training process
        # live GPUs: per-process readings taken as memory moves (a replay has its snapshots)
        self.procwatch = None
        if self.device.backend == "nvml":
            self.procwatch = ProcessWatch(self.device, self.sampler)
        self.events_received = 0
        self.events_rejected: Counter[str] = Counter()
        # accepted events, for the run store (a run's samplers; a daemon's keep none)
        self.events: deque[StepEvent] = deque(maxlen=EVENTS_KEPT if options.keep_events else 0)
        self.events_accepted = 0
        self.spool = SpoolReader(options.spool, gpu_uuid) if options.spool else None
        # A run's replay reads nothing until the run aligns it (replay_from): at the start, and
        # again after Ray restarted this actor with its first arguments, when a replay from the
        # launch-time origin would show values of the wrong moment as if measured
        if spec.hold_until_aligned and isinstance(self.device, ReplayControl):
            self.device.hold()
        self.labels = gpu_labels(node_id, self.device.info, options.run_id, options.workload)
        self.writer = None
        self._sample_cursor = 0
        self.ray_gauges = None
        if options.ray_metrics:
            from collector.export.ray_metrics import RayGauges

            self.ray_gauges = RayGauges(self.labels)
        if options.remote_write is not None:
            from collector.export.remote_write import RemoteWriter

            self.writer = RemoteWriter(options.remote_write)
        addr = options.metrics_addr or _node_address()
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
            if self.procwatch is not None:
                self.procwatch.start()
        self._stop = threading.Event()
        self._join_thread = threading.Thread(
            target=self._join_loop, name="stepmem-join", daemon=True
        )
        self._join_thread.start()

    def _processes_for(self, rec: StepRecord) -> ProcessesReading | None:
        """:meth:`_processes_at` for a joined step, with ``baseline``: the smallest memory its
        process has held outside torch so far (for the live accounting series)."""
        snap = self._processes_at(rec.end_ns, rec.nvml_end_bytes)
        pid = rec.begin_stat(Stat.PROCESS_PID)
        reserved = rec.reserved_end
        if snap is None or pid is None or reserved is None:
            return snap
        v = outside_share(snap.procs, pid, reserved)
        if v is not None:
            self._baseline = v if self._baseline is None else min(self._baseline, v)
        return dataclasses.replace(snap, baseline=self._baseline)

    def _processes_at(self, end_ns: int, end_used: int | None) -> ProcessesReading | None:
        """NVML per-process memory for the step that ended at ``end_ns``, with the device's used
        memory at the same moment: a live GPU's reading nearest the end that saw the device as
        the step left it (:class:`collector.procwatch.ProcessWatch`), a replay's snapshot
        nearest the end. Never in the sampling loop."""
        if self.procwatch is not None:
            return self.procwatch.reading_for(end_ns, end_used)
        try:
            t, used, procs = self.device.processes_reading(end_ns)
        except Exception:  # an NVML error costs the accounting its split, nothing else
            self.process_read_errors += 1
            return None
        return as_reading(t, used, procs)

    def _join_loop(self) -> None:
        next_gauges = 0.0
        while not self._stop.wait(JOIN_INTERVAL_S):
            try:
                if self.spool is not None:
                    self._accept(self.spool.read())
                self._publish(self.joiner.poll())
                if self.ray_gauges is not None and time.monotonic() >= next_gauges:
                    self.ray_gauges.update(self.snapshot())  # Ray exports every ~10 s anyway
                    next_gauges = time.monotonic() + RAY_GAUGES_INTERVAL_S
            except Exception:  # never let the join thread die silently
                log.exception("step join failed")

    def _publish(self, records: list[StepRecord], final: bool = False) -> None:
        if self.writer is None:
            return
        offset = time.time_ns() - time.monotonic_ns()
        for rec in records:
            self.writer.push_step(self.labels, rec, offset)
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
            window_s=self.options.sampling.window_s,
            samples_total=ring.count,
            errors=dict(s.errors),
            missed_deadlines=s.missed,
            dropped=dict(self.events_rejected) | dict(self.joiner.rejected),
            rate_hz=s.achieved_rate_hz(),
            target_rate_hz=s.rate_hz,
            up=s.alive,
            steps_joined=self.joiner.joined,
            last_records=self.joiner.newest_by_process(),
            remote_write=self.writer.stats() if self.writer is not None else {},
            processes=self._process_series(),
        )
        if last is not None:
            snap.used_bytes, snap.reserved_bytes = last[1], last[2]
            w = ring.window(last[0] - int(self.options.sampling.window_s * 1e9), last[0])
            snap.window_max_bytes, snap.window_min_bytes = int(w.used.max()), int(w.used.min())
        return snap

    def register_process(self, pid: int, label: str) -> None:
        """A training process reporting to this sampler (its outbox calls this once): its memory
        is shown under ``label`` in ``stepmem_process_used_bytes``."""
        self.process_labels[int(pid)] = str(label)[:64]

    def _process_series(self) -> dict[str, int]:
        """The newest per-process reading by process label (unregistered ones: ``other``)."""
        if self.procwatch is not None:
            reading = self.procwatch.latest()
        else:
            reading = self._processes_at(time.monotonic_ns(), None)
        out: dict[str, int] = {}
        for p in reading.procs if reading is not None else []:
            label = self.process_labels.get(p.pid, "other")
            out[label] = out.get(label, 0) + (p.used_bytes or 0)
        return out

    def info(self) -> SamplerInfo:
        d = self.device.info
        return SamplerInfo(
            node_id=self.node_id,
            actor_node_id=ray.get_runtime_context().get_node_id(),  # where it really runs
            gpu_uuid=d.uuid,
            index=d.index,
            name=d.name,
            total_bytes=d.total_bytes,
            driver=d.driver,
            backend=self.device.backend,
            memory_info_version=self.device.memory_info_version,
            rate_hz=self.sampler.rate_hz,
            resolution_ns=self.sampler.resolution_ns,
            run_id=self.options.run_id,
            workload=self.options.workload,
            targets=self.options.targets,
            metrics_addr=self.metrics_addr,
            metrics_port=self.metrics_port,
            capacity=self.sampler.ring.capacity,
            ring_bytes=self.sampler.ring.nbytes,
            pid=os.getpid(),
            started_ns=self.sampler.started_ns,
            wall_offset_ns=time.time_ns() - time.monotonic_ns(),
            replay_origin_ns=getattr(self.device, "origin_ns", None),
            replay_speed=getattr(self.device, "speed", None),
            error=self.init_error,
            # training processes that reported here: pid → Ray name (the per-process series)
            processes={str(pid): label for pid, label in self.process_labels.items()},
        )

    def record_events(self, events: list[dict[str, Any]]) -> int:
        """Take a batch of step events (dicts). Returns how many were accepted."""
        if not isinstance(events, list):
            self.events_rejected["malformed"] += 1
            return 0
        if len(events) > MAX_EVENTS_PER_CALL:
            self.events_rejected["batch_too_large"] += len(events)
            return 0
        return self._accept(events)

    def _accept(self, events: list[Any]) -> int:
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
            self.events.append(ev)
            self.events_accepted += 1
            accepted += 1
        return accepted

    def events_since(self, cursor: int) -> dict[str, Any]:
        """The events accepted from the ``cursor``-th on (for the run store): ``events``,
        ``next``, and ``lost`` (no longer kept)."""
        first = self.events_accepted - len(self.events)
        start = max(cursor, first)
        out = list(self.events)[start - first :]
        return {"events": out, "next": self.events_accepted, "lost": max(0, first - cursor)}

    def step_records(self, flush: bool = False) -> list[StepRecord]:
        """Every joined step record still kept (the newest 20,000); ``flush`` joins pending
        steps now."""
        return self.records_since(0, flush)["records"]

    def records_since(self, cursor: int, flush: bool = False) -> dict[str, Any]:
        """The records joined from the ``cursor``-th on (0: the first): ``records``, ``next``
        (the cursor for the next call) and ``lost`` (asked for but no longer kept). The run
        store drains with this: every record once, whatever its step number."""
        self._publish(self.joiner.poll(force=flush))
        recs, nxt, lost = self.joiner.records_since(cursor)
        return {"records": recs, "next": nxt, "lost": lost}

    def newest_record(self) -> StepRecord | None:
        """The newest joined step record (for a tracker's per-step keys), None before any."""
        return self.joiner.newest()

    def last(self) -> tuple[int, int, int] | None:
        return self.sampler.ring.last()

    def samples_since(self, seq: int) -> dict[str, Any]:
        """The ring's samples from sequence number ``seq`` on, the sequence to ask for next,
        how many were overwritten before this call, and ``started_ns``: when this sampler
        started (a new value: Ray restarted the actor, with a new ring)."""
        w, nxt = self.sampler.ring.since(seq)
        return {
            "t_ns": w.t_ns,
            "used": w.used,
            "reserved": w.reserved,
            "lost": w.lost,
            "next": nxt,
            "started_ns": self.sampler.started_ns,
        }

    def replay_from(self, origin_ns: int, loop: bool = True, stand_in: bool = False) -> None:
        """Replay backend: restart playback so capture time 0 falls at monotonic ``origin_ns``
        (the job aligns every replayed GPU of a node after they have all started); ``loop``
        False plays the capture once and then holds its last value. ``stand_in``: CPU
        processes bring the steps (``--command``, ``--train-workers``): the capture is not
        their memory, and their steps get no NVML figure (gap ``stand_in``)."""
        if not isinstance(self.device, ReplayControl):
            raise TypeError("replay_from is for the replay backend")
        self.joiner.stand_in = bool(stand_in)
        self.device.align(int(origin_ns), bool(loop))

    def inject_fault(self, kind: str, every: int = 1) -> None:
        """Replay backend only: make NVML reads fail (see ``ReplayDevice.inject``)."""
        if not isinstance(self.device, ReplayControl):
            raise TypeError("fault injection is for the replay backend")
        self.device.inject(kind, every, time.monotonic_ns())

    def thread_cpu_s(self) -> float:
        return self.sampler.thread_cpu_s()

    def health(self) -> SamplerHealth:
        s = self.sampler
        return SamplerHealth(
            gpu_uuid=self.device.uuid,
            alive=s.alive,
            stopped_by=s.stopped_by,
            samples_total=s.ring.count,
            errors=dict(s.errors),
            missed_deadlines=s.missed,
            sampler_niceness=s.niceness,
            rate_hz=s.achieved_rate_hz(),
            mean_rate_hz=s.mean_rate_hz(),
            events_received=self.events_received,
            events_rejected=dict(self.events_rejected) | dict(self.joiner.rejected),
            steps_pending=self.joiner.pending,
            steps_open=self.joiner.open_steps,
            spool_malformed=self.spool.malformed if self.spool is not None else 0,
            spool_failed_writers=self.spool.failed_writers if self.spool is not None else 0,
            steps_joined=self.joiner.joined,
            remote_write=self.writer.stats() if self.writer is not None else None,
            # NVML per-process readings (the accounting's split): taken, and failed by error
            process_readings={
                "taken": self.procwatch.reads if self.procwatch is not None else None,
                "errors": dict(self.procwatch.errors)
                if self.procwatch is not None
                else ({"read": self.process_read_errors} if self.process_read_errors else {}),
            },
        )

    def stop(self) -> SamplerHealth:
        """Stop sampling, join every pending step, flush remote write, return the final health."""
        self.sampler.stop()
        self._stop.set()
        self._publish(self.joiner.poll(force=True), final=True)
        if self.procwatch is not None:
            self.procwatch.stop()
        if self.writer is not None:
            self.writer.mark_stale()  # the run is over: its series end now, not 5 min later
            self.writer.close()
        return self.health()


def _node_address() -> str:
    """The address Ray registered for this actor's node (``--node-ip-address``: 127.0.0.1 on a
    loopback-only cluster), where /metrics listens unless told otherwise; the machine's outward
    address only when the node table cannot say."""
    try:
        me = ray.get_runtime_context().get_node_id()
        for n in ray.nodes():
            if n.get("NodeID") == me and n.get("NodeManagerAddress"):
                return str(n["NodeManagerAddress"])
    except Exception as exc:  # the node table is Ray's; a sampler starts without it
        log.debug("node table unavailable: %s", exc)
    return ray.util.get_node_ip_address()
