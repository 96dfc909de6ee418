"""A run diagnosed, once: :func:`diagnose_run` gathers everything the report says about a run —
per stream its findings (:mod:`collector.analysis.diagnosis`), its verdict and an OOM's lead-up
samples; the fleet side by side (every stream's peaks, lost GPUs, ranks out of balance) and its
findings; the allocation history's summary; and, given an estimate, the predicted-vs-measured
rows — into a :class:`RunDiagnosis`. :func:`collector.analysis.report.render` lays it out and
computes nothing (``torch.cuda.memory_stats`` gathers, ``memory_summary`` renders)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from collector.analysis.diagnosis import Finding, FindingKind, diagnose, verdict
from collector.analysis.diagnosis.fleet import Ranked, imbalance
from collector.analysis.predicted_vs_measured import Reconciliation, reconcile
from collector.analysis.runs import Run, Stream
from collector.model.prediction import Estimate
from collector.model.step import StepRecord
from collector.model.units import gib, gib_figure

__all__ = ["FleetRow", "Reconciled", "RunDiagnosis", "StreamDiagnosis", "diagnose_run"]


@dataclass(frozen=True)
class StreamDiagnosis:
    """One stream's (a process on a GPU) findings, its verdict (one to three lines), and the
    NVML samples leading to each step that ran out of memory, by step."""

    stream: Stream
    findings: list[Finding]
    verdict: list[str]
    lead_up: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FleetRow:
    """A stream in the fleet table: its node (shortened), its step with the highest NVML peak
    (None: none measured), its highest torch allocated peak, whether its GPU was lost (its
    sampler not reachable at the end) and whether its rank is out of balance."""

    stream: Stream
    node: str
    top: StepRecord | None
    alloc: int | None
    lost: bool
    imbalanced: bool = False


@dataclass(frozen=True)
class Reconciled:
    """One GPU's training process (the stream with the most steps) held against the estimate:
    the table's rows and the differences named."""

    gpu_uuid: str
    pid: int
    several: bool  # ranks share the GPU
    held: Reconciliation


@dataclass(frozen=True)
class RunDiagnosis:
    """Everything a report of ``run`` says, as data (see the module doc). ``history``: the
    allocation history's summary, a string saying why it cannot be read, or None;
    ``history_stream``: the stream it belongs to (rank 0's first GPU)."""

    streams: list[StreamDiagnosis]
    fleet: list[FleetRow]
    fleet_lines: list[str]
    history: dict[str, Any] | str | None
    history_stream: Stream | None
    estimate: Estimate | None = None
    reconciled: list[Reconciled] = field(default_factory=list)

    @property
    def findings(self) -> dict[tuple[str, int], list[Finding]]:
        """Each stream's findings, by (GPU, pid)."""
        return {(d.stream.gpu_uuid, d.stream.pid): d.findings for d in self.streams}


def diagnose_run(run: Run, verbose: bool = False, est: Estimate | None = None) -> RunDiagnosis:
    """Diagnose ``run`` (``verbose``: findings under the noise floor named too; ``est``: the
    estimate to hold it against)."""
    doc = _history(run)
    history = {s["step"]: s for s in doc["steps"]} if isinstance(doc, dict) else {}
    owner = _history_stream(run)
    streams = []
    for stream in run.streams:
        # the history is the first GPU of rank 0's process: its sites belong to that stream
        sites = history if stream is owner else {}
        fs = diagnose(
            stream.numbered(), run.totals.get(stream.gpu_uuid), sites, verbose, run.time_scale
        )
        lead = {
            f.numbers["step"]: _lead_up(run, stream, f.numbers["step"])
            for f in fs
            if f.kind is FindingKind.OOM
        }
        streams.append(StreamDiagnosis(stream, fs, verdict(fs), lead))
    fleet, lines = _fleet(run) if len(run.streams) > 1 else ([], [])
    reconciled = _reconciled(run, est) if est is not None else []
    return RunDiagnosis(streams, fleet, lines, doc, owner, est, reconciled)


def _reconciled(run: Run, est: Estimate) -> list[Reconciled]:
    """Every GPU of ``run`` held against ``est``: per GPU, its training process (the stream with
    the most steps, when ranks share the GPU)."""
    out = []
    for uuid in run.gpus:
        streams = run.streams_of(uuid)
        main = max(streams, key=lambda s: len(s.records))
        several = len([s for s in streams if s.records]) > 1
        out.append(Reconciled(uuid, main.pid, several, reconcile(est, main.records)))
    return out


def _history_stream(run: Run) -> Stream | None:
    """The stream the allocation history belongs to: rank 0's first GPU."""
    ranked = sorted(run.streams, key=lambda s: (s.rank, s.gpu))
    return ranked[0] if ranked else None


def _history(run: Run) -> dict[str, Any] | str | None:
    """The allocation history's summary (read once: the findings cite it, the sites section
    shows it); a string saying why it is unreadable; None without one (or with one whose
    steps never ended)."""
    if run.root is None or not (run.root / "history").is_dir():
        return None
    import collector.analysis.history as history

    try:
        return history.summary(run.root / "history", top=3)
    except FileNotFoundError:  # recording started but its steps never ended
        return None
    except history.HistoryError as exc:
        return str(exc)


def _lost(run: Run) -> set[str]:
    """The GPUs whose sampler could not be reached at the end of the run, by its final health
    (:attr:`Run.health`, each naming its GPU)."""
    return {h.gpu_uuid for h in run.health if h.unreachable}


def _fleet(run: Run) -> tuple[list[FleetRow], list[str]]:
    """Every stream side by side, and the fleet's findings as lines."""
    node_of = {s.gpu_uuid: s.node_id[:12] for s in run.samplers}
    lost = _lost(run)
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
            FleetRow(
                st,
                node_of.get(st.gpu_uuid, "?"),
                top,
                max(allocs, default=None),
                st.gpu_uuid in lost,
            )
        )
    odd = imbalance([Ranked(r.stream, r.alloc, r.lost) for r in rows])
    ranks = {(f.numbers["gpu"], f.numbers["pid"]) for f in odd}
    rows = [
        FleetRow(r.stream, r.node, r.top, r.alloc, r.lost, (r.stream.gpu, r.stream.pid) in ranks)
        for r in rows
    ]
    lines = _compared(run, rows) + _peaks(rows) + [f.text for f in odd] + _ended_early(rows)
    return rows, lines


def _compared(run: Run, rows: list[FleetRow]) -> list[str]:
    """What the fleet compares: the streams whose GPU was not lost, of one world size."""
    out = []
    # a lost GPU's records stop early: comparing its few steps with whole runs says nothing
    ran = [row for row in rows if not row.lost] or rows
    if len(ran) < len(rows):
        ranks = len(rows) > len(run.gpus)
        what = "ranks whose GPU was" if ranks else "GPUs that were"
        out.append(f"Compared: the {len(ran)} {what} not lost.")
    # a GPU no process reported a step to is no rank of any world
    worlds = sorted({r.stream.world_size for r in rows if r.stream.records})
    if len(worlds) > 1:
        out.append(
            "The ranks do not agree on the world size ("
            + ", ".join(str(w) for w in worlds)
            + "): they may belong to different runs, or one restarted with another size."
        )
    return out


def _peaks(rows: list[FleetRow]) -> list[str]:
    """The highest and lowest within-step peak of the GPUs compared, and per node."""
    out = []
    ran = [row for row in rows if not row.lost] or rows
    gpu_top: dict[int, FleetRow] = {}
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
                f"Every compared GPU's highest within-step peak is the same: {gib(hb)} "
                f"({len(measured)} GPUs)."
            )
        else:
            out.append(
                f"Highest within-step peak: GPU {hi.stream.gpu} on node {hi.node}, {gib(hb)} in "
                f"step {hi.top.step}; lowest: GPU {lo.stream.gpu} on node {lo.node}, "
                f"{gib(lb)} — the highest is {gib(hb - lb)} ({pct:.1f} %) above."
            )
        nodes: dict[str, int] = {}
        for row in measured:
            nodes[row.node] = max(nodes.get(row.node, 0), row.top.nvml_peak_bytes)
        if len(nodes) > 1:
            out.append(
                "Per node, highest peak: "
                + ", ".join(f"{n} {gib(b)}" for n, b in sorted(nodes.items()))
                + "."
            )
    return out


def _ended_early(rows: list[FleetRow]) -> list[str]:
    """Ranks that stopped before the others, and GPUs that were lost."""
    out = []
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


def _lead_up(run: Run, stream: Stream, step: int, n: int = 10) -> str:
    """The NVML samples leading to a failed step's end, from the run store: ``n`` readings
    evenly spaced over the last second before it (the steps before included)."""
    rec = next((r for r in stream.records if r.step == step), None)
    try:
        samples = run.samples(stream.gpu_uuid)
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
        f"{(int(w['t_ns'].iloc[i]) - end) / 1e6:.0f} ms: {gib_figure(w['used'].iloc[i])}"
        for i in idx
    ]
    return (
        f"NVML used (GiB) in the second before step {step} failed ({len(w)} samples): "
        + ", ".join(parts)
    )
