"""fp16 with ``GradScaler``: the estimate against the same script run for real on the GPU.

``GradScaler.step`` reads ``found_inf`` and steps the optimizer only when it is zero. Under the
estimate that read has no data; answered with the float placeholder (1.0) every step was
skipped: no optimizer state in the estimate. Now it is answered as a healthy run answers it.
This runs ``benchmarks/scripts/fp16_scaler.py`` for real (torch's own counters at each step
end) and under ``stepmem estimate --script`` on the same GPU, and writes both with their ratio.

    python benchmarks/grad_scaler.py --out benchmarks/results/grad_scaler
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "scripts" / "fp16_scaler.py"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    args = ["--batch", str(a.batch), "--steps", "4"]
    real = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    if real.returncode:
        print(real.stderr[-3000:], file=sys.stderr)
        return 1
    steps = [json.loads(x) for x in real.stdout.splitlines() if x.startswith("{")]
    est_file = a.out / "fp16_scaler.estimate.json"
    est = subprocess.run(
        [sys.executable, "-m", "collector.cli", "estimate", "--script", str(SCRIPT),
         "--out", str(est_file), "--force", "--", *args],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    (a.out / "fp16_scaler.estimate.txt").write_text(est.stdout + est.stderr)
    if est.returncode:
        print(est.stdout + est.stderr, file=sys.stderr)
        return 1
    e = json.loads(est_file.read_text())
    step2 = steps[1]
    predicted_end = sum(e["at_end"].values())
    predicted_peak = e["steps"][-1]["allocated_peak"]
    table = {
        "device": subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip(),
        "torch": e["torch"],
        "real_steps": steps,
        "estimate_optimizer": e["spec"]["optim"],
        "estimate_optimizer_state": e["at_end"].get("optimizer_state", 0),
        "real_optimizer_state": step2["optimizer_state"],
        "estimate_step2_end_allocated_components": predicted_end,
        "real_step2_end_allocated": step2["allocated"],
        "estimate_step2_allocated_peak": predicted_peak,
        "real_step2_peak": step2["peak"],
        "ratio_state": e["at_end"].get("optimizer_state", 0) / step2["optimizer_state"],
        "ratio_peak": predicted_peak / step2["peak"],
    }
    (a.out / "grad_scaler.json").write_text(json.dumps(table, indent=1) + "\n")
    print(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
