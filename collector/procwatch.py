"""Per-process memory for the step ends of a live GPU.

The training side's step events reach the sampler in batches, so a per-process reading taken
when a step is joined can come hundreds of ms after its end (measured on the H200: up to
561 ms for 100 ms steps), when the next steps have allocated. Instead a :class:`ProcessWatch`
keeps readings taken as device memory moves: on a thread of its own (never the sampling loop)
it looks at the sampler's newest sample every :data:`POLL_S` and reads NVML's per-process
memory when the device's used memory has moved by more than :data:`MOVE_BYTES` since the last
reading, and at least every :data:`HEARTBEAT_S`. A reading stays true until the device moves
again, so a step's end gets the latest reading before its end mark or the first after it,
whichever saw the device's used memory closest to the step's end reading.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque
from typing import TYPE_CHECKING

from collector.model.records import ProcessMemory
from collector.model.step import ProcessesReading

if TYPE_CHECKING:
    from collector.backends import Device
    from collector.sampler import Sampler

__all__ = ["HEARTBEAT_S", "MOVE_BYTES", "POLL_S", "ProcessWatch", "as_reading"]

POLL_S = 0.02
MOVE_BYTES = 2 << 20  # one NVML page
HEARTBEAT_S = 1.0
KEEP = 4096  # readings kept (≈ 80 s of constant movement, hours of a steady run)


def as_reading(t_ns: int, used: int, procs: list[ProcessMemory]) -> ProcessesReading:
    """A per-process reading as step records carry it (``StepRecord.processes``)."""
    return ProcessesReading(t_ns=int(t_ns), device_used=int(used), procs=list(procs))


class ProcessWatch:
    """Per-process readings of ``device``, taken when ``sampler`` sees its memory move."""

    def __init__(
        self,
        device: Device,
        sampler: Sampler,
        poll_s: float = POLL_S,
        heartbeat_s: float = HEARTBEAT_S,
        keep: int = KEEP,
    ) -> None:
        self.device, self.sampler = device, sampler
        self.poll_s, self.heartbeat_ns = poll_s, int(heartbeat_s * 1e9)
        self._t: deque[int] = deque(maxlen=keep)
        self._readings: deque[ProcessesReading] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.errors: Counter[str] = Counter()
        self.reads = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stepmem-procs", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> bool:
        """Take a reading if the device moved or the heartbeat is due. True if one was taken."""
        last = self.sampler.ring.last()
        with self._lock:
            prev = self._readings[-1] if self._readings else None
        if last is not None and prev is not None:
            moved = abs(last[1] - (prev.device_used or 0)) > MOVE_BYTES
            if not moved and last[0] - (prev.t_ns or 0) < self.heartbeat_ns:
                return False
        try:
            t, used, procs = self.device.processes_reading(time.monotonic_ns())
        except Exception as exc:  # an NVML error costs the accounting a split, nothing else
            self.errors[type(exc).__name__] += 1
            return False
        reading = as_reading(t, used, procs)
        with self._lock:
            self._t.append(int(t))
            self._readings.append(reading)
        self.reads += 1
        return True

    def latest(self) -> ProcessesReading | None:
        with self._lock:
            return self._readings[-1] if self._readings else None

    def reading_for(self, end_ns: int, end_used: int | None) -> ProcessesReading | None:
        """The reading that describes a step that ended at ``end_ns`` with ``end_used`` bytes
        used: of the latest before the end mark and the first after it, the one whose device
        figure is closest (the one before on a tie or without ``end_used``)."""
        with self._lock:
            i = bisect.bisect_right(self._t, end_ns)
            before = self._readings[i - 1] if i > 0 else None
            after = self._readings[i] if i < len(self._readings) else None
        if before is None or after is None or end_used is None:
            return before or after
        if abs((after.device_used or 0) - end_used) < abs((before.device_used or 0) - end_used):
            return after
        return before
