"""The metric table: every series stepmem exports, as data.

The exporter builds its families from this table; dashboards and alert rules are checked against
it by tests. Names are in base units with the usual suffixes (``_bytes``, ``_seconds``,
``_total``); no label carries an unbounded value (no step number, no timestamp).

Labels on every GPU series:

* ``node`` — the Ray node id the sampler runs on;
* ``gpu`` — NVML's index of the GPU on that node (for reading; the UUID is the identity);
* ``gpu_uuid`` — the GPU's UUID;
* ``run`` — the run (job) id the samplers were launched for;
* ``workload`` — what the run trains (``finetune``, a replayed capture, a name the user gives):
  the key that per-workload baselines are matched on (``stepmem_baseline_*``).

Per-step series (``stepmem_step*``, the allocator's retry and OOM counters) also carry ``rank``:
the training process's rank in a distributed run (``0`` for a single process), so ranks that
share a GPU, or a fleet of them, are told apart; it is bounded by the world size.

Series reach Prometheus two ways: scraped from each sampler's ``/metrics`` (scrape config
``job="stepmem"``), and — for per-step values, which change faster than any scrape interval —
pushed through remote write with each step's end timestamp, under ``job="stepmem-steps"``
(:data:`PUSHED`). Optionally the raw NVML trace is pushed too, as per-millisecond maxima of
``stepmem_nvml_used_bytes`` under ``job="stepmem-samples"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "GPU_LABELS",
    "METRICS",
    "PUSHED",
    "PUSH_JOB",
    "PUSH_SAMPLES_JOB",
    "STEP_LABELS",
    "Metric",
    "by_name",
    "gpu_labels",
]

GPU_LABELS = ("node", "gpu", "gpu_uuid", "run", "workload")
STEP_LABELS = (*GPU_LABELS, "rank")  # a step is one rank's (see the module docstring)
PUSH_JOB = "stepmem-steps"


def gpu_labels(node_id: str, info: Any, run_id: str, workload: str) -> dict[str, str]:
    """The labels of every series of one GPU (:data:`GPU_LABELS`), built once per sampler from
    its node and its ``DeviceInfo``; every exporter uses this dict as it is."""
    values = (node_id, str(info.index), info.uuid, run_id, workload)
    return dict(zip(GPU_LABELS, values, strict=True))


PUSH_SAMPLES_JOB = "stepmem-samples"


@dataclass(frozen=True)
class Metric:
    name: str
    type: str  # "gauge" | "counter"
    unit: str  # "bytes" | "seconds" | "hertz" | "" (a count or an index)
    help: str
    labels: tuple[str, ...] = GPU_LABELS

    def __post_init__(self) -> None:
        if self.type not in ("gauge", "counter"):
            raise ValueError(f"{self.name}: type must be gauge or counter")
        if (self.type == "counter") != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters, and only counters, end in _total")
        if self.unit == "bytes" and not self.name.endswith("_bytes"):
            raise ValueError(f"{self.name}: a bytes metric must end in _bytes")
        if self.unit == "seconds" and not self.name.endswith("_seconds"):
            raise ValueError(f"{self.name}: a seconds metric must end in _seconds")


_NVML_USED = (
    "NVML v2 device 'used' memory: everything allocated on the GPU by every process, including "
    "CUDA managed memory resident there, excluding driver-reserved memory"
)

METRICS: tuple[Metric, ...] = (
    # -- live NVML readings ------------------------------------------------------------------
    Metric("stepmem_nvml_used_bytes", "gauge", "bytes", f"Last sample of {_NVML_USED}."),
    Metric(
        "stepmem_nvml_reserved_bytes",
        "gauge",
        "bytes",
        "NVML v2 driver-reserved memory (0 when the driver only answers v1).",
    ),
    Metric("stepmem_nvml_total_bytes", "gauge", "bytes", "NVML total device memory."),
    Metric(
        "stepmem_process_used_bytes",
        "gauge",
        "bytes",
        "NVML per-process used memory at the newest per-process reading, by process: each "
        "training process that reports to this sampler under its Ray name (the actor's name, "
        "train_rank_<N> in a Ray Train worker, actor, driver or task), every other process on "
        "the GPU summed as 'other' (a bounded set of series, never one per pid).",
        (*GPU_LABELS, "process"),
    ),
    Metric(
        "stepmem_nvml_used_window_max_bytes",
        "gauge",
        "bytes",
        "Largest NVML used sample over the trailing window (stepmem_window_seconds long, "
        "ending at the newest sample); computed from the ring buffer, never reset on scrape.",
    ),
    Metric(
        "stepmem_nvml_used_window_min_bytes",
        "gauge",
        "bytes",
        "Smallest NVML used sample over the same trailing window.",
    ),
    Metric(
        "stepmem_window_seconds",
        "gauge",
        "seconds",
        "Length of the trailing window of the _window_max/_window_min gauges.",
    ),
    # -- the last completed step -------------------------------------------------------------
    Metric(
        "stepmem_step",
        "gauge",
        "",
        "Number of the last completed (joined) step. Pushed series carry every step.",
    ),
    Metric(
        "stepmem_step_duration_seconds",
        "gauge",
        "seconds",
        "Wall time between the step's begin and end marks.",
    ),
    Metric(
        "stepmem_step_nvml_peak_bytes",
        "gauge",
        "bytes",
        "Largest NVML used sample between the step's begin and end marks.",
    ),
    Metric(
        "stepmem_step_nvml_end_bytes",
        "gauge",
        "bytes",
        "NVML used at the step's end (first sample at or after the end mark).",
    ),
    Metric(
        "stepmem_step_torch_allocated_peak_bytes",
        "gauge",
        "bytes",
        "PyTorch allocator: peak allocated bytes inside the step (tensors in use).",
    ),
    Metric(
        "stepmem_step_estimate_peak_bytes",
        "gauge",
        "bytes",
        "The step's allocated peak as `stepmem estimate` predicted it (fake tensors and torch's "
        "MemTracker), beside stepmem_step_torch_allocated_peak_bytes; only for a probe given "
        "an estimate (STEPMEM_ESTIMATE).",
    ),
    Metric(
        "stepmem_step_torch_reserved_peak_bytes",
        "gauge",
        "bytes",
        "PyTorch allocator: peak reserved bytes inside the step (memory the caching "
        "allocator holds from the driver, used or cached).",
    ),
    Metric(
        "stepmem_step_torch_allocated_end_bytes",
        "gauge",
        "bytes",
        "PyTorch allocator: allocated bytes at the step's end mark.",
    ),
    Metric(
        "stepmem_step_torch_reserved_end_bytes",
        "gauge",
        "bytes",
        "PyTorch allocator: reserved bytes at the step's end mark. Reserved minus allocated "
        "is the allocator's cache and fragmentation.",
    ),
    Metric(
        "stepmem_step_nontorch_bytes",
        "gauge",
        "bytes",
        "NVML used minus torch reserved minus the CUDA-context baseline, at step end: memory "
        "the torch allocator does not hold (managed/paged optimizer state, other libraries).",
    ),
    Metric(
        "stepmem_step_account_bytes",
        "gauge",
        "bytes",
        "NVML used at step end, every byte by component: baseline (this process's CUDA context "
        "and what it held outside torch before step 1), torch_reserved, outside_torch (this "
        "process, beyond the baseline), other_processes, no_process (CUDA managed/UVM memory), "
        "remainder; outside_torch_unsplit where NVML gave no per-process readings. The series of "
        "one step sum to stepmem_step_nvml_end_bytes.",
        (*GPU_LABELS, "component"),
    ),
    Metric(
        "stepmem_step_ledger_bytes",
        "gauge",
        "bytes",
        "Memory ledger at step end by kind: parameters, gradients, optimizer_state (on the "
        "device), optimizer_state_managed (CUDA managed/paged), other_allocated.",
        (*GPU_LABELS, "kind"),
    ),
    Metric(
        "stepmem_step_gap",
        "gauge",
        "",
        "1 when the last step's sample window had a gap (sampler restarted, ring overrun, "
        "stall), else 0.",
    ),
    # -- allocator pressure ------------------------------------------------------------------
    Metric(
        "stepmem_torch_alloc_retries_total",
        "counter",
        "",
        "PyTorch allocator retries (cudaMalloc failed, cache flushed, retried), as of the "
        "last step.",
    ),
    Metric(
        "stepmem_torch_ooms_total",
        "counter",
        "",
        "PyTorch out-of-memory errors raised by the allocator, as of the last step.",
    ),
    # -- the collector's own health ----------------------------------------------------------
    Metric("stepmem_sampler_samples_total", "counter", "", "NVML samples taken."),
    Metric(
        "stepmem_sampler_errors_total",
        "counter",
        "",
        "NVML errors by kind (not_supported, gpu_lost, not_found, unavailable, unknown, internal).",
        (*GPU_LABELS, "kind"),
    ),
    Metric(
        "stepmem_sampler_missed_deadlines_total",
        "counter",
        "",
        "Sampling deadlines skipped because the thread woke more than a period late.",
    ),
    Metric(
        "stepmem_sampler_dropped_total",
        "counter",
        "",
        "Step events rejected by the sampler, by reason (malformed, wrong_gpu, "
        "end_without_begin, ...).",
        (*GPU_LABELS, "reason"),
    ),
    Metric(
        "stepmem_sampler_rate_hz",
        "gauge",
        "hertz",
        "Achieved sampling rate over the last 5 s (configured: stepmem_sampler_target_rate_hz).",
    ),
    Metric(
        "stepmem_sampler_target_rate_hz",
        "gauge",
        "hertz",
        "Configured sampling rate; 0 means 'max' (back to back).",
    ),
    Metric(
        "stepmem_sampler_up",
        "gauge",
        "",
        "1 while the sampling thread runs; 0 after it stopped (e.g. GPU lost).",
    ),
    Metric("stepmem_steps_joined_total", "counter", "", "Step records joined."),
    Metric(
        "stepmem_remote_write_samples_total",
        "counter",
        "",
        "Samples accepted by the remote-write receiver.",
    ),
    Metric(
        "stepmem_remote_write_dropped_total",
        "counter",
        "",
        "Remote-write samples dropped, by reason (buffer_full, rejected_4xx, redirected, gave_up).",
        (*GPU_LABELS, "reason"),
    ),
    Metric(
        "stepmem_remote_write_pending", "gauge", "", "Samples waiting in the remote-write buffer."
    ),
    # -- recorded by Prometheus itself -------------------------------------------------------
    Metric(
        "stepmem_baseline_step_nvml_peak_bytes",
        "gauge",
        "bytes",
        "A workload's accepted within-step NVML peak: a recording rule in "
        "deploy/prometheus/rules/baselines.yml written by `stepmem baseline`.",
        ("workload",),
    ),
)

#: Kinds and reasons exported as 0 from the start, so ``increase()`` sees their first event.
ERROR_KINDS = ("not_supported", "gpu_lost", "not_found", "unavailable", "unknown", "internal")
DROP_REASONS = (
    "malformed",
    "wrong_gpu",
    "batch_too_large",
    "end_without_begin",
    "phase_without_begin",
    "end_before_begin",
    "unended",
    "open_dropped",
    "phases_dropped",
    "future_timestamp",
)
REMOTE_WRITE_DROP_REASONS = ("buffer_full", "rejected_4xx", "redirected", "gave_up", "ring_overrun")

#: Metrics pushed per step (remote write, step-end timestamps, ``job="stepmem-steps"``).
PUSHED = (
    "stepmem_step",
    "stepmem_step_duration_seconds",
    "stepmem_step_nvml_peak_bytes",
    "stepmem_step_nvml_end_bytes",
    "stepmem_step_torch_allocated_peak_bytes",
    "stepmem_step_torch_reserved_peak_bytes",
    "stepmem_step_estimate_peak_bytes",
    "stepmem_step_torch_allocated_end_bytes",
    "stepmem_step_torch_reserved_end_bytes",
    "stepmem_step_nontorch_bytes",
    "stepmem_step_account_bytes",
    "stepmem_step_ledger_bytes",
)


def _per_rank(m: Metric) -> Metric:
    """A per-step series (or the allocator's counters, read at a step's end) with ``rank``."""
    if (
        not m.name.startswith(("stepmem_step", "stepmem_torch_"))
        or m.name == "stepmem_steps_joined_total"
    ):
        return m
    extra = tuple(label for label in m.labels if label not in GPU_LABELS)
    return Metric(m.name, m.type, m.unit, m.help, (*STEP_LABELS, *extra))


METRICS = tuple(_per_rank(m) for m in METRICS)
_BY_NAME = {m.name: m for m in METRICS}
if len(_BY_NAME) != len(METRICS):
    raise ValueError("duplicate metric names in METRICS")


def by_name(name: str) -> Metric:
    """The table entry for ``name``; ``KeyError`` names metrics that are not in the table."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in stepmem's metric table") from None
