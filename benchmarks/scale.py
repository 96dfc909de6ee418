"""Scale on the local Ray cluster: N simulated GPUs (replay backend), each a sampler at 1 kHz
exporting to a real Prometheus (scraped every second through file_sd) and pushing raw samples
as per-millisecond maxima by remote write.

For each N: CPU share of one core per sampler process (``/proc/<pid>/stat`` over the window),
series exported per GPU, scrape latency of ``/metrics`` (median of direct GETs), and samples per
second accepted by remote write. Writes JSON; the extrapolation to 1,024 GPUs is in the README
beside the committed result.

    python benchmarks/scale.py --gpus 1 2 4 8 --seconds 10 --out scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collector.backends import BackendSpec
from collector.export.file_sd import TargetsRefresher
from collector.export.remote_write import RemoteWriteConfig
from collector.model.settings import SamplerOptions
from collector.placement import launch_samplers
from collector.run.ray_session import start_local_ray
from tests.prom import Prometheus


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(n: int, seconds: float, prom: Prometheus) -> dict:
    rw = RemoteWriteConfig(url=f"{prom.url}/api/v1/write", flush_interval_s=0.5)
    placed = launch_samplers(
        BackendSpec("replay", captures=["adamw_8bit"], gpus=n),
        SamplerOptions(
            run_id=f"scale-{n}", metrics_addr="127.0.0.1", remote_write=rw, push_samples=True
        ),
    )
    refresher = TargetsRefresher(
        prom.targets / "stepmem.json", [p.handle for p in placed], interval_s=1.0
    )
    try:
        time.sleep(2.0)
        pids = [p.info.pid for p in placed]
        cpu0 = [proc_cpu_s(pid) for pid in pids]
        sent0 = sum(ray.get(p.handle.health.remote()).remote_write["sent"] for p in placed)
        t0 = time.monotonic()
        scrape_ms, series = [], 0
        while time.monotonic() - t0 < seconds:
            for p in placed:
                url = f"http://127.0.0.1:{p.info.metrics_port}/metrics"
                s = time.perf_counter()
                with urllib.request.urlopen(url, timeout=10) as r:
                    text = r.read().decode()
                scrape_ms.append((time.perf_counter() - s) * 1e3)
                series = sum(1 for line in text.splitlines() if line and line[0] != "#")
            time.sleep(0.5)
        wall = time.monotonic() - t0
        cpu = [(proc_cpu_s(pid) - c) / wall for pid, c in zip(pids, cpu0, strict=True)]
        health = [ray.get(p.handle.health.remote()) for p in placed]
        sent = sum(h.remote_write["sent"] for h in health) - sent0
        return {
            "gpus": n,
            "seconds": wall,
            "cpu_per_sampler_frac_median": statistics.median(cpu),
            "cpu_per_sampler_frac_max": max(cpu),
            "series_per_gpu": series,
            "scrape_ms_median": statistics.median(scrape_ms),
            "remote_write_samples_per_s": sent / wall,
            "achieved_rate_hz": [h.rate_hz for h in health],
            "remote_write_dropped": [h.remote_write["dropped"] for h in health],
        }
    finally:
        refresher.stop()
        for p in placed:
            ray.kill(p.handle)
        time.sleep(1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    start_local_ray(log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory(prefix="stepmem-scale-") as tmp:
        prom = Prometheus(Path(tmp)).start()
        try:
            for n in a.gpus:
                row = measure(n, a.seconds, prom)
                rows.append(row)
                print(
                    f"{n:>3} GPUs: CPU/sampler {100 * row['cpu_per_sampler_frac_median']:.1f} % "
                    f"(max {100 * row['cpu_per_sampler_frac_max']:.1f} %), "
                    f"{row['series_per_gpu']} series/GPU, scrape {row['scrape_ms_median']:.1f} ms, "
                    f"remote write {row['remote_write_samples_per_s']:,.0f} samples/s",
                    flush=True,
                )
        finally:
            prom.stop()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"rows": rows, "cpus": os.cpu_count()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
