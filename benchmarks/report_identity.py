"""Every report stepmem can print of the committed data, written to a folder, so that two trees
(before and after a change to the code that reads runs) can be diffed byte for byte.

    python benchmarks/report_identity.py OUT_DIR [--tree PATH]

``--tree`` (default: this checkout) is the source tree whose ``collector`` renders; the data is
always this checkout's (every committed capture, run store and records file, and the committed
estimates reconciled with the runs they were made for, ``report --estimate``). Each report is
rendered plain, ``--verbose`` and ``--all-steps``. The committed result of comparing the tree
before the ground-floor vocabulary (#28) with the tree after it is in
``results/structure/report-identity.txt``.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EST = ROOT / "benchmarks" / "results" / "estimate"
RECONCILE = {  # estimate file stem → the run it estimates (benchmarks/results/estimate/README)
    "-7b-adamw_8bit": "captures/adamw_8bit.capture.parquet",
    "-7b-paged_adamw_8bit": "captures/paged_adamw_8bit.capture.parquet",
    "-1b-fsdp2": "benchmarks/results/h200-distributed/runs/h200-1b-fsdp2",
}


def sources() -> list[Path]:
    caps = sorted((ROOT / "captures").glob("*.capture.parquet"))
    stores = sorted(p.parent for p in (ROOT / "benchmarks" / "results").rglob("meta.json"))
    records = sorted((ROOT / "benchmarks" / "results").rglob("*.records.json"))
    return caps + stores + records


def jobs() -> list[tuple[str, list[str]]]:
    out = []
    for src in sources():
        name = str(src.relative_to(ROOT)).replace("/", "__")
        for flags in ([], ["--verbose"], ["--all-steps"]):
            out.append((name + "".join(flags), ["report", str(src), *flags]))
    for est in sorted(EST.glob("*.estimate.json")):
        for suffix, run in RECONCILE.items():
            if est.name.endswith(f"{suffix}.estimate.json"):
                out.append(
                    (f"reconcile__{est.stem}", ["report", str(ROOT / run), "--estimate", str(est)])
                )
    return out


def keep(out: Path, name: str, returncode: int, output: str, digest) -> None:
    """One command's exit status and output: written to ``OUT/NAME.txt``, added to the digest,
    and said (``estimate_identity.py`` keeps its own the same way)."""
    text = f"exit {returncode}\n{output}"
    (out / f"{name}.txt").write_text(text)
    digest.update(name.encode() + text.encode())
    print(f"{name}: exit {returncode}, {len(text)} chars", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tree", type=Path, default=ROOT)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    env_code = (
        f"import sys; sys.path.insert(0, {str(a.tree.resolve())!r}); "
        "from collector.cli import main; sys.exit(main())"
    )
    digest = hashlib.sha256()
    for name, argv in jobs():
        res = subprocess.run(
            [sys.executable, "-c", env_code, *argv], capture_output=True, text=True, cwd=ROOT
        )
        keep(a.out, name, res.returncode, res.stdout + res.stderr, digest)
    print(f"{len(jobs())} reports, sha256 {digest.hexdigest()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
