"""The main job: samplers on every GPU, something to run under the probe, step records out.

On a machine with GPUs it runs a real workload (``finetune`` or ``spiky``, a user's script, or
either in Ray Train) under the step probe with live NVML samplers. Without a GPU it runs the same
pipeline on the replay backend: sampler actors play captures recorded on an H200 and the step
events recorded with them are sent again, at their recorded times, through the same outbox — so
the step records match the real run. What runs is a :mod:`collector.runners` runner; Ray's
lifetime is a :class:`collector.session.RaySession`; everything of one run (samplers, outbox, run
store, targets file) is a :class:`RunSession`, whose exit is the one teardown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shlex
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from collector.backends import BackendSpec
from collector.errors import StepmemError
from collector.export.file_sd import TargetsRefresher, write_targets
from collector.placement import PlacedSampler, launch_samplers, new_run_id
from collector.probe.core import Outbox
from collector.probe.outbox import SPOOL_ENV
from collector.replay import Capture, resolve_capture
from collector.runners import ReplayRunner, Runner, runner_for
from collector.session import RaySession
from collector.settings import JobOptions, SamplerOptions
from collector.store import RunWriter

__all__ = ["JobOptions", "JobResult", "WorkloadFailed", "choose_backend", "run_job"]

log = logging.getLogger(__name__)

GIB = 1 << 30


class WorkloadFailed(RuntimeError):
    """The workload raised (a CUDA OOM, a bug in the training script). The run store, the step
    records and the report were written first; the failed step's record has ``error`` set."""

    def __init__(self, exc: BaseException, step: int | None) -> None:
        where = f" at step {step}" if step is not None else ""
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        super().__init__(f"the workload failed{where}: {type(exc).__name__}: {first}")
        self.step = step


@dataclass
class JobResult:
    """What a run left: its step records, the samplers' info and final health, the runner's
    summary, and the workload's failure if it failed (``failure``, naming the step)."""

    banner: str
    records: list[dict[str, Any]]
    samplers: list[dict[str, Any]]
    health: list[dict[str, Any]]
    workload: dict[str, Any]
    error: str | None = None  # "Type: message" of the workload's exception
    failure: WorkloadFailed | None = None
    store: Path | None = None
    run_id: str = ""
    status: str = "complete"  # complete | failed | interrupted | incomplete
    problems: list[str] = dataclasses.field(default_factory=list)
    rate_hz: float = 0.0
    interrupted: BaseException | None = None  # the Ctrl-C/SIGTERM that ended it, re-raised after

    def meta(self) -> dict[str, Any]:
        """What a report of this run reads besides its records (a run store's meta.json)."""
        doc: dict[str, Any] = {
            "run_id": self.run_id,
            "banner": self.banner,
            "status": self.status,
            "samplers": self.samplers,
            "health": self.health,
            "rate_hz": self.rate_hz,
        }
        if self.problems:
            doc["problems"] = self.problems
        if self.error is not None:
            doc["error"] = self.error
        return doc

    def document(self) -> dict[str, Any]:
        """The ``--out`` JSON document."""
        return {**self.meta(), "records": self.records, "workload": self.workload}


def nvml_available() -> bool:
    from collector.nvml import LiveBackend, NvmlError

    try:
        return len(LiveBackend().devices()) > 0
    except NvmlError:
        return False


def choose_backend(opts: JobOptions) -> tuple[BackendSpec, str]:
    """The backend spec and the banner line that says plainly which one runs."""
    kind = opts.backend
    if kind == "auto":
        kind = "nvml" if nvml_available() else "replay"
    if kind == "nvml":
        if not (opts.ray_address or os.environ.get("RAY_ADDRESS")) and not nvml_available():
            raise StepmemError(
                "the live NVML backend needs a GPU and this machine has none that NVML can "
                "read; use --backend replay, or --address of a Ray cluster with GPU nodes"
            )
        return BackendSpec("nvml"), (
            f"stepmem: live NVML backend, {what_runs(opts)}, "
            f"sampling at {opts.sampler.sampling.rate}"
        )
    stand_ins = opts.command or bool(opts.train_workers)  # CPU processes bring the steps
    for name in opts.captures:  # fail here, in one line, not inside a sampler actor
        if not stand_ins and not Capture.load(resolve_capture(name)).events:
            raise StepmemError(f"capture {name!r} holds no step events: nothing to replay")
    caps = ", ".join(Path(c).name.removesuffix(".capture.parquet") for c in opts.captures)
    # Committed captures travel by name: each node's actors resolve them in their own install.
    spec = BackendSpec(
        "replay",
        captures=list(opts.captures),
        gpus=opts.gpus,
        speed=opts.speed,
        hold_until_aligned=True,
    )
    why = opts.backend_reason or ("no GPU here" if opts.backend == "auto" else "asked for")
    banner = (
        f"stepmem: REPLAY backend ({why}) — playing NVML captures recorded on a real "
        f"GPU, not this machine: {caps}; {spec.gpus or len(opts.captures)} simulated GPU(s) "
        f"per node at {opts.speed:g}x speed"
    )
    if stand_ins:
        what = "the command's" if opts.command else f"{opts.train_workers} Ray Train workers'"
        banner += f"; {what} CPU processes stand in for the GPUs (their steps, the capture's NVML)"
    return spec, banner


class _Drainer:
    """Pulls new samples, step records and the step events each sampler accepted into the run
    store every interval.

    Every sampler is drained by cursor (the sequence numbers of its ring and of its joined
    records), so every record is stored once whatever its step number, and nothing drained is
    kept here: the driver's memory does not grow with the run. A sampler that Ray restarted
    (a new ``started_ns``) has a new ring and a new record sequence: its cursors start over,
    the restart is counted and ``on_restart`` is called (a replay re-aligns the new actor). A
    call that times out (a loaded machine) is counted as slow; a sampler whose actor is gone
    is named in ``unreachable``.
    """

    def __init__(
        self,
        writer: RunWriter,
        placed: list[PlacedSampler],
        interval_s: float = 2.0,
        on_restart=None,
    ) -> None:
        self.writer, self.placed = writer, placed
        self.interval_s = interval_s
        self.on_restart = on_restart
        self.cursors = {p.gpu_uuid: 0 for p in placed}
        self.rec_cursors = {p.gpu_uuid: 0 for p in placed}
        self.ev_cursors = {p.gpu_uuid: 0 for p in placed}
        self.events_lost = 0
        self.started = {p.gpu_uuid: p.info.get("started_ns") for p in placed}
        self.samples_lost = 0
        self.records_lost = 0  # joined records a sampler no longer kept when asked
        self.restarts: Counter[str] = Counter()  # sampler name -> restarts seen
        self.unreachable: set[str] = set()  # the samplers whose actor is gone (names)
        self.calls_failed = 0
        self.calls_slow = 0
        self.errors: Counter[str] = Counter()  # drain passes that failed, by exception
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepmem-store", daemon=True)
        self._thread.start()

    def drain(self, flush_steps: bool = False) -> None:
        with self._lock:
            for p in self.placed:
                self._drain_one(p, flush_steps)
            self.writer.flush()

    def _drain_one(self, p: PlacedSampler, flush_steps: bool) -> None:
        uuid = p.gpu_uuid
        try:
            d = ray.get(p.handle.samples_since.remote(self.cursors[uuid]), timeout=30)
            if d.get("started_ns") != self.started[uuid]:
                self._restarted(p, d.get("started_ns"))
                d = ray.get(p.handle.samples_since.remote(0), timeout=30)
            r = ray.get(
                p.handle.records_since.remote(self.rec_cursors[uuid], flush_steps), timeout=30
            )
            e = ray.get(p.handle.events_since.remote(self.ev_cursors[uuid]), timeout=30)
        except ray.exceptions.GetTimeoutError:  # alive but slow (a loaded machine): next time
            self.calls_slow += 1
            return
        except Exception as exc:  # a dead sampler leaves a gap; training goes on
            self.lost(p.name)
            log.warning("run store: sampler %s unreachable: %s", p.name, _first_line(exc))
            return
        self.writer.add_samples(uuid, d["t_ns"], d["used"], d["reserved"])
        self.cursors[uuid] = d["next"]
        self.samples_lost += d["lost"]
        self.writer.add_records(r["records"])
        self.rec_cursors[uuid] = r["next"]
        self.records_lost += r["lost"]
        self.writer.add_events(e["events"])
        self.ev_cursors[uuid] = e["next"]
        self.events_lost += e["lost"]

    def _restarted(self, p: PlacedSampler, started_ns: int | None) -> None:
        """Ray restarted the sampler: a new ring and a new record sequence."""
        self.started[p.gpu_uuid] = started_ns
        self.cursors[p.gpu_uuid] = self.rec_cursors[p.gpu_uuid] = self.ev_cursors[p.gpu_uuid] = 0
        self.restarts[p.name] += 1
        log.warning("run store: sampler %s was restarted; its steps in flight are lost", p.name)
        if self.on_restart is not None:
            self.on_restart(p)

    def lost(self, name: str) -> None:
        """A call to sampler ``name`` failed: counted, and the sampler named once."""
        self.unreachable.add(name)
        self.calls_failed += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.drain()
            except Exception as exc:  # never let the store's thread die: count, go on
                self.errors[type(exc).__name__] += 1
                log.exception("run store: a drain failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _sampler_options(opts: JobOptions, spec: BackendSpec, local: bool) -> SamplerOptions:
    """The job's sampler settings with its labels filled in. A cluster this job started itself
    is a single machine: /metrics stays on loopback there."""
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
        metrics_addr=s.metrics_addr or ("127.0.0.1" if local else None),
    )


def what_runs(opts: JobOptions) -> str:
    """What the run runs, in words: ``script train.py``, ``command torchrun``, ``workload
    finetune``."""
    if opts.script is not None:
        return f"script {opts.script}"
    if opts.command and opts.workload_args:
        return f"command {Path(opts.workload_args[0]).name}"
    return f"workload {opts.workload}"


def spool_dir(run_id: str) -> Path:
    """Where this run's processes without Ray leave their step events on each node (private to
    the user; the run's samplers there read it)."""
    return Path(tempfile.gettempdir()) / f"stepmem-{os.getuid()}" / "spool" / run_id


def _private_dir(path: Path) -> None:
    """Create ``path`` (and its parents under the temp folder) for this user alone; refuse a
    parent someone else made (events written there could be read or planted)."""
    top = path.parent.parent  # <tmp>/stepmem-<uid>
    top.mkdir(mode=0o700, exist_ok=True)
    if top.stat().st_uid != os.getuid():
        raise StepmemError(f"{top} belongs to another user; remove it or set TMPDIR")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


class RunSession:
    """Everything of one run on a connected cluster: the samplers (launched on entry), the
    runner and its outbox, the run store and the drainer that fills it, the targets file.

    Leaving it is the run's one teardown, whatever ended the run: the outbox is flushed, every
    pending step joined, the store drained and marked ``complete``, ``failed`` (an exception, or
    :meth:`fail` for the workload's own) or ``interrupted`` (Ctrl-C, SIGTERM), the targets file
    emptied. ``records`` and ``health`` are then final.
    """

    def __init__(
        self, opts: JobOptions, spec: BackendSpec, banner: str, options: SamplerOptions, echo
    ) -> None:
        self.opts, self.spec, self.banner, self.options, self.echo = (
            opts,
            spec,
            banner,
            options,
            echo,
        )
        self.placed: list[PlacedSampler] = []
        self.runner: Runner | None = None
        self.outbox: Outbox | None = None
        self.writer: RunWriter | None = None
        self.drainer: _Drainer | None = None
        self.refresher: TargetsRefresher | None = None
        self.summary: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.error_text: str | None = None
        self.records: list[dict[str, Any]] = []
        self.health: list[dict[str, Any]] = []
        self.problems: list[str] = []  # why the run is not completely recorded
        self._stand_in_origin: int | None = None  # replay played under CPU stand-ins, from
        self.status = "running"
        self._history_set = False  # this run set STEPMEM_HISTORY_DIR (and unsets it at the end)

    def __enter__(self) -> RunSession:
        opts, echo = self.opts, self.echo
        self.placed = placed = launch_samplers(self.spec, self.options)
        if opts.targets is not None:
            self.refresher = TargetsRefresher(opts.targets, [p.handle for p in placed])
            echo(f"Prometheus targets: {opts.targets}")
        for p in placed:
            echo(
                f"sampler {p.name} ({p.info['name']}, {p.info['total_bytes'] / GIB:.1f} GiB, "
                f"{p.info['backend']})"
            )
        self.runner = runner_for(opts, self.spec, placed, self.options.run_id)
        self.outbox = self.runner.outbox(placed)
        if self.spec.kind == "replay" and not isinstance(self.runner, ReplayRunner):
            # CPU stand-ins bring the steps: the captures play from now, in a loop
            self._stand_in_origin = time.monotonic_ns()
            ray.get(
                [p.handle.replay_from.remote(self._stand_in_origin) for p in placed], timeout=60
            )
        _private_dir(Path(self.options.spool))
        os.environ[SPOOL_ENV] = self.options.spool  # this run's processes without Ray
        if opts.store is not None:
            meta = _meta(opts, self.options, self.banner, placed)
            self.writer = RunWriter(opts.store / self.options.run_id, meta)
            self.drainer = _Drainer(self.writer, placed, on_restart=self._restarted)
            echo(f"run store: {self.writer.root.resolve()}")
            self._history_env()
        return self

    def _restarted(self, p: PlacedSampler) -> None:
        """Ray restarted sampler ``p``: a replay plays on from the run's alignment (the new
        actor holds its reads until then)."""
        if isinstance(self.runner, ReplayRunner):
            origin, loop = self.runner.origin_ns, False
        else:
            origin, loop = self._stand_in_origin, True
        if origin is not None and self.spec.kind == "replay":
            try:
                ray.get(p.handle.replay_from.remote(origin, loop=loop), timeout=30)
            except Exception as exc:
                log.warning("sampler %s could not be re-aligned: %s", p.name, _first_line(exc))

    def _history_env(self) -> None:
        """A live run's probe (built-in workload or a script's own) records allocation history
        for its first steps into the run store's ``history/`` unless ``STEPMEM_HISTORY_DIR``
        says where (``""``: nowhere); restored when the run ends."""
        from collector.probe.core import HISTORY_ENV

        if self.spec.kind == "nvml" and HISTORY_ENV not in os.environ and self.writer is not None:
            os.environ[HISTORY_ENV] = str((self.writer.root / "history").resolve())
            self._history_set = True

    def run(self) -> None:
        """Run the runner; the workload's own exception is kept (:meth:`fail`), not raised."""
        assert self.runner is not None and self.outbox is not None
        try:
            self.summary = self.runner.run(self.outbox, self.echo)
        except Exception as exc:
            if not self.runner.fails_as_workload:
                raise
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """The workload died (e.g. a CUDA OOM): keep everything, report it, fail the job after."""
        self.error = exc
        self.error_text = f"{type(exc).__name__}: {exc}"[:2000]
        self.echo(f"{what_runs(self.opts)} failed: {type(exc).__name__}")

    def __exit__(self, exc_type: type | None, exc: object, tb: object) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            status = "interrupted"
        elif exc_type is not None or self.error is not None:
            status = "failed"
        else:
            status = "complete"
        if self.outbox is not None:
            self.outbox.close()
        time.sleep(0.1)  # the last batches other processes' probes sent on close
        if self.drainer is not None:
            self.drainer.stop()  # the periodic drains end; the last one follows the stop
        self.health, gone = _stop_samplers(self.placed, self.echo)
        kept: list[dict[str, Any]] = []
        if self.drainer is not None and self.writer is not None:
            for name in gone:
                self.drainer.lost(name)
            self.drainer.drain(flush_steps=True)
            self.problems = _problems(self.drainer, self.writer, len(self.placed))
            if self.problems and status == "complete":
                status = "incomplete"
            self.writer.close(
                status,
                health=self.health,
                samples_lost=self.drainer.samples_lost,
                records_lost=self.drainer.records_lost,
                samplers_unreachable=len(self.drainer.unreachable),
                sampler_calls_failed=self.drainer.calls_failed,
                sampler_calls_slow=self.drainer.calls_slow,
                sampler_restarts=dict(self.drainer.restarts),
                problems=self.problems,
                workload_summary=self.summary,
                error=self.error_text,
            )
            kept = _stored_records(self.writer.root)
        elif gone:
            self.problems = [
                f"{len(gone)} of {len(self.placed)} samplers could not be reached at the end "
                f"({', '.join(sorted(gone))}): with no run store, their steps are lost"
            ]
            status = "incomplete" if status == "complete" else status
        if self.writer is None or self.writer.write_errors:
            # no store, or one that could not keep everything: what the samplers still hold
            kept += _kept_records(self.placed, gone)
        self.records = _unique(kept)
        for p in self.placed:  # the run's own samplers go with it (a long-lived driver too)
            if p.name not in gone:
                with contextlib.suppress(Exception):
                    ray.kill(p.handle, no_restart=True)
        self.status = status
        if self.refresher is not None:
            self.refresher.stop()
            write_targets(self.opts.targets, [])  # the run is over: no stale targets to alert on
        from collector.probe.core import HISTORY_ENV

        if self._history_set:  # ours, not the user's: gone with the run
            os.environ.pop(HISTORY_ENV, None)
        os.environ.pop(SPOOL_ENV, None)
        shutil.rmtree(self.options.spool, ignore_errors=True)


def remote_write_line(health: list[dict[str, Any]]) -> str:
    """What remote write delivered, summed over the samplers (empty without remote write):
    every sample it could not deliver is said, with the last error."""
    stats = [h["remote_write"] for h in health if isinstance(h.get("remote_write"), dict)]
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


def _problems(drainer: _Drainer, writer: RunWriter, samplers: int) -> list[str]:
    """Why a run that ended is not completely recorded (empty: it is): what the store could
    not write, samplers lost or restarted, records no longer kept when drained."""
    out = []
    if writer.write_errors:
        parts = ", ".join(f"{n} {k}" for k, n in sorted(writer.write_errors.items()))
        out.append(f"the run store could not write {parts} ({writer.first_error})")
    if drainer.unreachable:
        out.append(
            f"{len(drainer.unreachable)} of {samplers} samplers could not be reached "
            f"({', '.join(sorted(drainer.unreachable))}): their steps stop where the last "
            "drain found them"
        )
    if drainer.restarts:
        out.append(
            f"{sum(drainer.restarts.values())} sampler restart(s) ({', '.join(drainer.restarts)}):"
            " the steps in flight then were lost, those around it are flagged sampler_started"
        )
    if drainer.records_lost:
        out.append(f"{drainer.records_lost} step records were no longer kept when drained")
    if drainer.events_lost:
        out.append(f"{drainer.events_lost} probe events were no longer kept when drained")
    if drainer.samples_lost:
        out.append(f"{drainer.samples_lost} NVML samples were overwritten before being stored")
    if drainer.errors:
        out.append(f"store drains failed: {dict(drainer.errors)}")
    return out


def _stop_samplers(placed: list[PlacedSampler], echo) -> tuple[list[dict[str, Any]], set[str]]:
    """Stop every sampler of the run (sampling, pending joins, remote write flushed): each
    sampler is this run's own (:mod:`collector.placement`). Returns their final health and the
    names of those that could not be reached (killed, their node gone): never the job's end."""
    health: list[dict[str, Any]] = []
    gone: set[str] = set()
    for p in placed:
        try:
            health.append(ray.get(p.handle.stop.remote(), timeout=60))
        except Exception as exc:
            echo(
                f"warning: sampler {p.name} unreachable at the end of the run ({_first_line(exc)})"
            )
            health.append({"alive": False, "unreachable": True, "error": type(exc).__name__})
            gone.add(p.name)
    return health, gone


def _stored_records(root: Path) -> list[dict[str, Any]]:
    """Every step record the run store holds (what the report shows: the steps drained
    before a sampler was lost included)."""
    from collector.store import RunStore, StoreError

    try:
        return [r.to_dict() for r in RunStore(root).records()]
    except (StoreError, OSError) as exc:
        log.warning("run store %s could not be read back: %s", root, exc)
        return []


def _kept_records(placed: list[PlacedSampler], gone: set[str]) -> list[dict[str, Any]]:
    """The step records each reachable sampler still keeps (its newest 20,000)."""
    out: list[dict[str, Any]] = []
    for p in placed:
        if p.name in gone:
            continue
        try:
            out.extend(ray.get(p.handle.step_records.remote(), timeout=60))
        except Exception as exc:
            log.warning("sampler %s: records not read: %s", p.name, _first_line(exc))
    return out


def _unique(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step (GPU, process, sequence), in GPU then time order."""
    unique = {(r["gpu_uuid"], r.get("pid", 0), r.get("seq", 0), r["begin_ns"]): r for r in records}
    return sorted(unique.values(), key=lambda r: (r["gpu_uuid"], r["begin_ns"]))


def run_job(opts: JobOptions, echo=print) -> JobResult:
    """Run ``opts`` to the end and print its report. A workload that fails leaves its result with
    ``failure`` set; stepmem's own errors and Ctrl-C/SIGTERM raise, after the teardown."""
    spec, banner = choose_backend(opts)
    live_only = "--script" if opts.script else ""
    if live_only and spec.kind == "replay":
        raise StepmemError(
            f"{live_only} needs the live NVML backend (a GPU); the replay backend plays "
            "recorded steps"
        )
    echo(banner)
    run: RunSession | None = None
    interrupted: BaseException | None = None
    try:
        with RaySession(opts.ray_address, echo) as ray_session:
            options = _sampler_options(opts, spec, ray_session.local)
            with RunSession(opts, spec, banner, options, echo) as run:
                run.run()
    except KeyboardInterrupt as exc:  # stopped: the teardown ran; keep and show what was done
        if run is None or run.status == "running":
            raise
        interrupted = exc
    from collector.report import render_report
    from collector.runs import Run

    failure = None
    failed = [r for r in run.records if r.get("error") and r["error"] != "KeyboardInterrupt"]
    if run.error is not None:
        failure = WorkloadFailed(run.error, min((r["step"] for r in failed), default=None))
    elif failed and spec.kind == "replay":  # the recorded run failed (an OOM): so does its replay
        first = min(failed, key=lambda r: r["begin_ns"])
        failure = WorkloadFailed(RuntimeError(f"{first['error']}, as recorded"), first["step"])
    result = JobResult(
        banner=banner,
        records=run.records,
        samplers=[p.info for p in run.placed],
        health=run.health,
        workload=run.summary,
        error=run.error_text,
        failure=failure,
        store=run.writer.root if run.writer is not None else None,
        run_id=options.run_id,
        status=run.status,
        problems=run.problems,
        rate_hz=options.sampling.rate.hz,
        interrupted=interrupted,
    )
    name = options.run_id if run.writer is not None else "(not stored: --no-store)"
    shown = Run(name, result.meta(), run.records)
    if run.writer is not None:
        shown.root = run.writer.root  # its allocation history, the samples before a failure
    text, _ = render_report(shown)
    echo(text.rstrip())
    pushed = remote_write_line(run.health)
    if pushed:
        echo(pushed)
    if run.writer is not None:
        where = shlex.quote(str(run.writer.root.resolve()))
        echo(f"again, or with --png/--html: stepmem report {where}")
    return result


_SECRET = re.compile(r"token|key|secret|passw|auth|credential|cookie", re.IGNORECASE)


def redact_args(argv: list[str]) -> list[str]:
    """A command line as the run store keeps it: the value of any flag whose name sounds like a
    secret (``--api-key X``, ``--token=X``), URLs' user info and query values, replaced by
    ``<redacted>``; the rest as given."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("<redacted>")
            hide_next = False
            continue
        if arg.startswith("-") and "=" in arg:
            flag, value = arg.split("=", 1)
            out.append(f"{flag}=<redacted>" if _SECRET.search(flag) else f"{flag}={_url(value)}")
            continue
        if arg.startswith("-") and _SECRET.search(arg) and not arg.startswith("--no-"):
            hide_next = True
        out.append(_url(arg) if "://" in arg else arg)
    return out


def _url(value: str) -> str:
    from collector.export.remote_write import redact_url

    return redact_url(value) if "://" in value else value


def _meta(
    opts: JobOptions, options: SamplerOptions, banner: str, placed: list[PlacedSampler]
) -> dict[str, Any]:
    import sys
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for dist in ("stepmem", "torch", "transformers", "bitsandbytes", "ray", "nvidia-ml-py"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    return {
        "run_id": options.run_id,
        "workload": options.workload,
        "banner": banner,
        "command": redact_args(sys.argv),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "backend": placed[0].info["backend"] if placed else None,
        "rate_hz": options.sampling.rate.hz,
        "window_s": options.sampling.window_s,
        "job": {
            "workload": opts.workload,
            "workload_args": redact_args(opts.workload_args),
            "captures": opts.captures,
            "gpus": opts.gpus,
            "speed": opts.speed,
            "steps": opts.steps,
        },
        "samplers": [p.info for p in placed],
        "driver": placed[0].info["driver"] if placed else None,
        "versions": versions,
    }
