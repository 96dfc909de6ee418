"""``stepmem compare BASE NEW``: the CI gate.

NEW passes only when it is a whole run that can be judged against BASE and no peak grew beyond
the tolerance. It fails ("Cannot compare", exit 1) when either run did not finish (interrupted,
failed, killed, incomplete), when NEW stopped at fewer steps than BASE, when the runs differ in
shape (GPUs, ranks), or when the NVML figures needed are missing (more than ``max_unsampled``
of a run's steps without samples, 5 % by default, or a run without any); it fails as a
regression when a failed step (an OOM) is in NEW, or when the largest within-step peak of a
stream — NVML over every step that has samples, torch allocated and reserved over every step —
grew by more than the tolerance. A few steps without NVML samples (a loaded machine starves a
sampler now and then) do not stop the gate: NVML is judged on the other steps, torch's peaks on
all, and the comparison says how many were left out. Judging each stream's largest peak (not
step k against step k) means a NEW with more steps is judged on all of them, and a BASE step
whose sampler missed a transient cannot make an identical NEW fail.

The per-step table pairs steps by their order in the run (the probe's sequence number), not
by the caller's step numbers, which may restart each epoch.
"""

from __future__ import annotations

import shlex

from collector.analysis.runs import Run, Stream
from collector.model.kinds import Gap
from collector.model.step import StepRecord
from collector.model.units import gib, have

__all__ = ["compare"]

METRICS = {
    "nvml_peak_bytes": "NVML within-step peak",
    "nvml_end": "NVML end of step",  # a stale end reading is left out
    "torch_allocated_peak_bytes": "torch allocated peak",
    "torch_reserved_peak_bytes": "torch reserved peak",
}
GATED = ("nvml_peak_bytes", "torch_allocated_peak_bytes", "torch_reserved_peak_bytes")
TABLE_ROWS = 40


def _report_cmd(run: Run) -> str:
    return f"`stepmem report {shlex.quote(run.source)}`"


def _finished(which: str, run: Run) -> str | None:
    if run.status == "complete":
        return None
    return (
        f"{which} did not finish: its status is {run.status!r} "
        f"(see {_report_cmd(run)}); only whole runs are judged"
    )


def _largest(recs: list[StepRecord], key: str) -> tuple[int | None, StepRecord | None]:
    vals = [r for r in recs if getattr(r, key) is not None]
    if not vals:
        return None, None
    top = max(vals, key=lambda r: getattr(r, key))
    return getattr(top, key), top


def _pct(b: int, n: int) -> str:
    return "new" if not b else f"{100 * (n - b) / b:+.1f} %"


def _stream_name(st: Stream, several: bool) -> str:
    return f"GPU {st.gpu}" + (f" rank {st.rank}" if several else "")


def _table(bs: Stream, ns: Stream, tolerance: float) -> list[str]:
    lines = [
        "| # | step | " + " | ".join(METRICS.values()) + " |",
        "|---:|---:|" + "---:|" * len(METRICS),
    ]
    pairs = list(zip(bs.records, ns.records, strict=False))
    if len(pairs) > TABLE_ROWS:
        keep = set(range(15)) | set(range(len(pairs) - 15, len(pairs)))
        worst = max(
            range(len(pairs)),
            key=lambda i: (pairs[i][1].nvml_peak_bytes or 0) - (pairs[i][0].nvml_peak_bytes or 0),
        )
        keep.add(worst)
    else:
        keep = set(range(len(pairs)))
    last = -1
    for i in sorted(keep):
        if i != last + 1:
            lines.append(f"| ⋯ | {i - last - 1} steps |" + " |" * len(METRICS))
        last = i
        b, n = pairs[i]
        cells = []
        for key in METRICS:
            bv, nv = getattr(b, key), getattr(n, key)
            if bv is None or nv is None:
                cells.append("—" if key.startswith("nvml") else "")
                continue
            flag = ""
            if key.endswith("peak_bytes") and (nv > bv * (1 + tolerance) or (not bv and nv)):
                flag = " ⚠"
            cells.append(f"{gib(bv)} → {gib(nv)} ({_pct(bv, nv)}){flag}")
        step = str(n.step) if n.step == b.step else f"{b.step} / {n.step}"
        lines.append(f"| {i + 1} | {step} | " + " | ".join(cells) + " |")
    if any(" ⚠" in x for x in lines[2:]):
        lines += [
            "",
            f"⚠ marks a step that grew more than {100 * tolerance:g} % against the same step of "
            "BASE. The gate judges each run's largest peak over the run (below), not step by "
            "step.",
        ]
    return lines


def _lengths(bs: Stream, ns: Stream, name: str, new: Run) -> tuple[list[str], list[str]]:
    """NEW's steps against BASE's: fewer is a run that stopped early."""
    nb, nn = len(bs.records), len(ns.records)
    if nn < nb:
        return [], [
            f"{name}: NEW has {nn} steps, BASE {nb}: NEW stopped early (see {_report_cmd(new)})"
        ]
    if nn > nb:
        return [
            f"- NEW has {nn} steps, BASE {nb}: every NEW step is judged against BASE's largest "
            "peak."
        ], []
    return [], []


def _unsampled(
    bs: Stream, ns: Stream, name: str, new: Run, base: Run, max_unsampled: float
) -> tuple[list[str], list[str]]:
    """Steps without NVML samples: judged without them up to ``max_unsampled`` of a run."""
    lines: list[str] = []
    problems: list[str] = []
    for which, st, run in (("NEW", ns, new), ("BASE", bs, base)):
        missing = [r.step for r in st.records if not r.measured]
        if not missing or len(missing) == len(st.records):
            continue  # none missing, or all: said below, per figure
        share = len(missing) / len(st.records)
        if share > max_unsampled:
            problems.append(
                f"{name}: {len(missing)} of {which}'s steps {have(len(missing))} no NVML samples "
                f"({100 * share:.1f} %, more than the {100 * max_unsampled:g} % allowed), so "
                f"{which}'s largest peak is unknown (see {_report_cmd(run)})"
            )
        else:
            lines.append(
                f"- {len(missing)} of {which}'s {len(st.records)} steps {have(len(missing))} "
                "no NVML samples "
                f"({100 * share:.1f} %, within the {100 * max_unsampled:g} % allowed): NVML is "
                "judged on its other steps, torch's peaks on all."
            )
    flagged = [r for r in ns.records if r.has_gap(Gap.UNDERSAMPLED)]
    if flagged:
        lines.append(
            f"- {len(flagged)} of NEW's steps were sampled at under half the rate (a starved "
            "sampler): their NVML peaks may be low."
        )
    return lines, problems


def _gated(
    bs: Stream, ns: Stream, name: str, tolerance: float, new: Run, base: Run
) -> tuple[list[str], list[str], list[str]]:
    """Each gated peak, largest over the run, BASE against NEW."""
    lines: list[str] = []
    problems: list[str] = []
    regressions: list[str] = []
    judged = 0
    for key in GATED:
        bv, btop = _largest(bs.records, key)
        nv, ntop = _largest(ns.records, key)
        label = METRICS[key]
        if bv is None and nv is None:
            continue
        judged += 1
        if bv is None or nv is None:
            which, run = ("BASE", base) if bv is None else ("NEW", new)
            problems.append(
                f"{name}: {which} has no {label} in any step, so the runs cannot be judged on "
                f"it (see {_report_cmd(run)})"
            )
            continue
        assert btop is not None and ntop is not None
        grew = nv > bv * (1 + tolerance) if bv else nv > 0
        change = "the same" if nv == bv else ("more" if nv > bv else "less")
        lines.append(
            f"- {label}, largest over the run: {gib(bv)} (step {btop.step}) → {gib(nv)} (step "
            f"{ntop.step}), {_pct(bv, nv)}: NEW uses {change}." + (" ⚠" if grew else "")
        )
        if grew:
            regressions.append(
                f"{name}: the largest {label} grew from {gib(bv)} to {gib(nv)} ({_pct(bv, nv)})"
            )
    stand_ins = all(r.has_gap(Gap.STAND_IN) for r in (*bs.records, *ns.records))
    if not judged and stand_ins:  # CPU ranks in CI: no GPU memory in either run to gate
        problems.append(
            f"{name}: both runs are CPU processes standing in for a GPU, which hold no GPU "
            "memory to gate (no NVML figure, no torch allocator figure); gate a run on a GPU, "
            "or before the run an estimate (`stepmem estimate --gpu CARD` says whether it fits)"
        )
    elif not judged:  # a gate that judged nothing must not pass
        problems.append(
            f"{name}: neither run measured any peak (no NVML sample and no torch figure in any "
            f"step), so nothing could be judged (see {_report_cmd(new)})"
        )
    return lines, problems, regressions


def _judge(
    bs: Stream,
    ns: Stream,
    name: str,
    tolerance: float,
    new: Run,
    base: Run,
    max_unsampled: float = 0.05,
) -> tuple[list[str], list[str], list[str]]:
    """Lines, problems (cannot compare) and regressions of one pair of streams."""
    lines, problems = _lengths(bs, ns, name, new)
    failed = [r for r in ns.records if r.failed]
    regressions = (
        [f"{name}: NEW's step {failed[0].step} failed ({failed[0].error})"] if failed else []
    )
    more, p = _unsampled(bs, ns, name, new, base, max_unsampled)
    lines += more
    problems += p
    more, p, r = _gated(bs, ns, name, tolerance, new, base)
    lines += more
    problems += p
    regressions += r
    bm = max((r.managed for r in bs.records), default=0)
    nm = max((r.managed for r in ns.records), default=0)
    if bm != nm:
        lines.append(
            f"- managed (paged) optimizer state: {gib(bm)} → {gib(nm)}, outside the torch "
            "allocator, inside NVML used."
        )
    return lines, problems, regressions


def _code(name: str) -> str:
    """A run's name inside a Markdown code span: no backtick can close it."""
    return name.replace("`", "'")


def _card(run: Run) -> list[tuple[str, int]]:
    """Each sampler's card: its name (a replay's without what it replays: the H200 replaying
    one capture is the H200 replaying another) and its memory."""
    return [(s.name.split(" (replay of ")[0], s.total_bytes) for s in run.samplers]


def _differences(base: Run, new: Run) -> list[str]:
    """What differs between the runs beyond their figures: the GPUs, the workload. Said, not
    failed: a run on another card or of another workload is the user's to judge."""
    out = []
    if base.samplers and new.samplers and _card(base) != _card(new):

        def cards(run: Run) -> str:
            return ", ".join(f"{n or '?'} ({gib(t)})" for n, t in dict.fromkeys(_card(run)))

        out.append(
            f"**Different GPUs**: BASE ran on {cards(base)}, NEW on {cards(new)}: the peaks "
            "compare as bytes, the headroom does not."
        )
    bw, nw = base.workload_summary, new.workload_summary
    if isinstance(bw, dict) and isinstance(nw, dict) and bw and nw:
        differ = sorted(
            k for k in set(bw) | set(nw) if k in _WORKLOAD_KEYS and bw.get(k) != nw.get(k)
        )
        if differ:
            out.append(
                "**Different workloads**: "
                + ", ".join(f"{k} {bw.get(k)!s:.40} → {nw.get(k)!s:.40}" for k in differ)
                + "."
            )
    return [*out, ""] if out else []


_WORKLOAD_KEYS = ("workload", "size", "config", "optim", "seq_len", "batch", "grad_accum")


def _other_workload(base: Run, new: Run) -> str | None:
    """Why the runs are of two workloads (their labels differ), or None: a gate pointed at
    the wrong baseline must not go green."""
    bl, nl = base.workload_label, new.workload_label
    if not bl or not nl or bl == nl:
        return None
    return (
        f"BASE is a run of {_code(bl)!r:.80}, NEW of {_code(nl)!r:.80}: a gate judges a workload "
        "against its own baseline (--other-workload judges them anyway)"
    )


def compare(
    base: Run,
    new: Run,
    tolerance: float,
    max_unsampled: float = 0.05,
    other_workload: bool = False,
) -> tuple[str, bool]:
    """Markdown comparing NEW with BASE stream by stream (GPU, rank), and whether NEW fails
    the gate (see the module docstring). ``other_workload``: judge runs whose workload labels
    differ (else they cannot be compared)."""
    lines = [f"## stepmem compare: `{_code(new.name)}` against `{_code(base.name)}`", ""]
    problems = [p for p in (_finished("BASE", base), _finished("NEW", new)) if p]
    other = _other_workload(base, new)
    if other and not other_workload:
        problems.append(other)
    elif other:
        lines += [f"**Other workloads**, judged as asked (--other-workload): {other}.", ""]
    regressions: list[str] = []
    for which, run in (("BASE", base), ("NEW", new)):
        if not run.streams:
            problems.append(f"{which} recorded no step, so there is nothing to judge")
    lines += _differences(base, new)
    if len(base.gpus) != len(new.gpus):
        problems.append(
            f"GPU counts differ: BASE has {len(base.gpus)}, NEW has {len(new.gpus)}; only runs "
            "of the same shape compare GPU by GPU"
        )
        lines += [f"**GPU counts differ** ({len(base.gpus)} vs {len(new.gpus)}).", ""]
    elif len(base.streams) != len(new.streams):
        problems.append(
            f"the runs have {len(base.streams)} and {len(new.streams)} training processes "
            "(ranks); only runs of the same shape compare rank by rank"
        )
    else:
        several = any(len(base.streams_of(u)) > 1 for u in base.gpus) or any(
            s.world_size > 1 for s in base.streams
        )
        for bs, ns in zip(base.streams, new.streams, strict=True):
            name = _stream_name(ns, several)
            lines += [f"### {name}", ""]
            lines += _table(bs, ns, tolerance)
            lines.append("")
            more, p, r = _judge(bs, ns, name, tolerance, new, base, max_unsampled)
            lines += more
            problems += p
            regressions += r
            lines.append("")
    if problems:
        lines += ["**Cannot compare**:", *(f"- {p}." for p in problems), ""]
    if regressions:
        lines += [
            f"**Regression** (tolerance {100 * tolerance:g} %):",
            *(f"- {r}." for r in regressions),
            "",
        ]
    elif not problems:
        lines.append(f"No peak grew by more than {100 * tolerance:g} %.")
    return "\n".join(lines) + "\n", bool(regressions or problems)
