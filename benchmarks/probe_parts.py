"""What one probe mark costs on a GPU, part by part (median of N calls each, microseconds).

    python benchmarks/probe_parts.py --out parts.json

Parts: ``torch.cuda.memory_stats`` (flattened), ``memory_stats_as_nested_dict`` (what the probe
reads), ``mem_get_info``, ``reset_peak_memory_stats``, and a whole begin/end pair of the probe
with no sampler (the training thread's share; sending happens on the outbox thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from collector.probe.core import StepProbe
from collector.probe.outbox import Outbox


def median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    keep = [torch.empty(1 << 20, device="cuda") for _ in range(64)]  # a non-trivial allocator state
    probe = StepProbe(outbox=Outbox(None))
    step = iter(range(1, 10**9))

    def pair() -> None:
        probe.begin(next(step))
        probe.end()

    parts = {
        "memory_stats_flat": median_us(lambda: torch.cuda.memory_stats(0), a.n),
        "memory_stats_nested": median_us(lambda: torch.cuda.memory_stats_as_nested_dict(0), a.n),
        "mem_get_info": median_us(lambda: torch.cuda.mem_get_info(0), a.n),
        "reset_peak_memory_stats": median_us(lambda: torch.cuda.reset_peak_memory_stats(0), a.n),
        "probe_begin_end_pair": median_us(pair, a.n),
    }
    probe.close()
    del keep
    print(json.dumps(parts, indent=1))
    with open(a.out, "w") as f:
        json.dump(parts, f, indent=1)


if __name__ == "__main__":
    main()
