"""Sampler rate and cost on a real GPU, side by side in one run.

1. ``max``: a bare pynvml loop (``nvmlDeviceGetMemoryInfo(h, version=nvmlMemory_v2)``) in this
   process against stepmem's sampler inside a Ray actor, interleaved ``--rounds`` times.
2. 1 kHz for ``--seconds``: achieved rate, gaps between samples (p50/p99/max), CPU time of the
   sampling thread and of the whole actor process (``/proc/<pid>/stat``).

    python benchmarks/sampler_rate.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import pynvml
import ray

from collector.backends import BackendSpec
from collector.model.settings import Rate, SamplerOptions, Sampling
from collector.placement import launch_samplers
from collector.run.ray_session import start_local_ray


def bare_pynvml(handle, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    end = t0 + seconds
    while True:
        for _ in range(1000):
            pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        n += 1000
        now = time.perf_counter()
        if now >= end:
            return n / (now - t0)


def bare_pynvml_1khz(handle, seconds: float) -> dict:
    """The same work as the sampler at 1 kHz, in the plainest Python: read, sleep to deadline."""
    c0, t0 = time.thread_time(), time.monotonic_ns()
    deadline, n = t0, 0
    while deadline - t0 < seconds * 1e9:
        pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        n += 1
        deadline += 1_000_000
        now = time.monotonic_ns()
        if now < deadline:
            time.sleep((deadline - now) / 1e9)
    wall = (time.monotonic_ns() - t0) / 1e9
    return {"rate_hz": n / wall, "thread_cpu_frac": (time.thread_time() - c0) / wall}


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def actor_window(handle, seconds: float) -> dict:
    start = ray.get(handle.samples_since.remote(1 << 62))["next"]
    info = ray.get(handle.info.remote())
    cpu0, tcpu0 = proc_cpu_s(info.pid), ray.get(handle.thread_cpu_s.remote())
    w0 = time.perf_counter()
    time.sleep(seconds)
    cpu1, tcpu1 = proc_cpu_s(info.pid), ray.get(handle.thread_cpu_s.remote())
    wall = time.perf_counter() - w0
    s = ray.get(handle.samples_since.remote(start))
    t = np.asarray(s["t_ns"])
    gaps = np.diff(t) / 1e6
    return {
        "samples": len(t),
        "lost": s["lost"],
        "rate_hz": (len(t) - 1) * 1e9 / float(t[-1] - t[0]),
        "gap_ms_p50": float(np.percentile(gaps, 50)),
        "gap_ms_p99": float(np.percentile(gaps, 99)),
        "gap_ms_max": float(gaps.max()),
        "wall_s": wall,
        "process_cpu_frac": (cpu1 - cpu0) / wall,
        "thread_cpu_frac": (tcpu1 - tcpu0) / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=3.0)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    start_local_ray(configure_logging=True)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    result: dict = {"rounds": []}
    placed = launch_samplers(
        BackendSpec("nvml"), SamplerOptions(Sampling(rate=Rate.MAX), metrics_addr="127.0.0.1")
    )[0]
    time.sleep(1.0)
    for _ in range(a.rounds):
        bare = bare_pynvml(handle, a.max_seconds)
        actor = actor_window(placed.handle, a.max_seconds)
        result["rounds"].append(
            {"bare_pynvml_hz": bare, "actor_max": actor, "ratio": actor["rate_hz"] / bare}
        )
        print(
            f"bare pynvml {bare:,.0f} Hz | actor at max {actor['rate_hz']:,.0f} Hz | "
            f"ratio {actor['rate_hz'] / bare:.3f}",
            flush=True,
        )
    ray.kill(placed.handle)
    time.sleep(1.0)
    placed = launch_samplers(
        BackendSpec("nvml"), SamplerOptions(Sampling(rate=1000.0), metrics_addr="127.0.0.1")
    )[0]
    time.sleep(1.0)
    k = actor_window(placed.handle, a.seconds)
    result["actor_1khz"] = k
    print(
        f"1 kHz over {k['wall_s']:.1f} s: {k['rate_hz']:.2f} Hz, gaps p50 {k['gap_ms_p50']:.3f} "
        f"p99 {k['gap_ms_p99']:.3f} max {k['gap_ms_max']:.3f} ms, CPU thread "
        f"{100 * k['thread_cpu_frac']:.2f} % process {100 * k['process_cpu_frac']:.2f} %",
        flush=True,
    )
    b = bare_pynvml_1khz(handle, 10.0)
    result["bare_pynvml_1khz"] = b
    print(
        f"bare pynvml loop at 1 kHz (10 s): {b['rate_hz']:.1f} Hz, CPU "
        f"{100 * b['thread_cpu_frac']:.2f} % of a core",
        flush=True,
    )
    result["median_ratio"] = float(np.median([r["ratio"] for r in result["rounds"]]))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
