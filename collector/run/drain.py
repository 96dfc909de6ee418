"""The run store's drain: every sampler of a run drained by cursor into the store, and what
could not be drained said (:func:`problems`)."""

from __future__ import annotations

import logging
import threading
from collections import Counter

import ray

from collector.model.errors import first_line
from collector.placement import PlacedSampler
from collector.store import RunWriter

__all__ = ["Drainer", "problems"]

log = logging.getLogger(__name__)


class Drainer:
    """Pulls new samples, step records and the step events each sampler accepted into the run
    store every interval.

    Every sampler is drained by cursor (the sequence numbers of its ring and of its joined
    records), so every record is stored once whatever its step number, and nothing drained is
    kept here: the driver's memory does not grow with the run. A sampler that Ray restarted
    (a new ``started_ns``) has a new ring and a new record sequence: its cursors start over,
    the restart is counted and ``on_restart`` is called (a replay re-aligns the new actor). A
    call that times out (a loaded machine) is counted as slow; a sampler whose actor is gone
    is named in ``unreachable``.
    """

    def __init__(
        self,
        writer: RunWriter,
        placed: list[PlacedSampler],
        interval_s: float = 2.0,
        on_restart=None,
    ) -> None:
        self.writer, self.placed = writer, placed
        self.interval_s = interval_s
        self.on_restart = on_restart
        self.cursors = {p.gpu_uuid: 0 for p in placed}
        self.rec_cursors = {p.gpu_uuid: 0 for p in placed}
        self.ev_cursors = {p.gpu_uuid: 0 for p in placed}
        self.events_lost = 0
        self.started = {p.gpu_uuid: p.info.started_ns for p in placed}
        self.samples_lost = 0
        self.records_lost = 0  # joined records a sampler no longer kept when asked
        self.restarts: Counter[str] = Counter()  # sampler name -> restarts seen
        self.unreachable: set[str] = set()  # the samplers whose actor is gone (names)
        self.calls_failed = 0
        self.calls_slow = 0
        self.errors: Counter[str] = Counter()  # drain passes that failed, by exception
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepmem-store", daemon=True)
        self._thread.start()

    def drain(self, flush_steps: bool = False) -> None:
        with self._lock:
            for p in self.placed:
                self._drain_one(p, flush_steps)
            self.writer.flush()

    def _drain_one(self, p: PlacedSampler, flush_steps: bool) -> None:
        uuid = p.gpu_uuid
        try:
            d = ray.get(p.handle.samples_since.remote(self.cursors[uuid]), timeout=30)
            if d.get("started_ns") != self.started[uuid]:
                self._restarted(p, d.get("started_ns"))
                d = ray.get(p.handle.samples_since.remote(0), timeout=30)
            r = ray.get(
                p.handle.records_since.remote(self.rec_cursors[uuid], flush_steps), timeout=30
            )
            e = ray.get(p.handle.events_since.remote(self.ev_cursors[uuid]), timeout=30)
        except ray.exceptions.GetTimeoutError:  # alive but slow (a loaded machine): next time
            self.calls_slow += 1
            return
        except Exception as exc:  # a dead sampler leaves a gap; training goes on
            self.lost(p.name)
            log.warning("run store: sampler %s unreachable: %s", p.name, first_line(exc))
            return
        self.writer.add_samples(uuid, d["t_ns"], d["used"], d["reserved"])
        self.cursors[uuid] = d["next"]
        self.samples_lost += d["lost"]
        self.writer.add_records(r["records"])
        self.rec_cursors[uuid] = r["next"]
        self.records_lost += r["lost"]
        self.writer.add_events(e["events"])
        self.ev_cursors[uuid] = e["next"]
        self.events_lost += e["lost"]

    def _restarted(self, p: PlacedSampler, started_ns: int | None) -> None:
        """Ray restarted the sampler: a new ring and a new record sequence."""
        self.started[p.gpu_uuid] = started_ns
        self.cursors[p.gpu_uuid] = self.rec_cursors[p.gpu_uuid] = self.ev_cursors[p.gpu_uuid] = 0
        self.restarts[p.name] += 1
        log.warning("run store: sampler %s was restarted; its steps in flight are lost", p.name)
        if self.on_restart is not None:
            self.on_restart(p)

    def lost(self, name: str) -> None:
        """A call to sampler ``name`` failed: counted, and the sampler named once."""
        self.unreachable.add(name)
        self.calls_failed += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.drain()
            except Exception as exc:  # never let the store's thread die: count, go on
                self.errors[type(exc).__name__] += 1
                log.exception("run store: a drain failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def problems(drainer: Drainer, writer: RunWriter, samplers: int) -> list[str]:
    """Why a run that ended is not completely recorded (empty: it is): what the store could
    not write, samplers lost or restarted, records no longer kept when drained."""
    out = []
    if writer.write_errors:
        parts = ", ".join(f"{n} {k}" for k, n in sorted(writer.write_errors.items()))
        out.append(f"the run store could not write {parts} ({writer.first_error})")
    if drainer.unreachable:
        out.append(
            f"{len(drainer.unreachable)} of {samplers} samplers could not be reached "
            f"({', '.join(sorted(drainer.unreachable))}): their steps stop where the last "
            "drain found them"
        )
    if drainer.restarts:
        out.append(
            f"{sum(drainer.restarts.values())} sampler restart(s) ({', '.join(drainer.restarts)}):"
            " the steps in flight then were lost (the report marks them, by the probe's count), "
            "and a step that began before its new sampler started is flagged sampler_started"
        )
    if drainer.records_lost:
        out.append(f"{drainer.records_lost} step records were no longer kept when drained")
    if drainer.events_lost:
        out.append(f"{drainer.events_lost} probe events were no longer kept when drained")
    if drainer.samples_lost:
        out.append(f"{drainer.samples_lost} NVML samples were overwritten before being stored")
    if drainer.errors:
        out.append(f"store drains failed: {dict(drainer.errors)}")
    return out
