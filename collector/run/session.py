"""Everything of one run on a connected cluster (:class:`RunSession`): the samplers, the runner
and its outbox, the run store and its drain, the targets file — and the one teardown that ends
them, whatever ended the run. The job around it is :mod:`collector.run.job`."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import ray

from collector.backends import BackendSpec
from collector.export.file_sd import TargetsRefresher, write_targets
from collector.model.errors import StepmemError, first_line
from collector.model.records import SamplerHealth
from collector.model.settings import JobOptions, SamplerOptions
from collector.model.step import StepRecord
from collector.model.units import GIB
from collector.placement import PlacedSampler, launch_samplers
from collector.probe.outbox import SPOOL_ENV, Outbox
from collector.run.drain import Drainer, problems
from collector.run.runners import ReplayRunner, Runner, runner_for
from collector.store import RunWriter

__all__ = ["RunSession", "redact_args", "what_runs"]

log = logging.getLogger(__name__)


def what_runs(opts: JobOptions) -> str:
    """What the run runs, in words: ``script train.py``, ``command torchrun``, ``workload
    finetune``."""
    if opts.script is not None:
        return f"script {opts.script}"
    if opts.command and opts.workload_args:
        return f"command {Path(opts.workload_args[0]).name}"
    return f"workload {opts.workload}"


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

    def __init__(self, job: JobOptions, spec: BackendSpec, banner: str, echo) -> None:
        """``job`` as it runs on its cluster (:meth:`collector.run.job.Plan.on_cluster`): its
        sampler settings are final."""
        self.opts, self.spec, self.banner, self.echo = job, spec, banner, echo
        self.placed: list[PlacedSampler] = []
        self.runner: Runner | None = None
        self.outbox: Outbox | None = None
        self.writer: RunWriter | None = None
        self.drainer: Drainer | None = None
        self.refresher: TargetsRefresher | None = None
        self.summary: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.error_text: str | None = None
        self.records: list[StepRecord] = []
        self.health: list[SamplerHealth] = []
        self.problems: list[str] = []  # why the run is not completely recorded
        self.replay_speed: float | None = None  # the steps are a capture's, played at this speed
        self._stand_in_origin: int | None = None  # replay played under CPU stand-ins, from
        self.status = "running"
        self._history_set = False  # this run set STEPMEM_HISTORY_DIR (and unsets it at the end)

    @property
    def options(self) -> SamplerOptions:
        """The run's sampler settings (the job's, resolved once by its plan)."""
        return self.opts.sampler

    def __enter__(self) -> RunSession:
        opts, echo = self.opts, self.echo
        self.placed = placed = launch_samplers(self.spec, self.options)
        if opts.targets is not None:
            self.refresher = TargetsRefresher(opts.targets, [p.handle for p in placed])
            echo(f"Prometheus targets: {opts.targets}")
        for p in placed:
            echo(
                f"sampler {p.name} ({p.info.name}, {p.info.total_bytes / GIB:.1f} GiB, "
                f"{p.info.backend})"
            )
        self.runner = runner_for(opts, self.spec, placed, self.options.run_id)
        self.outbox = self.runner.outbox(placed)
        if isinstance(self.runner, ReplayRunner):
            self.replay_speed = float(opts.speed)
        if self.spec.kind == "replay" and not isinstance(self.runner, ReplayRunner):
            # CPU stand-ins bring the steps: the captures play from now, in a loop
            self._stand_in_origin = time.monotonic_ns()
            ray.get(
                [p.handle.replay_from.remote(self._stand_in_origin, stand_in=True) for p in placed],
                timeout=60,
            )
        _private_dir(Path(self.options.spool))
        free = _free_bytes(self.options.spool)
        if free is not None and free < SPOOL_ROOM:
            self.echo(
                f"stepmem: the spool folder {self.options.spool} has {free >> 20} MiB free: "
                "processes without Ray leave their step events there (set TMPDIR elsewhere)"
            )
        os.environ[SPOOL_ENV] = self.options.spool  # this run's processes without Ray
        if opts.store is not None:
            meta = _meta(opts, self.options, self.banner, placed)
            if self.replay_speed is not None:
                meta["replay_speed"] = self.replay_speed
            self.writer = RunWriter(opts.store / self.options.run_id, meta)
            self.drainer = Drainer(self.writer, placed, on_restart=self._restarted)
            echo(f"run store: {self.writer.root.resolve()}")
            self._history_env()
        return self

    def _restarted(self, p: PlacedSampler) -> None:
        """Ray restarted sampler ``p``: a replay plays on from the run's alignment (the new
        actor holds its reads until then)."""
        stand_in = not isinstance(self.runner, ReplayRunner)  # CPU processes bring the steps
        origin = self._stand_in_origin if stand_in else self.runner.origin_ns
        if origin is not None and self.spec.kind == "replay":
            try:  # a replay's own steps play once; stand-ins' capture loops beside them
                ray.get(
                    p.handle.replay_from.remote(origin, loop=stand_in, stand_in=stand_in),
                    timeout=30,
                )
            except Exception as exc:
                log.warning("sampler %s could not be re-aligned: %s", p.name, first_line(exc))

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
        kept: list[StepRecord] = []
        if self.drainer is not None and self.writer is not None:
            for name in gone:
                self.drainer.lost(name)
            self.drainer.drain(flush_steps=True)
            self.problems = problems(self.drainer, self.writer, len(self.placed))
            self.problems += spool_problems(self.health, self.options.spool)
            if self.problems and status == "complete":
                status = "incomplete"
            self.writer.close(
                status,
                health=[h.to_dict() for h in self.health],
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


SPOOL_ROOM = 64 << 20  # a run's spool holds its events: a few hundred bytes a step a process


def _free_bytes(folder: str) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def spool_problems(health: list[SamplerHealth], spool: str) -> list[str]:
    """Processes that could not write their step events to the spool folder (a full disk):
    their steps are missing from the record, and the run says so."""
    # every sampler of a node reads that node's folder: the most any of them saw
    n = max((h.spool_failed_writers or 0 for h in health), default=0)
    if not n:
        return []
    return [
        f"{n} process(es) could not write their step events to the spool folder {spool} (a "
        "full disk?): their steps after that are missing"
    ]


def _stop_samplers(placed: list[PlacedSampler], echo) -> tuple[list[SamplerHealth], set[str]]:
    """Stop every sampler of the run (sampling, pending joins, remote write flushed): each
    sampler is this run's own (:mod:`collector.placement`). Returns their final health and the
    names of those that could not be reached (killed, their node gone): never the job's end."""
    health: list[SamplerHealth] = []
    gone: set[str] = set()
    for p in placed:
        try:
            health.append(ray.get(p.handle.stop.remote(), timeout=60))
        except Exception as exc:
            echo(f"warning: sampler {p.name} unreachable at the end of the run ({first_line(exc)})")
            health.append(SamplerHealth.unreached(p.gpu_uuid, exc))
            gone.add(p.name)
    return health, gone


def _stored_records(root: Path) -> list[StepRecord]:
    """Every step record the run store holds (what the report shows: the steps drained
    before a sampler was lost included)."""
    from collector.store import RunStore, StoreError

    try:
        return RunStore(root).records()
    except (StoreError, OSError) as exc:
        log.warning("run store %s could not be read back: %s", root, exc)
        return []


def _kept_records(placed: list[PlacedSampler], gone: set[str]) -> list[StepRecord]:
    """The step records each reachable sampler still keeps (its newest 20,000)."""
    out: list[StepRecord] = []
    for p in placed:
        if p.name in gone:
            continue
        try:
            out.extend(ray.get(p.handle.step_records.remote(), timeout=60))
        except Exception as exc:
            log.warning("sampler %s: records not read: %s", p.name, first_line(exc))
    return out


def _unique(records: list[StepRecord]) -> list[StepRecord]:
    """One record per step (GPU, process, sequence), in GPU then time order."""
    unique = {(*r.key, r.begin_ns): r for r in records}
    return sorted(unique.values(), key=lambda r: (r.gpu_uuid, r.begin_ns))


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
        "backend": placed[0].info.backend if placed else None,
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
        "samplers": [p.info.to_dict() for p in placed],
        "driver": placed[0].info.driver if placed else None,
        "versions": versions,
    }
