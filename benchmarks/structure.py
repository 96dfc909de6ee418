"""Structure figures for the collector package: what a change has to touch.

    python benchmarks/structure.py [--out FILE.json]

Prints, for ``collector`` and ``workloads``:

* the longest functions (lines, from ``def`` to the last line of the body);
* import cycles between modules (strongly connected parts of the import graph, every import
  counted, also those inside functions), from grimp;
* what the training process imports: the modules ``collector.probe.core`` pulls in, and whether
  the sampler actor's module and the Prometheus exporter are among them;
* where the sampling settings' defaults are written (the number literal of the default rate and
  window next to a name that says so) and where "0 means max" is read;
* the sampler settings copied by hand from one object into another (``rate_hz=opts.rate_hz``):
  each is a line to touch when a setting is added or renamed;
* dead code by vulture (60 % confidence, tests and benchmarks counted as users; framework
  callbacks whitelisted by name).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("collector", "workloads")
CALLBACKS = re.compile(
    r"'(on_\w+|describe|collect|do_POST|log_message|training_step|configure_optimizers|"
    r"pytest_\w+|ray_cluster)'"
)


def _files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def longest_functions(n: int = 8) -> list[dict]:
    out = []
    for path in _files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out.append(
                    {
                        "function": f"{path.relative_to(ROOT)}:{node.name}",
                        "lines": node.end_lineno - node.lineno + 1,
                    }
                )
    return sorted(out, key=lambda f: -f["lines"])[:n]


def import_cycles() -> tuple[list[list[str]], list[str]]:
    """Cycles between modules, and the modules ``collector.probe.core`` imports (transitively)."""
    import grimp

    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(*PACKAGES, include_external_packages=True)
    mods = sorted(m for m in graph.modules if m.split(".")[0] in PACKAGES)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) & set(mods) for m in mods}
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            # a package and its own submodules (``collector.probe`` → ``.core``) are not a cycle
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for m in mods:
        if m not in index:
            visit(m)
    probe = sorted(graph.find_upstream_modules("collector.probe.core"))
    return sccs, probe


def literals() -> dict[str, list[str]]:
    pats = {
        "default rate written (1000 / 1000.0 as a rate default)": re.compile(
            r"(rate\w*\s*[:=][^,]*\b1_?000(\.0)?\b|default=1_?000(\.0)?\b)", re.I
        ),
        "default window written (15 / 15.0 as a window default)": re.compile(
            r"(window\w*\s*[:=][^,]*\b15(\.0)?\b|default=15(\.0)?\b)", re.I
        ),
        "a sampler setting copied by hand from one object to another (keyword = attribute)": (
            re.compile(
                r"\b(rate_hz|window_s|metrics_addr|metrics_port|remote_write|push_samples)"
                r"=(ns|opts|options|self\.options)\.\w+"
            )
        ),
        "'0 = max' read (rate compared with 0 or MAX_RATE)": re.compile(
            r"rate\w*\s*(==|>|<=|!=)\s*(0(\.0)?|MAX_RATE)\b|(0(\.0)?|MAX_RATE)\s*==\s*\w*rate|\bhz\s*==\s*0"
        ),
    }
    out: dict[str, list[str]] = {k: [] for k in pats}
    for path in _files():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            for k, pat in pats.items():
                if pat.search(code):
                    out[k].append(f"{path.relative_to(ROOT)}:{i}")
    return out


def dead_code() -> list[str]:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "vulture",
            *PACKAGES,
            "tests",
            "benchmarks",
            "--min-confidence",
            "60",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return [
        line
        for line in res.stdout.splitlines()
        if line.split(":")[0].startswith(PACKAGES)
        and "unused variable" not in line
        and not CALLBACKS.search(line)
        and "collector/records.py" not in line  # NamedTuple fields read by name elsewhere
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    cycles, probe = import_cycles()
    result = {
        "longest_functions": longest_functions(),
        "import_cycles": cycles,
        "probe_imports": [m for m in probe if m.split(".")[0] in ("collector", "ray", "workloads")],
        "literals": literals(),
        "dead_code": dead_code(),
    }
    for f in result["longest_functions"]:
        print(f"{f['lines']:4d} lines  {f['function']}")
    print(f"import cycles: {len(cycles)}")
    for c in cycles:
        print("   ", " <-> ".join(c))
    print("collector.probe.core imports:", ", ".join(result["probe_imports"]) or "-")
    for k, where in result["literals"].items():
        print(f"{k}: {len(where)}  {' '.join(where)}")
    print(f"dead code (vulture): {len(result['dead_code'])}")
    for line in result["dead_code"]:
        print("   ", line)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
