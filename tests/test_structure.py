"""The house's fitness functions: the import contracts between its rooms, no import cycle, the
size ratchet (no function over 60 lines nor module over 450 that the committed list does not hold
at that size or more), and what a training process loads with the probe — an estimate given
included (``benchmarks/structure.py`` prints the same figures). Each checker is also shown to
fail: a planted import, a grown function."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import structure  # noqa: E402

ESTIMATE = ROOT / "benchmarks" / "results" / "estimate" / "cpu-7b-adamw_8bit.estimate.json"


@pytest.fixture(scope="module")
def graph():
    return structure._graph()


@pytest.mark.parametrize("contract", [c[0] for c in structure.CONTRACTS])
def test_every_import_contract_holds(graph, contract):
    assert structure.contracts(graph)[contract] == []


def test_no_import_cycle(graph):
    cycles, _ = structure.import_cycles(graph)
    assert cycles == []


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The house with one dotted import planted where it breaks a contract and closes a
    circle: ``import collector.analysis.runs`` (no ``as``) at the top of the exporter — the form
    grimp, as the checker used to call it, recorded as an import of ``collector``."""
    root = tmp_path_factory.mktemp("house")
    shutil.copytree(ROOT / "collector", root / "collector", ignore=shutil.ignore_patterns("*.pyc"))
    (root / "workloads").mkdir()
    (root / "workloads" / "__init__.py").write_text("")
    target = root / "collector" / "export" / "prometheus.py"
    target.write_text("import collector.analysis.runs\n" + target.read_text())
    return structure.ImportGraph(root, ("collector", "workloads"))


def test_a_planted_dotted_import_breaks_its_contract_and_is_a_cycle(planted):
    broken = structure.contracts(planted)
    name = "neither the exporters nor the actor import the analysis or the estimate"
    assert broken[name] == ["collector.export.prometheus -> collector.analysis.runs"]
    assert all(v == [] for k, v in broken.items() if k != name)
    cycles, _ = structure.import_cycles(planted)
    assert any(
        "collector.export.prometheus" in c and "collector.analysis.runs" in c for c in cycles
    ), cycles


def test_every_import_form_is_read(tmp_path):
    """``import a.b.c``, ``from a.b import c`` (a module, and a name), relative imports, imports
    inside functions and ``importlib.import_module`` with a literal are each an edge to the
    module they load."""
    pkg = tmp_path / "collector"
    (pkg / "deep").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "b.py", "c.py", "d.py", "e.py", "deep/__init__.py"):
        (pkg / f).write_text("X = 1\n")
    (pkg / "deep" / "inner.py").write_text(
        "import collector.a\n"
        "from collector import b\n"
        "from collector.c import X\n"
        "from .. import d\n"
        "def f():\n"
        "    import importlib\n"
        "    importlib.import_module('collector.e')\n"
    )
    g = structure.ImportGraph(tmp_path, ("collector",))
    found = g.find_modules_directly_imported_by("collector.deep.inner")
    assert found == {f"collector.{m}" for m in "abcde"}


def test_the_graph_sees_every_import_grimp_sees(graph):
    """grimp as a second reader: each edge it records between the house's modules is one the
    AST graph has (grimp's ``-> collector`` for a dotted import, mapped back, is a finer one).
    grimp leaves out packages without an ``__init__`` (``collector/analysis``, a namespace
    package): the AST graph reads them, and they must be in it."""
    grimp = pytest.importorskip("grimp")
    sys.path.insert(0, str(ROOT))
    g = grimp.build_graph(*structure.PACKAGES, include_external_packages=True)
    assert "collector.analysis.runs" in graph.modules
    missing = []
    for m in sorted(graph.modules & set(g.modules)):
        ours = graph.find_modules_directly_imported_by(m)
        for t in g.find_modules_directly_imported_by(m):
            if t in graph.modules and not any(o == t or o.startswith(t + ".") for o in ours):
                missing.append(f"{m} -> {t}")
    assert missing == []


def test_the_size_ratchet_holds():
    """No function over 60 lines nor module over 450 that ``ratchet.json`` does not list, and
    none larger than it lists: the list may only shrink."""
    kept = json.loads(structure.RATCHET.read_text())
    assert structure.ratchet_breaks(structure.over_watch(), kept) == []


def test_the_ratchet_names_what_grew_and_what_is_new():
    kept = {"functions": {"m.py:f": 70}, "modules": {"m.py": 500}}
    now = {"functions": {"m.py:f": 71, "m.py:g": 61}, "modules": {"m.py": 500}}
    assert structure.ratchet_breaks(now, kept) == [
        "m.py:f: 71 lines, was 70",
        "m.py:g: 61 lines, new over 60",
    ]


def test_the_vocabulary_is_spelled_on_the_ground_floor_only():
    """Memory kinds, step phases and GiB are spelled in ``collector/model`` (workloads' own
    summaries and
    the growth rule's pool names, a vocabulary of their own, aside)."""
    v = structure.vocabulary()
    assert [w for w in v["memory_kind_literals"] if w.startswith("collector/")] == []
    assert [w for w in v["phase_literals"] if w.startswith("collector/")] == []
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


UNRESOLVED = """
import ast, importlib, json, pathlib, sys
bad = []
for name in sys.argv[1:]:
    path = pathlib.Path(name)
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.ImportFrom) and node.module and not node.level):
            continue
        if node.module.split(".")[0] not in ("collector", "workloads"):
            continue
        try:
            module = importlib.import_module(node.module)
        except ImportError as e:
            bad.append(f"{name}:{node.lineno} {node.module}: {e}")
            continue
        for alias in node.names:
            if alias.name == "*" or hasattr(module, alias.name):
                continue
            try:
                importlib.import_module(f"{node.module}.{alias.name}")
            except ImportError:
                bad.append(f"{name}:{node.lineno} {node.module}.{alias.name}")
print(json.dumps(bad))
"""


def _unresolved(paths: list[Path]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", UNRESOLVED, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_deferred_import_names_what_exists(tmp_path):
    """An import inside a function runs only when that path does (a Ray Train worker, a child):
    a name moved to another module breaks it with no import-time error. Every ``from collector…
    import name`` in the project, deferred ones included, must name something that exists — and a
    planted one that does not is named."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from collector.probe.core import NOT_THERE\n")
    assert _unresolved([planted]) == [f"{planted}:2 collector.probe.core.NOT_THERE"]
    ours = [
        p
        for d in ("collector", "workloads", "benchmarks", "tests")
        for p in sorted((ROOT / d).rglob("*.py"))
    ]
    assert _unresolved(ours) == []


def _forks(source: str) -> list[int]:
    """Lines of calls that pass ``preexec_fn``: subprocess then forks this process (no vfork).
    In a Ray driver — the job, the test session with its cluster — a fork can leave the GCS
    unanswering (seen: after Ray Train, ray.nodes() hung and every later sampler with it)."""
    import ast

    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and any(k.arg == "preexec_fn" for k in node.keywords)
    ]


def test_nothing_forks_a_process_that_may_be_a_ray_driver():
    assert _forks("import subprocess\nsubprocess.run(['true'], preexec_fn=lambda: None)\n") == [2]
    found = {
        str(path.relative_to(ROOT)): lines
        for top in ("collector", "tests", "workloads", "benchmarks")
        for path in sorted((ROOT / top).rglob("*.py"))
        if (lines := _forks(path.read_text()))
    }
    assert found == {}, "start it through tests.cli.launched (a launcher that execs) instead"
