"""A long run, accelerated: is a sampler's memory bounded?

Replayed GPUs (the 7B ``adamw_8bit`` H200 capture) sampled at ``max`` on the local Ray cluster,
each well past ``--samples`` samples (default 10⁷, about ten times the ring's 2²⁰ slots), while
this process acts as a fast training job and its run store: a step (begin and end events) to
every sampler every ``--step-ms`` and, every 2 s, a drain of new samples and step records as the
job's run-store writer does. The resident memory (VmRSS) of each sampler process is read every
second. The ring is allocated up front, so from the moment it first wraps the RSS should stay
flat; the JSON holds the whole series.

    python benchmarks/long_run.py --out benchmarks/results/local-long-run/long_run.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collector.backends import BackendSpec
from collector.model.settings import DEFAULT_CAPACITY, Rate, SamplerOptions, Sampling
from collector.placement import launch_samplers
from collector.run.ray_session import start_local_ray

MIB = 1 << 20


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A /proc/<pid>/status memory field: VmRSS (all resident), RssAnon (the process's own
    heap), RssShmem (shared memory it touched: Ray's object store)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--samples", type=float, default=1e7, help="per GPU, at least")
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--max-seconds", type=float, default=900.0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    start_local_ray(log_to_driver=False)
    placed = launch_samplers(
        BackendSpec("replay", captures=["adamw_8bit"], gpus=a.gpus),
        SamplerOptions(Sampling(rate=Rate.MAX), metrics_addr="127.0.0.1", run_id="long-run"),
    )
    pids = {p.gpu_uuid: p.info.pid for p in placed}
    cursors = {p.gpu_uuid: 0 for p in placed}
    last_step = {p.gpu_uuid: 0 for p in placed}  # record cursors
    series: list[dict] = []
    drained = {"samples": 0, "records": 0}
    step, t_start = 0, time.monotonic()
    next_drain = next_read = t_start
    done = False
    while not done and time.monotonic() - t_start < a.max_seconds:
        step += 1
        b = time.monotonic_ns()
        time.sleep(a.step_ms / 1000)
        e = time.monotonic_ns()
        for p in placed:  # fire-and-forget, as the probe's sender does
            p.handle.record_events.remote(
                [
                    {"kind": "begin", "step": step, "t_ns": b, "gpu_uuid": p.gpu_uuid},
                    {"kind": "end", "step": step, "t_ns": e, "gpu_uuid": p.gpu_uuid},
                ]
            )
        now = time.monotonic()
        if now >= next_drain:  # the run store's drain
            next_drain = now + 2.0
            for p in placed:
                d = ray.get(p.handle.samples_since.remote(cursors[p.gpu_uuid]), timeout=60)
                cursors[p.gpu_uuid] = d["next"]
                drained["samples"] += len(d["t_ns"])
                r = ray.get(p.handle.records_since.remote(last_step[p.gpu_uuid]), timeout=60)
                last_step[p.gpu_uuid] = r["next"]  # a cursor: the records joined so far
                drained["records"] += len(r["records"])
        if now >= next_read:
            next_read = now + 1.0
            health = {p.gpu_uuid: ray.get(p.handle.health.remote(), timeout=60) for p in placed}
            row = {
                "t_s": round(now - t_start, 2),
                "step": step,
                "samples": {u: h.samples_total for u, h in health.items()},
                "rss_mib": {u: round(rss_bytes(pids[u]) / MIB, 2) for u in pids},
                "anon_mib": {u: round(rss_bytes(pids[u], "RssAnon") / MIB, 2) for u in pids},
                "shmem_mib": {u: round(rss_bytes(pids[u], "RssShmem") / MIB, 2) for u in pids},
            }
            series.append(row)
            print(
                f"{row['t_s']:7.1f} s  step {step:6d}  samples "
                + " ".join(f"{s / 1e6:.2f}M" for s in row["samples"].values())
                + "  RSS "
                + " ".join(f"{r:.1f}" for r in row["rss_mib"].values())
                + " MiB",
                flush=True,
            )
            done = all(s >= a.samples for s in row["samples"].values())
    summary = {}
    for u in pids:
        wrapped = next((r for r in series if r["samples"][u] >= DEFAULT_CAPACITY), None)
        last = series[-1]
        half = next(r for r in series if r["samples"][u] >= last["samples"][u] / 2)
        summary[u] = {
            "samples": last["samples"][u],
            "rss_at_ring_wrap_mib": wrapped["rss_mib"][u] if wrapped else None,
            "rss_end_mib": last["rss_mib"][u],
            "rss_max_after_wrap_mib": max(
                r["rss_mib"][u] for r in series if r["samples"][u] >= DEFAULT_CAPACITY
            )
            if wrapped
            else None,
            "growth_after_wrap_mib": round(last["rss_mib"][u] - wrapped["rss_mib"][u], 2)
            if wrapped
            else None,
            "growth_second_half_mib": round(last["rss_mib"][u] - half["rss_mib"][u], 2),
            "anon_growth_second_half_mib": round(last["anon_mib"][u] - half["anon_mib"][u], 2),
            "shmem_growth_second_half_mib": round(last["shmem_mib"][u] - half["shmem_mib"][u], 2),
            "samples_second_half": last["samples"][u] - half["samples"][u],
            "steps_second_half": last["step"] - half["step"],
        }
    result = {
        "gpus": a.gpus,
        "ring_capacity": DEFAULT_CAPACITY,
        "steps_sent": step,
        "drained": drained,
        "seconds": round(time.monotonic() - t_start, 1),
        "per_gpu": summary,
        "series": series,
    }
    for u, s in summary.items():
        print(
            f"{u}: {s['samples'] / 1e6:.2f}M samples; RSS {s['rss_at_ring_wrap_mib']} MiB when "
            f"the ring first wrapped, {s['rss_end_mib']} MiB at the end (max after wrap "
            f"{s['rss_max_after_wrap_mib']}): {s['growth_after_wrap_mib']} MiB; over the second "
            f"half ({s['samples_second_half'] / 1e6:.2f}M samples, {s['steps_second_half']} "
            f"steps) {s['growth_second_half_mib']:+.2f} MiB (own heap "
            f"{s['anon_growth_second_half_mib']:+.2f}, object-store pages "
            f"{s['shmem_growth_second_half_mib']:+.2f})"
        )
    print(f"{step} steps sent to each sampler; drained {drained}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
