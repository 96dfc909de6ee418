"""The allocator model against the real allocator (#29): every committed allocation history
(recorded on the H200 by stepmem's probe, steps 1-3) replayed request by request through
``collector.estimate.allocator``; per history the requests, the blocks placed at the real
address, the segments (or mapped pages) got from the driver at the same request, and torch's
reserved bytes at each step end, real against modelled.

    python benchmarks/allocator_replay.py --out benchmarks/results/allocator
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1 << 30


def main() -> int:
    from collector.analysis.allocator_vs_history import replay_history

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    paths = sorted(
        q
        for q in (ROOT / "benchmarks/results").rglob("history-steps-*.pickle*")
        if q.stat().st_size > 50_000
    )
    rows, lines = [], []
    lines.append(
        "| history | settings | requests | at the real address | driver calls matched "
        "| reserved at step ends, real → model (GiB) | worst error | cache at step 2 |"
    )
    lines.append("| --- | --- | ---: | ---: | ---: | --- | ---: | ---: |")
    worst = 0.0
    for q in paths:
        t0 = time.perf_counter()
        r = replay_history(q)
        d = r.to_dict()
        d["source"] = str(q.relative_to(ROOT))
        d["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(d)
        worst = max(worst, r.worst_error)
        ends = ", ".join(f"{s.real / GIB:.3f} → {s.model / GIB:.3f}" for s in r.steps)
        name = "/".join(q.relative_to(ROOT / "benchmarks/results").parts[:-1])
        lines.append(
            f"| {name} | {r.config.describe()} | {r.requests:,} | {r.addresses_matched:,} "
            f"| {r.segments_matched} of {len(r.segments_real)} | {ends} | {r.worst_error:.3%} "
            f"| {r.steps[1].cache_share if len(r.steps) > 1 else 0:.0%} |"
        )
        print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay.json").write_text(
        json.dumps({"histories": rows, "worst_step_end_error": worst}, indent=1) + "\n"
    )
    (args.out / "replay.md").write_text("\n".join(lines) + "\n")
    print(f"{len(rows)} histories; worst step-end error {worst:.3%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
