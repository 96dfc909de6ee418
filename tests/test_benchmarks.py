"""The benchmark runner and the fault table as a user runs them (no GPU here)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "results" / "bench"


def run(*args):
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_committed_table_is_what_the_committed_results_render_to(tmp_path):
    for f in BENCH.glob("*.json"):
        (tmp_path / f.name).write_text(f.read_text())
    r = run("benchmarks/run.py", "--table", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "table.md").read_text() == (BENCH / "table.md").read_text()
    assert "**2.09×** pynvml (target ≥ 0.9×)" in r.stdout


def test_gpu_parts_are_skipped_with_the_reason_and_bad_parts_named(tmp_path):
    r = run("benchmarks/run.py", "--out", str(tmp_path), "--parts", "rate,smi,cost")
    assert r.returncode == 0, r.stderr
    status = json.loads((tmp_path / "runner.json").read_text())
    assert {status[p]["status"] for p in ("rate", "smi", "cost")} == {"skipped"}
    assert "skipped: no GPU" in r.stdout
    bad = run("benchmarks/run.py", "--out", str(tmp_path), "--parts", "rate,warp")
    assert bad.returncode == 2 and "unknown part 'warp'" in bad.stderr
