"""#38's acceptance cases on the CPU: ``stepmem estimate --plan`` for a step that does not fit,
then the first plan's command run exactly as printed (it must say "Fits"). Each case's
output, the seconds it took, the steps traced and the first plan's verdict go to ``--out``.

    python benchmarks/plans.py --out benchmarks/results/plans
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "gpt2-large-8x1024-24gib": [
        "--config", "benchmarks/configs/gpt2-large.json", "--seq-len", "1024", "--batch", "8",
        "--no-checkpointing", "--gpu", "24",
    ],
    "7b-full-adamw-80gib": [
        "--size", "7b", "--optim", "adamw_torch", "--seq-len", "4096", "--batch", "1",
        "--gpu", "80",
    ],
    "7b-qlora-4x4096-24gib": [
        "--size", "7b", "--lora-r", "16", "--load-in-4bit", "--seq-len", "4096", "--batch", "4",
        "--no-checkpointing", "--gpu", "24",
    ],
}  # fmt: skip


def _estimate(args: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "collector", "estimate", *args],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    return p, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--case", choices=sorted(CASES), action="append")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.case or CASES:
        args = CASES[name]
        est = a.out / f"{name}.plan.json"
        est.unlink(missing_ok=True)
        p, seconds = _estimate([*args, "--plan", "--out", str(est)])
        (a.out / f"{name}.plan.txt").write_text(p.stdout)
        (a.out / f"{name}.plan.stderr").write_text(p.stderr)
        if p.returncode not in (0, 3):
            print(f"{name}: exit {p.returncode}\n{p.stderr[-2000:]}", file=sys.stderr)
            return 1
        plans = json.loads(est.read_text())["plans"]
        row = {
            "case": name,
            "command": "stepmem estimate " + shlex.join([*args, "--plan"]),
            "exit": p.returncode,
            "seconds": round(seconds, 1),
            "traces": plans["traces"],
            "reheld": plans["reheld"],
            "need": plans["need"],
            "usable": plans["usable"],
            "plans": [
                {k: q[k] for k in ("changes", "same_training", "need", "headroom", "command")}
                for q in plans["plans"]
            ],
        }
        if plans["plans"]:
            first = plans["plans"][0]["command"]
            check, _ = _estimate(first)
            row["first_plan_exit"] = check.returncode
            row["first_plan_says_fits"] = any(
                line.startswith("Fits: ") for line in check.stdout.splitlines()
            )
            (a.out / f"{name}.first-plan.txt").write_text(check.stdout)
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    (a.out / "plans.json").write_text(json.dumps(rows, indent=1) + "\n")
    (a.out / "table.md").write_text(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    """The cases as a markdown table: the step as asked, the search's work, its first plans."""
    gib = 1 << 30
    out = [
        "| case | as asked needs | traces (re-held) | seconds | plans that fit | first plan "
        "| first plan run as printed |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]  # fmt: skip
    for r in rows:
        first = r["plans"][0] if r["plans"] else None
        same = sum(1 for p in r["plans"] if p["same_training"])
        said = f"{'; '.join(first['changes'])} ({first['need'] / gib:.2f} GiB)" if first else "none"
        fits = "says it fits" if r.get("first_plan_says_fits") else "—"
        out.append(
            f"| {r['case']} | {r['need'] / gib:.2f} GiB of {r['usable'] / gib:.2f} | "
            f"{r['traces']} ({r['reheld']}) | {r['seconds']:.0f} | {len(r['plans'])} "
            f"({same} the same training) | {said} | {fits} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
