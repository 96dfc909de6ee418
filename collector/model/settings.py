"""The settings of sampling and export, each written once: the rate (with what "max" means), the
trailing window of the window gauges, the ring's size (:class:`Sampling`), and what every sampler
actor of a run shares (:class:`SamplerOptions`, which nests a :class:`Sampling`). The command
line builds them (:mod:`collector.args`); everything else takes them as they are."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_RATE",
    "DEFAULT_WINDOW_S",
    "JobOptions",
    "Rate",
    "SamplerOptions",
    "Sampling",
]

_NS = 1_000_000_000
MAX_HZ = 1_000_000.0  # above this a rate is a typo; "max" samples back to back
MIN_HZ = 0.1  # below this a rate is a typo (and its period would not fit the clock)
MAX_WINDOW_S = 86_400.0  # the window gauges' trailing window, at most a day
MAX_RATE_GUESS_HZ = 150_000.0  # what "max" reaches at best on an H200 (for sizing buffers)
DEFAULT_CAPACITY = 1 << 20  # ring samples: 24 MiB, 17.5 minutes at 1 kHz
DEFAULT_WINDOW_S = 15.0  # the window max/min gauges' trailing window


@dataclass(frozen=True)
class Rate:
    """A sampling rate: ``hz`` > 0, or 0 for "max" (sample back to back, as fast as NVML
    answers). The only place that knows 0 means max."""

    hz: float

    def __post_init__(self) -> None:
        hz = self.hz
        if not isinstance(hz, int | float) or hz != hz or hz > MAX_HZ or (hz != 0 and hz < MIN_HZ):
            raise ValueError(f"rate must be 0 (max) or in [{MIN_HZ:g}, {MAX_HZ:g}] Hz, got {hz!r}")
        object.__setattr__(self, "hz", float(hz))

    @classmethod
    def parse(cls, value: str | float | Rate) -> Rate:
        """``"max"`` → :data:`Rate.MAX`; a positive number of Hz otherwise. ``ValueError``
        names why in one line."""
        if isinstance(value, Rate):
            return value
        if isinstance(value, str):
            if value.strip().lower() == "max":
                return cls(0.0)
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"rate {value!r} is neither a number of Hz nor 'max'") from None
        if not value > 0 or value != value or value == float("inf"):
            raise ValueError(f"rate must be > 0 Hz (or 'max'), got {value}")
        if value < MIN_HZ:
            raise ValueError(
                f"rate {value:g} Hz is below {MIN_HZ:g} Hz (a sample every "
                f"{1 / MIN_HZ:g} s); within-step peaks need far more"
            )
        if value > MAX_HZ:
            raise ValueError(f"rate {value:g} Hz is above 1 MHz; use 'max' to sample back to back")
        return cls(float(value))

    @classmethod
    def of(cls, value: str | float | Rate) -> Rate:
        """A :class:`Rate` from a Rate, a command-line text (:meth:`parse`) or a number of Hz
        (0: max)."""
        if isinstance(value, Rate):
            return value
        return cls.parse(value) if isinstance(value, str) else cls(value)

    @property
    def is_max(self) -> bool:
        return self.hz == 0.0

    @property
    def period_ns(self) -> int:
        """The sampling period; 0 for max (no sleep between samples)."""
        return 0 if self.is_max else int(_NS / self.hz)

    def samples_in(self, seconds: float) -> int:
        """How many samples ``seconds`` hold at most (max: at the best rate seen on an H200)."""
        return int((MAX_RATE_GUESS_HZ if self.is_max else self.hz) * seconds)

    def __str__(self) -> str:
        return "max rate" if self.is_max else f"{self.hz:g} Hz"


Rate.MAX = Rate(0.0)  # type: ignore[attr-defined]
DEFAULT_RATE = Rate(1000.0)


@dataclass(frozen=True)
class Sampling:
    """How a sampler samples: the rate, the trailing window of the window gauges (seconds), the
    ring's capacity (samples, 24 bytes each)."""

    rate: Rate = field(default=DEFAULT_RATE)
    window_s: float = DEFAULT_WINDOW_S
    capacity: int = DEFAULT_CAPACITY

    def __post_init__(self) -> None:
        object.__setattr__(self, "rate", Rate.of(self.rate))
        if not 0 < self.window_s <= MAX_WINDOW_S:
            raise ValueError(f"window must be in (0, {MAX_WINDOW_S:g}] s, got {self.window_s}")
        if self.capacity < 2:
            raise ValueError(f"ring capacity must be >= 2, got {self.capacity}")


@dataclass
class SamplerOptions:
    """How each sampler actor samples (``sampling``) and exports.

    ``metrics_addr`` None binds ``/metrics`` to the node's own IP address (never all interfaces
    unless ``"0.0.0.0"`` is asked for); ``metrics_port`` 0 lets the OS pick a free port (the
    actor reports it in ``info()`` and the launcher writes it to the ``file_sd`` file); a
    non-zero ``metrics_port`` is a base: the sampler of the GPU with NVML index ``i`` serves on
    ``metrics_port + i`` (fixed ports, for a Kubernetes PodMonitor).
    ``remote_write`` (a :class:`collector.export.remote_write.RemoteWriteConfig`) pushes every
    step record with its step-end timestamp; with ``push_samples`` also the raw NVML trace as
    per-millisecond maxima (``job="stepmem-samples"``). ``ray_metrics`` also sets headline
    gauges through ``ray.util.metrics`` (:mod:`collector.export.ray_metrics`), for a Prometheus
    that already scrapes Ray.
    """

    sampling: Sampling = field(default_factory=Sampling)
    run_id: str = ""
    workload: str = ""
    metrics_addr: str | None = None
    metrics_port: int = 0
    remote_write: Any = None
    push_samples: bool = False
    ray_metrics: bool = False
    targets: str = ""  # the file_sd file that lists this sampler (daemon: emptied by --stop)
    keep_events: bool = False  # keep accepted events for a run store's drain (a run's samplers)
    spool: str = ""  # where probes without Ray leave their events (see collector.probe.outbox)

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port must be 0..65535, got {self.metrics_port}")


@dataclass
class JobOptions:
    """One run. ``sampler`` holds every sampler setting (sampling rate and window, /metrics,
    remote write) and the run's labels: ``sampler.run_id`` (default: time-based) and
    ``sampler.workload`` (default: the workload, the script, or ``replay:<captures>``)."""

    backend: str = "auto"  # auto | nvml | replay
    backend_reason: str = ""  # why this backend, for the banner (default: from ``backend``)
    captures: list[str] = field(default_factory=lambda: ["adamw_8bit"])
    gpus: int | None = None
    speed: float = 1.0
    steps: int | None = None
    workload: str = "finetune"
    workload_args: list[str] = field(default_factory=list)
    ray_address: str | None = None
    targets: Path | None = None  # Prometheus file_sd file kept current while the job runs
    sampler: SamplerOptions = field(default_factory=SamplerOptions)
    store: Path | None = Path("runs")  # run store root; None: no store
    train_workers: int = 0  # >0: run the workload in a Ray Train TorchTrainer with N workers
    script: Path | None = None  # a user's training script (with a probe adapter) instead
    command: bool = False  # workload_args is a command to run (torchrun …) as the workload
