"""#38 on the GPU: plans made on a CPU, trained on a GPU. ``plan`` runs ``stepmem estimate
--plan`` here (no GPU) for three models on two card sizes each, keeping the optimizer, LoRA and
FSDP2 (``--keep``: the plans are then the ones ``benchmarks/fit_loop.py`` trains — micro-batches,
checkpointing, expandable segments, shorter sequences). ``run``, on the GPU, trains the step as
asked and the top plans of each search for three steps with torch capped at what the card
leaves (``fit_loop.py --card-gib``, the bytes ``--gpu`` holds a step against) and writes the
table: the step as asked should run out of memory, each plan should not.

    python benchmarks/plan_check.py plan --out benchmarks/results/plans/gpu
    python benchmarks/plan_check.py run --plans benchmarks/results/plans/gpu --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIGS = "benchmarks/configs"
KEEP = "optim,lora,fsdp2"  # what fit_loop.py cannot train: the plans keep them
TOP = 2  # plans trained a search

# (case, the model's flags, the step's flags, the card sizes in GiB)
CASES = [
    ("gpt2-medium", ["--config", f"{CONFIGS}/gpt2-medium.json"], ["--batch", "8"], (12, 16)),
    ("gpt2-large", ["--config", f"{CONFIGS}/gpt2-large.json"], ["--batch", "8"], (16, 24)),
    ("llama-small", ["--size", "small"], ["--batch", "16", "--seq-len", "2048"], (12, 24)),
]  # fmt: skip
STEP = ["--optim", "adamw_torch", "--grad-accum", "2", "--no-checkpointing", "--margin", "2"]
SEQ = ["--seq-len", "1024"]  # unless a case names its own


def _args(model: list[str], step: list[str], gib: int) -> list[str]:
    seq = [] if "--seq-len" in step else SEQ
    return [*model, *step, *seq, *STEP, "--gpu", str(gib)]


def plan(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for name, model, step, cards in CASES:
        for gib in cards:
            case = f"{name}-{gib}gib"
            args = [*_args(model, step, gib), "--plan", "--keep", KEEP]
            t0 = time.monotonic()
            est = ["--out", str(out / f"{case}.json"), "--force"]
            p = subprocess.run(
                [sys.executable, "-m", "collector", "estimate", *args, *est],
                cwd=ROOT, capture_output=True, text=True, check=False,
            )  # fmt: skip
            (out / f"{case}.txt").write_text(
                f"$ stepmem estimate {' '.join(args)}\n\n{p.stdout}\n{p.stderr}"
            )
            print(f"{case}: exit {p.returncode}, {time.monotonic() - t0:.0f} s", flush=True)
            if p.returncode not in (0, 3):
                print(p.stderr[-3000:], file=sys.stderr)
                return 1
    return 0


def _loop_args(command: list[str]) -> tuple[list[str], dict[str, str], dict]:
    """fit_loop.py's arguments and environment for a plan's command (planned as the CPU
    planned it), and the spec."""
    from collector.cli.subcommands import build_parser
    from collector.estimate.request import EstimateFlags, plan_estimate

    flags = EstimateFlags.of(build_parser().parse_args(["estimate", *command]))
    spec = plan_estimate(flags, cuda=False).spec
    assert spec is not None and spec.optim == "adamw_torch" and not spec.lora_r
    args = ["--config", str(flags.config)] if flags.config else ["--size", str(spec.size)]
    args += ["--seq-len", str(spec.seq_len), "--batch", str(spec.batch)]
    args += ["--grad-accum", str(spec.grad_accum), "--card-gib", str(flags.gpu), "--steps", "3"]
    args += [] if spec.checkpointing else ["--no-checkpointing"]
    args += [] if spec.bf16 else ["--no-bf16"]
    env = {"PYTORCH_CUDA_ALLOC_CONF": flags.alloc_conf} if flags.alloc_conf else {}
    return args, env, {"batch": spec.batch, "grad_accum": spec.grad_accum, "seq_len": spec.seq_len}


def _train(command: list[str]) -> dict:
    args, env, spec = _loop_args(command)
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "benchmarks/fit_loop.py", *args, "--no-probe"],
        cwd=ROOT, capture_output=True, text=True, check=False, env={**os.environ, **env},
        timeout=300,
    )  # fmt: skip
    last = (p.stdout.strip().splitlines() or ["{}"])[-1]
    try:
        got = json.loads(last)
    except ValueError:
        got = {"error": p.stderr[-1500:]}
    steps = got.get("steps") or []
    return {
        "fit_loop": args,
        "env": env,
        "spec": spec,
        "exit": p.returncode,
        "oom": got.get("oom"),
        "oom_step": got.get("oom_step"),
        "steps_trained": len(got.get("step_times_s") or []),
        "reserved_peak": max((s["reserved_peak"] for s in steps), default=None),
        "allocated_peak": max((s["allocated_peak"] for s in steps), default=None),
        "retries": got.get("retries"),
        "memory_fraction": got.get("memory_fraction"),
        "seconds": round(time.monotonic() - t0, 1),
        "error": got.get("error"),
    }


def run(plans: Path, out: Path) -> int:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for f in sorted(plans.glob("*.json")):
        doc = json.loads(f.read_text())
        r = doc["plans"]
        original = _original(f)
        rows.append(
            {"case": f.stem, "plan": "as asked", "predicted": r["need"], **_train(original)}
        )
        print(json.dumps(rows[-1]), flush=True)
        for i, p in enumerate(r["plans"][:TOP], 1):
            row = {
                "case": f.stem,
                "plan": f"{i}. " + "; ".join(p["changes"]),
                "predicted": p["need"],
            }
            rows.append({**row, "command": p["command"], **_train(p["command"])})
            print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    (out / "plan_check.json").write_text(
        json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1) + "\n"
    )
    return 0


def _original(f: Path) -> list[str]:
    """The step as asked: the search's command line, without --plan and --keep."""
    line = f.with_suffix(".txt").read_text().splitlines()[0].removeprefix("$ stepmem estimate ")
    words = line.split()
    cut = words.index("--plan")
    return words[:cut]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("plan").add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--plans", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    return plan(a.out) if a.what == "plan" else run(a.plans, a.out)


if __name__ == "__main__":
    sys.exit(main())
