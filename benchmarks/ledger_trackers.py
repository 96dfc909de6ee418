"""The ledger against PyTorch's own memory trackers, category by category, on the same step.

On this machine: ``torchrun`` with 2 gloo ranks of ``workloads.distributed`` (tiny Llama) under
FSDP2, DDP (with and without ``gradient_as_bucket_view``) and no sharding, step 2 of each rank
under ``FSDPMemTracker`` (FSDP2) or ``MemTracker`` beside the probe's ledger for that step. Then
the same comparison read from the H200 runs (``benchmarks/results/h200-distributed/track-*``:
world size 1, NCCL, ~1.1B Llama) if they are there. Writes ``ledger_trackers.json`` and
``table.md`` into ``--out``.

    python benchmarks/ledger_trackers.py --out benchmarks/results/ledger-trackers
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
H200 = ROOT / "benchmarks" / "results" / "h200-distributed"
PAIRS = {  # the ledger's kind → the tracker's category, per tracker
    "FSDPMemTracker": {
        "parameters": "Sharded Param",
        "gradients": "Sharded Grad",
        "optimizer_state": "OptState",
        "unsharded_parameters_peak": "unsharded peak",
    },
    "MemTracker": {
        "parameters": "Parameter",
        "gradients": "Gradient",
        "optimizer_state": "Optstate",
        "gradient_buckets": "Activation",  # where MemTracker files DDP's buckets
    },
}
RUNS = {
    "fsdp2": ["--shard", "fsdp2"],
    "ddp": ["--shard", "ddp"],
    "ddp, bucket view": ["--shard", "ddp", "--bucket-view"],
    "none": ["--shard", "none"],
}


def compare(track: dict, tracker: str, device: str) -> dict[str, dict[str, int]]:
    cur = track["current"][device]
    led = track["ledger"]
    out = {}
    for kind, category in PAIRS[tracker].items():
        theirs = (
            track["unsharded_param_peak"] if category == "unsharded peak" else cur.get(category)
        )
        if kind == "gradient_buckets" and not led.get(kind):
            continue  # no second copy (bucket views, no DDP): nothing for the tracker to miss
        if kind in led and theirs is not None:
            out[kind] = {"stepmem": int(led[kind]), "tracker": int(theirs), "category": category}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    for name, extra in RUNS.items():
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "workloads.distributed"]
            cmd += [*extra, "--steps", "3", "--track", f"{tmp}/t"]
            print(" ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
            tracker = "FSDPMemTracker" if "fsdp2" in extra else "MemTracker"
            for rank in (0, 1):
                track = json.loads(Path(f"{tmp}/t.rank{rank}.json").read_text())
                rows.append(
                    {"where": "CPU, 2 gloo ranks (torchrun), tiny Llama", "run": name,
                     "rank": rank, "tracker": tracker, "pairs": compare(track, tracker, "cpu")}
                )  # fmt: skip
    for shard, tracker in (("fsdp2", "FSDPMemTracker"), ("ddp", "MemTracker")):
        path = H200 / f"track-{shard}.rank0.json"
        if path.exists():
            track = json.loads(path.read_text())
            rows.append(
                {"where": "H200, Ray Train, NCCL, 1.1B Llama", "run": shard, "rank": 0,
                 "tracker": tracker, "pairs": compare(track, tracker, "cuda:0")}
            )  # fmt: skip
    (a.out / "ledger_trackers.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "| where | run | rank | kind | stepmem (bytes) | tracker: category (bytes) | diff |",
        "| --- | --- | ---: | --- | ---: | --- | ---: |",
    ]
    for r in rows:
        for kind, p in r["pairs"].items():
            diff = (p["stepmem"] - p["tracker"]) / p["tracker"] if p["tracker"] else 0.0
            lines.append(
                f"| {r['where']} | {r['run']} | {r['rank']} | {kind} | {p['stepmem']:,} | "
                f"{r['tracker']}: {p['category']} ({p['tracker']:,}) | {100 * diff:+.2f} % |"
            )
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
