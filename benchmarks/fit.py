"""Will it fit? (#29) The estimate of every benchmark row against what the H200 measured: torch's
allocated and reserved peaks and NVML's within-step peak, predicted (the allocator model and the
calibrated outside-torch bytes) beside measured, with the median and worst error; and, side by
side, what torch's ``MemTracker`` alone, Accelerate's ``estimate-memory`` and DeepSpeed's
model-state formula would have said of the same step.

    python benchmarks/fit.py estimate DIR [--rows NAME ...]   # stepmem estimate of each row
    python benchmarks/fit.py table --gpu DIR --cpu DIR --out benchmarks/results/fit

``estimate`` runs ``stepmem estimate ROW --gpu H200 --margin 0 --out`` of every row into
``DIR/<row>.json`` (on the GPU machine: fake CUDA tensors; elsewhere: the CPU standing in).
``table`` reads those estimates and the rows' measured records
(``benchmarks/results/fit/<row>.records.json``), prints the table and writes ``fit.md`` and
``fit.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1 << 30
MEASURED = ROOT / "benchmarks/results/fit"
CONFIGS = "benchmarks/configs"

# (row, its run id on the H200, the estimate's flags for the loop that run trained)
ROWS: list[tuple[str, str, list[str]]] = [
    (
        "7B `adamw_8bit` (HF Trainer)",
        "h200-fit-7b-adamw_8bit",
        ["--size", "7b", "--optim", "adamw_8bit", "--seq-len", "4096"],
    ),
    (
        "7B `paged_adamw_8bit` (HF Trainer)",
        "h200-fit-7b-paged",
        ["--size", "7b", "--optim", "paged_adamw_8bit", "--seq-len", "4096"],
    ),
    (
        "3B Llama, `adamw_torch`, 2 × 2048",
        "h200-fit-3b",
        ["--size", "3b", "--optim", "adamw_torch", "--seq-len", "2048", "--batch", "2"],
    ),
    (
        "Qwen2-1.5B (grouped KV), `adamw_torch`, 4 × 2048",
        "h200-fit-qwen2",
        [
            "--config",
            f"{CONFIGS}/qwen2-1.5b.json",
            "--optim",
            "adamw_torch",
            "--seq-len",
            "2048",
            "--batch",
            "4",
        ],
    ),
    (
        "GPT-2 medium, no checkpointing, 8 × 1024",
        "h200-fit-gpt2",
        [
            "--config",
            f"{CONFIGS}/gpt2-medium.json",
            "--optim",
            "adamw_torch",
            "--no-checkpointing",
            "--seq-len",
            "1024",
            "--batch",
            "8",
        ],
    ),
    (
        "1B FSDP2 (world size 1), fp32, 4 × 1024",
        "h200-fit-1b-fsdp2",
        [
            "--workload",
            "distributed",
            "--shard",
            "fsdp2",
            "--size",
            "1b",
            "--seq-len",
            "1024",
            "--batch",
            "4",
        ],
    ),
]


def _estimate(out: Path, names: list[str] | None, parallel: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    running = []
    for _row, run, flags in ROWS:
        if names and run not in names:
            continue
        cmd = [sys.executable, "-m", "collector.cli", "estimate", *flags]
        cmd += ["--gpu", "H200", "--margin", "0", "--out", str(out / f"{run}.json")]
        log = (out / f"{run}.txt").open("w")
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        running.append((run, p, log, time.perf_counter()))
        if not parallel:
            _wait(*running.pop())
    for r in running:
        _wait(*r)
    return 0


def _wait(run: str, p: subprocess.Popen, log, t0: float) -> None:
    try:
        rc = p.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
    log.close()
    print(f"{run}: exit {rc}, {time.perf_counter() - t0:.1f} s", flush=True)


def measured(run: str) -> dict[str, int]:
    """The run's largest step peaks: torch's allocated and reserved, NVML's within-step."""
    recs = json.loads((MEASURED / f"{run}.records.json").read_text())["records"]
    return {
        "allocated": max(r["torch_allocated_peak_bytes"] for r in recs),
        "reserved": max(r["torch_reserved_peak_bytes"] for r in recs),
        "nvml": max(r["nvml_peak_bytes"] for r in recs),
    }


def _others(est: dict, flags: list[str]) -> dict[str, int]:
    """What other tools would have said of the same step (bytes): torch's MemTracker alone
    (allocated tensors, step 1 or 2, whichever is larger); Accelerate's ``estimate-memory``
    (``estimate_training_usage``: the model's bytes × 4 in float32, × 2 under float16/bfloat16
    mixed precision, its largest stage); DeepSpeed's model-state estimators (ZeRO-2 without
    offload, ``4P + 16P/N``, for one GPU; ZeRO-3, ``18P/N`` + the largest layer's 4 bytes a
    parameter, for FSDP2)."""
    p = est["parameters_count"]
    fp32 = "--fp32" in flags or "distributed" in flags
    tracker = max(sum(est["steady"].values()), sum(est["first"].values()))
    n = int(est["spec"].get("world_size") or 1)
    if est["spec"].get("shard") == "fsdp2":
        largest = _largest_layer(est)
        deepspeed = 18 * p // n + 4 * largest
    else:
        deepspeed = 4 * p + 16 * p // n
    return {
        "memtracker": tracker,
        "accelerate": 4 * p * (4 if fp32 else 2),
        "deepspeed": deepspeed,
    }


def _largest_layer(est: dict) -> int:
    """The most parameters one module holds directly (DeepSpeed's ``largest_layer_params``),
    of the row's model built on the meta device."""
    import torch

    from collector.estimate import build
    from collector.estimate.spec import Spec

    spec = Spec(**est["spec"])
    with torch.device("meta"):
        model = build.build_model(spec)
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def _err(pred: int, real: int) -> float:
    return (pred - real) / real


def _table(gpu: Path, cpu: Path | None, out: Path | None) -> int:
    lines = [
        "| row | allocated: predicted / measured | reserved | NVML | NVML error "
        "| CPU estimate vs GPU (NVML) | MemTracker alone | Accelerate | DeepSpeed |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows, nvml_errors, cpu_gaps = [], [], []
    for name, run, flags in ROWS:
        f = gpu / f"{run}.json"
        if not f.exists():
            print(f"{run}: no GPU estimate in {gpu}", file=sys.stderr)
            continue
        est = json.loads(f.read_text())
        m = measured(run)
        steps = est["steps"]
        pred = {
            "allocated": max(s["allocated_peak"] for s in steps),
            "reserved": max(s["reserved_peak"] for s in steps),
        }
        pred["nvml"] = pred["reserved"] + est["outside_torch"] + est["optimizer_state_managed"]
        errs = {k: _err(pred[k], m[k]) for k in pred}
        nvml_errors.append(errs["nvml"])
        row = {"row": name, "run": run, "predicted": pred, "measured": m, "errors": errs}
        gap = ""
        c = (cpu / f"{run}.json") if cpu else None
        if c is not None and c.exists():
            ce = json.loads(c.read_text())
            cn = max(s["reserved_peak"] for s in ce["steps"]) + ce["outside_torch"]
            cn += ce["optimizer_state_managed"]
            row["cpu_nvml"] = cn
            row["cpu_vs_gpu"] = _err(cn, pred["nvml"])
            row["cpu_seconds"] = ce["seconds"]
            cpu_gaps.append(row["cpu_vs_gpu"])
            gap = f"{row['cpu_vs_gpu']:+.2%}"
        o = _others(est, flags)
        row["others"] = {k: {"bytes": v, "error": _err(v, m["nvml"])} for k, v in o.items()}
        row["gpu_seconds"] = est["seconds"]
        rows.append(row)

        pair = {k: f"{pred[k] / GIB:.2f} / {m[k] / GIB:.2f} ({errs[k]:+.1%})" for k in pred}
        other = {k: f"{v / GIB:.2f} ({_err(v, m['nvml']):+.0%})" for k, v in o.items()}
        lines.append(
            f"| {name} | {pair['allocated']} | {pair['reserved']} | {pair['nvml']} "
            f"| {errs['nvml']:+.2%} | {gap or '—'} | {other['memtracker']} "
            f"| {other['accelerate']} | {other['deepspeed']} |"
        )
    if not rows:
        return 1
    absn = [abs(e) for e in nvml_errors]
    summary = (
        f"NVML peak error over {len(rows)} rows: median {statistics.median(absn):.2%}, "
        f"worst {max(absn):.2%}"
    )
    if cpu_gaps:
        summary += f"; CPU estimate vs GPU estimate: worst {max(map(abs, cpu_gaps)):.2%}"
    lines += ["", summary]
    text = "\n".join(lines)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "fit.md").write_text(text + "\n")
        (out / "fit.json").write_text(
            json.dumps(
                {"rows": rows, "median_nvml_error": statistics.median(absn), "worst": max(absn)},
                indent=1,
            )
            + "\n"
        )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("estimate")
    e.add_argument("dir", type=Path)
    e.add_argument("--rows", nargs="*", help="run ids (default: every row)")
    e.add_argument("--parallel", action="store_true", help="every row at once")
    t = sub.add_parser("table")
    t.add_argument("--gpu", type=Path, required=True, help="the GPU's estimates")
    t.add_argument("--cpu", type=Path, help="the same estimates made without a GPU")
    t.add_argument("--out", type=Path)
    a = p.parse_args()
    if a.cmd == "estimate":
        return _estimate(a.dir, a.rows, a.parallel)
    return _table(a.gpu, a.cpu, a.out)


if __name__ == "__main__":
    sys.exit(main())
