"""``stepmem report``: a run's per-step tables and its diagnosis, as text.

Reading a run is :mod:`collector.runs`; comparing two is :mod:`collector.compare`. Everything a
run store or records file says is data: it is printed as plain text (never as Rich markup) and
nothing in it is executed.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, NamedTuple

from collector.diagnosis import Finding, FindingKind, diagnose, g, steps_text, verdict
from collector.records import StepRecord
from collector.runs import Run, Stream

__all__ = ["render_report"]

GIB = 1 << 30
TABLE_ROWS = 40  # a stream with more steps shows its first and last ones and the notable ones
EDGE_ROWS = 15
COLUMNS = (
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
)


def _c(v: float | None, missing: str = "") -> str:
    return missing if v is None else f"{v / GIB:.2f}"


def _row(r: StepRecord, seq: bool, shared: bool = False) -> list[str]:
    led = r.ledger
    gap = " ".join(x for x in (r.gap, r.failed and "FAILED") if x)
    return [
        *([str(r.seq)] if seq else []),
        str(r.step),
        _c(r.nvml_peak_bytes, "—"),  # not measured: no sample inside the step
        _c(r.nvml_end_bytes, "—"),
        _c(r.torch_allocated_peak_bytes),
        _c(r.allocated_end),
        _c(r.torch_reserved_peak_bytes),
        _c(r.reserved_end),
        "—" if shared else _c(r.nontorch_end),  # a shared GPU's NVML is every rank's
        _c(led.get("parameters")),
        _c(led.get("gradients")),
        _c(led.get("optimizer_state")),
        _c(led.get("optimizer_state_managed")),
        gap,
    ]


def shown_rows(recs: list[StepRecord], all_steps: bool = False) -> list[int | None]:
    """Which records a table shows: all of a short stream; of a long one the first and last
    :data:`EDGE_ROWS`, the highest NVML peak, and every failed or gapped step up to the table's
    size. ``None`` marks where steps are left out."""
    n = len(recs)
    if all_steps or n <= TABLE_ROWS:
        return list(range(n))
    keep = set(range(EDGE_ROWS)) | set(range(n - EDGE_ROWS, n))
    peaked = [i for i in range(n) if recs[i].measured]
    if peaked:
        keep.add(max(peaked, key=lambda i: recs[i].nvml_peak_bytes or 0))
    odd = [i for i in range(n) if recs[i].failed or recs[i].gap]
    for i in odd[: TABLE_ROWS - len(keep)]:
        keep.add(i)
    out: list[int | None] = []
    for i in sorted(keep):
        if out and out[-1] is not None and i != out[-1] + 1:
            out.append(None)
        out.append(i)
    return out


def _table(run: Run, stream: Stream, several: bool, all_steps: bool) -> Any:
    from rich.table import Table

    recs = stream.records
    seq = stream.steps_repeat
    title = f"GPU {stream.gpu} {stream.gpu_uuid}{stream.label(several)} — memory per step (GiB)"
    table = Table(title=title, title_justify="center")
    for col in ("#", *COLUMNS) if seq else COLUMNS:
        table.add_column(col, justify="right")
    rows = shown_rows(recs, all_steps)
    for k, i in enumerate(rows):
        if i is None:
            nxt = rows[k + 1]
            prev = rows[k - 1]
            assert nxt is not None and prev is not None
            left = nxt - prev - 1
            table.add_row(*(["⋯"] * (len(COLUMNS) + seq - 1)), f"{left} steps")
            continue
        table.add_row(*_row(recs[i], seq, several))
    if several:
        table.caption = (
            "This GPU is shared by several ranks: NVML figures are the whole device's, so "
            "non-torch is left out here; each rank's own memory outside torch is in its "
            "accounting below."
        )
    return table


def render_report(
    run: Run, verbose: bool = False, all_steps: bool = False
) -> tuple[str, dict[tuple[str, int], list[Finding]]]:
    """The report as text (tables + findings) and the findings per stream ((GPU, pid))."""
    from rich.console import Console
    from rich.text import Text

    console = Console(width=150, record=True, file=io.StringIO(), highlight=False)
    findings = {}
    title = Text(f"Run {run.name}", style="bold")
    title.append(f" — {run.meta.get('banner', '')}", style="")
    console.print(title)
    for line in status_lines(run.meta):
        console.print(Text(line, style="bold"))
    quality = sampling_line(run.meta)
    if quality:
        console.print(Text(quality))
    repeat = [s for s in run.streams if s.steps_repeat]
    if repeat:
        console.print(
            Text(
                "Step numbers repeat (the caller restarts them, e.g. each epoch): every step "
                "is kept, numbered # in the order it ran; the diagnosis names steps by that #."
            )
        )
    history = _history(run)
    for stream in run.streams:
        several = len(run.streams_of(stream.gpu_uuid)) > 1
        console.print(_table(run, stream, several, all_steps))
        # the history is the first GPU of rank 0's process: its sites belong to that stream
        sites = history if stream is _history_stream(run) else {}
        fs = diagnose(stream.numbered(), run.totals.get(stream.gpu_uuid), sites, verbose)
        findings[(stream.gpu_uuid, stream.pid)] = fs
        head = verdict(fs)
        if head:
            console.print(Text("Verdict", style="bold"))
            for line in head:
                console.print(Text(f" {line}"))
        console.print(Text("Findings", style="bold"))
        hidden = 0
        for f in fs:
            if f.minor and not verbose:
                hidden += 1
                continue
            console.print(Text(f" • {f.shown(verbose)}"))
            if f.kind is FindingKind.OOM and run.root is not None:
                lead = _lead_up(run.root, stream.gpu_uuid, stream.records, f.numbers["step"])
                if lead:
                    console.print(Text(f"   {lead}"))
        if hidden:
            console.print(
                Text(f" ({hidden} finding(s) under the noise floor left out: --verbose shows them)")
            )
    if len(run.streams) > 1:
        _fleet(run, console)
    if run.root is not None and (run.root / "history").is_dir():
        _sites(run.root / "history", console)
    return console.export_text(), findings


def _history_stream(run: Run) -> Stream | None:
    """The stream the allocation history belongs to: rank 0's first GPU."""
    ranked = sorted(run.streams, key=lambda s: (s.rank, s.gpu))
    return ranked[0] if ranked else None


def _history(run: Run) -> dict[int, dict[str, Any]]:
    """The allocation history's summary by step (empty without a readable one)."""
    if run.root is None or not (run.root / "history").is_dir():
        return {}
    from collector import history

    try:
        return {s["step"]: s for s in history.summary(run.root / "history", top=3)["steps"]}
    except (FileNotFoundError, history.HistoryError):
        return {}


def _sites(folder: Path, console: Any, top: int = 3) -> None:
    """Which lines allocated it: the probe's allocation history (first GPU of the process)."""
    from rich.text import Text

    from collector import history

    try:
        doc = history.summary(folder, top=top)
    except FileNotFoundError:  # recording started but its steps never ended
        return
    except history.HistoryError as exc:
        console.print(Text(f"Allocation sites: the history in {folder} is unreadable ({exc})"))
        return
    steps = doc["steps"]
    if not steps:
        return
    head = Text("Allocation sites", style="bold")
    head.append(
        f" (PyTorch's memory history, steps {steps_text([s['step'] for s in steps])}, "
        f"{doc['trace_entries']:,} allocator events; open {folder}/*.pickle in "
        "https://pytorch.org/memory_viz)",
        style="",
    )
    console.print(head)

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
            Text(
                f" • step {s['step']}{why}: at its peak ({g(s['peak_bytes'])} traced, "
                f"{s['peak_phase'].replace('_', '/')}): {fmt(s['at_peak'])}"
            )
        )
        if s["kept_to_next"]:
            console.print(
                Text(
                    f"   allocated in step {s['step']}, still live at the end of step "
                    f"{s['step'] + 1}: {fmt(s['kept_to_next'])}"
                )
            )


FLEET_ROWS = 16  # a fleet table of more streams shows the highest, the lowest and the odd ones
IMBALANCE_FRACTION = 0.05  # a rank whose allocated peak is this far from the median…
IMBALANCE_BYTES = 256 << 20  # …and at least this far, is named
_LEDGER_PARTS = ("parameters", "gradients", "optimizer_state", "other_allocated")


class _FleetRow(NamedTuple):
    stream: Stream
    node: str  # node id, shortened
    top: StepRecord | None  # the step with the highest NVML peak (None: none measured)
    alloc: int | None  # this process's highest torch allocated peak
    lost: bool  # its sampler could not be reached at the end of the run


def _fleet_rows(run: Run) -> list[_FleetRow]:
    samplers = run.meta.get("samplers", [])
    node_of = {s["gpu_uuid"]: str(s["node_id"])[:12] for s in samplers}
    lost = {
        s["gpu_uuid"]
        for s, h in zip(samplers, run.meta.get("health") or [], strict=False)
        if isinstance(h, dict) and h.get("unreachable")
    }
    rows = []
    for st in run.streams:
        peaked = [r for r in st.records if r.measured]
        top = max(peaked, key=lambda r: r.nvml_peak_bytes or 0, default=None)
        allocs = [
            r.torch_allocated_peak_bytes
            for r in st.records
            if r.torch_allocated_peak_bytes is not None
        ]
        rows.append(
            _FleetRow(
                st,
                node_of.get(st.gpu_uuid, "?"),
                top,
                max(allocs, default=None),
                st.gpu_uuid in lost,
            )
        )
    return rows


def imbalance(rows: list[_FleetRow]) -> list[dict[str, Any]]:
    """Ranks whose highest torch allocated peak lies more than :data:`IMBALANCE_FRACTION`
    (and :data:`IMBALANCE_BYTES`) above the median of all ranks (with two ranks: above the
    lower one), each with the ledger component that differs most from the median rank's
    (parameters, gradients, optimizer state, other allocated: activations and temporaries)."""
    import statistics

    ranked = [r for r in rows if r.alloc is not None and not r.lost]
    if len(ranked) < 2:
        return []
    # what the ranks are held against: the median, or with two ranks the lower of them (the
    # median of two is their mean, and would make both look odd)
    med = (
        statistics.median(r.alloc for r in ranked)
        if len(ranked) > 2
        else min(r.alloc for r in ranked)
    )

    def ledger(row: _FleetRow) -> dict[str, int]:
        last = next((r for r in reversed(row.stream.records) if r.ledger), None)
        return {k: last.ledger_of(k) if last else 0 for k in _LEDGER_PARTS}

    if len(ranked) > 2:
        parts_med = {k: statistics.median(ledger(r)[k] for r in ranked) for k in _LEDGER_PARTS}
    else:
        parts_med = ledger(min(ranked, key=lambda r: r.alloc))
    out = []
    for row in ranked:
        diff = row.alloc - med
        # only ranks above: the alert's rule (StepMemRankImbalance), and the rank to look at
        if diff <= max(IMBALANCE_FRACTION * med, IMBALANCE_BYTES):
            continue
        led = ledger(row)
        deltas = {k: led[k] - parts_med[k] for k in _LEDGER_PARTS}
        part = max(deltas, key=lambda k: abs(deltas[k])) if any(deltas.values()) else None
        out.append(
            {
                "rank": row.stream.rank,
                "gpu": row.stream.gpu,
                "pid": row.stream.pid,
                "alloc_peak": row.alloc,
                "median": med,
                "diff": diff,
                "component": part,
                "component_diff": deltas[part] if part else 0,
            }
        )
    return out


def _fleet(run: Run, console: Any) -> None:
    """Every stream (a GPU, or one rank of several on a GPU) side by side: which peaks highest,
    how far apart they are, per node, ranks out of balance, and GPUs that were lost (a sampler
    not reachable at the end: its node gone, its actor dead). A fleet of more than
    :data:`FLEET_ROWS` shows its highest and lowest and every odd one, and says how many more
    lie between."""
    from rich.table import Table
    from rich.text import Text

    rows = _fleet_rows(run)
    odd_ranks = {(x["gpu"], x["pid"]) for x in imbalance(rows)}
    ranks = any(r.stream.world_size > 1 or len(run.streams_of(r.stream.gpu_uuid)) > 1 for r in rows)
    shown = rows
    if len(rows) > FLEET_ROWS:
        by_peak = sorted(rows, key=lambda r: -(r.top.nvml_peak_bytes if r.top else -1))
        keep = {id(r) for r in by_peak[:6] + by_peak[-3:]}
        keep |= {id(r) for r in rows if r.lost or (r.stream.gpu, r.stream.pid) in odd_ranks}
        shown = [r for r in rows if id(r) in keep]
    what = f"{len(rows)} ranks" if ranks else f"every GPU ({len(rows)})"
    table = Table(title=f"Fleet — {what} of the run (GiB)")
    cols = [
        "GPU",
        *(["rank"] if ranks else []),
        "node",
        "steps",
        "last step",
        "nvml peak",
        "in step",
        "alloc peak",
        "state",
    ]
    for col in cols:
        table.add_column(col, justify="right")
    for row in shown:
        st = row.stream
        state = "LOST" if row.lost else ("IMBALANCED" if (st.gpu, st.pid) in odd_ranks else "")
        table.add_row(
            str(st.gpu),
            *([str(st.rank)] if ranks else []),
            row.node,
            str(len(st.records)),
            str(st.records[-1].step) if st.records else "—",
            _c(row.top.nvml_peak_bytes) if row.top else "—",
            str(row.top.step) if row.top else "—",
            _c(row.alloc, "—"),
            state,
        )
    if len(shown) < len(rows):
        table.add_row(*(["⋯"] * (len(cols) - 1)), f"{len(rows) - len(shown)} more")
    console.print(table)
    console.print(Text("Fleet", style="bold"))
    for line in fleet_lines(run, rows):
        console.print(Text(f" • {line}"))


def fleet_lines(run: Run, rows: list[_FleetRow]) -> list[str]:
    """The fleet's findings, as lines."""
    out = []
    # a lost GPU's records stop early: comparing its few steps with whole runs says nothing
    ran = [row for row in rows if not row.lost] or rows
    if len(ran) < len(rows):
        ranks = len(rows) > len(run.gpus)
        what = "ranks whose GPU was" if ranks else "GPUs that were"
        out.append(f"Compared: the {len(ran)} {what} not lost.")
    worlds = sorted({r.stream.world_size for r in rows})
    if len(worlds) > 1:
        out.append(
            "The ranks do not agree on the world size ("
            + ", ".join(str(w) for w in worlds)
            + "): they may belong to different runs, or one restarted with another size."
        )
    gpu_top: dict[int, _FleetRow] = {}
    for row in ran:
        if row.top is None:
            continue
        cur = gpu_top.get(row.stream.gpu)
        if cur is None or row.top.nvml_peak_bytes > cur.top.nvml_peak_bytes:
            gpu_top[row.stream.gpu] = row
    measured = list(gpu_top.values())
    if len(measured) > 1:
        hi = max(measured, key=lambda row: row.top.nvml_peak_bytes)
        lo = min(measured, key=lambda row: row.top.nvml_peak_bytes)
        hb, lb = hi.top.nvml_peak_bytes, lo.top.nvml_peak_bytes
        pct = (hb / lb - 1) * 100 if lb else 0.0
        if hb == lb:
            out.append(
                f"Every compared GPU's highest within-step peak is the same: {g(hb)} "
                f"({len(measured)} GPUs)."
            )
        else:
            out.append(
                f"Highest within-step peak: GPU {hi.stream.gpu} on node {hi.node}, {g(hb)} in "
                f"step {hi.top.step}; lowest: GPU {lo.stream.gpu} on node {lo.node}, "
                f"{g(lb)} — the highest is {g(hb - lb)} ({pct:.1f} %) above."
            )
        nodes: dict[str, int] = {}
        for row in measured:
            nodes[row.node] = max(nodes.get(row.node, 0), row.top.nvml_peak_bytes)
        if len(nodes) > 1:
            out.append(
                "Per node, highest peak: "
                + ", ".join(f"{n} {g(b)}" for n, b in sorted(nodes.items()))
                + "."
            )
    for x in imbalance(rows):
        what = ""
        if x["component"]:
            name = x["component"].replace("_", " ")
            if x["component"] == "other_allocated":
                name = "other allocated (activations, temporaries)"
            diff = x["component_diff"] / GIB
            what = f"; the ledger component that differs most: {name} ({diff:+.2f} GiB)"
        against = "the median of the ranks" if len(rows) > 2 else "the other rank"
        out.append(
            f"Rank {x['rank']} (GPU {x['gpu']}) is out of balance: its allocated peak "
            f"{g(x['alloc_peak'])} is {x['diff'] / GIB:+.2f} GiB "
            f"({100 * x['diff'] / x['median']:+.0f} %) above {against} "
            f"({g(x['median'])}){what}."
        )
    most = max((len(row.stream.records) for row in rows), default=0)
    for row in rows:
        recs = row.stream.records
        if not row.lost and 0 < len(recs) < most and row.stream.world_size > 1:
            out.append(
                f"Rank {row.stream.rank} (GPU {row.stream.gpu}, pid {row.stream.pid}) stopped "
                f"after step {recs[-1].step}: {len(recs)} of {most} steps — its process "
                "ended early or died; its steps up to then are kept."
            )
    for row in rows:
        if row.lost:
            recs = row.stream.records
            out.append(
                f"GPU {row.stream.gpu} on node {row.node} was LOST: its sampler could not be "
                "reached at the end of the run (its node removed or dead, or the actor killed); "
                + (
                    f"its records stop at step {recs[-1].step} ({len(recs)} of {most} "
                    "steps), kept as drained before."
                    if recs
                    else "none of its step records had been drained."
                )
            )
    return out


STATUS = {
    "interrupted": "Run INTERRUPTED (Ctrl-C, SIGTERM or `ray job stop`): the steps below are "
    "the ones that ended before it stopped; the store was flushed.",
    "running": "Run UNFINISHED: its store still says running — the job was killed without a "
    "chance to flush (SIGKILL, the OOM killer, a lost node) or is still going; up to the last "
    "2 s of samples and any step not yet joined may be missing.",
    "failed": "Run FAILED: the workload raised; the failed step is marked below.",
    "incomplete": "Run INCOMPLETE: it ended, but not everything it measured was kept:",
}


def status_lines(meta: dict[str, Any]) -> list[str]:
    """What the run store says about how the run ended, when it did not simply complete, and
    why a run's record is incomplete (write errors, samplers lost), one line each."""
    status = meta.get("status")
    out = []
    if status not in (None, "complete"):
        out.append(STATUS.get(str(status), f"Run status: {status!r}."))
    problems = [str(p) for p in meta.get("problems") or []]
    errors = meta.get("write_errors") or {}
    if errors and not problems:  # a store closed by an older stepmem, or killed mid-way
        problems.append(
            "the run store could not write "
            + ", ".join(f"{n} {k}" for k, n in sorted(errors.items()))
        )
    if problems and status != "incomplete":
        out.append("Not everything this run measured was kept:")
    out += [f"  - {p}" for p in problems]
    return out


def sampling_line(meta: dict[str, Any]) -> str:
    """How well the samplers kept their rate, from their final health: the mean rate achieved
    against the target, deadlines missed, and the trace's resolution when it is coarser than
    2 ms (a replayed capture recorded at a low rate). Empty when nothing was recorded."""
    health = [h for h in meta.get("health") or [] if isinstance(h, dict) and "rate_hz" in h]
    target = meta.get("rate_hz")
    if not health:
        return ""
    rates = [float(h.get("mean_rate_hz") or h.get("rate_hz") or 0) for h in health]
    missed = sum(int(h.get("missed_deadlines") or 0) for h in health)
    aim = f" (target {target:g} Hz)" if isinstance(target, int | float) and target else ""
    span = f"{min(rates):.0f}" + (
        f"–{max(rates):.0f}" if round(max(rates)) != round(min(rates)) else ""
    )
    line = f"Sampling: {span} Hz achieved{aim}; {missed:,} sampling deadlines missed"
    coarse = max(
        (
            int(s.get("resolution_ns") or 0)
            for s in meta.get("samplers") or []
            if isinstance(s, dict)
        ),
        default=0,
    )
    # a replay holds the capture's samples: it cannot be faster than the capture was taken
    reachable = target if isinstance(target, int | float) else 0
    if coarse and reachable:
        reachable = min(reachable, 1e9 / coarse)
    if reachable and min(rates) < 0.5 * reachable:
        line += " — the samplers got too little CPU: short transients may be missed"
        nice = max((int(h.get("sampler_niceness") or 0) for h in health), default=0)
        if nice > 0:
            line += (
                f" (their threads ran at nice {nice}, Ray's for its workers: lowering it needs "
                "CAP_SYS_NICE)"
            )
    if coarse > 2_000_000:
        line += (
            f". The NVML trace resolves {coarse / 1e6:.0f} ms (the capture's own rate): "
            f"transients shorter than that may be missed, and a reading at a step mark may "
            f"show what happened up to {coarse / 1e6:.0f} ms after it"
        )
    return line + "."


def _lead_up(root: Path, uuid: str, recs: list[StepRecord], step: int, n: int = 10) -> str:
    """The NVML samples leading to a failed step's end, from the run store: ``n`` readings
    evenly spaced over the last second before it (the steps before included)."""
    from collector.store import RunStore

    rec = next((r for r in recs if r.step == step), None)
    try:
        samples = RunStore(root).samples(uuid)
    except (OSError, ValueError):
        return ""
    if rec is None or samples is None or not len(samples):
        return ""
    end = int(rec.end_ns)
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
