"""Prometheus ``file_sd`` targets: one entry per sampler, written atomically.

The file is a JSON list of ``{"targets": ["host:port"], "labels": {...}}`` objects, the format
Prometheus' ``file_sd_configs`` watches (it re-reads the file when it changes). Labels give
``node``, ``gpu``, ``gpu_uuid``, ``run`` and ``workload``, so every scraped series carries them
even before the first scrape succeeds (``up`` included).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from collector.model.files import atomic_write
from collector.model.records import SamplerInfo

__all__ = ["TargetsRefresher", "infos_of", "targets_for", "write_targets"]


def targets_for(infos: list[SamplerInfo]) -> list[dict[str, Any]]:
    """file_sd entries for samplers' ``info()``, sorted for stable output."""
    out = []
    for info in sorted(infos, key=lambda i: (i.node_id, i.index, i.gpu_uuid)):
        out.append(
            {
                "targets": [f"{info.metrics_addr}:{info.metrics_port}"],
                "labels": {
                    "node": info.node_id,
                    "gpu": str(info.index),
                    "gpu_uuid": info.gpu_uuid,
                    "run": info.run_id,
                    "workload": info.workload,
                },
            }
        )
    return out


def infos_of(handles: list[Any], timeout_s: float) -> list[SamplerInfo]:
    """The ``info()`` of every sampler actor that answers within ``timeout_s`` (a dead or stuck
    sampler is not a target)."""
    import ray

    infos = []
    for h in handles:
        try:
            infos.append(ray.get(h.info.remote(), timeout=timeout_s))
        except Exception:
            continue
    return infos


def write_targets(path: str | Path, infos: list[SamplerInfo]) -> bool:
    """Write the targets file if its content changed (atomically: temp file + rename).

    Returns True when the file was (re)written.
    """
    path = Path(path)
    text = json.dumps(targets_for(infos), indent=1) + "\n"
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text)
    return True


class TargetsRefresher:
    """Keeps a ``file_sd`` file current for a set of sampler actors (a daemon thread).

    Every ``interval_s`` it asks each actor for its ``info()`` (bounded by ``timeout_s``); actors
    that do not answer drop out of the file, restarted ones come back with their new port.
    """

    def __init__(
        self, path: str | Path, handles: list[Any], interval_s: float = 5.0, timeout_s: float = 5.0
    ) -> None:
        import threading

        self.path = Path(path)
        self.handles = handles
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="stepmem-file-sd", daemon=True)
        self._thread.start()

    def refresh(self) -> list[SamplerInfo]:
        infos = infos_of(self.handles, self.timeout_s)
        write_targets(self.path, infos)
        return infos

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + self.interval_s)
