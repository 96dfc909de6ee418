"""Structure figures for the collector package: what a change has to touch.

    python benchmarks/structure.py [--out FILE.json] [--root TREE] [--write-ratchet]

Prints, for ``collector`` and ``workloads``:

* the longest functions (lines, from ``def`` to the last line of the body);
* import cycles between modules (strongly connected parts of the import graph, every import
  counted, also those inside functions and dotted ones: :class:`ImportGraph`, from the AST);
* the ratchet: functions over 60 lines and modules over 450, each no larger than the committed
  ``results/structure/ratchet.json`` lists it;
* what the training process imports: the modules ``collector.probe.core`` pulls in, and whether
  the sampler actor's module and the Prometheus exporter are among them;
* the import contracts between the house's rooms (:data:`CONTRACTS`), each with the imports that
  break it (none: it holds); module sizes;
* the vocabulary: memory kinds and account components written as string literals outside the
  ground floor (:mod:`collector.model`), ``GIB`` defined outside its units module;
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


def _functions(root: Path | None = None) -> list[tuple[str, int]]:
    """``(path:Qual.name, lines)`` of every function of the packages, from ``def`` to the last
    line of its body."""
    out = []

    def walk(node: ast.AST, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((f"{path}:{name}", child.end_lineno - child.lineno + 1))
                walk(child, path, name + ".")
            else:
                walk(child, path, prefix)

    for path in _files():
        walk(ast.parse(path.read_text()), str(path.relative_to(root or ROOT)), "")
    return out


def longest_functions(n: int = 8) -> list[dict]:
    out = [{"function": f, "lines": lines} for f, lines in _functions()]
    return sorted(out, key=lambda f: -f["lines"])[:n]


class ImportGraph:
    """Every import between the modules of ``packages`` under ``root``, read from the AST —
    also those inside functions, and ``importlib.import_module("…")`` with a literal name.

    ``import a.b.c`` is an import of ``a.b.c`` (grimp, as it was called here, records it as one
    of ``a``: a dotted import broke no contract and closed no cycle); ``from a.b import c`` is
    one of ``a.b.c`` when that is a module, else of ``a.b``; relative imports are resolved. The
    interface is grimp's that the checks use: ``modules`` and
    ``find_modules_directly_imported_by``."""

    def __init__(self, root: Path | None = None, packages: tuple[str, ...] = PACKAGES) -> None:
        root = self.root = root or ROOT
        files = {}
        for pkg in packages:
            for path in sorted((root / pkg).rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                files[name] = path
        self.modules = set(files)
        self._edges = {m: self._read(m, path) for m, path in files.items()}

    def find_modules_directly_imported_by(self, module: str) -> set[str]:
        return set(self._edges.get(module, ()))

    def _known(self, dotted: str) -> str | None:
        """The longest prefix of ``dotted`` that is one of the modules, else None (outside)."""
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            name = ".".join(parts[:n])
            if name in self.modules:
                return name
        return None

    def _read(self, module: str, path: Path) -> set[str]:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([base] if base else [])])
                names = [f"{base}.{a.name}" for a in node.names if a.name != "*"] or [base]
                names = [n if n in self.modules else base for n in names]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names = [node.args[0].value]
            for name in names:
                known = self._known(name)
                if known is not None and known != module:
                    out.add(known)
        return out


def _graph(root: Path | None = None, packages: tuple[str, ...] = PACKAGES) -> ImportGraph:
    return ImportGraph(root, packages)


def import_cycles(graph: ImportGraph | None = None) -> tuple[list[list[str]], list[str]]:
    """Cycles between modules (strongly connected parts of the import graph, Tarjan), and the
    modules ``collector.probe.core`` imports, transitively."""
    graph = graph or _graph()
    mods = sorted(graph.modules)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in mods}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
    probe: set[str] = set()
    todo = ["collector.probe.core"] if "collector.probe.core" in edges else []
    while todo:
        for w in edges[todo.pop()]:
            if w not in probe:
                probe.add(w)
                todo.append(w)
    return sccs, sorted(probe)


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


STAT_KEY = re.compile(
    r'"(allocated_bytes|reserved_bytes|active_bytes|inactive_split_bytes)\.all\.(current|peak)"'
    r'|"(segment\.all\.current|num_alloc_retries|num_ooms|num_device_alloc|'
    r'context_baseline_bytes|process_pid)"'
)
RECORD_AS_DICT = re.compile(r'\b(r|rec|recs\[\w+\]|prev|cur|first|last|top)(\.get\(|\[")')
BYTES_LITERAL = re.compile(r"\b\d+\s*\*\s*(MIB|GIB)\b|<<\s*(20|30)\b")


def diagnosis_figures() -> dict:
    """What the diagnosis and report code looks like: torch's stat keys written as string
    literals outside the model's records; step records read as dicts in the code that reads a
    run (``r["…"]``, ``r.get(…)``); the rule modules and their sizes; byte thresholds written as
    literals in the diagnosis's rule code rather than declared once (in ``kinds.Thresholds``)."""
    stat_sites = []
    for path in _files():
        if path.name == "records.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if STAT_KEY.search(line.split("#")[0]):
                stat_sites.append(f"{path.relative_to(ROOT)}:{i}")
    readers = sorted((ROOT / "collector" / "analysis").rglob("*.py"))
    as_dict = []
    thresholds = []
    for path in readers:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if RECORD_AS_DICT.search(code):
                as_dict.append(f"{path.relative_to(ROOT)}:{i}")
            in_rules = "diagnosis" in path.parts and path.name != "kinds.py"
            if BYTES_LITERAL.search(code) and in_rules:
                thresholds.append(f"{path.relative_to(ROOT)}:{i}")
    rules_dir = ROOT / "collector" / "analysis" / "diagnosis" / "rules"
    rules = {
        p.stem: len(p.read_text().splitlines())
        for p in sorted(rules_dir.glob("*.py"))
        if p.stem != "__init__"
    }
    return {
        "stat_key_literals": stat_sites,
        "stat_key_files": sorted({s.split(":")[0] for s in stat_sites}),
        "records_read_as_dicts": as_dict,
        "byte_literals_in_rule_code": thresholds,
        "rule_modules": rules,
    }


# -- the house: rooms, contracts between them, sizes, vocabulary ------------------------------

LIBRARY = (  # what must never depend on the example workloads (the job runs them by name)
    "collector.model",
    "collector.probe",
    "collector.analysis",
    "collector.estimate",
    "collector.export",
    "collector.sampler",
    "collector.join",
    "collector.actor",
    "collector.nvml",
    "collector.replay",
    "collector.capture_meta",
    "collector.store",
    "collector.metrics",
)
# (name, the modules it binds, what they may import of stepmem: allowed prefixes, or
# forbidden prefixes when the third element starts with "!")
CONTRACTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    (
        "the model (ground floor) imports nothing of collector but itself",
        ("collector.model",),
        ("collector.model",),
    ),
    (
        "the probe imports only the model and its lookup",
        ("collector.probe",),
        ("collector.model", "collector.probe", "collector.lookup"),
    ),
    (
        "neither the exporters nor the actor import the analysis or the estimate",
        ("collector.export", "collector.actor", "collector.sampler", "collector.join"),
        ("!", "collector.analysis", "collector.estimate", "collector.cli"),
    ),
    (
        "the estimate does not import the run-reading side, the live side or the job",
        ("collector.estimate",),
        # the keeper and the reaper: leaves that import nothing of stepmem
        ("collector.model", "collector.estimate", "collector.supervise", "collector.reaper"),
    ),
    (
        "nothing in the library imports the example workloads",
        LIBRARY,
        ("!", "workloads"),
    ),
    (
        "nothing below the command imports it",
        ("collector",),
        ("!", "collector.cli"),
    ),
    (  # a leaf: the parent-side launcher and the child, reached through run_estimate only
        "nothing but the estimate's entry imports the script path",
        ("collector",),
        ("!", "collector.estimate.script"),
    ),
)
# who a forbidding contract lets through, besides the command (ENTRY): its own room, and for
# the script path the estimate's entry
EXEMPT = {
    "nothing but the estimate's entry imports the script path": (
        "collector.estimate.script",
        "collector.estimate.run",
    ),
}
ENTRY = ("collector.cli", "collector.__main__", "collector.job")  # the command and its shims
# The ratchet: every function over FUNCTION_WATCH lines and every module over MODULE_WATCH is
# listed in RATCHET with its size, and may only shrink (or leave the list); nothing new joins it.
# Hard caps steered the code to sit just under them (two functions at exactly 80 lines of 80);
# a ratchet asks for the seam instead. ``--write-ratchet`` rewrites the file from the tree.
FUNCTION_WATCH = 60
MODULE_WATCH = 450
RATCHET = ROOT / "benchmarks" / "results" / "structure" / "ratchet.json"


def over_watch() -> dict[str, dict[str, int]]:
    """The functions over :data:`FUNCTION_WATCH` lines and modules over :data:`MODULE_WATCH`."""
    funcs: dict[str, int] = {}
    for name, lines in _functions():
        if lines > FUNCTION_WATCH:
            funcs[name] = max(lines, funcs.get(name, 0))
    mods = {k: v for k, v in module_sizes().items() if v > MODULE_WATCH}
    return {"functions": dict(sorted(funcs.items())), "modules": dict(sorted(mods.items()))}


def ratchet_breaks(now: dict[str, dict[str, int]], kept: dict[str, dict[str, int]]) -> list[str]:
    """What ``now`` adds to, or grows in, the committed ratchet ``kept`` (empty: it holds)."""
    out = []
    for part, watch in (("functions", FUNCTION_WATCH), ("modules", MODULE_WATCH)):
        for name, lines in now[part].items():
            was = kept.get(part, {}).get(name)
            if was is None:
                out.append(f"{name}: {lines} lines, new over {watch}")
            elif lines > was:
                out.append(f"{name}: {lines} lines, was {was}")
    return out


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def contracts(graph=None, table=None) -> dict[str, list[str]]:
    """Each contract of ``table`` (default :data:`CONTRACTS`) with the imports that break it
    (``importer -> imported``; empty: holds)."""
    graph = graph or _graph()
    mods = sorted(graph.modules)
    out: dict[str, list[str]] = {}
    for name, bound, rule in CONTRACTS if table is None else table:
        forbid = rule[0] == "!"
        exempt = EXEMPT.get(name, ENTRY)
        broken = []
        for m in mods:
            if not _within(m, bound) or (forbid and _within(m, exempt)):
                continue
            for imp in sorted(graph.find_modules_directly_imported_by(m)):
                if imp not in graph.modules:
                    continue
                bad = _within(imp, rule[1:]) if forbid else not _within(imp, rule)
                if bad:
                    broken.append(f"{m} -> {imp}")
        out[name] = broken
    return out


def module_sizes() -> dict[str, int]:
    """Lines of every module of ``collector`` and ``workloads``, largest first."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _files()}
    return dict(sorted(sizes.items(), key=lambda kv: -kv[1]))


KIND_LITERAL = re.compile(
    r'"(parameters|gradients|optimizer_state|optimizer_state_managed|gradient_buckets|'
    r"other_allocated|activations|temporaries|buffers|gradient_bucket_bytes|"
    r'unsharded_parameters_peak)"'
)
COMPONENT_LITERAL = re.compile(
    r'"(torch reserved|outside torch, this process|other processes|no process \(managed/UVM\)|'
    r'outside torch \(unsplit\))"'
)
PHASE_LITERAL = re.compile(r'"(forward_backward|optimizer step)"|\.(phase|mark)\(f?"[a-z_]')
GIB_DEFINED = re.compile(r"^\s*GIB\s*=|\b1\s*<<\s*30\b")


def vocabulary() -> dict[str, list[str]]:
    """Where the shared vocabulary is written outside the ground floor: memory kinds, account
    components and step phases as string literals (a phase marked with a literal name), ``GIB``
    defined (or ``1 << 30`` spelled out)."""
    out: dict[str, list[str]] = {
        "memory_kind_literals": [],
        "component_literals": [],
        "phase_literals": [],
        "gib": [],
    }
    for path in _files():
        if "model" in path.relative_to(ROOT).parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            where = f"{path.relative_to(ROOT)}:{i}"
            if KIND_LITERAL.search(code):
                out["memory_kind_literals"].append(where)
            if COMPONENT_LITERAL.search(code):
                out["component_literals"].append(where)
            if PHASE_LITERAL.search(code):
                out["phase_literals"].append(where)
            if GIB_DEFINED.search(code):
                out["gib"].append(where)
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
        and "collector/model/records.py" not in line  # fields read by name elsewhere
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--write-ratchet", action="store_true", help=f"rewrite {RATCHET.name} from this tree"
    )
    ap.add_argument(
        "--root", type=Path, help="measure another tree (a checkout before a change) instead"
    )
    a = ap.parse_args()
    if a.root is not None:
        global ROOT
        ROOT = a.root.resolve()
    if a.write_ratchet:
        RATCHET.write_text(json.dumps(over_watch(), indent=1) + "\n")
    cycles, probe = import_cycles()
    sizes = module_sizes()
    result = {
        "longest_functions": longest_functions(),
        "over_watch": over_watch(),
        "largest_modules": dict(list(sizes.items())[:8]),
        "modules": len(sizes),
        "contracts": contracts(),
        "vocabulary": vocabulary(),
        "import_cycles": cycles,
        "probe_imports": [m for m in probe if m.split(".")[0] in ("collector", "ray", "workloads")],
        "literals": literals(),
        "dead_code": dead_code(),
        "diagnosis": diagnosis_figures(),
    }
    for f in result["longest_functions"]:
        print(f"{f['lines']:4d} lines  {f['function']}")
    watch = result["over_watch"]
    print(
        f"functions over {FUNCTION_WATCH} lines: {len(watch['functions'])}; "
        f"modules over {MODULE_WATCH} lines: {len(watch['modules'])} "
        f"(of {result['modules']}; largest: "
        + ", ".join(f"{k} {v}" for k, v in list(result["largest_modules"].items())[:4])
        + ")"
    )
    kept = json.loads(RATCHET.read_text()) if RATCHET.exists() else {}
    breaks = ratchet_breaks(watch, kept)
    print(f"ratchet ({RATCHET.name}): {'holds' if not breaks else f'{len(breaks)} grew'}")
    for b in breaks:
        print("   ", b)
    for name, broken in result["contracts"].items():
        print(f"contract: {name}: {'holds' if not broken else f'{len(broken)} imports break it'}")
        for b in broken:
            print("   ", b)
    for k, where in result["vocabulary"].items():
        print(f"vocabulary: {k} outside collector/model: {len(where)}  {' '.join(where)}")
    print(f"import cycles: {len(cycles)}")
    for c in cycles:
        print("   ", " <-> ".join(c))
    print("collector.probe.core imports:", ", ".join(result["probe_imports"]) or "-")
    for k, where in result["literals"].items():
        print(f"{k}: {len(where)}  {' '.join(where)}")
    print(f"dead code (vulture): {len(result['dead_code'])}")
    for line in result["dead_code"]:
        print("   ", line)
    d = result["diagnosis"]
    print(
        f"torch stat keys written as literals outside records.py: {len(d['stat_key_literals'])} "
        f"sites in {len(d['stat_key_files'])} files"
    )
    print(f"step records read as dicts in the run-reading code: {len(d['records_read_as_dicts'])}")
    print(f"byte literals in the rule code: {len(d['byte_literals_in_rule_code'])}")
    print(
        f"rule modules: {len(d['rule_modules'])}"
        + (
            f" (largest {max(d['rule_modules'].values())} lines)"
            if d["rule_modules"]
            else " (the rules live in one module)"
        )
    )
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
