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

import dataclasses
import logging
import os
import shlex
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from collector.backends import BackendSpec
from collector.errors import StepmemError
from collector.export.file_sd import TargetsRefresher, write_targets
from collector.placement import PlacedSampler, launch_samplers, new_run_id
from collector.probe.core import Outbox
from collector.replay import Capture, resolve_capture
from collector.runners import Runner, runner_for
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

    def document(self) -> dict[str, Any]:
        """The ``--out`` JSON document."""
        doc = {
            "banner": self.banner,
            "records": self.records,
            "samplers": self.samplers,
            "health": self.health,
            "workload": self.workload,
        }
        if self.error is not None:
            doc["error"] = self.error
        return doc


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
            f"stepmem: live NVML backend, workload {opts.workload}, "
            f"sampling at {opts.sampler.sampling.rate}"
        )
    for name in opts.captures:  # fail here, in one line, not inside a sampler actor
        if not Capture.load(resolve_capture(name)).events:
            raise StepmemError(f"capture {name!r} holds no step events: nothing to replay")
    caps = ", ".join(Path(c).name.removesuffix(".capture.parquet") for c in opts.captures)
    # Committed captures travel by name: each node's actors resolve them in their own install.
    spec = BackendSpec("replay", captures=list(opts.captures), gpus=opts.gpus, speed=opts.speed)
    why = opts.backend_reason or ("no GPU here" if opts.backend == "auto" else "asked for")
    return spec, (
        f"stepmem: REPLAY backend ({why}) — playing NVML captures recorded on a real "
        f"GPU, not this machine: {caps}; {spec.gpus or len(opts.captures)} simulated GPU(s) "
        f"per node at {opts.speed:g}x speed"
    )


class _Drainer:
    """Pulls new samples, step records and probe events into the run store every interval."""

    def __init__(
        self,
        writer: RunWriter,
        placed: list[PlacedSampler],
        outbox: Outbox,
        interval_s: float = 2.0,
    ) -> None:
        self.writer, self.placed, self.outbox = writer, placed, outbox
        self.interval_s = interval_s
        self.cursors = {p.gpu_uuid: 0 for p in placed}
        self.last_step = {p.gpu_uuid: -1 for p in placed}
        self.samples_lost = 0
        self.unreachable: set[str] = set()  # the samplers a call failed on (names)
        self.calls_failed = 0
        self.records: dict[str, list[dict[str, Any]]] = {p.gpu_uuid: [] for p in placed}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepmem-store", daemon=True)
        self._thread.start()

    def drain(self, flush_steps: bool = False) -> None:
        with self._lock:
            for p in self.placed:
                uuid = p.gpu_uuid
                try:
                    d = ray.get(p.handle.samples_since.remote(self.cursors[uuid]), timeout=30)
                    recs = ray.get(
                        p.handle.step_records.remote(self.last_step[uuid], flush_steps), timeout=30
                    )
                except Exception as exc:  # a dead sampler leaves a gap; training goes on
                    self.lost(p.name)
                    log.warning("run store: sampler %s unreachable: %s", p.name, exc)
                    continue
                self.writer.add_samples(uuid, d["t_ns"], d["used"], d["reserved"])
                self.cursors[uuid] = d["next"]
                self.samples_lost += d["lost"]
                self.writer.add_records(recs)
                self.records[uuid].extend(recs)
                if recs:
                    self.last_step[uuid] = max(r["step"] for r in recs)
            self.writer.add_events(self.outbox.take_events())
            self.writer.flush()

    def lost(self, name: str) -> None:
        """A call to sampler ``name`` failed: counted, and the sampler named once."""
        self.unreachable.add(name)
        self.calls_failed += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.drain()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def _sampler_options(opts: JobOptions, spec: BackendSpec, local: bool) -> SamplerOptions:
    """The job's sampler settings with its labels filled in. A cluster this job started itself
    is a single machine: /metrics stays on loopback there."""
    s = opts.sampler
    return dataclasses.replace(
        s,
        run_id=s.run_id or new_run_id(),
        workload=s.workload
        or (f"script:{opts.script.stem}" if opts.script is not None else "")
        or (opts.workload if spec.kind == "nvml" else "replay:" + "+".join(opts.captures)),
        metrics_addr=s.metrics_addr or ("127.0.0.1" if local else None),
    )


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
        if opts.store is not None:
            meta = _meta(opts, self.options, self.banner, placed)
            self.writer = RunWriter(opts.store / self.options.run_id, meta)
            self.drainer = _Drainer(self.writer, placed, self.outbox)
            echo(f"run store: {self.writer.root.resolve()}")
            self._history_env()
        return self

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
        self.echo(f"workload {self.opts.workload} failed: {type(exc).__name__}")

    def __exit__(self, exc_type: type | None, exc: object, tb: object) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            status = "interrupted"
        elif exc_type is not None or self.error is not None:
            status = "failed"
        else:
            status = "complete"
        if self.outbox is not None:
            self.outbox.close()
        time.sleep(0.1)
        self.records, self.health = _final_records(
            self.placed, self.options.run_id, self.drainer, self.echo
        )
        if self.drainer is not None and self.writer is not None:
            self.drainer.stop()
            self.drainer.drain(flush_steps=True)
            self.writer.close(
                status,
                health=self.health,
                samples_lost=self.drainer.samples_lost,
                samplers_unreachable=len(self.drainer.unreachable),
                sampler_calls_failed=self.drainer.calls_failed,
                workload_summary=self.summary,
                error=self.error_text,
            )
        if self.refresher is not None:
            self.refresher.stop()
            write_targets(self.opts.targets, [])  # the run is over: no stale targets to alert on
        from collector.probe.core import HISTORY_ENV

        if self._history_set:  # ours, not the user's: gone with the run
            os.environ.pop(HISTORY_ENV, None)


def run_job(opts: JobOptions, echo=print) -> JobResult:
    """Run ``opts`` to the end and print its report. A workload that fails leaves its result with
    ``failure`` set; stepmem's own errors and Ctrl-C/SIGTERM raise, after the teardown."""
    spec, banner = choose_backend(opts)
    live_only = "--script" if opts.script else "--train-workers" if opts.train_workers else ""
    if live_only and spec.kind == "replay":
        raise StepmemError(
            f"{live_only} needs the live NVML backend (a GPU); the replay backend plays "
            "recorded steps"
        )
    echo(banner)
    with RaySession(opts.ray_address, echo) as ray_session:
        options = _sampler_options(opts, spec, ray_session.local)
        with RunSession(opts, spec, banner, options, echo) as run:
            run.run()
    from collector.report import Run, render_report

    samplers = [p.info for p in run.placed]
    text, _ = render_report(
        Run(options.run_id, {"banner": banner, "samplers": samplers}, run.records)
    )
    echo(text.rstrip())
    if run.writer is not None:
        where = shlex.quote(str(run.writer.root.resolve()))
        echo(f"again, or with --png/--html: stepmem report {where}")
    failure = None
    if run.error is not None:
        failed = [r["step"] for r in run.records if r.get("error")]
        failure = WorkloadFailed(run.error, min(failed) if failed else None)
    return JobResult(
        banner=banner,
        records=run.records,
        samplers=samplers,
        health=run.health,
        workload=run.summary,
        error=run.error_text,
        failure=failure,
        store=run.writer.root if run.writer is not None else None,
    )


def _final_records(
    placed: list[PlacedSampler], run_id: str, drainer: _Drainer | None, echo
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every GPU's step records, pending steps joined, and each sampler's final health. Samplers
    this job launched are stopped (sampling, pending joins, remote write flushed); ones it found
    running (a daemon's) go on. A sampler that cannot be reached (killed, its node gone) costs
    only its own records: those the run store drained already are kept, and it is named."""
    records: list[dict[str, Any]] = []
    health: list[dict[str, Any]] = []
    for p in placed:
        try:
            records.extend(ray.get(p.handle.step_records.remote(flush=True), timeout=60))
            end = p.handle.stop if p.info.get("run_id") == run_id else p.handle.health
            health.append(ray.get(end.remote(), timeout=60))
        except Exception as exc:  # a dead actor, a lost node, a timeout: never the job's end
            kept = drainer.records.get(p.gpu_uuid, []) if drainer is not None else []
            echo(
                f"warning: sampler {p.name} unreachable at the end of the run "
                f"({type(exc).__name__}); {len(kept)} of its step records were drained before"
            )
            records.extend(kept)
            health.append({"alive": False, "unreachable": True, "error": type(exc).__name__})
            if drainer is not None:
                drainer.lost(p.name)
    # the drained copy and a late flush can both hold a step: keep one per (GPU, step)
    unique = {(r["gpu_uuid"], r["step"]): r for r in records}
    return sorted(unique.values(), key=lambda r: (r["gpu_uuid"], r["step"])), health


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
        "command": sys.argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "backend": placed[0].info["backend"] if placed else None,
        "rate_hz": options.sampling.rate.hz,
        "window_s": options.sampling.window_s,
        "job": {
            "workload": opts.workload,
            "workload_args": opts.workload_args,
            "captures": opts.captures,
            "gpus": opts.gpus,
            "speed": opts.speed,
            "steps": opts.steps,
        },
        "samplers": [p.info for p in placed],
        "driver": placed[0].info["driver"] if placed else None,
        "versions": versions,
    }
