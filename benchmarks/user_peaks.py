"""On a GPU: a training loop's own peak logging with and without the probe (#39 F6).

    python benchmarks/user_peaks.py --out user_peaks.json

Each step allocates a transient that shrinks from step to step ((5 − ``step``) × 256 MiB, freed
inside the step) and keeps 64 MiB, so the peak of the run so far and a step's own peak differ.
The loop logs ``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()`` at each step
end, in two patterns users write: never resetting (the peak of the run so far) and resetting at
each step's start (the step's own peak). The same loop runs three times in this process: without
the probe, with ``StepProbe()`` (which resets torch's peaks at every mark) and with
``StepProbe(reset_peaks=False)``. What the loop logs must be the same with the probe as without
it, and the probe's own per-step peaks must still be the step's (since its last mark).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

MIB = 1 << 20
STEPS = 4


def loop(probe, reset_each_step: bool) -> tuple[list[list[int]], list[int]]:
    """What the loop logs (allocated, reserved peaks) per step, and the probe's own allocated
    peak per step (empty without a probe)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    kept, logged = [], []
    for step in range(1, STEPS + 1):
        if reset_each_step:
            torch.cuda.reset_peak_memory_stats()
        if probe is not None:
            probe.begin(step)
        t = torch.empty((STEPS + 1 - step) * 256 * MIB, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        del t
        kept.append(torch.empty(64 * MIB, dtype=torch.uint8, device="cuda"))
        if probe is not None:
            probe.end()
        torch.cuda.synchronize()
        logged.append([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()])
    own = []
    if probe is not None:
        own = [int(r["torch"]["allocated_bytes.all.peak"]) for r in list(probe.records)[-STEPS:]]
    del kept
    return logged, own


def main() -> None:
    from collector.probe.core import StepProbe
    from collector.probe.outbox import Outbox

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out: dict = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cases": {},
    }
    for reset_each in (False, True):
        pattern = "reset at each step" if reset_each else "never reset"
        bare, _ = loop(None, reset_each)
        probe = StepProbe(outbox=Outbox(None))
        with_probe, own = loop(probe, reset_each)
        probe.close()
        kept_probe = StepProbe(outbox=Outbox(None), reset_peaks=False)
        untouched, _ = loop(kept_probe, reset_each)
        kept_probe.close()
        # what the probe took as each step's peak must be the step's own, reset or not by the user
        probe_steps = [int(x) for x, _ in loop(None, True)[0]]
        out["cases"][pattern] = {
            "without probe (allocated, reserved peak per step)": bare,
            "with StepProbe()": with_probe,
            "with StepProbe(reset_peaks=False)": untouched,
            "probe's own allocated peak per step": own,
            "same as without the probe": with_probe == bare,
            "each step's own allocated peak (resetting at each step, no probe)": probe_steps,
            "probe's peaks are the steps' own": own == probe_steps,
        }
        print(pattern, "same as without the probe:", with_probe == bare)
        for name, rows in (("bare", bare), ("probe", with_probe), ("no-reset probe", untouched)):
            print(f"  {name:15s}", [f"{x / MIB:.0f}/{y / MIB:.0f} MiB" for x, y in rows])
        print(
            "  probe's own   ",
            [f"{x / MIB:.0f} MiB" for x in own],
            "= steps' own:",
            own == probe_steps,
        )
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
