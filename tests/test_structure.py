"""The house's fitness functions: the import contracts between its rooms, no import cycle, no
module over 600 lines nor function over 80, and what a training process loads with the probe —
an estimate given included (``benchmarks/structure.py`` prints the same figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
pytest.importorskip("grimp")
import structure  # noqa: E402

ESTIMATE = ROOT / "benchmarks" / "results" / "estimate" / "cpu-7b-adamw_8bit.estimate.json"


@pytest.fixture(scope="module")
def graph():
    return structure._graph()


@pytest.mark.parametrize("contract", [c[0] for c in structure.CONTRACTS])
def test_every_import_contract_holds(graph, contract):
    assert structure.contracts(graph)[contract] == []


def test_no_import_cycle():
    cycles, _ = structure.import_cycles()
    assert cycles == []


def test_no_module_over_600_lines_and_no_function_over_80():
    big = {k: v for k, v in structure.module_sizes().items() if v > structure.MAX_MODULE_LINES}
    assert big == {}
    long = [
        f for f in structure.longest_functions(10_000) if f["lines"] > structure.MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_vocabulary_is_spelled_on_the_ground_floor_only():
    """Memory kinds and GiB are spelled in ``collector/model`` (workloads' own summaries and
    the growth rule's pool names, a vocabulary of their own, aside)."""
    v = structure.vocabulary()
    assert [w for w in v["memory_kind_literals"] if w.startswith("collector/")] == []
    assert v["gib"] == []


def test_a_training_process_loads_the_probe_and_the_model_only_with_an_estimate_given():
    """With ``STEPMEM_ESTIMATE`` set (the probe reads the predicted peak from it) a training
    process loads the probe, its lookup and the ground floor: no sampler, exporter, analysis,
    estimate package, CLI or workload, and no torch beyond what the loop itself imports."""
    code = (
        "import json, sys\n"
        "from collector.probe.core import StepProbe\n"
        "from collector.probe.outbox import Outbox\n"
        "probe = StepProbe(outbox=Outbox(None))\n"
        "assert probe.estimate_peak and not probe.errors, probe.errors\n"
        "probe.begin(1); probe.end()\n"
        "ours = sorted(m for m in sys.modules if m.startswith(('collector', 'workloads')))\n"
        "print(json.dumps(ours))\n"
    )
    env = {"STEPMEM_ESTIMATE": str(ESTIMATE), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    allowed = ("collector.model", "collector.probe", "collector.lookup")
    assert loaded and all(m == "collector" or m.startswith(allowed) for m in loaded), loaded


def test_no_module_imports_its_own_package():
    """A module of a package importing that package (``from collector.estimate import build``
    inside ``collector/estimate``) runs the package's ``__init__``, which imports the module
    back: an import circle however the names resolve. Modules import their siblings."""
    import ast

    found = []
    for path in (ROOT / "collector").rglob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):  # `python -m` runs the package first
            continue
        package = ".".join(path.relative_to(ROOT).parent.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == package and not node.level:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
