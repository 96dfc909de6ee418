"""The estimate's twin of ``report_identity.py``: every committed estimate read and printed, and a
few estimates made afresh, written to a folder, so two trees (before and after a change to the
estimate's code) can be diffed byte for byte.

    python benchmarks/estimate_identity.py OUT_DIR [--tree PATH]

``--tree`` (default: this checkout) is the source tree whose ``collector`` runs. For each committed
``*.estimate.json`` under ``benchmarks/results``: the text ``render`` prints and the JSON
``to_dict`` writes back (the file format kept). Then ``stepmem estimate`` of the tiny shape as
the CLI plans it — plain, held against a 24 GiB card, with ``--max-batch`` on a small card, with an
allocator setting, and the distributed loop — as JSON, less the seconds the trace took.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from report_identity import keep  # noqa: E402

READ = """
import json, sys
from collector.estimate.render import render
from collector.model.prediction import load_estimate
est = load_estimate(__import__('pathlib').Path(sys.argv[1]))
print(render(est))
print(json.dumps(est.to_dict(), indent=1, sort_keys=True))
"""
FRESH = (
    ["--size", "tiny"],
    ["--size", "tiny", "--gpu", "24", "--batch", "4"],
    ["--size", "tiny", "--gpu", "1.8", "--seq-len", "512", "--max-batch", "--margin", "0"],
    ["--size", "tiny", "--gpu", "H200", "--alloc-conf", "expandable_segments:True"],
    ["--size", "tiny", "--workload", "distributed", "--world-size", "2"],
)
DROP = """
import json, sys
d = json.load(sys.stdin); d.pop('seconds', None)
print(json.dumps(d, indent=1, sort_keys=True))
"""


def jobs(tree: Path) -> list[tuple[str, list[str], str | None]]:
    boot = f"import sys; sys.path.insert(0, {str(tree.resolve())!r}); "
    out: list[tuple[str, list[str], str | None]] = []
    for est in sorted((ROOT / "benchmarks" / "results").rglob("*.estimate.json")):
        name = "read__" + str(est.relative_to(ROOT)).replace("/", "__")
        out.append((name, ["-c", boot + READ, str(est)], None))
    for flags in FRESH:
        code = boot + "from collector.cli import main; sys.exit(main())"
        out.append(("fresh__" + "_".join(flags), ["-c", code, "estimate", *flags, "--json"], DROP))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tree", type=Path, default=ROOT)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    todo = jobs(a.tree)
    for name, argv, post in todo:
        res = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT)
        stdout = res.stdout
        if post is not None and res.returncode == 0:
            stdout = subprocess.run(
                [sys.executable, "-c", post], input=stdout, capture_output=True, text=True
            ).stdout
        keep(a.out, name, res.returncode, stdout + res.stderr, digest)
    print(f"{len(todo)} estimates, sha256 {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
