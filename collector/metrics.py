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

from typing import Any

from collector.model.series import GPU_LABELS, SERIES, STEP_LABELS, Metric

__all__ = ["METRICS", "PUSHED", "PUSH_JOB", "PUSH_SAMPLES_JOB", "by_name", "gpu_labels"]

PUSH_JOB = "stepmem-steps"
PUSH_SAMPLES_JOB = "stepmem-samples"


def gpu_labels(node_id: str, info: Any, run_id: str, workload: str) -> dict[str, str]:
    """The labels of every series of one GPU (:data:`GPU_LABELS`), built once per sampler from
    its node and its ``DeviceInfo``; every exporter uses this dict as it is."""
    values = (node_id, str(info.index), info.uuid, run_id, workload)
    return dict(zip(GPU_LABELS, values, strict=True))


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
    # -- per step (and the allocator's counters as of a step's end): collector.model.series
    *(row.metric for row in SERIES),
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
PUSHED = tuple(row.metric.name for row in SERIES if row.pushed)


def _per_rank(m: Metric) -> Metric:
    """A per-step series (or the allocator's counters, read at a step's end) with ``rank``."""
    if m.name not in _PER_STEP:
        return m
    extra = tuple(label for label in m.labels if label not in GPU_LABELS)
    return Metric(m.name, m.type, m.unit, m.help, (*STEP_LABELS, *extra))


_PER_STEP = {row.metric.name for row in SERIES}
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
