"""``stepmem report``: a run's per-step table and its diagnosis; ``stepmem compare``.

A run is a run-store directory (``runs/<run id>``) or the records JSON of ``stepmem run --out``.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

from collector.accounting import nontorch_bytes
from collector.diagnose import Finding, diagnose, g, steps_text
from collector.errors import InputError

__all__ = ["Run", "compare", "load_run", "render_report"]


_INT_FIELDS = ("begin_ns", "end_ns", "samples")
_OPTIONAL_INT_FIELDS = (
    "nvml_peak_bytes",
    "nvml_peak_t_ns",
    "nvml_min_bytes",
    "nvml_end_bytes",
    "nvml_reserved_bytes",
    "torch_allocated_peak_bytes",
    "torch_reserved_peak_bytes",
)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_records(records: Any, source: str) -> list[dict[str, Any]]:
    """``records`` if they are step records stepmem can read; otherwise :class:`InputError`
    naming the first bad record and field (records come from files anyone can edit)."""
    if not isinstance(records, list):
        raise InputError(f"{source}: 'records' must be a list, got {type(records).__name__}")
    for i, r in enumerate(records):
        where = f"{source}: record {i}"
        if not isinstance(r, dict):
            raise InputError(f"{where} is not an object")
        if not isinstance(r.get("gpu_uuid"), str) or not r["gpu_uuid"]:
            raise InputError(f"{where}: gpu_uuid must be a non-empty string")
        if not _is_int(r.get("step")) or r["step"] < 0:
            raise InputError(f"{where}: step must be a non-negative integer, got {r.get('step')!r}")
        for k in _INT_FIELDS:
            if k in r and not _is_int(r[k]):
                raise InputError(f"{where}: {k} must be an integer, got {r[k]!r}")
        for k in _OPTIONAL_INT_FIELDS:
            if r.get(k) is not None and not _is_int(r[k]):
                raise InputError(
                    f"{where}: {k} must be a whole number of bytes or null, got {r[k]!r}"
                )
        for k in ("torch_end", "torch_begin", "ledger"):
            v = r.get(k)
            if v is not None and not (
                isinstance(v, dict)
                and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v.values())
            ):
                raise InputError(f"{where}: {k} must map names to numbers")
        if r.get("phases") is not None and not (
            isinstance(r["phases"], list) and all(isinstance(p, dict) for p in r["phases"])
        ):
            raise InputError(f"{where}: phases must be a list of objects")
        for k in ("gap", "error"):
            if r.get(k) is not None and not isinstance(r[k], str):
                raise InputError(f"{where}: {k} must be a string, got {r[k]!r}")
    return records


def check_meta(meta: Any, source: str) -> dict[str, Any]:
    """Run metadata (``meta.json`` or a records file's header) stepmem can read, else
    :class:`InputError` naming the field."""
    if not isinstance(meta, dict):
        raise InputError(f"{source}: must be a JSON object, got {type(meta).__name__}")
    samplers = meta.get("samplers", [])
    if not isinstance(samplers, list):
        raise InputError(f"{source}: 'samplers' must be a list")
    for i, smp in enumerate(samplers):
        if not isinstance(smp, dict):
            raise InputError(f"{source}: samplers[{i}] is not an object")
        for k, ok in (
            ("gpu_uuid", lambda v: isinstance(v, str) and v),
            ("node_id", lambda v: isinstance(v, str)),
            ("index", _is_int),
            ("total_bytes", lambda v: _is_int(v) and v > 0),
        ):
            if not ok(smp.get(k)):
                raise InputError(f"{source}: samplers[{i}].{k} is missing or of the wrong type")
    for k in ("banner", "status", "run_id"):
        if meta.get(k) is not None and not isinstance(meta[k], str):
            raise InputError(f"{source}: {k} must be a string")
    return meta


class Run:
    """One run's step records per GPU (in sampler index order) and the GPUs' capacities."""

    def __init__(self, name: str, meta: dict[str, Any], records: list[dict[str, Any]]) -> None:
        self.name = name
        self.meta = meta
        self.root: Path | None = None  # the run directory, when read from the run store
        samplers = sorted(meta.get("samplers", []), key=lambda s: (s["node_id"], s["index"]))
        self.gpus = [s["gpu_uuid"] for s in samplers] or sorted({r["gpu_uuid"] for r in records})
        self.totals = {s["gpu_uuid"]: s["total_bytes"] for s in samplers}
        self.by_gpu = {
            u: sorted((r for r in records if r["gpu_uuid"] == u), key=lambda r: r["step"])
            for u in self.gpus
        }


def load_run(path: str | Path) -> Run:
    """Read a run directory or a records JSON. Raises ``ValueError`` naming what is wrong."""
    path = Path(path)
    if path.is_dir():
        from collector.store import RunStore

        store = RunStore(path)
        check_meta(store.meta, str(path / "meta.json"))
        records = [r.to_dict() for r in store.records()]
        run = Run(path.name, store.meta, check_records(records, str(path / "steps")))
        run.root = path
        return run
    if not path.is_file():
        raise InputError(f"{path} is neither a run directory nor a records file")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path} is not a stepmem records file ({exc})") from None
    if not isinstance(doc, dict) or "records" not in doc:
        raise InputError(f"{path} is not a stepmem records file (no 'records')")
    check_meta(doc, str(path))
    return Run(path.stem, doc, check_records(doc["records"], str(path)))


def render_report(run: Run) -> tuple[str, dict[str, list[Finding]]]:
    """The report as text (rich tables + findings) and the findings per GPU."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150, record=True, file=io.StringIO())
    findings = {}
    console.print(f"[bold]Run {run.name}[/bold] — {run.meta.get('banner', '')}")
    status = _status_line(run.meta)
    if status:
        console.print(f"[bold]{status}[/bold]")
    for i, uuid in enumerate(run.gpus):
        recs = run.by_gpu[uuid]
        table = Table(title=f"GPU {i} {uuid} — memory per step (GiB)")
        for col in (
            "step",
            "nvml peak",
            "nvml end",
            "alloc peak",
            "alloc end",
            "resv peak",
            "resv end",
            "non-torch",
            "params",
            "grads",
            "opt state",
            "managed",
            "gap",
        ):
            table.add_column(col, justify="right")
        for r in recs:
            te, led = r.get("torch_end") or {}, r.get("ledger") or {}
            res = te.get("reserved_bytes.all.current")
            nt = nontorch_bytes(r)

            def c(v, missing=""):
                return missing if v is None else f"{v / (1 << 30):.2f}"

            table.add_row(
                str(r["step"]),
                c(r.get("nvml_peak_bytes"), "—"),  # not measured: no sample inside the step
                c(r.get("nvml_end_bytes"), "—"),
                c(r.get("torch_allocated_peak_bytes")),
                c(te.get("allocated_bytes.all.current")),
                c(r.get("torch_reserved_peak_bytes")),
                c(res),
                c(nt),
                c(led.get("parameters")),
                c(led.get("gradients")),
                c(led.get("optimizer_state")),
                c(led.get("optimizer_state_managed")),
                " ".join(x for x in (r.get("gap"), r.get("error") and "FAILED") if x),
            )
        console.print(table)
        findings[uuid] = diagnose(recs, run.totals.get(uuid))
        console.print("[bold]Diagnosis[/bold]")
        for f in findings[uuid]:
            console.print(f" • {f.text}")
            if f.rule == "oom" and run.root is not None:
                lead = _lead_up(run.root, uuid, recs, f.numbers["step"])
                if lead:
                    console.print(f"   {lead}")
    if len(run.gpus) > 1:
        _fleet(run, console)
    if run.root is not None and (run.root / "history").is_dir():
        _sites(run.root / "history", console)
    return console.export_text(), findings


def _sites(folder: Path, console: Any, top: int = 3) -> None:
    """Which lines allocated it: the probe's allocation history (first GPU of the process)."""
    from collector import history

    try:
        doc = history.summary(folder, top=top)
    except FileNotFoundError:  # recording started but its steps never ended
        return
    except (OSError, ValueError, EOFError, KeyError) as exc:
        console.print(
            f"[bold]Allocation sites[/bold]: the history in {folder} is unreadable ({exc})"
        )
        return
    steps = doc["steps"]
    if not steps:
        return
    console.print(
        f"[bold]Allocation sites[/bold] (PyTorch's memory history, steps "
        f"{steps_text([s['step'] for s in steps])}, {doc['trace_entries']:,} allocator events; "
        f"open {folder}/*.pickle in https://pytorch.org/memory_viz)"
    )

    def fmt(rows: list[dict[str, Any]]) -> str:
        return "; ".join(f"{r['site']} {g(r['bytes'])} ({r['count']})" for r in rows) or "—"

    for s in steps:
        why = (
            f" (recorded because torch reserved jumped {g(s['after_jump'])} at step "
            f"{s['step'] - 1}'s end)"
            if s.get("after_jump")
            else ""
        )
        console.print(
            f" • step {s['step']}{why}: at its peak ({g(s['peak_bytes'])} traced, "
            f"{s['peak_phase'].replace('_', '/')}): {fmt(s['at_peak'])}"
        )
        if s["kept_to_next"]:
            console.print(
                f"   allocated in step {s['step']}, still live at the end of step "
                f"{s['step'] + 1}: {fmt(s['kept_to_next'])}"
            )


class _FleetRow(NamedTuple):
    gpu: int  # the report's GPU number
    node: str  # node id, shortened
    recs: list[dict[str, Any]]
    top: dict[str, Any] | None  # the step with the highest NVML peak (None: none measured)
    lost: bool  # its sampler could not be reached at the end of the run


def _fleet(run: Run, console: Any) -> None:
    """Every GPU side by side: which peaks highest, how far apart the GPUs are, per node, and
    which GPUs were lost (a sampler not reachable at the end: its node gone, its actor dead)."""
    from rich.table import Table

    samplers = run.meta.get("samplers", [])
    node_of = {s["gpu_uuid"]: str(s["node_id"])[:12] for s in samplers}
    lost = {
        s["gpu_uuid"]
        for s, h in zip(samplers, run.meta.get("health") or [], strict=False)
        if h.get("unreachable")
    }
    gib = 1 << 30
    rows = []
    for i, uuid in enumerate(run.gpus):
        recs = run.by_gpu[uuid]
        peaked = [r for r in recs if r.get("nvml_peak_bytes") is not None]
        top = max(peaked, key=lambda r: r["nvml_peak_bytes"], default=None)
        rows.append(_FleetRow(i, node_of.get(uuid, "?"), recs, top, uuid in lost))
    table = Table(title="Fleet — every GPU of the run (GiB)")
    for col in ("GPU", "node", "steps", "last step", "nvml peak", "in step", "alloc peak", "state"):
        table.add_column(col, justify="right")
    for row in rows:
        alloc = max((r.get("torch_allocated_peak_bytes") or 0 for r in row.recs), default=0)
        table.add_row(
            str(row.gpu),
            row.node,
            str(len(row.recs)),
            str(row.recs[-1]["step"]) if row.recs else "—",
            f"{row.top['nvml_peak_bytes'] / gib:.2f}" if row.top else "—",
            str(row.top["step"]) if row.top else "—",
            f"{alloc / gib:.2f}" if row.recs else "—",
            "LOST" if row.lost else "",
        )
    console.print(table)
    console.print("[bold]Fleet[/bold]")
    # a lost GPU's records stop early: comparing its few steps with whole runs says nothing
    ran = [row for row in rows if not row.lost] or rows
    measured = [row for row in ran if row.top is not None]
    if len(ran) < len(rows):
        console.print(f" • Compared: the {len(ran)} GPUs that were not lost.")
    if measured:
        hi = max(measured, key=lambda row: row.top["nvml_peak_bytes"])
        lo = min(measured, key=lambda row: row.top["nvml_peak_bytes"])
        hb, lb = hi.top["nvml_peak_bytes"], lo.top["nvml_peak_bytes"]
        pct = (hb / lb - 1) * 100 if lb else 0.0
        if hb == lb:
            console.print(
                f" • Every compared GPU's highest within-step peak is the same: {hb / gib:.2f} GiB "
                f"({len(measured)} GPUs)."
            )
        else:
            console.print(
                f" • Highest within-step peak: GPU {hi.gpu} on node {hi.node}, {hb / gib:.2f} GiB "
                f"in step {hi.top['step']}; lowest: GPU {lo.gpu} on node {lo.node}, "
                f"{lb / gib:.2f} GiB — the highest is {(hb - lb) / gib:.2f} GiB ({pct:.1f} %) "
                "above."
            )
        nodes: dict[str, int] = {}
        for row in measured:
            nodes[row.node] = max(nodes.get(row.node, 0), row.top["nvml_peak_bytes"])
        if len(nodes) > 1:
            console.print(
                " • Per node, highest peak: "
                + ", ".join(f"{n} {b / gib:.2f} GiB" for n, b in sorted(nodes.items()))
                + "."
            )
    most = max((len(row.recs) for row in rows), default=0)
    for row in rows:
        if row.lost:
            console.print(
                f" • GPU {row.gpu} on node {row.node} was LOST: its sampler could not be reached "
                "at the end of the run (its node removed or dead, or the actor killed); "
                + (
                    f"its records stop at step {row.recs[-1]['step']} ({len(row.recs)} of {most} "
                    "steps), kept as drained before."
                    if row.recs
                    else "none of its step records had been drained."
                )
            )


STATUS = {
    "interrupted": "Run INTERRUPTED (Ctrl-C, SIGTERM or `ray job stop`): the steps below are "
    "the ones that ended before it stopped; the store was flushed.",
    "running": "Run UNFINISHED: its store still says running — the job was killed without a "
    "chance to flush (SIGKILL, the OOM killer, a lost node) or is still going; up to the last "
    "2 s of samples and any step not yet joined may be missing.",
    "failed": "Run FAILED: the workload raised; the failed step is marked below.",
}


def _status_line(meta: dict[str, Any]) -> str:
    """What the run store says about how the run ended, when it did not simply complete."""
    status = meta.get("status")
    if status in (None, "complete"):
        return ""
    return STATUS.get(status, f"Run status: {status!r}.")


def _lead_up(root: Path, uuid: str, recs: list[dict[str, Any]], step: int, n: int = 10) -> str:
    """The NVML samples leading to a failed step's end, from the run store: ``n`` readings
    evenly spaced over the last second before it (the steps before included)."""
    from collector.store import RunStore

    rec = next((r for r in recs if r["step"] == step), None)
    try:
        samples = RunStore(root).samples(uuid)
    except (OSError, ValueError):
        return ""
    if rec is None or samples is None or not len(samples):
        return ""
    end = int(rec["end_ns"])
    start = end - 1_000_000_000
    w = samples[(samples["t_ns"] >= start) & (samples["t_ns"] <= end)]
    if not len(w):
        return ""
    idx = sorted({round(i * (len(w) - 1) / (n - 1)) for i in range(n)})
    parts = [
        f"{(int(w['t_ns'].iloc[i]) - end) / 1e6:.0f} ms: {w['used'].iloc[i] / (1 << 30):.2f}"
        for i in idx
    ]
    return (
        f"NVML used (GiB) in the second before step {step} failed ({len(w)} samples): "
        + ", ".join(parts)
    )


METRICS = {
    "nvml_peak_bytes": "NVML within-step peak",
    "nvml_end_bytes": "NVML end of step",
    "torch_allocated_peak_bytes": "torch allocated peak",
    "torch_reserved_peak_bytes": "torch reserved peak",
}


def compare(base: Run, new: Run, tolerance: float) -> tuple[str, bool]:
    """Markdown comparing NEW with BASE, GPU by GPU (in index order) and step by step; and
    whether NEW fails: some step's peak above BASE's by more than ``tolerance``, a GPU count
    that differs (every GPU is compared or the comparison fails), or steps of NEW without NVML
    samples (their peaks cannot be checked)."""
    lines = [f"## stepmem compare: `{new.name}` against `{base.name}`", ""]
    regressed = False
    problems: list[str] = []
    if len(base.gpus) != len(new.gpus):
        problems.append(
            f"GPU counts differ: BASE has {len(base.gpus)}, NEW has {len(new.gpus)}; only runs "
            "of the same shape compare GPU by GPU"
        )
        lines += [f"**GPU counts differ** ({len(base.gpus)} vs {len(new.gpus)}).", ""]
    for i, (bu, nu) in enumerate(zip(base.gpus, new.gpus, strict=False)):
        b = {r["step"]: r for r in base.by_gpu[bu]}
        n = {r["step"]: r for r in new.by_gpu[nu]}
        steps = sorted(set(b) & set(n))
        lines += [
            f"### GPU {i}",
            "",
            "| step | " + " | ".join(METRICS.values()) + " |",
            "|---:|" + "---:|" * len(METRICS),
        ]
        worst: dict[str, float] = {}
        for s in steps:
            cells = []
            for key in METRICS:
                bv, nv = b[s].get(key), n[s].get(key)
                if bv is None or nv is None:
                    cells.append("—" if key.startswith("nvml") else "")
                    continue
                if not bv:
                    cells.append(f"{g(bv)} → {g(nv)}")
                    continue
                rel = (nv - bv) / bv
                worst[key] = max(worst.get(key, -math.inf), rel)
                flag = " ⚠" if key.endswith("peak_bytes") and rel > tolerance else ""
                cells.append(f"{g(bv)} → {g(nv)} ({100 * rel:+.1f} %){flag}")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines.append("")
        for which, recs, run in (("BASE", b, base), ("NEW", n, new)):
            missing = [s for s in steps if recs[s].get("nvml_peak_bytes") is None]
            if missing:
                lines.append(
                    f"- {which} has no NVML samples in {len(missing)} of {len(steps)} common "
                    f"steps ({', '.join(map(str, missing))}): left out of the NVML columns."
                )
                if which == "NEW":
                    problems.append(
                        f"GPU {i}: {len(missing)} of NEW's steps have no NVML samples, so their "
                        f"peaks cannot be checked (see `stepmem report {run.name}`)"
                    )
        if not steps:
            problems.append(f"GPU {i}: no step in common")
        for key, label in METRICS.items():
            if key in worst:
                more = "more" if worst[key] > 0 else "less or the same"
                lines.append(
                    f"- {label}: NEW uses {more} (largest change "
                    f"{100 * worst[key]:+.1f} % over {len(steps)} common steps)."
                )
                if key.endswith("peak_bytes") and worst[key] > tolerance:
                    regressed = True
        bm = max(
            ((r.get("ledger") or {}).get("optimizer_state_managed", 0) for r in b.values()),
            default=0,
        )
        nm = max(
            ((r.get("ledger") or {}).get("optimizer_state_managed", 0) for r in n.values()),
            default=0,
        )
        if bm != nm:
            lines.append(
                f"- managed (paged) optimizer state: {g(bm)} → {g(nm)}, outside the "
                "torch allocator, inside NVML used."
            )
        lines.append("")
    if problems:
        lines += ["**Cannot compare**:", *(f"- {p}." for p in problems), ""]
    if regressed:
        lines.append(f"**Regression**: a within-step peak grew by more than {100 * tolerance:g} %.")
    elif not problems:
        lines.append(f"No peak grew by more than {100 * tolerance:g} %.")
    return "\n".join(lines) + "\n", regressed or bool(problems)
