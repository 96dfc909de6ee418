"""A run's timeline as a picture: one panel per GPU, time in seconds from the first step.

Each panel: the NVML ``used`` trace at full rate (from the run store), steps as alternating bands,
per step the NVML within-step peak (a red bar across the step, a triangle at the moment it
happened) against the NVML reading at the step's end (a blue dot), torch reserved at the end
(shifted up by the CUDA-context baseline so it sits on NVML's scale), and the ledger at each step
end as a stacked band under the trace. The PNG shows the steps (idle lead-in and tail trimmed)
on an axis scaled to the data; a card far above the data is named in a note rather than drawn.
``render_png`` uses matplotlib (Agg); ``render_html`` writes an interactive page with plotly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from collector.analysis.accounting import accounts, changes
from collector.analysis.runs import Run
from collector.model.kinds import Component, MemoryKind
from collector.model.units import GIB

__all__ = ["render_html", "render_png"]

# the ledger's kinds stacked under the trace, and their colours
LEDGER = {
    MemoryKind.PARAMETERS: "#4c72b0",
    MemoryKind.GRADIENTS: "#dd8452",
    MemoryKind.OPTIMIZER_STATE: "#55a868",
    MemoryKind.OPTIMIZER_STATE_MANAGED: "#8172b3",
    MemoryKind.OTHER_ALLOCATED: "#c7c7c7",
}
# the accounting's components stacked instead where per-process readings split NVML used
ACCOUNT = {
    Component.BASELINE: "#8c8c8c",
    Component.TORCH_RESERVED: "#4c72b0",
    Component.FIRST_USE: "#937860",
    Component.OUTSIDE_TORCH: "#c44e52",
    Component.OTHER_PROCESSES: "#dd8452",
    Component.NO_PROCESS: "#8172b3",
    # a step whose per-process reading did not describe its end
    Component.OUTSIDE_UNSPLIT: "#bcbcbc",
}


def _panels(run: Run) -> list[dict[str, Any]]:
    panels = []
    t0 = None
    traces = {u: run.samples(u) for u in run.gpus}
    for df in traces.values():
        if df is not None and len(df):
            t0 = int(df["t_ns"].min()) if t0 is None else min(t0, int(df["t_ns"].min()))
    t0 = t0 or min((r.begin_ns for u in run.gpus for r in run.by_gpu[u]), default=0)
    for i, uuid in enumerate(run.gpus):
        df = traces[uuid]
        recs = run.by_gpu[uuid]
        accs = {a.step: a for a in accounts(recs)}
        split = any(a.unsplit is None for a in accs.values())
        steps = []

        def gib(v: int | None, base: int = 0) -> float | None:
            return None if v is None else (v + base) / GIB

        for r in recs:
            base = r.context_baseline or 0
            steps.append(
                {
                    "step": r.step,
                    "begin": (r.begin_ns - t0) / 1e9,
                    "end": (r.end_ns - t0) / 1e9,
                    "peak_t": ((r.nvml_peak_t_ns or r.end_ns) - t0) / 1e9,
                    "nvml_peak": gib(r.nvml_peak_bytes),
                    "nvml_end": gib(r.nvml_end),
                    "reserved_peak": gib(r.torch_reserved_peak_bytes, base),
                    "reserved_end": gib(r.reserved_end, base),
                    "ledger": {k: r.ledger_of(k) / GIB for k in LEDGER},
                    "error": r.error,
                    # every byte at step end (when NVML's per-process readings split it)
                    "account": {k: v / GIB for k, v in accs[r.step].components().items()}
                    if split and r.step in accs
                    else {},
                }
            )
        panels.append(
            {
                "title": f"GPU {i} {uuid}",
                "t": [] if df is None else ((df["t_ns"] - t0) / 1e9).tolist(),
                "used": [] if df is None else (df["used"] / GIB).tolist(),
                "steps": steps,
                "total": run.totals.get(uuid, 0) / GIB,
                "changes": [
                    c
                    for c in changes(list(accs.values()))
                    if c.component is not Component.TORCH_RESERVED
                ]
                if split
                else [],
            }
        )
    return panels


LEAD = 0.04  # trace kept before the first step and after the last: this share of the steps' span
FAR = 2.0  # a capacity line above FAR x the data's top is a note, not a line


def _view(p: dict[str, Any]) -> tuple[float, float, list[float], list[float]]:
    """The x range around the steps, and the trace inside it."""
    if p["steps"]:
        lo = min(s["begin"] for s in p["steps"])
        hi = max(s["end"] for s in p["steps"])
        lo, hi = lo - LEAD * (hi - lo), hi + LEAD * (hi - lo)
    else:
        lo, hi = (p["t"][0], p["t"][-1]) if p["t"] else (0.0, 1.0)
    keep = [(t, u) for t, u in zip(p["t"], p["used"], strict=True) if lo <= t <= hi]
    return lo, hi, [t for t, _ in keep], [u for _, u in keep]


def _note(ax: Any, text: str, xy: tuple[float, float], dy: float, color: str, arrow: str) -> None:
    """A small label ``dy`` points above (below, if negative) ``xy``, with a line to it."""
    ax.annotate(
        text,
        xy=xy,
        xytext=(0, dy),
        textcoords="offset points",
        ha="center",
        fontsize=8,
        color=color,
        arrowprops={"arrowstyle": arrow, "color": color, "lw": 0.6},
        zorder=5,
    )


def _draw_steps(ax: Any, steps: list[dict[str, Any]]) -> None:
    """Each step's span shaded, its number under it (at most ~25 numbers on the axis), a failed
    or interrupted step in red with its error."""
    every = max(1, len(steps) // 25)
    for k, s in enumerate(steps):
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
        ax.axvspan(s["begin"], s["end"], color="#e8e8e8" if k % 2 else "#f6f6f6", zorder=0)
        if k % every == 0:
            ax.text(
                (s["begin"] + s["end"]) / 2,
                0.01,
                str(s["step"]),
                transform=ax.get_xaxis_transform(),
                ha="center",
                fontsize=7,
                color="#777777",
            )


def _draw_stacks(ax: Any, steps: list[dict[str, Any]]) -> None:
    """The accounting's components stacked to NVML end when there are per-process readings,
    else the ledger's kinds (what live tensors are)."""
    ends = [s["end"] for s in steps]
    bottom = [0.0] * len(ends)
    for name, color, vals in _stacks(steps):
        tops = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.fill_between(ends, bottom, tops, step="pre", alpha=0.3, color=color, label=name, lw=0)
        bottom = tops


STACK_SHOWN_GIB = 0.01  # a stack under 10 MiB at every step is not drawn (nor in the legend)


def _stacks(steps: list[dict[str, Any]]) -> list[tuple[str, str, list[float]]]:
    """(name, colour, value at each step end) of every stack the run has: the accounting's
    components when per-process readings split NVML used, else the ledger's kinds; a kind
    this run does not have is left out (and out of the legend)."""
    split = any(s["account"] for s in steps)
    out = []
    for kind, color in (ACCOUNT if split else LEDGER).items():
        if split:
            vals = [max(0.0, s["account"].get(kind, 0.0)) for s in steps]
        else:
            vals = [s["ledger"][kind] for s in steps]
        if max(map(abs, vals), default=0.0) >= STACK_SHOWN_GIB:
            out.append((str(kind) if split else f"ledger: {kind.words}", color, vals))
    return out


def _draw_readings(
    ax: Any, steps: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[tuple[float, float]]]:
    """Peak against end, per step: a red bar at the peak across the step, a blue dot at the end
    reading (the gap between them is what an end-of-step reading hides), torch reserved at the
    end. Returns the steps with a peak and the (end, reserved) points."""
    measured = [s for s in steps if s["nvml_peak"] is not None]
    ax.hlines(
        [s["nvml_peak"] for s in measured],
        [s["begin"] for s in measured],
        [s["end"] for s in measured],
        color="crimson",
        lw=1.6,
        zorder=3,
        label="NVML within-step peak" if measured else None,  # the legend names what is drawn
    )
    ax.scatter(
        [s["peak_t"] for s in measured],
        [s["nvml_peak"] for s in measured],
        marker="v",
        color="crimson",
        s=22,
        zorder=4,
    )
    ended = [s for s in steps if s["nvml_end"] is not None]
    ax.scatter(
        [s["end"] for s in ended],
        [s["nvml_end"] for s in ended],
        marker="o",
        s=18,
        color="#1f5fbf",
        zorder=4,
        label="NVML at step end" if ended else None,
    )
    re = [(s["end"], s["reserved_end"]) for s in steps if s["reserved_end"]]
    if re:
        ax.scatter(
            *zip(*re, strict=True),
            marker="_",
            s=140,
            color="#e08000",
            zorder=4,
            label="torch reserved at step end + context",
        )
    return measured, re


def _draw_notes(
    ax: Any, p: dict[str, Any], steps: list[dict[str, Any]], measured: list[dict[str, Any]]
) -> None:
    """The step whose peak is farthest above its end, and what the accounting found (at most 4
    changes), each at the step it happened."""
    spread = [(s["nvml_peak"] - s["nvml_end"], s) for s in measured if s["nvml_end"] is not None]
    if spread:
        gap, big = max(spread, key=lambda x: x[0])
        if gap > 0:
            _note(
                ax,
                f"step {big['step']}: peak {big['nvml_peak']:.2f} GiB, "
                f"end {big['nvml_end']:.2f} GiB (+{gap:.2f})",
                (big["peak_t"], big["nvml_peak"]),
                14,
                "crimson",
                "-",
            )
    by_step = {s["step"]: s for s in steps}
    for c in p["changes"][:4]:
        s = by_step.get(c.step)
        if s is None or s["nvml_end"] is None:
            continue
        _note(
            ax,
            f"step {c.step}: {c.component} {c.delta / GIB:+.2f} GiB",
            (s["end"], s["nvml_end"]),
            -22 if c.delta < 0 else 22,
            "#5a2d82",
            "->",
        )


def _scale(ax: Any, p: dict[str, Any], values: list[float], peak: float) -> None:
    """The y range over ``values``, with the card's capacity drawn when it is near enough to
    them (else written in a corner with the share the largest peak ``peak`` uses)."""
    top = max(values, default=p["total"] or 1.0)
    low = min(values, default=0.0)
    y0 = 0.0 if low < 0.5 * top else low - 0.1 * (top - low)
    y1 = top + 0.15 * (top - y0)
    if p["total"] and p["total"] <= FAR * top:
        ax.axhline(p["total"], color="#aa0000", lw=0.6, ls="--", label="capacity")
        y1 = max(y1, p["total"] * 1.03)
    elif p["total"]:
        share = (
            f"peak uses {100 * peak / p['total']:.1f} %"
            if peak
            else "no NVML samples inside these steps: their peaks are unknown"
        )
        ax.text(
            0.99,
            0.97,
            f"capacity {p['total']:.1f} GiB (off scale; {share})",
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=8,
            color="#aa0000",
        )
    ax.set_ylim(y0, y1)


def render_png(run: Run, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(run)
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 4.6 * len(panels)), squeeze=False)
    for ax, p in zip(axes[:, 0], panels, strict=True):
        x0, x1, t, used = _view(p)
        steps = p["steps"]
        _draw_steps(ax, steps)
        _draw_stacks(ax, steps)
        shown = any(x0 <= x <= x1 for x in t)
        label = "NVML used (full rate)" if shown else None
        ax.plot(t, used, lw=0.7, color="#333333", label=label, zorder=2)
        measured, re = _draw_readings(ax, steps)
        if steps and not measured:
            ax.text(
                0.01,
                0.97,
                "no NVML sample inside any of these steps: their NVML figures are unknown",
                transform=ax.transAxes,
                ha="left",
                va="top",
                fontsize=8,
                color="#aa0000",
            )
        _draw_notes(ax, p, steps, measured)
        values = [*used, *(s["nvml_peak"] for s in measured), *(v for _, v in re)]
        values += [sum(s["ledger"].values()) for s in steps]
        _scale(ax, p, values, max((s["nvml_peak"] for s in measured), default=0))
        ax.set_xlim(x0, x1)
        ax.ticklabel_format(axis="x", useOffset=False)  # not "1e-8 + 4.98e-1"
        ax.set_title(p["title"], fontsize=10)
        ax.set_xlabel("seconds since the first sample")
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0)
    fig.suptitle(f"stepmem timeline — run {run.name}", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _markers(steps: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]], str, dict]]:
    """The per-step readings drawn as markers: (name, the steps that have it, x key, marker),
    y the reading of the same key as the name's (see :func:`_html_panel`)."""
    measured = [s for s in steps if s["nvml_peak"] is not None]
    ended = [s for s in steps if s["nvml_end"] is not None]
    res = [s for s in steps if s["reserved_end"]]
    return [
        (
            "NVML within-step peak",
            measured,
            "peak_t",
            {"color": "crimson", "symbol": "triangle-down", "size": 8},
        ),
        ("NVML at step end", ended, "end", {"color": "#1f5fbf", "size": 7}),
        (
            "torch reserved at step end + context",
            res,
            "end",
            {"color": "#e08000", "symbol": "line-ew-open", "size": 14},
        ),
    ]


_Y = {
    "NVML within-step peak": "nvml_peak",
    "NVML at step end": "nvml_end",
    "torch reserved at step end + context": "reserved_end",
}


def _html_panel(fig: Any, row: int, p: dict[str, Any], legend: Any) -> None:
    """One GPU's panel of the interactive timeline."""
    import plotly.graph_objects as go

    x0, x1, t, used = _view(p)
    steps = p["steps"]
    every = max(1, len(steps) // 25)  # step numbers as on the PNG: at most ~25
    for k, s in enumerate(steps):
        fig.add_vrect(
            x0=s["begin"],
            x1=s["end"],
            fillcolor="#f4c7c3" if s["error"] else ("#dcdcdc" if k % 2 else "#efefef"),
            opacity=1.0,
            layer="below",
            line_width=0,
            row=row,
            col=1,
        )
        if k % every == 0:
            fig.add_annotation(
                text=str(s["step"]),
                x=(s["begin"] + s["end"]) / 2,
                xref=f"x{row if row > 1 else ''}",
                yref=f"y{row if row > 1 else ''} domain",
                y=0.01,
                showarrow=False,
                font={"color": "#777777", "size": 9},
            )
    ends = [s["end"] for s in steps]
    for name, color, vals in _stacks(steps):
        fig.add_trace(
            go.Scatter(
                x=ends,
                y=vals,
                stackgroup=f"stack{row}",
                name=name,
                line={"shape": "vh", "width": 0},
                fillcolor=color,
                opacity=0.3,
                showlegend=legend(name),
            ),
            row=row,
            col=1,
        )
    name = "NVML used (full rate)"
    line = {"color": "#333333", "width": 1}
    fig.add_trace(
        go.Scattergl(x=t, y=used, mode="lines", name=name, line=line, showlegend=legend(name)),
        row=row,
        col=1,
    )
    for name, shown, x, marker in _markers(steps):
        if not shown and name.startswith("torch"):
            continue
        fig.add_trace(
            go.Scatter(
                x=[s[x] for s in shown],
                y=[s[_Y[name]] for s in shown],
                mode="markers",
                name=name,
                marker=marker,
                text=None if name.startswith("torch") else [f"step {s['step']}" for s in shown],
                showlegend=legend(name),
            ),
            row=row,
            col=1,
        )
    if steps and not any(s["nvml_peak"] is not None for s in steps):
        fig.add_annotation(
            text="no NVML samples inside these steps: their peaks are unknown",
            xref=f"x{row if row > 1 else ''} domain",
            yref=f"y{row if row > 1 else ''} domain",
            x=0.99,
            y=0.97,
            showarrow=False,
            font={"color": "#aa0000", "size": 11},
        )
    fig.update_xaxes(range=[x0, x1], title_text="seconds since the first sample", row=row, col=1)
    fig.update_yaxes(title_text="GiB", row=row, col=1)


def render_html(run: Run, out: str | Path) -> Path:
    """The same story as :func:`render_png`, interactive: the same window (idle lead-in and
    tail trimmed), step bands, the within-step peak and the NVML reading at each step end, torch
    reserved, and the stacks (only the kinds the run has), in the same colours."""
    from plotly.subplots import make_subplots

    panels = _panels(run)
    fig = make_subplots(rows=len(panels), cols=1, subplot_titles=[p["title"] for p in panels])
    shown: set[str] = set()

    def legend(name: str) -> bool:
        first = name not in shown
        shown.add(name)
        return first

    for row, p in enumerate(panels, start=1):
        _html_panel(fig, row, p, legend)
    fig.update_layout(
        height=420 * len(panels),
        title=run.meta.get("banner") or run.name,
        plot_bgcolor="white",
    )
    out = Path(out)
    fig.write_html(out, include_plotlyjs=True, full_html=True)
    return out
