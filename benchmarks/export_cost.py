"""Export cost, measured side by side in one run on this machine (no GPU needed).

1. Scrape cost: the collector serving 1 GPU and 8 GPUs (each with a ring of 15 s at 1 kHz, so
   the window max/min is computed over 15,000 samples per GPU, and a last step with a full
   ledger): median time of ``generate_latest`` over ``--scrapes`` scrapes, bytes and series.
2. Remote write into a real Prometheus (Debian's, on 127.0.0.1): ``--steps`` step records of
   one GPU (14 series each) pushed as fast as possible, timed until the receiver accepted them,
   at two batch sizes.

    python benchmarks/export_cost.py --out benchmarks/results/local-export/export_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collector.export.prometheus import SamplerCollector, Snapshot
from collector.export.remote_write import RemoteWriteConfig, RemoteWriter
from collector.sampler import RingBuffer
from tests.prom import Prometheus
from tests.records import step_record as record

GIB = 1 << 30


def gpu_snapshots(n: int) -> list:
    rings = []
    for _ in range(n):
        r = RingBuffer(1 << 15)
        for i in range(15_000):
            r.append(i * 1_000_000, 80 * GIB + (i % 997) * 4096, 615 << 20)
        rings.append(r)

    def build() -> list[Snapshot]:
        out = []
        for k, r in enumerate(rings):
            last = r.last()
            w = r.window(last[0] - 15_000_000_000, last[0])
            out.append(
                Snapshot(
                    labels={
                        "node": "n1",
                        "gpu": str(k),
                        "gpu_uuid": f"GPU-{k:08d}",
                        "run": "bench",
                        "workload": "bench",
                    },
                    total_bytes=140 * GIB,
                    used_bytes=last[1],
                    reserved_bytes=last[2],
                    window_max_bytes=int(w.used.max()),
                    window_min_bytes=int(w.used.min()),
                    last_record=record(),
                    samples_total=r.count,
                    rate_hz=1000.0,
                    target_rate_hz=1000.0,
                    steps_joined=7,
                )
            )
        return out

    return build


def scrape_cost(n: int, scrapes: int) -> dict:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SamplerCollector(gpu_snapshots(n)))
    times = []
    for _ in range(scrapes):
        t0 = time.perf_counter_ns()
        text = generate_latest(reg)
        times.append(time.perf_counter_ns() - t0)
    series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))
    return {
        "gpus": n,
        "median_ms": statistics.median(times) / 1e6,
        "bytes": len(text),
        "series": series,
    }


def remote_write_rate(url: str, steps: int, batch: int) -> dict:
    w = RemoteWriter(
        RemoteWriteConfig(url=url, batch_max=batch, buffer_max=steps * 20, flush_interval_s=0.05)
    )
    labels = {
        "node": "n1",
        "gpu": "0",
        "gpu_uuid": f"GPU-rw-{batch}",
        "run": "bench",
        "workload": "bench",
    }
    base_ns = time.monotonic_ns() - steps * 2_000_000
    offset = time.time_ns() - time.monotonic_ns()
    rec = record()
    t0 = time.perf_counter()
    for i in range(steps):
        rec = dict(
            rec,
            step=i + 1,
            begin_ns=base_ns + i * 2_000_000,
            end_ns=base_ns + i * 2_000_000 + 1_500_000,
        )
        w.push_step(labels, rec, offset)
    pushed_s = time.perf_counter() - t0
    total = len(w._buf) + w.sent
    deadline = time.monotonic() + 120
    while w.sent < total and time.monotonic() < deadline and not w.dropped:
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    w.close(timeout=1)
    return {
        "batch": batch,
        "steps": steps,
        "samples": total,
        "sent": w.sent,
        "dropped": dict(w.dropped),
        "requests": w.requests,
        "push_s": pushed_s,
        "elapsed_s": elapsed,
        "steps_per_s": steps / elapsed,
        "samples_per_s": total / elapsed,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    result = {"scrape": [scrape_cost(1, a.scrapes), scrape_cost(8, a.scrapes)]}
    one, eight = result["scrape"]
    result["scrape_ratio_8_to_1"] = eight["median_ms"] / one["median_ms"]
    print(
        f"scrape: 1 GPU {one['median_ms']:.2f} ms ({one['series']} series, {one['bytes']} B); "
        f"8 GPUs {eight['median_ms']:.2f} ms ({eight['series']} series, {eight['bytes']} B); "
        f"ratio {result['scrape_ratio_8_to_1']:.2f}"
    )
    with tempfile.TemporaryDirectory(prefix="stepmem-bench-prom-") as tmp:
        prom = Prometheus(Path(tmp)).start()
        try:
            url = f"{prom.url}/api/v1/write"
            result["remote_write"] = [remote_write_rate(url, a.steps, b) for b in (500, 5000)]
        finally:
            prom.stop()
    for r in result["remote_write"]:
        print(
            f"remote write, batch {r['batch']}: {r['steps_per_s']:,.0f} steps/s "
            f"({r['samples_per_s']:,.0f} samples/s, {r['requests']} requests, "
            f"dropped {r['dropped'] or 0})"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
