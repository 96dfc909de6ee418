"""``stepmem report``: a run's per-step table and its diagnosis; ``stepmem compare``.

A run is a run-store directory (``runs/<run id>``) or the records JSON of ``stepmem run --out``.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from collector.diagnose import Finding, diagnose, g

__all__ = ["Run", "compare", "load_run", "render_report"]


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


def _unflatten(row: dict[str, Any]) -> dict[str, Any]:
    rec: dict[str, Any] = {"torch_end": {}, "ledger": {}}
    for k, v in row.items():
        if isinstance(v, float) and math.isnan(v):
            continue
        if k.startswith("torch_end."):
            rec["torch_end"][k.removeprefix("torch_end.")] = int(v)
        elif k.startswith("ledger."):
            rec["ledger"][k.removeprefix("ledger.")] = int(v)
        elif k == "phases":
            rec["phases"] = json.loads(v)
        else:
            rec[k] = v.item() if hasattr(v, "item") else v
    return rec


def load_run(path: str | Path) -> Run:
    """Read a run directory or a records JSON. Raises ``ValueError`` naming what is wrong."""
    path = Path(path)
    if path.is_dir():
        from collector.store import RunStore

        store = RunStore(path)
        steps = store.steps()
        records = [] if steps is None else [_unflatten(r) for r in steps.to_dict("records")]
        run = Run(path.name, store.meta, records)
        run.root = path
        return run
    if not path.is_file():
        raise ValueError(f"{path} is neither a run directory nor a records file")
    try:
        doc = json.loads(path.read_text())
        return Run(path.stem, doc, doc["records"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} is not a stepmem records file") from None


def render_report(run: Run) -> tuple[str, dict[str, list[Finding]]]:
    """The report as text (rich tables + findings) and the findings per GPU."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150, record=True, file=io.StringIO())
    findings = {}
    console.print(f"[bold]stepmem report[/bold] {run.name}: {run.meta.get('banner', '')}")
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
            nt = (
                None
                if res is None
                else (r["nvml_end_bytes"] - res - te.get("context_baseline_bytes", 0))
            )

            def c(v):
                return "" if v is None else f"{v / (1 << 30):.2f}"

            table.add_row(
                str(r["step"]),
                c(r["nvml_peak_bytes"]),
                c(r["nvml_end_bytes"]),
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
    return console.export_text(), findings


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
    whether NEW regresses: some step's peak above BASE's by more than ``tolerance``."""
    lines = [f"## stepmem compare: `{new.name}` against `{base.name}`", ""]
    regressed = False
    if len(base.gpus) != len(new.gpus):
        lines.append(
            f"GPU counts differ ({len(base.gpus)} vs {len(new.gpus)}): the first "
            f"{min(len(base.gpus), len(new.gpus))} are compared in index order."
        )
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
                    cells.append("")
                    continue
                rel = (nv - bv) / bv if bv else 0.0
                worst[key] = max(worst.get(key, -math.inf), rel)
                flag = " ⚠" if key.endswith("peak_bytes") and rel > tolerance else ""
                cells.append(f"{g(bv)} → {g(nv)} ({100 * rel:+.1f} %){flag}")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines.append("")
        for key, label in METRICS.items():
            if key in worst:
                more = "more" if worst[key] > 0 else "less or the same"
                lines.append(
                    f"- {label}: NEW uses {more} (largest change "
                    f"{100 * worst[key]:+.1f} % over {len(steps)} common steps)."
                )
                if key.endswith("peak_bytes") and worst[key] > tolerance:
                    regressed = True
        bm = max((r.get("ledger") or {}).get("optimizer_state_managed", 0) for r in b.values())
        nm = max((r.get("ledger") or {}).get("optimizer_state_managed", 0) for r in n.values())
        if bm != nm:
            lines.append(
                f"- managed (paged) optimizer state: {g(bm)} → {g(nm)}, outside the "
                "torch allocator, inside NVML used."
            )
        lines.append("")
    verdict = (
        f"**Regression**: a within-step peak grew by more than {100 * tolerance:g} %."
        if regressed
        else f"No peak grew by more than {100 * tolerance:g} %."
    )
    lines.append(verdict)
    return "\n".join(lines) + "\n", regressed
