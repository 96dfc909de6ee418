"""Headline gauges through Ray's own metrics pipeline (``ray.util.metrics``), opt-in
(``--ray-metrics``).

A Ray cluster's Prometheus (KubeRay's PodMonitor, ``ray start --metrics-export-port``, the
service discovery file Ray writes) already scrapes every node's metrics agent; these gauges
reach it with no extra scrape config, as ``ray_stepmem_*``. Ray exports custom metrics on its
own clock (``RAY_metrics_report_interval_ms``, 10 s by default): whatever a gauge held between
two exports is lost, so the NVML figure here is the maximum over the sampler's trailing window
(``--window``, 15 s by default, longer than Ray's interval) and never a single sample. Step-level
detail needs stepmem's own ``/metrics`` and remote write.
"""

from __future__ import annotations

from typing import Any

from collector.model.series import SERIES

__all__ = ["RAY_GAUGES", "RayGauges"]

TAGS = ("node", "gpu", "gpu_uuid", "run")
# name → help: the sampler's window, and the newest step's per-step series marked for Ray
RAY_GAUGES = {
    "stepmem_nvml_used_window_max_bytes": "Largest NVML used sample over the sampler's trailing "
    "window (longer than Ray's export interval).",
    "stepmem_headroom_bytes": "NVML total minus that window maximum.",
    **{
        row.ray_gauge: f"The newest joined step's {row.metric.name}: {row.metric.help}"
        for row in SERIES
        if row.ray_gauge
    },
}


class RayGauges:
    """The gauges of one sampler (tags: its GPU labels)."""

    def __init__(self, labels: dict[str, str]) -> None:
        from ray.util.metrics import Gauge

        self.tags = {k: str(labels.get(k, "")) for k in TAGS}
        self.gauges = {
            name: Gauge(name, description=text, tag_keys=TAGS) for name, text in RAY_GAUGES.items()
        }

    def values(self, snap: Any) -> dict[str, float]:
        """What each gauge is set to from a sampler snapshot (absent: not known yet)."""
        out: dict[str, float] = {}
        if snap.window_max_bytes is not None:
            out["stepmem_nvml_used_window_max_bytes"] = snap.window_max_bytes
            out["stepmem_headroom_bytes"] = snap.total_bytes - snap.window_max_bytes
        rec = snap.last_record
        if rec is not None:
            for row in SERIES:
                for _, v in row.values(rec) if row.ray_gauge else ():
                    out[row.ray_gauge] = v
        return out

    def update(self, snap: Any) -> None:
        for name, v in self.values(snap).items():
            self.gauges[name].set(float(v), tags=self.tags)
