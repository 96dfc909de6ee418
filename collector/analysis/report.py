"""``stepmem report``: a run's per-step tables and its diagnosis, as text.

Reading a run is :mod:`collector.analysis.runs`; comparing two is
:mod:`collector.analysis.compare`; what the findings say is :mod:`collector.analysis.diagnosis`.
Everything a run store or records file says is data: it is printed as plain text (never as Rich
markup) and nothing in it is executed.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from collector.analysis.diagnose_run import RunDiagnosis, StreamDiagnosis, diagnose_run
from collector.analysis.diagnosis import Finding, FindingKind, steps_text
from collector.analysis.make_it_fit import offer
from collector.analysis.predicted_vs_measured import render_reconciliation
from collector.analysis.runs import Run, Stream, replay_speed
from collector.model.kinds import MemoryKind
from collector.model.prediction import Estimate
from collector.model.records import SamplerHealth, SamplerInfo
from collector.model.step import StepRecord
from collector.model.units import gib, gib_figure

__all__ = ["render", "render_report"]

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
    return missing if v is None else gib_figure(v)


def _row(r: StepRecord, seq: bool, shared: bool = False) -> list[str]:
    led = r.ledger
    gap = " ".join(x for x in (r.gap, r.failed and "FAILED") if x)
    return [
        *([str(r.seq)] if seq else []),
        str(r.step),
        _c(r.nvml_peak_bytes, "—"),  # not measured: no sample inside the step
        _c(r.nvml_end, "—"),  # none, or stale (left out: the gap column says so)
        _c(r.torch_allocated_peak_bytes),
        _c(r.allocated_end),
        _c(r.torch_reserved_peak_bytes),
        _c(r.reserved_end),
        "—" if shared else _c(r.nontorch_end),  # a shared GPU's NVML is every rank's
        _c(led.get(MemoryKind.PARAMETERS)),
        _c(led.get(MemoryKind.GRADIENTS)),
        _c(led.get(MemoryKind.OPTIMIZER_STATE)),
        _c(led.get(MemoryKind.OPTIMIZER_STATE_MANAGED)),
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
    from rich.text import Text

    recs = stream.records
    seq = stream.steps_repeat
    title = f"GPU {stream.gpu} {stream.gpu_uuid}{stream.label(several)} — memory per step (GiB)"
    table = Table(title=Text(title), title_justify="center")  # data, not markup
    for col in ("#", *COLUMNS) if seq else COLUMNS:
        table.add_column(col, justify="right")
    rows = shown_rows(recs, all_steps)
    lost = dict(stream.lost)  # first lost seq → last
    width = len(COLUMNS) + seq
    for k, i in enumerate(rows):
        if i is not None:
            # the steps lost just before this record (after the one shown before it)
            before = recs[i - 1].seq if i > 0 else 0
            for a, b in [(a, b) for a, b in lost.items() if before < a < (recs[i].seq or 0)]:
                n = b - a + 1
                table.add_row(
                    *map(Text, ["—"] * (width - 1)), Text(f"{n} step{'s' if n > 1 else ''} lost")
                )
        if i is None:
            nxt = rows[k + 1]
            prev = rows[k - 1]
            assert nxt is not None and prev is not None
            left = nxt - prev - 1
            table.add_row(*(["⋯"] * (len(COLUMNS) + seq - 1)), f"{left} steps")
            continue
        table.add_row(*map(Text, _row(recs[i], seq, several)))  # a gap of "[/x]" is text
    if several:
        table.caption = (
            "This GPU is shared by several ranks: NVML figures are the whole device's, so "
            "non-torch is left out here; each rank's own memory outside torch is in its "
            "accounting below."
        )
    return table


def render_report(
    run: Run, verbose: bool = False, all_steps: bool = False, est: Estimate | None = None
) -> tuple[str, dict[tuple[str, int], list[Finding]]]:
    """The report of ``run`` (diagnosed, then rendered) and the findings per stream ((GPU,
    pid)); with ``est``, the predicted-vs-measured table after it."""
    diagnosis = diagnose_run(run, verbose, est)
    return render(run, diagnosis, verbose, all_steps), diagnosis.findings


def render(run: Run, d: RunDiagnosis, verbose: bool = False, all_steps: bool = False) -> str:
    """The report as text: the run's header lines, each stream's table, verdict and findings,
    the fleet, the allocation sites, the reconciliation — laid out from ``d``, nothing
    computed, no store read."""
    from rich.console import Console
    from rich.text import Text

    console = Console(width=150, record=True, file=io.StringIO(), highlight=False)
    title = Text(f"Run {run.name}", style="bold")
    title.append(f" — {run.meta.get('banner', '')}", style="")
    console.print(title)
    for line in status_lines(run.meta):
        console.print(Text(line, style="bold"))
    quality = sampling_line(run.meta, run.samplers, run.health)
    if quality:
        console.print(Text(quality))
    if run.time_scale != 1:
        console.print(
            Text(
                f"A replay at {run.time_scale:g}x: times inside a step are the recorded run's "
                f"({run.time_scale:g}× the replay's)."
            )
        )
    repeat = [s for s in run.streams if s.steps_repeat]
    if repeat:
        console.print(
            Text(
                "Step numbers repeat (the caller restarts them, e.g. each epoch): every step "
                "is kept, numbered # in the order it ran; the diagnosis names steps by that #."
            )
        )
    for sd in d.streams:
        _stream(run, sd, console, verbose, all_steps)
    if d.fleet:
        _fleet(run, d, console)
    if d.history is not None and run.root is not None:
        _sites(run.root / "history", d.history, console)
    for line in offer(run):
        console.print(Text(line))
    text = console.export_text()
    if d.estimate is not None:
        text = text.rstrip("\n") + "\n\n" + _reconciliation(d) + "\n"
    return text


def _stream(run: Run, sd: StreamDiagnosis, console: Any, verbose: bool, all_steps: bool) -> None:
    from rich.text import Text

    stream = sd.stream
    several = len(run.streams_of(stream.gpu_uuid)) > 1
    console.print(_table(run, stream, several, all_steps))
    if stream.lost:
        console.print(Text(_lost_line(stream), style="bold"))
    if sd.verdict:
        console.print(Text("Verdict", style="bold"))
        for line in sd.verdict:
            console.print(Text(f" {line}"))
    console.print(Text("Findings", style="bold"))
    hidden = 0
    for f in sd.findings:
        if f.minor and not verbose:
            hidden += 1
            continue
        console.print(Text(f" • {f.shown(verbose)}"))
        lead = sd.lead_up.get(f.numbers["step"]) if f.kind is FindingKind.OOM else ""
        if lead:
            console.print(Text(f"   {lead}"))
    if hidden:
        console.print(
            Text(f" ({hidden} finding(s) under the noise floor left out: --verbose shows them)")
        )


def _reconciliation(d: RunDiagnosis) -> str:
    assert d.estimate is not None
    parts = []
    for r in d.reconciled:
        head = f"GPU {r.gpu_uuid}" + (f", process {r.pid}" if r.several else "")
        parts.append(f"{head}\n{render_reconciliation(d.estimate, r.held)}")
    return "\n\n".join(parts)


def _lost_line(stream: Stream) -> str:
    """Steps this process ran that no record holds, by the probe's numbering (#)."""
    n = sum(b - a + 1 for a, b in stream.lost)
    where = ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in stream.lost[:8])
    more = ", …" if len(stream.lost) > 8 else ""
    return (
        f"Lost: {n} step{'s' if n > 1 else ''} this process ran (# {where}{more}, by the "
        "probe's count) reached no record — a sampler restarted or events were dropped (see "
        "above); the findings below cannot see them (a jump into a lost step is not judged)."
    )


def _sites(folder: Path, doc: dict[str, Any] | str, console: Any) -> None:
    """Which lines allocated it: the probe's allocation history (first GPU of the process)."""
    from rich.text import Text

    if isinstance(doc, str):
        console.print(Text(f"Allocation sites: the history in {folder} is unreadable ({doc})"))
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
        return "; ".join(f"{r['site']} {gib(r['bytes'])} ({r['count']})" for r in rows) or "—"

    for s in steps:
        why = (
            f" (recorded because torch reserved jumped {gib(s['after_jump'])} at step "
            f"{s['step'] - 1}'s end)"
            if s.get("after_jump")
            else ""
        )
        console.print(
            Text(
                f" • step {s['step']}{why}: at its peak ({gib(s['peak_bytes'])} traced, "
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


def _fleet(run: Run, d: RunDiagnosis, console: Any) -> None:
    """Every stream (a GPU, or one rank of several on a GPU) side by side: which peaks highest,
    how far apart they are, per node, ranks out of balance, and GPUs that were lost (a sampler
    not reachable at the end: its node gone, its actor dead). A fleet of more than
    :data:`FLEET_ROWS` shows its highest and lowest and every odd one, and says how many more
    lie between."""
    from rich.table import Table
    from rich.text import Text

    rows = d.fleet
    ranks = any(r.stream.world_size > 1 or len(run.streams_of(r.stream.gpu_uuid)) > 1 for r in rows)
    idle = [r for r in rows if not r.stream.records]
    shown = rows
    if len(rows) > FLEET_ROWS:
        by_peak = sorted(rows, key=lambda r: -(r.top.nvml_peak_bytes if r.top else -1))
        keep = {id(r) for r in by_peak[:6] + by_peak[-3:]}
        keep |= {id(r) for r in rows if r.lost or r.imbalanced}
        shown = [r for r in rows if id(r) in keep]
    what = f"{len(rows)} ranks" if ranks else f"every GPU ({len(rows)})"
    if ranks and idle:
        what = (
            f"{len(rows) - len(idle)} ranks, and {len(idle)} GPU{'s' if len(idle) > 1 else ''} "
            "without a step"
        )
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
        state = "LOST" if row.lost else ("IMBALANCED" if row.imbalanced else "")
        cells = [
            str(st.gpu),
            *([str(st.rank) if st.records else "—"] if ranks else []),
            row.node,
            str(len(st.records)),
            str(st.records[-1].step) if st.records else "—",
            _c(row.top.nvml_peak_bytes) if row.top else "—",
            str(row.top.step) if row.top else "—",
            _c(row.alloc, "—"),
            state,
        ]
        table.add_row(*map(Text, cells))
    if len(shown) < len(rows):
        table.add_row(*(["⋯"] * (len(cols) - 1)), f"{len(rows) - len(shown)} more")
    console.print(table)
    if d.fleet_lines:  # nothing the fleet rule found: no empty heading
        console.print(Text("Fleet", style="bold"))
    for line in d.fleet_lines:
        console.print(Text(f" • {line}"))


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
    out += [f"{n}." for n in meta.get("read_notes") or [] if isinstance(n, str)]
    return out


def sampling_line(
    meta: dict[str, Any], samplers: list[SamplerInfo], health: list[SamplerHealth]
) -> str:
    """How well the samplers kept their rate, from their final health: the mean rate achieved
    against the target, deadlines missed, and the trace's resolution when it is coarser than
    2 ms (a replayed capture recorded at a low rate). Empty when nothing was recorded."""
    health = [h for h in health if h.rate_hz is not None]
    target = meta.get("rate_hz")
    if not health:
        return ""
    rates = [float(h.mean_rate_hz or h.rate_hz or 0) for h in health]
    missed = sum(h.missed_deadlines or 0 for h in health)
    aim = f" (target {target:g} Hz)" if isinstance(target, int | float) and target else ""
    span = f"{min(rates):.0f}" + (
        f"–{max(rates):.0f}" if round(max(rates)) != round(min(rates)) else ""
    )
    line = f"Sampling: {span} Hz achieved{aim}; {missed:,} sampling deadlines missed"
    coarse = max((s.resolution_ns for s in samplers), default=0)
    # a replay holds the capture's samples: it cannot be faster than the capture was taken
    reachable = target if isinstance(target, int | float) else 0
    if coarse and reachable:
        reachable = min(reachable, 1e9 / coarse)
    speed = replay_speed(meta)
    fast = speed > 1
    if reachable and min(rates) < 0.5 * reachable and speed >= 10:
        line += (
            f" — the replay ran at {speed:g}x and was over before the samplers came up to "
            "speed (not a want of CPU)"
        )
    elif reachable and min(rates) < 0.5 * reachable:
        line += " — the samplers got too little CPU: short transients may be missed"
        nice = max((h.sampler_niceness or 0 for h in health), default=0)
        if nice > 0:
            line += (
                f" (their threads ran at nice {nice}, Ray's for its workers: lowering it needs "
                "CAP_SYS_NICE)"
            )
    if fast:
        line += (
            f"; a replay at {speed:g}x: each step lasts 1/{speed:g} of its recorded time, so "
            "it holds that many times fewer samples (a step shorter than the sampling period "
            "has none)"
        )
    if coarse > 2_000_000:
        line += (
            f". The NVML trace resolves {coarse / 1e6:.0f} ms (the capture's own rate): "
            f"transients shorter than that may be missed, and a reading at a step mark may "
            f"show what happened up to {coarse / 1e6:.0f} ms after it"
        )
    return line + "."
