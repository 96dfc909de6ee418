"""Per-step series: every figure a joined step exports, as data read off a
:class:`~collector.model.step.StepRecord`.

One table (:data:`SERIES`, nvitop's ``DEVICE_METRICS`` is the pattern) feeds every output:
Prometheus pull (the newest step of each process, ``collector.export.prometheus``), remote write
(every step at its end time, the rows marked ``pushed``), Ray's headline gauges (``ray_gauge``:
the newest step's value under that name) and the probe's tracker keys (``tracker``:
``stepmem/<key>`` from the sampler's newest joined step, bytes in GiB). Each row carries its
:class:`Metric` (name, type, unit, help), so a new per-step series is one row here; the exporter
registers the names of this table and :data:`collector.metrics.METRICS` together, which refuses
a duplicate at import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from collector.model.account import account
from collector.model.records import Stat
from collector.model.step import StepRecord

__all__ = ["GPU_LABELS", "SERIES", "STEP_LABELS", "Metric", "Series", "step_values"]

GPU_LABELS = ("node", "gpu", "gpu_uuid", "run", "workload")
STEP_LABELS = (*GPU_LABELS, "rank")  # a step is one rank's (see collector.metrics)
TYPES = ("gauge", "counter")
UNITS = ("bytes", "seconds", "hertz", "")  # "": a count or an index


@dataclass(frozen=True)
class Metric:
    """One exported metric: its name in base units with the usual suffix, its type, unit, help
    and labels. A bad combination is refused when the table is built (at import)."""

    name: str
    type: str  # "gauge" | "counter"
    unit: str  # "bytes" | "seconds" | "hertz" | "" (a count or an index)
    help: str
    labels: tuple[str, ...] = GPU_LABELS

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise ValueError(f"{self.name}: type must be gauge or counter")
        if self.unit not in UNITS:
            raise ValueError(f"{self.name}: unit must be one of {UNITS}")
        if (self.type == "counter") != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters, and only counters, end in _total")
        if self.unit == "bytes" and not self.name.endswith("_bytes"):
            raise ValueError(f"{self.name}: a bytes metric must end in _bytes")
        if self.unit == "seconds" and not self.name.endswith("_seconds"):
            raise ValueError(f"{self.name}: a seconds metric must end in _seconds")


Values = Callable[[StepRecord], Iterable[tuple[dict[str, str], float]]]


@dataclass(frozen=True)
class Series:
    """A per-step series: its metric (labels: :data:`STEP_LABELS` and its own), how its values
    are read off a record (``(extra labels, value)`` pairs; none where the record has no figure:
    not measured is no sample, never 0), and where else it goes."""

    metric: Metric
    values: Values
    pushed: bool = True  # remote write, at the step's end time (job="stepmem-steps")
    ray_gauge: str = ""  # the newest step's value as this ray.util.metrics gauge
    tracker: str = ""  # the probe's stepmem/<tracker> key (bytes as GiB)


def attr(name: str) -> Values:
    """The record's attribute ``name``, where it is not None."""

    def values(r: StepRecord) -> Iterable[tuple[dict[str, str], float]]:
        v = getattr(r, name)
        return [] if v is None else [({}, v)]

    return values


def end_stat(key: str) -> Values:
    """An allocator figure at the step's end mark, where the probe read it."""

    def values(r: StepRecord) -> Iterable[tuple[dict[str, str], float]]:
        v = r.end_stat(key)
        return [] if v is None else [({}, v)]

    return values


def _account(r: StepRecord) -> Iterable[tuple[dict[str, str], float]]:
    """The step's account with the baseline the sampler has seen so far (the report uses the
    whole run's)."""
    baseline = r.processes.baseline if r.processes is not None else None
    acc = account(r, r.process_pid or None, baseline)
    if acc is None:
        return []
    return [({"component": c.label}, v) for c, v in acc.components().items()]


def _ledger(r: StepRecord) -> Iterable[tuple[dict[str, str], float]]:
    return [({"kind": str(kind)}, v) for kind, v in r.ledger.items()]


def _duration(r: StepRecord) -> Iterable[tuple[dict[str, str], float]]:
    return [({}, (r.end_ns - r.begin_ns) / 1e9)]


def _gap(r: StepRecord) -> Iterable[tuple[dict[str, str], float]]:
    return [({}, 1 if r.gap else 0)]


def _nontorch(r: StepRecord) -> Iterable[tuple[dict[str, str], float]]:
    v = r.nontorch_end
    return [] if v is None else [({}, v)]


SERIES: tuple[Series, ...] = (
    Series(
        Metric(
            "stepmem_step",
            "gauge",
            "",
            "Number of the last completed (joined) step. Pushed series carry every step.",
        ),
        attr("step"),
        ray_gauge="stepmem_last_step",
        tracker="nvml_step",
    ),
    Series(
        Metric(
            "stepmem_step_duration_seconds",
            "gauge",
            "seconds",
            "Wall time between the step's begin and end marks.",
        ),
        _duration,
    ),
    Series(
        Metric(
            "stepmem_step_nvml_peak_bytes",
            "gauge",
            "bytes",
            "Largest NVML used sample between the step's begin and end marks.",
        ),
        attr("nvml_peak_bytes"),
        ray_gauge="stepmem_last_step_nvml_peak_bytes",
        tracker="nvml_peak_gib",
    ),
    Series(
        Metric(
            "stepmem_step_nvml_end_bytes",
            "gauge",
            "bytes",
            "NVML used at the step's end (first sample at or after the end mark); not set "
            "for a step whose end reading is stale (gap stale_end).",
        ),
        attr("nvml_end"),
        tracker="nvml_end_gib",
    ),
    Series(
        Metric(
            "stepmem_step_torch_allocated_peak_bytes",
            "gauge",
            "bytes",
            "PyTorch allocator: peak allocated bytes inside the step (tensors in use).",
        ),
        attr("torch_allocated_peak_bytes"),
    ),
    Series(
        Metric(
            "stepmem_step_estimate_peak_bytes",
            "gauge",
            "bytes",
            "The step's allocated peak as `stepmem estimate` predicted it (fake tensors and "
            "torch's MemTracker), beside stepmem_step_torch_allocated_peak_bytes; only for a "
            "probe given an estimate (STEPMEM_ESTIMATE).",
        ),
        attr("estimate_peak_bytes"),
    ),
    Series(
        Metric(
            "stepmem_step_torch_reserved_peak_bytes",
            "gauge",
            "bytes",
            "PyTorch allocator: peak reserved bytes inside the step (memory the caching "
            "allocator holds from the driver, used or cached).",
        ),
        attr("torch_reserved_peak_bytes"),
        ray_gauge="stepmem_last_step_torch_reserved_peak_bytes",
    ),
    Series(
        Metric(
            "stepmem_step_torch_allocated_end_bytes",
            "gauge",
            "bytes",
            "PyTorch allocator: allocated bytes at the step's end mark.",
        ),
        end_stat(Stat.ALLOCATED),
    ),
    Series(
        Metric(
            "stepmem_step_torch_reserved_end_bytes",
            "gauge",
            "bytes",
            "PyTorch allocator: reserved bytes at the step's end mark. Reserved minus allocated "
            "is the allocator's cache and fragmentation.",
        ),
        end_stat(Stat.RESERVED),
    ),
    Series(
        Metric(
            "stepmem_step_nontorch_bytes",
            "gauge",
            "bytes",
            "NVML used minus torch reserved minus the CUDA-context baseline, at step end: memory "
            "the torch allocator does not hold (managed/paged optimizer state, other libraries).",
        ),
        _nontorch,
    ),
    Series(
        Metric(
            "stepmem_step_account_bytes",
            "gauge",
            "bytes",
            "NVML used at step end, every byte by component: baseline (this process's CUDA "
            "context and what it held outside torch before step 1), torch_reserved, "
            "outside_torch (this process, beyond the baseline), other_processes, no_process "
            "(CUDA managed/UVM memory), remainder; outside_torch_unsplit where NVML gave no "
            "per-process readings. The series of one step sum to stepmem_step_nvml_end_bytes.",
            (*GPU_LABELS, "component"),
        ),
        _account,
    ),
    Series(
        Metric(
            "stepmem_step_ledger_bytes",
            "gauge",
            "bytes",
            "Memory ledger at step end by kind: parameters, gradients, optimizer_state (on the "
            "device), optimizer_state_managed (CUDA managed/paged), other_allocated.",
            (*GPU_LABELS, "kind"),
        ),
        _ledger,
    ),
    Series(
        Metric(
            "stepmem_step_gap",
            "gauge",
            "",
            "1 when the last step's sample window had a gap (sampler restarted, ring overrun, "
            "stall), else 0.",
        ),
        _gap,
        pushed=False,
    ),
    Series(
        Metric(
            "stepmem_torch_alloc_retries_total",
            "counter",
            "",
            "PyTorch allocator retries (cudaMalloc failed, cache flushed, retried), as of the "
            "last step.",
        ),
        end_stat(Stat.RETRIES),
        pushed=False,
        ray_gauge="stepmem_torch_alloc_retries",
    ),
    Series(
        Metric(
            "stepmem_torch_ooms_total",
            "counter",
            "",
            "PyTorch out-of-memory errors raised by the allocator, as of the last step.",
        ),
        end_stat(Stat.OOMS),
        pushed=False,
        ray_gauge="stepmem_torch_ooms",
    ),
)


def step_values(
    rec: StepRecord, pushed_only: bool = False
) -> list[tuple[str, dict[str, str], float]]:
    """``(metric, extra labels, value)`` for every per-step series ``rec`` has data for (with
    ``pushed_only``, those remote write pushes); every one carries the step's ``rank``."""
    rank = {"rank": str(rec.rank)}
    return [
        (s.metric.name, {**rank, **extra}, value)
        for s in SERIES
        if s.pushed or not pushed_only
        for extra, value in s.values(rec)
    ]
