"""What stepmem costs a real training step: the 7B ``finetune`` step with and without stepmem.

One process, one model, one optimizer (Llama-2-7B shape from a config, fp32 weights, bf16
autocast, gradient checkpointing, seq 4096, batch 1, gradient accumulation 2, bitsandbytes
``adamw_8bit``). After warm-up steps, blocks of ``--block`` steps run in turn in three modes —
``off`` (no sampler actor, no probe), ``1 kHz`` and ``max`` (a sampler actor at that rate on the
GPU plus the probe with its phase mark and ledger) — repeated ``--reps`` times, interleaved so
drift hits every mode alike, the order rotated each repetition so no mode always follows
another. Step time is host wall time with a CUDA synchronize at step end. The slowdown is the
ratio of medians; its 95 % interval comes from resampling each mode's steps (bootstrap).

    python benchmarks/training_cost.py --out training_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import ray
import torch

from collector.backends import BackendSpec
from collector.lookup import SamplerLookup
from collector.model.settings import SamplerOptions, Sampling
from collector.placement import launch_samplers
from collector.probe.core import StepProbe
from collector.run.ray_session import start_local_ray
from workloads.finetune import SHAPES, build_model

MODES = {"off": None, "1 kHz": 1000.0, "max": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import bitsandbytes as bnb

    start_local_ray(configure_logging=True)
    model = build_model("7b", a.seq_len, None)
    model.gradient_checkpointing_enable()
    model.train()
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-5)
    ids = torch.randint(0, SHAPES["7b"]["vocab_size"], (2, 1, a.seq_len), device="cuda")
    step_no = 0

    def train_step(probe: StepProbe | None) -> float:
        nonlocal step_no
        step_no += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if probe is not None:
            probe.begin(step_no)
        for micro in ids:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=micro, labels=micro).loss / len(ids)
            loss.backward()
        if probe is not None:
            probe.phase("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if probe is not None:
            probe.end()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    probe = StepProbe(devices=[0]).watch(model, opt)
    for _ in range(a.warmup):
        train_step(None)
    train_step(probe)  # the probe's one-time set-up (devices, baseline, full ledger) stays out
    times: dict[str, list[float]] = {m: [] for m in MODES}
    names = list(MODES)
    for r in range(a.reps):
        for mode in names[r % 3 :] + names[: r % 3]:
            rate = MODES[mode]
            handle = None
            if rate is not None:
                (p,) = launch_samplers(
                    BackendSpec("nvml"),
                    SamplerOptions(Sampling(rate=rate), metrics_addr="127.0.0.1"),
                )
                handle = p.handle
                # a fresh lookup: not the warm-up's miss nor an earlier block's actor
                probe.outbox._resolve = SamplerLookup()
                time.sleep(0.5)
            times[mode] += [train_step(probe if handle else None) for _ in range(a.block)]
            if handle is not None:
                probe.outbox.flush()  # this block's events reach this block's sampler
                ray.kill(handle)
                time.sleep(0.5)
    probe.close()
    med = {m: statistics.median(v) for m, v in times.items()}
    rng = np.random.default_rng(0)

    def ci95(mode: str) -> list[float]:
        """Bootstrap 95 % interval of median(mode) / median(off) - 1."""
        on, off = np.array(times[mode]), np.array(times["off"])
        r = [
            np.median(rng.choice(on, len(on))) / np.median(rng.choice(off, len(off))) - 1
            for _ in range(2000)
        ]
        return [float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))]

    result = {
        "step_times_s": times,
        "median_s": med,
        "probe_dropped": dict(probe.outbox.dropped),
        "probe_sent": probe.outbox.sent,
        "slowdown_1khz": med["1 kHz"] / med["off"] - 1,
        "slowdown_max": med["max"] / med["off"] - 1,
        "slowdown_1khz_ci95": ci95("1 kHz"),
        "slowdown_max_ci95": ci95("max"),
        "spread_off": (max(times["off"]) - min(times["off"])) / med["off"],
    }
    for m in MODES:
        print(f"{m:>6}: median step {med[m]:.4f} s over {len(times[m])} steps", flush=True)
    lo1, hi1 = (100 * x for x in result["slowdown_1khz_ci95"])
    lom, him = (100 * x for x in result["slowdown_max_ci95"])
    print(
        f"slowdown at 1 kHz {100 * result['slowdown_1khz']:+.2f} %, at max "
        f"{100 * result['slowdown_max']:+.2f} % (95 % intervals {lo1:+.2f}..{hi1:+.2f} and "
        f"{lom:+.2f}..{him:+.2f} %) "
        f"(off-mode spread {100 * result['spread_off']:.2f} %)"
    )
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
