"""The main job: samplers on every GPU, something to run under the probe, step records out.

On a machine with GPUs it runs a real workload (``finetune`` or ``spiky``, a user's script, or
either in Ray Train) under the step probe with live NVML samplers. Without a GPU it runs the same
pipeline on the replay backend: sampler actors play captures recorded on an H200 and the step
events recorded with them are sent again, at their recorded times, through the same outbox — so
the step records match the real run. What runs is a :mod:`collector.run.runners` runner; Ray's
lifetime is a :class:`collector.run.ray_session.RaySession`; everything of one run (samplers,
outbox, run store, targets file) is a :class:`RunSession`, whose exit is the one teardown.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shlex
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collector.backends import BackendSpec
from collector.model.errors import UserError, first_line
from collector.model.records import SamplerHealth, SamplerInfo
from collector.model.settings import JobOptions, SamplerOptions
from collector.model.step import StepRecord
from collector.placement import new_run_id
from collector.replay import Capture, resolve_capture
from collector.run.ray_session import RaySession
from collector.run.session import RunSession, what_runs

__all__ = ["JobResult", "Plan", "WorkloadFailed", "plan_job", "run_job"]

log = logging.getLogger(__name__)

MAX_REPLAY_GPUS = 64  # simulated GPUs per node: each is an actor process (~80 MB)
MAX_REPLAY_S = 86_400.0  # a replay that would play longer than a day is a typo in --speed


class WorkloadFailed(RuntimeError):
    """The workload raised (a CUDA OOM, a bug in the training script). The run store, the step
    records and the report were written first; the failed step's record has ``error`` set."""

    def __init__(self, exc: BaseException, step: int | None) -> None:
        where = f" at step {step}" if step is not None else ""
        first = first_line(exc) if str(exc).strip() else ""
        super().__init__(f"the workload failed{where}: {type(exc).__name__}: {first}")
        self.step = step


@dataclass
class JobResult:
    """What a run left: its step records, the samplers' info and final health, the runner's
    summary, and the workload's failure if it failed (``failure``, naming the step)."""

    banner: str
    records: list[StepRecord]
    samplers: list[SamplerInfo]
    health: list[SamplerHealth]
    workload: dict[str, Any]
    error: str | None = None  # "Type: message" of the workload's exception
    failure: WorkloadFailed | None = None
    store: Path | None = None
    run_id: str = ""
    status: str = "complete"  # complete | failed | interrupted | incomplete
    problems: list[str] = dataclasses.field(default_factory=list)
    rate_hz: float = 0.0
    replay_speed: float | None = None  # the steps are a capture's, played at this speed
    interrupted: BaseException | None = None  # the Ctrl-C/SIGTERM that ended it, re-raised after

    def meta(self) -> dict[str, Any]:
        """What a report of this run reads besides its records (a run store's meta.json)."""
        doc: dict[str, Any] = {
            "run_id": self.run_id,
            "banner": self.banner,
            "status": self.status,
            "samplers": [s.to_dict() for s in self.samplers],
            "health": [h.to_dict() for h in self.health],
            "rate_hz": self.rate_hz,
        }
        if self.problems:
            doc["problems"] = self.problems
        if self.replay_speed is not None:
            doc["replay_speed"] = self.replay_speed
        if self.error is not None:
            doc["error"] = self.error
        return doc

    def document(self) -> dict[str, Any]:
        """The ``--out`` JSON document."""
        return {
            **self.meta(),
            "records": [r.to_dict() for r in self.records],
            "workload": self.workload,
        }


def nvml_available() -> bool:
    from collector.nvml import LiveBackend, NvmlError

    try:
        return len(LiveBackend().devices()) > 0
    except NvmlError:
        return False


@dataclass(frozen=True)
class Plan:
    """A job that passed every job-level check (:func:`plan_job`): the backend its samplers
    build, the banner that says plainly which one runs, and the job with its sampler settings
    resolved once (``job.sampler``: the run id chosen, the spool folder, the workload label,
    whether events are kept for the store)."""

    spec: BackendSpec
    banner: str
    job: JobOptions

    def with_store(self, store: Path | None) -> Plan:
        """This plan writing its run store under ``store`` (None: none)."""
        sampler = dataclasses.replace(self.job.sampler, keep_events=store is not None)
        job = dataclasses.replace(self.job, store=store, sampler=sampler)
        return dataclasses.replace(self, job=job)

    def on_cluster(self, local: bool) -> JobOptions:
        """The job as it runs on its cluster: on one this job started itself (a single
        machine) /metrics stays on loopback unless an address was given."""
        s = self.job.sampler
        addr = s.metrics_addr or ("127.0.0.1" if local else None)
        return dataclasses.replace(self.job, sampler=dataclasses.replace(s, metrics_addr=addr))


def plan_job(opts: JobOptions, prog: str = "stepmem run") -> Plan:
    """Every check of a job, once, before anything starts: the backend (``auto``: live NVML
    when a GPU is readable — NVML probed once —, else replay); live-only runs (``--script``,
    stand-ins asked for on ``auto``) refused on replay; what a replay will play (captures with
    steps, at most :data:`MAX_REPLAY_GPUS` simulated GPUs per node, ports, a day at most).
    :class:`UserError` naming the problem (``prog``: the command, its prefix) otherwise."""
    kind, reason = opts.backend, opts.backend_reason
    if kind == "auto":
        kind = "nvml" if nvml_available() else "replay"
        reason = reason or ("no GPU here" if kind == "replay" else "")
    elif (
        kind == "nvml"
        and not (opts.ray_address or os.environ.get("RAY_ADDRESS"))
        and not nvml_available()
    ):
        raise UserError(
            f"{prog}: the live NVML backend needs a GPU and this machine has none that NVML "
            "can read; use --backend replay, or --address of a Ray cluster with GPU nodes"
        )
    if kind == "nvml":
        spec = BackendSpec("nvml")
        banner = (
            f"stepmem: live NVML backend, {what_runs(opts)}, "
            f"sampling at {opts.sampler.sampling.rate}"
        )
    else:
        _check_replay(opts, auto=opts.backend == "auto", prog=prog)
        spec, banner = _replay_spec(opts), _replay_banner(opts, reason or "asked for")
    job = dataclasses.replace(opts, sampler=_sampler_options(opts, spec))
    return Plan(spec, banner, job)


def _check_replay(opts: JobOptions, auto: bool, prog: str) -> None:
    stand_ins = "--command" if opts.command else "--train-workers" if opts.train_workers else ""
    if stand_ins and auto:
        raise UserError(
            f"{prog}: {stand_ins} needs the live NVML backend (a GPU), and this machine "
            "has none; with --backend replay its CPU processes stand in for the replayed GPUs"
        )
    if opts.script is not None:
        raise UserError(
            f"{prog}: --script needs the live NVML backend (a GPU); the replay backend "
            "plays recorded steps (--command runs a script's processes as CPU stand-ins)"
        )
    gpus = opts.gpus or len(opts.captures)
    if gpus > MAX_REPLAY_GPUS:
        raise UserError(
            f"{prog}: --gpus {gpus}: at most {MAX_REPLAY_GPUS} simulated GPUs per node "
            "(each is a sampler process); use several nodes for more"
        )
    base = opts.sampler.metrics_port
    if base and base + gpus - 1 > 65535:
        raise UserError(
            f"{prog}: --metrics-port {base} with {gpus} GPUs needs ports up to "
            f"{base + gpus - 1}; the largest is 65535"
        )
    longest = 0.0
    for name in opts.captures:
        cap = Capture.load(resolve_capture(name))
        if not cap.events and not stand_ins:
            raise UserError(
                f"{prog}: capture {name!r} holds no step events, so there are no steps to "
                "replay (idle is for `stepmem daemon --backend replay` and `stepmem devices`)"
            )
        longest = max(longest, cap.duration_ns / 1e9)
    if longest / opts.speed > MAX_REPLAY_S:
        raise UserError(
            f"{prog}: --speed {opts.speed:g} would play the {longest:.0f} s capture for "
            f"{longest / opts.speed / 3600:.0f} hours; the longest replay is one day"
        )


def _replay_spec(opts: JobOptions) -> BackendSpec:
    # Committed captures travel by name: each node's actors resolve them in their own install.
    return BackendSpec(
        "replay",
        captures=list(opts.captures),
        gpus=opts.gpus,
        speed=opts.speed,
        hold_until_aligned=True,
    )


def _replay_banner(opts: JobOptions, why: str) -> str:
    caps = ", ".join(Path(c).name.removesuffix(".capture.parquet") for c in opts.captures)
    banner = (
        f"stepmem: REPLAY backend ({why}) — playing NVML captures recorded on a real "
        f"GPU, not this machine: {caps}; {opts.gpus or len(opts.captures)} simulated GPU(s) "
        f"per node at {opts.speed:g}x speed"
    )
    if opts.command or opts.train_workers:  # CPU processes bring the steps
        what = "the command's" if opts.command else f"{opts.train_workers} Ray Train workers'"
        banner += (
            f"; {what} CPU processes stand in for the GPUs (their steps and ledger; the "
            "capture plays beside them, not joined to their steps: no NVML figure)"
        )
    return banner


def _sampler_options(opts: JobOptions, spec: BackendSpec) -> SamplerOptions:
    """The job's sampler settings with its labels filled in, the run id chosen once."""
    s = opts.sampler
    run_id = s.run_id or new_run_id()
    return dataclasses.replace(
        s,
        run_id=run_id,
        keep_events=opts.store is not None,
        spool=str(spool_dir(run_id)),
        workload=s.workload
        or (f"script:{opts.script.stem}" if opts.script is not None else "")
        or (f"command:{Path(opts.workload_args[0]).name}" if opts.command else "")
        or (opts.workload if spec.kind == "nvml" or opts.train_workers else "")
        or "replay:" + "+".join(opts.captures),
    )


def spool_dir(run_id: str) -> Path:
    """Where this run's processes without Ray leave their step events on each node (private to
    the user; the run's samplers there read it): a folder of this run instance alone — two runs
    given one run id (in two stores, or one after another killed) never share one."""
    instance = f"{run_id}-{secrets.token_hex(6)}"
    return Path(tempfile.gettempdir()) / f"stepmem-{os.getuid()}" / "spool" / instance


def remote_write_line(health: list[SamplerHealth]) -> str:
    """What remote write delivered, summed over the samplers (empty without remote write):
    every sample it could not deliver is said, with the last error."""
    stats = [h.remote_write for h in health if h.remote_write is not None]
    if not stats:
        return ""
    sent = sum(int(x.get("sent", 0)) for x in stats)
    dropped: Counter[str] = Counter()
    for x in stats:
        dropped.update(x.get("dropped") or {})
    pending = sum(int(x.get("pending", 0)) for x in stats)
    lost = sum(dropped.values()) + pending
    line = f"remote write: {sent:,} of {sent + lost:,} samples delivered"
    if lost:
        line += f"; not delivered: {', '.join(f'{k} {n:,}' for k, n in sorted(dropped.items()))}"
        if pending:
            line += f"{', ' if dropped else ''}left unsent {pending:,}"
        errors = [x.get("last_error") for x in stats if x.get("last_error")]
        if errors:
            line += f" (last error: {errors[-1][:160]})"
    return line


def run_job(job: JobOptions | Plan, echo=print) -> JobResult:
    """Run a job to the end and print its report: a :class:`Plan` as :func:`plan_job` made it
    (options are planned here). A workload that fails leaves its result with ``failure`` set;
    stepmem's own errors and Ctrl-C/SIGTERM raise, after the teardown."""
    plan = job if isinstance(job, Plan) else plan_job(job).with_store(job.store)
    spec, banner = plan.spec, plan.banner
    echo(banner)
    run: RunSession | None = None
    interrupted: BaseException | None = None
    try:
        with (
            RaySession(plan.job.ray_address, echo) as ray_session,
            RunSession(plan.on_cluster(ray_session.local), spec, banner, echo) as run,
        ):
            run.run()
    except KeyboardInterrupt as exc:  # stopped: the teardown ran; keep and show what was done
        if run is None or run.status == "running":
            raise
        interrupted = exc
    from collector.analysis.report import render_report
    from collector.analysis.runs import Run

    failure = None
    failed = [r for r in run.records if r.failed and not r.interrupted]
    if run.error is not None:
        failure = WorkloadFailed(run.error, min((r.step for r in failed), default=None))
    elif failed and spec.kind == "replay":  # the recorded run failed (an OOM): so does its replay
        first = min(failed, key=lambda r: r.begin_ns)
        failure = WorkloadFailed(RuntimeError(f"{first.error}, as recorded"), first.step)
    result = JobResult(
        banner=banner,
        records=run.records,
        samplers=[p.info for p in run.placed],
        health=run.health,
        workload=run.summary,
        error=run.error_text,
        failure=failure,
        store=run.writer.root if run.writer is not None else None,
        run_id=run.options.run_id,
        status=run.status,
        problems=run.problems,
        rate_hz=run.options.sampling.rate.hz,
        replay_speed=run.replay_speed,
        interrupted=interrupted,
    )
    name = run.options.run_id if run.writer is not None else "(not stored: --no-store)"
    # the store's root: its allocation history, the samples before a failure
    root = run.writer.root if run.writer is not None else None
    text, _ = render_report(Run(name, result.meta(), run.records, root=root))
    echo(text.rstrip())
    pushed = remote_write_line(run.health)
    if pushed:
        echo(pushed)
    if run.writer is not None:
        where = shlex.quote(str(run.writer.root.resolve()))
        echo(f"again, or with --png/--html: stepmem report {where}")
    return result
