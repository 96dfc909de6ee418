"""A run's timeline as a picture: one panel per GPU, time in seconds from the first sample.

Each panel: the NVML ``used`` trace at full rate (from the run store), steps as alternating bands,
per step the torch reserved peak and end (shifted up by the CUDA-context baseline so they sit on
NVML's scale), the NVML within-step peak marked at the moment it happened, and the ledger at each
step end as a stacked band under the trace. ``render_png`` uses matplotlib (Agg);
``render_html`` writes a self-contained interactive page with plotly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from collector.report import Run
from collector.store import RunStore

__all__ = ["render_html", "render_png"]

GIB = float(1 << 30)
LEDGER = (
    "parameters",
    "gradients",
    "optimizer_state",
    "optimizer_state_managed",
    "other_allocated",
)
COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer_state": "#55a868",
    "optimizer_state_managed": "#8172b3",
    "other_allocated": "#c7c7c7",
}


def _panels(run: Run, store: RunStore) -> list[dict[str, Any]]:
    panels = []
    t0 = None
    traces = {u: store.samples(u) for u in run.gpus}
    for df in traces.values():
        if df is not None and len(df):
            t0 = int(df["t_ns"].min()) if t0 is None else min(t0, int(df["t_ns"].min()))
    t0 = t0 or min((r["begin_ns"] for u in run.gpus for r in run.by_gpu[u]), default=0)
    for i, uuid in enumerate(run.gpus):
        df = traces[uuid]
        recs = run.by_gpu[uuid]
        steps = []
        for r in recs:
            te = r.get("torch_end") or {}
            base = te.get("context_baseline_bytes", 0)
            steps.append(
                {
                    "step": r["step"],
                    "begin": (r["begin_ns"] - t0) / 1e9,
                    "end": (r["end_ns"] - t0) / 1e9,
                    "peak_t": ((r.get("nvml_peak_t_ns") or r["end_ns"]) - t0) / 1e9,
                    "nvml_peak": r["nvml_peak_bytes"] / GIB,
                    "reserved_peak": None
                    if r.get("torch_reserved_peak_bytes") is None
                    else (r["torch_reserved_peak_bytes"] + base) / GIB,
                    "reserved_end": None
                    if "reserved_bytes.all.current" not in te
                    else (te["reserved_bytes.all.current"] + base) / GIB,
                    "ledger": {k: (r.get("ledger") or {}).get(k, 0) / GIB for k in LEDGER},
                    "error": r.get("error") or "",
                }
            )
        panels.append(
            {
                "title": f"GPU {i} {uuid}",
                "t": [] if df is None else ((df["t_ns"] - t0) / 1e9).tolist(),
                "used": [] if df is None else (df["used"] / GIB).tolist(),
                "steps": steps,
                "total": run.totals.get(uuid, 0) / GIB,
            }
        )
    return panels


def render_png(run: Run, store: RunStore, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(run, store)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 4.2 * len(panels)), squeeze=False)
    for ax, p in zip(axes[:, 0], panels, strict=True):
        for k, s in enumerate(p["steps"]):
            if s["error"]:  # a step that failed (OOM) or was interrupted
                ax.axvspan(s["begin"], s["end"], color="#f4c7c3", zorder=0)
                ax.text(
                    s["end"],
                    0.5,
                    f" step {s['step']}: {s['error']}",
                    transform=ax.get_xaxis_transform(),
                    fontsize=8,
                    color="#aa0000",
                    rotation=90,
                    va="center",
                )
                continue
            ax.axvspan(s["begin"], s["end"], color="#eeeeee" if k % 2 else "#f7f7f7", zorder=0)
            ax.text(
                (s["begin"] + s["end"]) / 2,
                0.01,
                str(s["step"]),
                transform=ax.get_xaxis_transform(),
                ha="center",
                fontsize=7,
                color="#888888",
            )
        ends = [s["end"] for s in p["steps"]]
        bottom = [0.0] * len(ends)
        for kind in LEDGER:
            vals = [s["ledger"][kind] for s in p["steps"]]
            if any(vals):
                tops = [b + v for b, v in zip(bottom, vals, strict=True)]
                ax.fill_between(
                    ends,
                    bottom,
                    tops,
                    step="pre",
                    alpha=0.35,
                    color=COLORS[kind],
                    label=f"ledger: {kind.replace('_', ' ')}",
                    lw=0,
                )
                bottom = tops
        ax.plot(p["t"], p["used"], lw=0.8, color="black", label="NVML used (full rate)")
        ax.scatter(
            [s["peak_t"] for s in p["steps"]],
            [s["nvml_peak"] for s in p["steps"]],
            marker="v",
            color="crimson",
            s=25,
            zorder=3,
            label="NVML within-step peak",
        )
        rp = [(s["end"], s["reserved_peak"]) for s in p["steps"] if s["reserved_peak"]]
        re = [(s["end"], s["reserved_end"]) for s in p["steps"] if s["reserved_end"]]
        if rp:
            ax.scatter(
                *zip(*rp, strict=True),
                marker="_",
                s=200,
                color="#1f77b4",
                zorder=3,
                label="torch reserved peak + context",
            )
        if re:
            ax.scatter(
                *zip(*re, strict=True),
                marker="o",
                s=14,
                color="#1f77b4",
                zorder=3,
                label="torch reserved at step end + context",
            )
        if p["total"]:
            ax.axhline(p["total"], color="#aa0000", lw=0.6, ls="--", label="capacity")
        ax.set_title(p["title"], fontsize=10)
        ax.set_xlabel("seconds since the first sample")
        ax.set_ylabel("GiB")
        top = max([p["total"], *p["used"], *(s["nvml_peak"] for s in p["steps"])], default=0)
        ax.set_ylim(bottom=0, top=top * 1.05 or None)  # the capacity line stays in view
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(f"stepmem timeline — run {run.name}", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def render_html(run: Run, store: RunStore, out: str | Path) -> Path:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = _panels(run, store)
    fig = make_subplots(rows=len(panels), cols=1, subplot_titles=[p["title"] for p in panels])
    for row, p in enumerate(panels, start=1):
        legend = row == 1
        for s in p["steps"]:
            fig.add_vrect(
                x0=s["begin"],
                x1=s["end"],
                fillcolor="#eeeeee",
                opacity=0.5,
                line_width=0,
                row=row,
                col=1,
            )
        fig.add_trace(
            go.Scattergl(
                x=p["t"],
                y=p["used"],
                mode="lines",
                name="NVML used",
                line={"color": "black", "width": 1},
                showlegend=legend,
            ),
            row=row,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=[s["peak_t"] for s in p["steps"]],
                y=[s["nvml_peak"] for s in p["steps"]],
                mode="markers",
                name="NVML within-step peak",
                marker={"color": "crimson"},
                text=[f"step {s['step']}" for s in p["steps"]],
                showlegend=legend,
            ),
            row=row,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=[s["end"] for s in p["steps"]],
                y=[s["reserved_end"] for s in p["steps"]],
                mode="markers",
                name="torch reserved at end + context",
                marker={"color": "#1f77b4"},
                showlegend=legend,
            ),
            row=row,
            col=1,
        )
        for kind in LEDGER:
            fig.add_trace(
                go.Scatter(
                    x=[s["end"] for s in p["steps"]],
                    y=[s["ledger"][kind] for s in p["steps"]],
                    stackgroup=f"ledger{row}",
                    name=f"ledger: {kind}",
                    line={"shape": "hv"},
                    showlegend=legend,
                    fillcolor=COLORS[kind],
                    line_color=COLORS[kind],
                ),
                row=row,
                col=1,
            )
        fig.update_yaxes(title_text="GiB", row=row, col=1)
    fig.update_layout(height=420 * len(panels), title=run.meta.get("banner") or run.name)
    out = Path(out)
    fig.write_html(out, include_plotlyjs=True, full_html=True)
    return out
