"""A sampler without its thread, and the step join over samples a test chooses."""

from __future__ import annotations

from collector.join import StepJoiner
from collector.model.records import StepEvent
from collector.nvml import NvmlGpuLost, NvmlNotSupported
from collector.sampler import Sampler

MS = 1_000_000


class CountingDevice:
    uuid = "GPU-test"

    def __init__(self, fail_every: int = 0, fail_with=NvmlNotSupported, lose_after: int = 0):
        self.n = 0
        self.fail_every, self.fail_with, self.lose_after = fail_every, fail_with, lose_after

    def read(self):
        self.n += 1
        if self.lose_after and self.n > self.lose_after:
            raise NvmlGpuLost("GPU is lost")
        if self.fail_every and self.n % self.fail_every == 0:
            raise self.fail_with("injected")
        return self.n, 0


def joiner_with(samples, capacity=1024, started_ns=1):
    """A StepJoiner over a sampler whose ring holds ``samples`` [(t_ns, used)] (no thread)."""
    s = Sampler(CountingDevice(), rate=1000, capacity=capacity)
    s.started_ns = started_ns
    for t, used in samples:
        s.ring.append(t, used, 100)
    return StepJoiner(s)


def ev(kind, step, t, phase="", **torch):
    return StepEvent(kind=kind, step=step, t_ns=t, gpu_uuid="GPU-test", phase=phase, torch=torch)
