"""#38 on the GPU: plans made on a CPU, trained on a GPU. ``plan`` runs ``stepmem estimate
--plan`` here (no GPU) for three models on two card sizes each, keeping the optimizer, LoRA and
FSDP2 (``--keep``: the plans are then the ones ``benchmarks/fit_loop.py`` trains — micro-batches,
checkpointing, expandable segments, shorter sequences). ``run``, on the GPU, trains the step as
asked and the top plans of each search for three steps with torch capped at what the card
leaves (``fit_loop.py --card-gib``, the bytes ``--gpu`` holds a step against) and writes the
table: the step as asked should run out of memory, each plan should not. Beside it, Accelerate's
``find_executable_batch_size`` on the step as asked: the GPU runs it needs to find a batch.

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
    ("gpt2-large", ["--config", f"{CONFIGS}/gpt2-large.json"], ["--batch", "8"], (20, 24)),
    ("llama-small", ["--size", "small"], ["--batch", "16", "--seq-len", "2048"], (12, 24)),
]  # fmt: skip
STEP = ["--optim", "adamw_torch", "--grad-accum", "2", "--no-checkpointing", "--margin", "2"]
SEQ = ["--seq-len", "1024"]  # unless a case names its own


def _args(model: list[str], step: list[str], gib: int) -> list[str]:
    seq = [] if "--seq-len" in step else SEQ
    return [*model, *step, *seq, *STEP, "--gpu", str(gib)]


def plan(out: Path, only: list[str] | None = None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for name, model, step, cards in CASES:
        for gib in cards:
            case = f"{name}-{gib}gib"
            if only and case not in only:
                continue
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


def run(plans: Path, out: Path, only: list[str] | None = None) -> int:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for f in sorted(plans.glob("*.json")):
        if only and f.stem not in only:
            continue
        doc = json.loads(f.read_text())
        r = doc["plans"]
        original = _original(f)
        rows.append(
            {"case": f.stem, "plan": "as asked", "predicted": r["need"], **_train(original)}
        )
        rows[-1].update(_finder_in_child(original))
        _keep(out, rows[-1])
        for i, p in enumerate(r["plans"][:TOP], 1):
            row = {
                "case": f.stem,
                "plan": f"{i}. " + "; ".join(p["changes"]),
                "predicted": p["need"],
            }
            rows.append({**row, "command": p["command"], **_train(p["command"])})
            _keep(out, rows[-1])
    (out / "table.md").write_text(table(rows))
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    (out / "plan_check.json").write_text(
        json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1) + "\n"
    )
    return 0


def finder(command: list[str]) -> dict:
    """Accelerate's ``find_executable_batch_size`` on the step as asked (on the GPU): the loop
    trained from the asked micro-batch down, as Accelerate shrinks it after each out-of-memory
    error (the micro-batches a step kept, so the global batch shrinks with it); how many runs
    it took and ran out, and the batch it found."""
    import contextlib
    import io

    import fit_loop
    import torch
    from accelerate.utils import find_executable_batch_size

    args, _env, spec = _loop_args(command)
    runs: list[int] = []
    t0 = time.monotonic()

    @find_executable_batch_size(starting_batch_size=spec["batch"])
    def train(batch_size: int) -> int:
        runs.append(batch_size)
        at = list(args)
        at[at.index("--batch") + 1] = str(batch_size)
        with contextlib.redirect_stdout(io.StringIO()):
            rc = fit_loop.main([*at, "--no-probe"])
        if rc == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. (fit_loop.py)")
        return batch_size

    found: int | None
    try:
        found = train()
    except RuntimeError:  # no batch fits: Accelerate gives up
        found = None
    return {
        "finder_runs": len(runs),
        "finder_out_of_memory": len(runs) - (1 if found else 0),
        "finder_batches": runs,
        "finder_found": found,
        "finder_seconds": round(time.monotonic() - t0, 1),
    }


def table(rows: list[dict]) -> str:
    """The rows as a markdown table: each plan's predicted and measured reserved peak and
    whether it trained; Accelerate's finder beside the step as asked."""
    gib = 1 << 30
    out = [
        "| case | plan | predicted reserved | measured reserved peak | three steps | "
        "Accelerate's finder (GPU runs, out of memory, batch found) |",
        "| --- | --- | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        got = "—" if r.get("reserved_peak") is None else f"{r['reserved_peak'] / gib:.2f} GiB"
        ran = (
            f"out of memory in step {r['oom_step']}"
            if r.get("oom")
            else f"trained ({r['retries']} cache flushes)"
            if r.get("exit") == 0
            else f"exit {r.get('exit')}"
        )
        finder = (
            f"{r['finder_runs']} runs, {r['finder_out_of_memory']} out of memory, "
            f"micro-batch {r['finder_found']} × 2"
            if "finder_runs" in r
            else ""
        )
        out.append(
            f"| {r['case']} | {r['plan']} | {r['predicted'] / gib:.2f} GiB | {got} | {ran} | "
            f"{finder} |"
        )
    return "\n".join(out) + "\n"


def _keep(out: Path, row: dict) -> None:
    """A row printed and appended to ``rows.jsonl`` as it comes (a run cut short keeps it)."""
    line = json.dumps(row)
    print(line, flush=True)
    with open(out / "rows.jsonl", "a") as f:
        f.write(line + "\n")


def _finder_in_child(command: list[str]) -> dict:
    p = subprocess.run(
        [sys.executable, "benchmarks/plan_check.py", "finder", "--", *command],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"finder_error": p.stderr[-1500:]}


def _original(f: Path) -> list[str]:
    """The step as asked: the search's command line, without --plan and --keep."""
    line = f.with_suffix(".txt").read_text().splitlines()[0].removeprefix("$ stepmem estimate ")
    words = line.split()
    cut = words.index("--plan")
    return words[:cut]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    pl = sub.add_parser("plan")
    pl.add_argument("--out", type=Path, required=True)
    pl.add_argument("--case", action="append", help="only this case (NAME-GIBgib)")
    r = sub.add_parser("run")
    r.add_argument("--plans", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--case", action="append", help="only this case (NAME-GIBgib)")
    sub.add_parser("finder").add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("table").add_argument("rows", type=Path, help="a run's rows.jsonl")
    a = ap.parse_args()
    if a.what == "table":
        rows = [json.loads(line) for line in a.rows.read_text().splitlines() if line.strip()]
        print(table(rows), end="")
        return 0
    if a.what == "finder":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        print(json.dumps(finder([c for c in a.command if c != "--"])))
        return 0
    return plan(a.out, a.case) if a.what == "plan" else run(a.plans, a.out, a.case)


if __name__ == "__main__":
    sys.exit(main())
