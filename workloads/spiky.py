"""A workload whose memory rises and falls inside each step, by a known amount.

Each step: a resident working set (``--base-mib``) does a little matrix work, then one transient
buffer of a known size is allocated, filled on the GPU, held for a known time, freed, and the
allocator cache is released with ``torch.cuda.empty_cache()`` before the step ends — so NVML falls
back and the step's within-step NVML peak exceeds its end-of-step reading by the transient's size.
Step ``i`` uses transient ``i mod len(--spikes)``.

torch's within-step *reserved* peak (reset at step begin) plus the CUDA-context baseline is the
exact reference for what NVML should have seen at the peak.

    python -m workloads.spiky --steps 120 --spikes 2048:2,1024:5,4096:20,512:50
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from workloads import add_common_args, finish, script_args

MIB = 1 << 20


def parse_spikes(text: str) -> list[tuple[int, float]]:
    """``"SIZE_MIB:HOLD_MS,..."`` → [(bytes, seconds)]; ``ValueError`` names a bad part."""
    out = []
    for part in text.split(","):
        try:
            size, hold = part.split(":")
            mib, ms = int(size), float(hold)
        except ValueError:
            raise ValueError(f"spike {part!r} is not SIZE_MIB:HOLD_MS") from None
        if mib <= 0 or ms < 0:
            raise ValueError(f"spike {part!r}: size must be > 0 MiB and hold >= 0 ms")
        out.append((mib * MIB, ms / 1000))
    return out


def run(args: argparse.Namespace, probe: Any = None) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    spikes = parse_spikes(args.spikes)
    base = torch.randn(args.base_mib * MIB // 4, device=dev)
    w = torch.randn(1024, 1024, device=dev)
    out = torch.empty(1024, 1024, device=dev)  # preallocated: only the transient comes and goes
    times, plan = [], []
    for i in range(args.steps):
        size, hold = spikes[i % len(spikes)]
        t0 = time.perf_counter()
        if probe is not None:
            probe.begin(i + 1)
        torch.matmul(base[: 1024 * 1024].view(1024, 1024), w, out=out)  # a little real work
        tmp = torch.empty(size // 4, device=dev)
        tmp.fill_(1.0)  # touch it on the device
        if cuda:
            torch.cuda.synchronize()
        time.sleep(hold)
        del tmp
        if cuda:
            torch.cuda.empty_cache()  # hand the transient back to the driver: NVML falls
        if probe is not None:
            probe.end()
        times.append(time.perf_counter() - t0)
        plan.append({"step": i + 1, "spike_bytes": size, "hold_s": hold})
        if args.pause_ms:
            time.sleep(args.pause_ms / 1000)
    return {
        "workload": "spiky",
        "steps": args.steps,
        "base_bytes": args.base_mib * MIB,
        "plan": plan,
        "step_times_s": times,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spiky", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--spikes",
        default="2048:2,1024:5,4096:20,512:50",
        help="transients as SIZE_MIB:HOLD_MS, comma-separated, used in turn",
    )
    add_common_args(p)
    return p


def check(args: argparse.Namespace) -> None:
    """``ValueError`` naming a bad value."""
    parse_spikes(args.spikes)
    if args.steps < 1 or args.base_mib < 1:
        raise ValueError("--steps and --base-mib must be >= 1")


def main(argv: list[str] | None = None) -> int:
    _, args = script_args(sys.modules[__name__], argv)
    from collector.probe.core import StepProbe

    probe = None if args.no_probe else StepProbe()
    return finish(run(args, probe), probe, args.summary)


if __name__ == "__main__":
    sys.exit(main())
