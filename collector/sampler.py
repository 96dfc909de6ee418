"""The sampling thread, its ring buffer and window queries (the step join that reads them is
:mod:`collector.join`).

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
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from collector.model.settings import DEFAULT_CAPACITY, DEFAULT_RATE, Rate
from collector.nvml import NvmlError, NvmlGpuLost

__all__ = ["RingBuffer", "SampleWindow", "Sampler"]

log = logging.getLogger(__name__)

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
