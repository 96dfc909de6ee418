"""The sampling thread, its ring buffer, window queries and the step join.

Buffer behaviour
    :class:`RingBuffer` preallocates three int64 columns (timestamp, used, reserved): **24 bytes a
    sample**, fixed at construction. The default capacity, 2**20 samples, is 24 MiB and holds
    17.5 minutes at 1 kHz (10.5 s at the ≈100 kHz of ``max``). When full, the oldest samples are
    overwritten; anything that must keep every sample (the run store) drains it with
    :meth:`RingBuffer.since` faster than it wraps, and that call reports what it lost.

Concurrency
    One writer (the sampling thread), any number of readers, no lock on the write path. The
    writer fills a slot and then publishes it by advancing ``count`` (an int assignment, atomic
    under the GIL). A reader takes ``count`` first, copies, then takes ``count`` again and drops
    whatever the writer may have overwritten meanwhile — the sequence-lock pattern.

Latency impact
    The sampling thread holds the GIL for the NVML call wrapper and three array stores (≈1 µs
    beyond the NVML call itself). At 1 kHz that is ≈1-2 % of one core; at ``max`` it takes what
    NVML gives.
"""

from __future__ import annotations

import array
import bisect
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from collector.nvml import NvmlError, NvmlGpuLost
from collector.records import ERROR_PREFIX, Stat, StepEvent, StepRecord
from collector.settings import DEFAULT_CAPACITY, DEFAULT_RATE, Rate

__all__ = [
    "DEFAULT_CAPACITY",
    "RingBuffer",
    "SampleWindow",
    "Sampler",
    "StepJoiner",
]

log = logging.getLogger(__name__)

FIRST_PHASE = "forward_backward"
RECORDS_KEPT = 20_000
MAX_OPEN = 4096  # processes with a step open at once on one GPU
MAX_PHASES = 256  # phase marks kept per step
MAX_FUTURE_NS = 3600 * 1_000_000_000  # an event stamped further ahead than this is refused
MAX_SCRAPED = 256  # processes whose newest step /metrics shows (the most recent ones)
UNDERSAMPLED_SHARE = 0.5  # a step with fewer samples than this share of its rate's is flagged
UNDERSAMPLED_MIN = 4  # … when its rate promised at least this many
_NS = 1_000_000_000
MAX_SLEEP_NS = 50_000_000
# Ray starts its worker processes at nice 15 (``RAY_worker_niceness``): on a machine whose other
# processes run at the usual 0 and keep every core busy, a thread at 15 gets a few per cent of a
# core and the sampler misses most of its deadlines. The sampling thread alone (a few per cent
# of one core at 1 kHz) asks for an ordinary process's niceness; where that is not permitted
# (lowering niceness needs CAP_SYS_NICE or RLIMIT_NICE) it keeps Ray's, and health says which.
SAMPLER_NICENESS = 0


class Device(Protocol):
    """What the sampler needs from a backend device (live NVML or replay)."""

    uuid: str

    def read(self) -> tuple[int, int]: ...


@dataclass
class SampleWindow:
    """Samples copied out of the ring: parallel int64 arrays, oldest first."""

    t_ns: np.ndarray
    used: np.ndarray
    reserved: np.ndarray
    lost: int = 0  # samples that were overwritten before this read could copy them

    def __len__(self) -> int:
        return len(self.t_ns)


class RingBuffer:
    """Fixed-size ring of (t_ns, used, reserved) samples. See the module docstring."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 2:
            raise ValueError(f"ring capacity must be >= 2, got {capacity}")
        self.capacity = capacity
        # array.array stores are ~3x cheaper than numpy scalar stores; numpy views share memory.
        self._t = array.array("q", bytes(8 * capacity))
        self._u = array.array("q", bytes(8 * capacity))
        self._r = array.array("q", bytes(8 * capacity))
        self._tv = np.frombuffer(self._t, dtype=np.int64)
        self._uv = np.frombuffer(self._u, dtype=np.int64)
        self._rv = np.frombuffer(self._r, dtype=np.int64)
        self.count = 0  # samples ever written; the next one goes to count % capacity

    @property
    def nbytes(self) -> int:
        return 24 * self.capacity

    def append(self, t_ns: int, used: int, reserved: int) -> None:
        i = self.count % self.capacity
        self._t[i] = t_ns
        self._u[i] = used
        self._r[i] = reserved
        self.count += 1

    def __len__(self) -> int:
        return min(self.count, self.capacity)

    def last(self) -> tuple[int, int, int] | None:
        n = self.count
        if n == 0:
            return None
        i = (n - 1) % self.capacity
        return int(self._t[i]), int(self._u[i]), int(self._r[i])

    def _copy(self, start: int, stop: int) -> SampleWindow:
        """Copy samples with sequence numbers in [start, stop), dropping overwritten ones."""
        cap = self.capacity
        lost = 0
        if start < stop - cap:
            lost = stop - cap - start
            start = stop - cap
        if start >= stop:
            return SampleWindow(*(np.empty(0, np.int64) for _ in range(3)), lost=lost)
        a, b = start % cap, stop % cap
        if a < b or b == 0:
            end = cap if b == 0 else b
            cols = [v[a:end].copy() for v in (self._tv, self._uv, self._rv)]
        else:
            cols = [np.concatenate((v[a:], v[:b])) for v in (self._tv, self._uv, self._rv)]
        after = self.count
        overwritten = after - cap - start
        if overwritten > 0:  # the writer lapped the reader during the copy
            cols = [c[overwritten:] for c in cols]
            lost += overwritten
        return SampleWindow(*cols, lost=lost)

    def since(self, seq: int) -> tuple[SampleWindow, int]:
        """Every sample written from sequence number ``seq`` on, and the sequence to pass next."""
        stop = self.count
        return self._copy(seq, stop), stop

    def snapshot(self) -> SampleWindow:
        """Every sample still held, oldest first."""
        stop = self.count
        return self._copy(max(0, stop - self.capacity), stop)

    def _seq_of(self, t_ns: int, side: str) -> tuple[int, int]:
        """Binary search over held sequence numbers by timestamp (timestamps never decrease).

        Returns (seq, first held seq): the first seq whose t_ns is >= (``left``) or > (``right``)
        ``t_ns``. No copy is made.
        """
        stop = self.count
        first = max(0, stop - self.capacity)
        tv, cap = self._tv, self.capacity
        finder = bisect.bisect_left if side == "left" else bisect.bisect_right
        return finder(range(first, stop), t_ns, key=lambda s: int(tv[s % cap])) + first, first

    def oldest_t_ns(self) -> int | None:
        """Timestamp of the oldest sample still held."""
        if self.count == 0:
            return None
        return int(self._tv[max(0, self.count - self.capacity) % self.capacity])

    def window(self, begin_ns: int, end_ns: int) -> SampleWindow:
        """Samples with ``begin_ns <= t_ns <= end_ns`` (copies only those)."""
        lo, _ = self._seq_of(begin_ns, "left")
        hi, _ = self._seq_of(end_ns, "right")
        w = self._copy(lo, max(lo, hi))
        w.lost = 0
        return w

    def value_after(self, t_ns: int) -> tuple[int, int, int] | None:
        """The first sample at or after ``t_ns``, or None."""
        seq, _ = self._seq_of(t_ns, "left")
        if seq >= self.count:
            return None
        i = seq % self.capacity
        return int(self._tv[i]), int(self._uv[i]), int(self._rv[i])

    def value_at(self, t_ns: int) -> tuple[int, int, int] | None:
        """The last sample at or before ``t_ns`` (the value in force then), or None."""
        seq, first = self._seq_of(t_ns, "right")
        if seq - 1 < first:
            return None
        i = (seq - 1) % self.capacity
        return int(self._tv[i]), int(self._uv[i]), int(self._rv[i])


class Sampler:
    """A dedicated thread reading one device into a :class:`RingBuffer`.

    The loop keeps its schedule: the k-th deadline is ``start + k * period`` on the monotonic
    clock, the thread sleeps the remainder, and a deadline already missed by more than a period is
    skipped (counted in ``missed``) rather than made up in a burst. Each sample carries the
    ``time.monotonic_ns()`` taken right after NVML answered — the rate is measured, not assumed.

    Errors are counted by kind and the loop goes on; a lost GPU stops the loop (``stopped_by``).
    """

    def __init__(
        self,
        device: Device,
        rate: Rate | str | float = DEFAULT_RATE,
        capacity: int = DEFAULT_CAPACITY,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.device = device
        self.rate = Rate.of(rate)
        self.ring = RingBuffer(capacity)
        self.errors: Counter[str] = Counter()
        self.missed = 0
        self.started_ns = 0
        self.stopped_by = ""
        self._clock = clock
        self._running = False
        self._thread: threading.Thread | None = None
        self._last_error_log = 0
        self.niceness: int | None = None  # the sampling thread's, once it runs

    @property
    def rate_hz(self) -> float:
        """The target rate in Hz (0: max), as exported and stored."""
        return self.rate.hz

    @property
    def period_ns(self) -> int:
        return self.rate.period_ns

    @property
    def resolution_ns(self) -> int:
        """How finely the trace resolves time: the sampling period, or a replayed capture's own
        period (a 100 Hz capture replayed at 1 kHz still changes only every 10 ms)."""
        return max(self.period_ns, int(getattr(self.device, "resolution_ns", 0) or 0))

    @property
    def mark_window_ns(self) -> int:
        """A sample taken this soon after a step mark still shows the device at the mark (a
        release just before it); a later one may show what followed the mark."""
        return max(2 * self.resolution_ns, 2_000_000)

    @property
    def gap_threshold_ns(self) -> int:
        """Two samples further apart than this mark a ``stall`` in a step window."""
        return max(20 * self.resolution_ns, 20_000_000)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("sampler already started")
        self.started_ns = self._clock()
        self._running = True
        self._thread = threading.Thread(
            target=self._run, name=f"stepmem-sampler-{self.device.uuid}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout)

    def thread_cpu_s(self) -> float:
        """CPU seconds the sampling thread has used (Linux: the thread's own CPU clock)."""
        if self._thread is None or self._thread.ident is None or not self._thread.is_alive():
            return 0.0
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _record_error(self, err: NvmlError) -> None:
        self.errors[err.kind] += 1
        now = time.monotonic()
        if now - self._last_error_log > 10:  # say it, but not 1000 times a second
            self._last_error_log = now
            log.warning(
                "sampler %s: %s (%d %s errors so far)",
                self.device.uuid,
                err,
                self.errors[err.kind],
                err.kind,
            )

    def _take_priority(self) -> None:
        """Give the sampling thread :data:`SAMPLER_NICENESS` when its process runs nicer (a
        Ray worker) and the system permits; note the niceness it runs at."""
        import os

        tid = threading.get_native_id()
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > SAMPLER_NICENESS:
                os.setpriority(os.PRIO_PROCESS, tid, SAMPLER_NICENESS)
        except OSError:  # not permitted: Ray's niceness stays, and is said in health
            pass
        try:
            self.niceness = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError:
            self.niceness = None

    def _run(self) -> None:
        self._take_priority()
        append, clock = self.ring.append, self._clock
        sample_at = getattr(self.device, "sample_at", None)
        if sample_at is None:  # live NVML: stamped when the reading arrived

            def sample() -> None:
                used, reserved = self.device.read()
                append(clock(), used, reserved)
        else:  # a replay keeps each captured sample once, at the time it was captured
            last = [-1, 0]  # the captured sample last kept, its stamp

            def sample() -> None:
                key, stamp, used, reserved = sample_at(clock())
                if key != last[0]:
                    stamp = max(stamp, last[1] + 1)  # timestamps never go back
                    append(stamp, used, reserved)
                    last[0], last[1] = key, stamp

        period = self.period_ns
        sleep, max_sleep = time.sleep, MAX_SLEEP_NS
        deadline = clock()
        while self._running:
            try:
                sample()
            except NvmlGpuLost as err:
                self._record_error(err)
                self.stopped_by = err.kind
                return
            except NvmlError as err:
                if err.kind != "held":  # a replay waiting to be aligned: nothing to read yet
                    self._record_error(err)
            except Exception as err:  # a bug in a backend must not kill sampling silently
                self.errors["internal"] += 1
                log.exception("sampler %s: unexpected error: %s", self.device.uuid, err)
            if period:
                deadline += period
                now = clock()
                if now >= deadline:
                    late = (now - deadline) // period
                    if late:
                        self.missed += late
                        deadline += late * period
                    continue
                # time.sleep is one clock_nanosleep; Event.wait costs a lock and a condition
                # more per wake. Long periods sleep in slices so stop() is never slow.
                while self._running and now < deadline:
                    sleep(min(deadline - now, max_sleep) / _NS)
                    now = clock()

    def mean_rate_hz(self) -> float:
        """Samples per second since the sampler started (0 before the second sample)."""
        last = self.ring.last()
        if last is None or self.ring.count < 2 or last[0] <= self.started_ns:
            return 0.0
        return (self.ring.count - 1) * _NS / float(last[0] - self.started_ns)

    def achieved_rate_hz(self, over_s: float = 5.0) -> float:
        """Samples per second over the last ``over_s`` seconds (or since start, if shorter)."""
        snap_last = self.ring.last()
        if snap_last is None:
            return 0.0
        now = snap_last[0]
        w = self.ring.window(now - int(over_s * _NS), now)
        if len(w) < 2:
            return 0.0
        return (len(w) - 1) * _NS / float(w.t_ns[-1] - w.t_ns[0])


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
        processes: Callable[[StepRecord], dict[str, Any] | None] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.sampler = sampler
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
            if self._processes is not None:
                for rec in out:  # a reading for each step's end (live: now, shared by the poll)
                    rec.processes = self._processes(rec) or {}
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
            return "no_samples"
        flags = []
        if sampler.started_ns > begin.t_ns:
            flags.append("sampler_started")
        elif ring.count > ring.capacity and oldest is not None and oldest > begin.t_ns:
            flags.append("overrun")
        else:
            edges = np.concatenate(([begin.t_ns], w.t_ns, [end.t_ns]))
            if int(np.diff(edges).max()) > sampler.gap_threshold_ns:
                flags.append("stall")
        period = sampler.resolution_ns  # a replay: the capture's own period when coarser
        expected = (end.t_ns - begin.t_ns) / period if period else 0
        if expected >= UNDERSAMPLED_MIN and len(w) < UNDERSAMPLED_SHARE * expected:
            flags.append("undersampled")  # a starved sampler: a short transient may be missed
        before = ring.value_at(end.t_ns)
        after = ring.value_after(end.t_ns)
        window = sampler.mark_window_ns
        late = after is not None and after[0] - end.t_ns > window
        if late or (after is None and (before is None or end.t_ns - before[0] > window)):
            # The first sample after the end mark came late (a starved sampler): the reading
            # rests on a sample before the mark, which cannot show memory released between it
            # and the mark; or no sample near the mark at all.
            flags.append("stale_end")
        return " ".join(flags)

    def join(self, begin: StepEvent, end: StepEvent, phases: list[StepEvent]) -> StepRecord:
        ring, sampler = self.sampler.ring, self.sampler
        w = ring.window(begin.t_ns, end.t_ns)
        gap = self._gap(begin, end, w)
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
        )

    def _phases(self, begin: StepEvent, end: StepEvent, marks: list[StepEvent]) -> list[dict]:
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
            w = ring.window(opener.t_ns, closer.t_ns)
            k = int(np.argmax(w.used)) if len(w) else None
            at = _reading_at_mark(ring, opener.t_ns, gap) if len(w) else None
            out.append(
                {
                    "phase": name,
                    "begin_ns": opener.t_ns,
                    "end_ns": closer.t_ns,
                    "nvml_peak_bytes": None if k is None else int(w.used[k]),
                    "nvml_peak_t_ns": None if k is None else int(w.t_ns[k]),
                    # the device and torch's reserved pool at the mark that opens the phase
                    "nvml_begin_bytes": at[1] if at else None,
                    "torch_reserved_begin_bytes": opener.torch.get(Stat.RESERVED),
                    "torch_allocated_peak_bytes": closer.torch.get(Stat.ALLOCATED_PEAK, 0),
                    "torch_reserved_peak_bytes": closer.torch.get(Stat.RESERVED_PEAK, 0),
                }
            )
        return out
