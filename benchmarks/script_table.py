"""Users' own scripts (#30), estimated and measured side by side on the H200: for each script of
``benchmarks/scripts`` run by ``benchmarks/device/h200_scripts.sh``, ``stepmem estimate --script``
(fake CUDA tensors) against ``stepmem run --script`` (the same arguments, measured): parameters
and optimizer state (the probe's ledger at a step end), each step's allocated and reserved peaks
and NVML's within-step peak, through the same reconciliation ``stepmem report --estimate``
prints.

    python benchmarks/script_table.py benchmarks/results/scripts             # the H200's estimates
    python benchmarks/script_table.py benchmarks/results/scripts --est cpu   # this machine's
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1 << 30
ROWS = {  # the reconciliation's rows the table keeps, by the start of their name
    "parameters": "parameters",
    "optimizer state (device)": "state (device)",
    "optimizer state (managed)": "state (managed)",
    "NVML used": "NVML peak 2",
}
# the two traced steps' rows, named with the run's own step numbers (a loop may count from 0):
# by their order
PEAKS = {"allocated peak": "alloc peak", "reserved peak": "resv peak"}


def _row(name: str, est_path: Path, run_path: Path) -> dict:
    from collector.analysis.predicted_vs_measured import reconcile
    from collector.analysis.runs import load_run
    from collector.model.prediction import load_estimate

    est = load_estimate(est_path)
    run = load_run(run_path)
    uuid = run.gpus[0]
    main = max(run.streams_of(uuid), key=lambda s: len(s.records))
    rows, _named = reconcile(est, main.records)
    out = {"name": name, "estimate_seconds": est.seconds, "figures": {}}
    seen: dict[str, int] = {}
    for r in rows:
        key = next((v for k, v in ROWS.items() if r.component.startswith(k)), None)
        peak = next((v for k, v in PEAKS.items() if r.component.endswith(k)), None)
        if key is None and peak is not None and r.component.startswith("step "):
            seen[peak] = seen.get(peak, 0) + 1
            key = f"{peak} {seen[peak]}"
        if key is None or r.predicted is None or r.measured is None:
            continue
        err = (r.predicted - r.measured) / r.measured if r.measured else None
        out["figures"][key] = {"predicted": r.predicted, "measured": r.measured, "error": err}
    return out


def _md(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r["figures"]))
    head = "| script | " + " | ".join(keys) + " | estimate s |"
    lines = [head, "|" + " --- |" * (len(keys) + 2)]
    for r in rows:
        cells = []
        for k in keys:
            f = r["figures"].get(k)
            if f is None:
                cells.append("—")
            elif k.startswith(("parameters", "state")):
                same = "= " if f["predicted"] == f["measured"] else ""
                cells.append(
                    f"{same}{f['predicted'] / GIB:.3f} / {f['measured'] / GIB:.3f}"
                    + ("" if same else f" ({f['predicted'] - f['measured']:+,} B)")
                )
            else:
                cells.append(
                    f"{f['predicted'] / GIB:.2f} / {f['measured'] / GIB:.2f} ({f['error']:+.1%})"
                )
        lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {r['estimate_seconds']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, help="the unpacked result of h200_scripts.sh")
    p.add_argument(
        "--est",
        default="est",
        help="the folder of estimates under DIR (default est: the H200's; cpu: this machine's)",
    )
    a = p.parse_args()
    rows = []
    for est in sorted((a.dir / a.est).glob("*.estimate.json")):
        name = est.name.removesuffix(".estimate.json")
        run = a.dir / "runs" / f"h200-{name}"
        if not run.is_dir():
            print(f"{name}: no run store ({run})", file=sys.stderr)
            continue
        rows.append(_row(name, est, run))
    md = _md(rows)
    print("GiB, predicted / measured (error); '=': equal to the byte\n")
    print(md)
    stem = "table" if a.est == "est" else f"table-{a.est}"
    (a.dir / f"{stem}.md").write_text(
        "GiB, predicted / measured (error); '=': equal to the byte\n\n" + md + "\n"
    )
    (a.dir / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
