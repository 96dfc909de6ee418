"""The step join: a step's begin, phase and end events (from the probe) joined with the NVML
samples of its window (from the sampler's ring) into a
:class:`~collector.model.step.StepRecord`, on the sampler actor's join thread.

A step's figures are read from the ring once its window is covered (a sample after its end
mark), so a record is final when it is made; :class:`StepJoiner` keeps the newest
:data:`RECORDS_KEPT` for the run store's drain and the newest of each process for ``/metrics``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import numpy as np

from collector.model.kinds import Gap, Phase
from collector.model.records import ERROR_PREFIX, Stat, StepEvent
from collector.model.step import PhaseReading, ProcessesReading, StepRecord
from collector.sampler import RingBuffer, Sampler, SampleWindow

__all__ = ["FIRST_PHASE", "RECORDS_KEPT", "StepJoiner"]

FIRST_PHASE = Phase.FORWARD_BACKWARD
RECORDS_KEPT = 20_000
MAX_OPEN = 4096  # processes with a step open at once on one GPU
MAX_PHASES = 256  # phase marks kept per step
MAX_FUTURE_NS = 3600 * 1_000_000_000  # an event stamped further ahead than this is refused
MAX_SCRAPED = 256  # processes whose newest step /metrics shows (the most recent ones)
UNDERSAMPLED_SHARE = 0.5  # a step with fewer samples than this share of its rate's is flagged
UNDERSAMPLED_MIN = 4  # … when its rate promised at least this many
HOLE_PERIODS = 5  # two samples of a step this many sampling periods apart flag a ``hole`` …
HOLE_MIN_NS = 5_000_000  # … and at least this far apart


def _step_peak(key: str, marks: list[StepEvent], end: StepEvent) -> int | None:
    values = [m.torch[key] for m in (*marks, end) if key in m.torch]
    return max(values) if values else None


def _error_of(end: StepEvent) -> str:
    """The exception a failed step raised, from its end event (``""`` for a step that ended)."""
    return end.phase.removeprefix(ERROR_PREFIX) if end.phase.startswith(ERROR_PREFIX) else ""


def _reading_at_mark(ring: RingBuffer, t_ns: int, window_ns: int) -> tuple[int, int, int] | None:
    """The device at a step mark: the lower of the last sample at or before the mark and the
    first one after it, when that came within ``window_ns`` (the sampler's mark window). Memory
    released just before the mark shows only in the sample after it; memory allocated just
    after the mark belongs to what follows it (at a step's end: the next step)."""
    before = ring.value_at(t_ns)
    after = ring.value_after(t_ns)
    if after is not None and after[0] - t_ns > window_ns:
        after = None
    if before is None or after is None:
        return before or after
    return after if after[1] < before[1] else before


class StepJoiner:
    """Pairs step events into windows and joins them with a sampler's ring into StepRecords.

    A step is keyed by (pid, seq): the training process and the probe's own sequence number, so
    steps whose caller numbers repeat (a new epoch) and steps of several processes sharing the
    GPU (ranks) never merge. Events written before ``seq`` existed (``seq`` 0) are numbered here
    in the order their steps begin.

    A step is joined once the sampler has a sample at or after its end (so the window is
    complete); until then it waits in ``pending``. Events that cannot be paired (an ``end``
    without a ``begin``) are counted in ``rejected``. What the joiner holds is bounded: a
    process has at most one open step (a new ``begin`` abandons the one before, counted as
    ``unended``), at most :data:`MAX_OPEN` processes have one (the oldest is dropped,
    ``open_dropped``), a step keeps at most :data:`MAX_PHASES` phase marks
    (``phases_dropped``), and an event stamped more than :data:`MAX_FUTURE_NS` ahead of this
    node's clock is refused (``future_timestamp``: it would wait for a sample for ever).
    """

    def __init__(
        self,
        sampler: Sampler,
        processes: Callable[[StepRecord], ProcessesReading | None] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.sampler = sampler
        # CPU processes stand in for this replayed GPU (``stepmem run --backend replay
        # --command``): their steps get no NVML figure (gap ``stand_in``)
        self.stand_in = False
        # per-process readings for the records of one poll (the join thread, never the sampler's)
        self._processes = processes
        self._clock = clock
        # The newest RECORDS_KEPT records (≈ 1.5 kB each); the run store drains them long before.
        self.records: deque[StepRecord] = deque(maxlen=RECORDS_KEPT)
        self.joined = 0  # records ever joined: record i (0-based) is the i-th joined
        self.rejected: Counter[str] = Counter()
        # pid -> (seq, begin, phase marks) of the step it has open
        self._open: dict[int, tuple[int, StepEvent, list[StepEvent]]] = {}
        self._legacy_seq: Counter[int] = Counter()  # steps numbered here for seq-less events
        self._newest: dict[int, StepRecord] = {}  # pid → its newest record (the scrape's)
        self._pending: list[tuple[StepEvent, StepEvent, list[StepEvent]]] = []
        self._lock = threading.Lock()  # events in, pending out
        # One poll at a time, and ``records`` read under it: the join thread polls while Ray
        # calls read, and a record must never land behind a newer step a reader already saw.
        self._records_lock = threading.Lock()

    def add(self, ev: StepEvent) -> None:
        if ev.t_ns > self._clock() + MAX_FUTURE_NS:
            self.rejected["future_timestamp"] += 1
            return
        with self._lock:
            if ev.kind == "begin":
                self._begin(ev)
                return
            opened = self._open.get(ev.pid)
            if opened is None or not self._same_step(opened, ev):
                self.rejected[f"{ev.kind}_without_begin"] += 1
                return
            if ev.kind == "phase":
                if len(opened[2]) >= MAX_PHASES:
                    self.rejected["phases_dropped"] += 1
                else:
                    opened[2].append(ev)
                return
            del self._open[ev.pid]
            if ev.t_ns < opened[1].t_ns:
                self.rejected["end_before_begin"] += 1
                return
            self._pending.append((opened[1], ev, opened[2]))

    def _begin(self, ev: StepEvent) -> None:
        if not ev.seq:  # written before seq existed: number it in begin order
            self._legacy_seq[ev.pid] += 1
            ev.seq = self._legacy_seq[ev.pid]
        if ev.pid in self._open:
            self.rejected["unended"] += 1
        elif len(self._open) >= MAX_OPEN:
            oldest = min(self._open, key=lambda pid: self._open[pid][1].t_ns)
            del self._open[oldest]
            self.rejected["open_dropped"] += 1
        self._open[ev.pid] = (ev.seq, ev, [])

    @staticmethod
    def _same_step(opened: tuple[int, StepEvent, list[StepEvent]], ev: StepEvent) -> bool:
        """Whether ``ev`` (a phase or end) belongs to the open step: same seq, or for a
        seq-less event the same caller step number."""
        if ev.seq:
            return ev.seq == opened[0]
        if ev.step == opened[1].step:
            ev.seq = opened[0]
            return True
        return False

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def open_steps(self) -> int:
        return len(self._open)

    def poll(self, force: bool = False) -> list[StepRecord]:
        """Join every pending step whose window the sampler has covered; ``force`` joins all."""
        with self._records_lock:
            last = self.sampler.ring.last()
            newest = last[0] if last else 0
            with self._lock:
                ready, waiting = [], []
                for p in self._pending:
                    (ready if force or p[1].t_ns < newest else waiting).append(p)
                self._pending = waiting
            out = [self.join(b, e, ph) for b, e, ph in ready]
            if self._processes is not None and not self.stand_in:
                for rec in out:  # a reading for each step's end (live: now, shared by the poll)
                    rec.processes = self._processes(rec)
            self.records.extend(out)
            self.joined += len(out)
            for rec in out:
                self._newest.pop(rec.pid, None)  # re-inserted last: the dict stays time-ordered
                self._newest[rec.pid] = rec
            while len(self._newest) > MAX_SCRAPED:
                del self._newest[next(iter(self._newest))]
        return out

    def records_since(self, cursor: int) -> tuple[list[StepRecord], int, int]:
        """The records joined from the ``cursor``-th on (0: the first ever), the cursor to pass
        next, and how many of those asked for are no longer kept (the oldest beyond
        :data:`RECORDS_KEPT`). Safe while the join thread polls."""
        with self._records_lock:
            first = self.joined - len(self.records)  # the index of the oldest one kept
            start = max(cursor, first)
            recs = list(itertools.islice(self.records, start - first, None))
            return recs, self.joined, max(0, first - cursor)

    def newest(self) -> StepRecord | None:
        with self._records_lock:
            return self.records[-1] if self.records else None

    def newest_by_process(self) -> list[StepRecord]:
        """The newest record of each process (rank) on this GPU, at most :data:`MAX_SCRAPED`,
        oldest first."""
        with self._records_lock:
            return list(self._newest.values())

    def _gap(self, begin: StepEvent, end: StepEvent, w: SampleWindow) -> str:
        """Why this step's window may not show everything (see :class:`StepRecord`): one
        reason, or two ("undersampled stale_end")."""
        ring, sampler = self.sampler.ring, self.sampler
        oldest = ring.oldest_t_ns()
        if len(w) == 0:
            return Gap.NO_SAMPLES
        flags = []
        if sampler.started_ns > begin.t_ns:
            flags.append(Gap.SAMPLER_STARTED)
        elif ring.count > ring.capacity and oldest is not None and oldest > begin.t_ns:
            flags.append(Gap.OVERRUN)
        else:
            edges = np.concatenate(([begin.t_ns], w.t_ns, [end.t_ns]))
            widest = int(np.diff(edges).max())
            if widest > sampler.gap_threshold_ns:
                flags.append(Gap.STALL)
            elif widest > max(HOLE_PERIODS * sampler.resolution_ns, HOLE_MIN_NS):
                # a hole of a few periods: a transient inside it is not seen, even in a step
                # that got most of its samples
                flags.append(Gap.HOLE)
        period = sampler.resolution_ns  # a replay: the capture's own period when coarser
        expected = (end.t_ns - begin.t_ns) / period if period else 0
        if expected >= UNDERSAMPLED_MIN and len(w) < UNDERSAMPLED_SHARE * expected:
            flags.append(Gap.UNDERSAMPLED)  # a starved sampler: a short transient may be missed
        before = ring.value_at(end.t_ns)
        after = ring.value_after(end.t_ns)
        window = sampler.mark_window_ns
        late = after is not None and after[0] - end.t_ns > window
        if late or (after is None and (before is None or end.t_ns - before[0] > window)):
            # The first sample after the end mark came late (a starved sampler): the reading
            # rests on a sample before the mark, which cannot show memory released between it
            # and the mark; or no sample near the mark at all.
            flags.append(Gap.STALE_END)
        return " ".join(flags)

    def _window(self, t0: int, t1: int) -> SampleWindow:
        """The samples between two marks; none for CPU stand-ins (a capture beside them: none
        of its samples are theirs)."""
        w = self.sampler.ring.window(t0, t1)
        return SampleWindow(w.t_ns[:0], w.used[:0], w.reserved[:0]) if self.stand_in else w

    def join(self, begin: StepEvent, end: StepEvent, phases: list[StepEvent]) -> StepRecord:
        ring, sampler = self.sampler.ring, self.sampler
        w = self._window(begin.t_ns, end.t_ns)
        gap = Gap.STAND_IN if self.stand_in else self._gap(begin, end, w)
        at_end = _reading_at_mark(ring, end.t_ns, sampler.mark_window_ns)
        at_begin = _reading_at_mark(ring, begin.t_ns, sampler.mark_window_ns)
        # A step without samples has no NVML figures (None, never 0 bytes), its end reading
        # included: a sample taken after a step the sampler never saw says nothing about it.
        peak = peak_t = low = None
        if not len(w):
            at_end = at_begin = None
        else:
            k = int(np.argmax(w.used))
            peak, peak_t, low = int(w.used[k]), int(w.t_ns[k]), int(w.used.min())
        return StepRecord(
            gpu_uuid=begin.gpu_uuid,
            step=begin.step,
            begin_ns=begin.t_ns,
            end_ns=end.t_ns,
            samples=len(w),
            nvml_peak_bytes=peak,
            nvml_peak_t_ns=peak_t,
            nvml_min_bytes=low,
            nvml_end_bytes=at_end[1] if at_end else None,
            nvml_begin_bytes=at_begin[1] if at_begin else None,
            nvml_reserved_bytes=at_end[2] if at_end else None,
            gap=gap,
            torch_allocated_peak_bytes=_step_peak(Stat.ALLOCATED_PEAK, phases, end),
            torch_reserved_peak_bytes=_step_peak(Stat.RESERVED_PEAK, phases, end),
            torch_begin=dict(begin.torch),
            torch_end=dict(end.torch),
            phases=self._phases(begin, end, phases),
            ledger=dict(end.ledger),
            error=_error_of(end),
            seq=begin.seq,
            pid=begin.pid or int(begin.torch.get(Stat.PROCESS_PID, 0)),
            rank=begin.rank,
            world_size=begin.world_size,
            estimate_peak_bytes=end.estimate_peak,
        )

    def _phases(
        self, begin: StepEvent, end: StepEvent, marks: list[StepEvent]
    ) -> list[PhaseReading]:
        """Per-phase peaks. The segment before the first mark is ``first_phase`` (named by the
        begin event's ``phase``, default ``forward_backward``); each mark starts the phase it names
        and carries the allocator peaks of the segment it closes."""
        if not marks:
            return []
        starts = [(begin, begin.phase or FIRST_PHASE), *((m, m.phase) for m in marks)]
        closers = [*marks, end]
        ring, gap = self.sampler.ring, self.sampler.mark_window_ns
        out = []
        for (opener, name), closer in zip(starts, closers, strict=True):
            w = self._window(opener.t_ns, closer.t_ns)
            k = int(np.argmax(w.used)) if len(w) else None
            at = _reading_at_mark(ring, opener.t_ns, gap) if len(w) else None
            out.append(
                PhaseReading(
                    phase=name,
                    begin_ns=opener.t_ns,
                    end_ns=closer.t_ns,
                    nvml_peak_bytes=None if k is None else int(w.used[k]),
                    nvml_peak_t_ns=None if k is None else int(w.t_ns[k]),
                    # the device and torch's reserved pool at the mark that opens the phase
                    nvml_begin_bytes=at[1] if at else None,
                    torch_reserved_begin_bytes=opener.torch.get(Stat.RESERVED),
                    torch_allocated_peak_bytes=closer.torch.get(Stat.ALLOCATED_PEAK, 0),
                    torch_reserved_peak_bytes=closer.torch.get(Stat.RESERVED_PEAK, 0),
                )
            )
        return out
