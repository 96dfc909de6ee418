"""The main job: samplers on every GPU, a workload under the probe, step records out.

On a machine with GPUs it runs a real workload (``finetune`` or ``spiky``) under the step probe
with live NVML samplers. Without a GPU it runs the same pipeline on the replay backend: sampler
actors play captures recorded on an H200 and the step events recorded with them are sent again,
at their recorded times, through the probe's outbox — so the step records match the real run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

import workloads
from collector.errors import StepmemError
from collector.export.file_sd import TargetsRefresher, write_targets
from collector.placement import (
    BackendSpec,
    PlacedSampler,
    SamplerOptions,
    find_sampler,
    launch_samplers,
)
from collector.probe.core import Outbox
from collector.records import StepEvent, StepRecord
from collector.replay import Capture, resolve_capture
from collector.store import RunWriter

__all__ = ["JobOptions", "WorkloadFailed", "run_job", "start_local_ray"]

log = logging.getLogger(__name__)

GIB = 1 << 30
REPLAY_LEAD_S = 0.5  # lead between aligning replayed GPUs and the first replayed step


class WorkloadFailed(RuntimeError):
    """The workload raised (a CUDA OOM, a bug in the training script). The run store, the step
    records and the report were written first; the failed step's record has ``error`` set."""

    def __init__(self, exc: BaseException, step: int | None) -> None:
        where = f" at step {step}" if step is not None else ""
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        super().__init__(f"the workload failed{where}: {type(exc).__name__}: {first}")
        self.step = step


@dataclass
class JobOptions:
    backend: str = "auto"  # auto | nvml | replay
    backend_reason: str = ""  # why this backend, for the banner (default: from ``backend``)
    captures: list[str] = field(default_factory=lambda: ["adamw_8bit"])
    gpus: int | None = None
    rate_hz: float = 1000.0
    speed: float = 1.0
    steps: int | None = None
    workload: str = "finetune"
    workload_args: list[str] = field(default_factory=list)
    out: Path | None = None
    ray_address: str | None = None
    targets: Path | None = None  # Prometheus file_sd file kept current while the job runs
    remote_write: Any = None  # RemoteWriteConfig
    push_samples: bool = False
    metrics_addr: str | None = None
    metrics_port: int = 0
    window_s: float = 15.0
    run_id: str = ""
    store: Path | None = Path("runs")  # run store root; None: no store
    workload_label: str = ""  # the `workload` label; default: the workload or the captures
    train_workers: int = 0  # >0: run the workload in a Ray Train TorchTrainer with N workers
    script: Path | None = None  # a user's training script (with a probe adapter) instead


def nvml_available() -> bool:
    from collector.nvml import LiveBackend, NvmlError

    try:
        return len(LiveBackend().devices()) > 0
    except NvmlError:
        return False


def choose_backend(opts: JobOptions) -> tuple[BackendSpec, str]:
    """The backend spec and the banner line that says plainly which one runs."""
    import os

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
            f"sampling at {_rate(opts.rate_hz)}"
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


def _rate(rate_hz: float) -> str:
    return "max rate" if rate_hz == 0 else f"{rate_hz:g} Hz"


def terminate_as_interrupt(echo=print) -> None:
    """SIGTERM (``ray job stop``, a scheduler's kill) ends the run like Ctrl-C: samplers stopped,
    the run store flushed and marked ``interrupted``. Only the first SIGINT or SIGTERM does: the
    ones that follow while the run stops (a user pressing Ctrl-C again) are answered with a line
    and otherwise ignored, so the flush and Ray's shutdown are not cut short into tracebacks and
    orphaned processes. SIGKILL still ends it at once (and :mod:`collector.reaper` removes a
    local cluster's processes then)."""
    import signal

    stopping = False

    def handler(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt(f"signal {signum}")
        echo(
            "stepmem: already stopping (stopping samplers, flushing the run store, stopping Ray); "
            "kill -9 abandons the flush"
        )

    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def loopback_only_ray() -> None:
    """Keep a single-machine Ray cluster that this process starts on 127.0.0.1. Ray replaces
    127.0.0.1 by the machine's outward address (its "remotely reachable" IP) unless multi-node
    clusters are switched off, which it reads from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` at
    import (for this process) and in every process it starts (from the environment)."""
    import os

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False  # read when the node address is resolved
    except (ImportError, AttributeError):  # another Ray: the environment variable still holds
        pass


def is_loopback_address(address: str | None) -> bool:
    """Whether a Ray address (``127.0.0.1:6379``, ``ray://localhost:10001``,
    ``http://[::1]:8265``) names this machine's loopback interface."""
    import ipaddress
    from urllib.parse import urlsplit

    if not address or address in ("auto", "local"):
        return False
    host = urlsplit(address if "://" in address else f"//{address}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect_ray(address: str | None) -> None:
    """Connect to an existing cluster at ``address`` (else ``RAY_ADDRESS``), keeping a loopback
    address as given: Ray would otherwise swap 127.0.0.1 for the machine's outward address and
    wait for a node there that never answers."""
    import os

    if is_loopback_address(address or os.environ.get("RAY_ADDRESS")):
        loopback_only_ray()
    ray.init(address=address, namespace="stepmem")


def _init_ray(address: str | None) -> bool:
    """Connect to the cluster (``address``, else ``RAY_ADDRESS``), or start a local one on
    loopback. Returns True when this process started a local cluster."""
    import os

    if ray.is_initialized():
        return False
    if address or os.environ.get("RAY_ADDRESS"):
        connect_ray(address)
        return False
    start_local_ray()
    return True


def start_local_ray(**options: Any) -> None:
    """Start a single-machine Ray cluster of this process's own, on 127.0.0.1 only (the job
    without a cluster, the benchmarks). ``options`` go to ``ray.init``. Its processes go with
    this one however it ends (:func:`collector.reaper.guard`)."""
    from collector import reaper

    loopback_only_ray()
    reaper.guard()
    ray.init(
        # "local": a new cluster of our own, never one that /tmp/ray/ray_current_cluster names
        # (a `ray start` head that may be long gone)
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        namespace="stepmem",
        **{"configure_logging": False, **options},
    )


def stop_local_ray() -> None:
    """Shut down the local cluster :func:`start_local_ray` started, then remove any of its
    processes still there (Ray's agents outlive ``ray.shutdown()`` by up to a minute)."""
    import os

    from collector import reaper

    ray.shutdown()
    token = os.environ.get(reaper.MARK)  # set by reaper.guard() before the cluster started
    if token:
        reaper.reap(token)


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
        self.unreachable = 0
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
                    self.unreachable += 1
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

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.drain()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def _replay_events(
    placed: list[PlacedSampler], spec: BackendSpec, steps: int | None, outbox: Outbox, echo
) -> int:
    """Send each simulated GPU's recorded events at their recorded times. Returns steps sent."""
    plan: list[tuple[int, dict[str, Any]]] = []
    held = {
        c: max((e["step"] for e in Capture.load(resolve_capture(c)).events), default=0)
        for c in spec.captures
    }
    if steps is not None and steps > max(held.values()):
        echo(
            f"note: --steps {steps}, but the capture(s) hold "
            + ", ".join(
                f"{n} steps ({Path(c).name.removesuffix('.capture.parquet')})"
                for c, n in held.items()
            )
            + ": every recorded step is played"
        )
    for p in placed:
        cap = Capture.load(resolve_capture(spec.captures[p.info["index"] % len(spec.captures)]))
        origin, speed = p.info["replay_origin_ns"], p.info["replay_speed"]
        for ev in cap.events:
            if steps is not None and ev["step"] > steps:
                continue
            t = origin + int(ev["t_ns"] / speed)
            plan.append((t, {**ev, "t_ns": t, "gpu_uuid": p.gpu_uuid}))
    if not plan:
        raise StepmemError("the replayed captures hold no step events")
    plan.sort(key=lambda x: x[0])
    done = 0
    for t, ev in plan:
        delay = (t - time.monotonic_ns()) / 1e9
        if delay > 0:
            time.sleep(delay)
        outbox.put(StepEvent.from_dict(ev))
        outbox.maybe_flush()
        if ev["kind"] == "end":
            done += 1
            if done % max(1, len(placed)) == 0:
                echo(f"  replayed step {ev['step']}")
    outbox.flush()
    if outbox.dropped:
        echo(
            f"warning: {sum(outbox.dropped.values())} events could not be sent: "
            f"{dict(outbox.dropped)}"
        )
    return done


@ray.remote(num_cpus=0)
class _Summaries:
    """Where Ray Train workers leave their summaries for the driver (Ray Train 2 keeps reported
    metrics only with checkpoints, which would need storage shared by every node)."""

    def __init__(self) -> None:
        self.by_rank: dict[int, dict[str, Any]] = {}

    def put(self, rank: int, summary: dict[str, Any]) -> None:
        self.by_rank[rank] = summary

    def get(self) -> dict[int, dict[str, Any]]:
        return self.by_rank


def _train_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: the workload under its own probe, which finds this node's sampler
    for the worker's GPU by name. Leaves its step count and step times for the driver."""
    import ray.train

    import workloads
    from collector.probe.core import StepProbe

    wl, args = workloads.parse(config["workload"], config["args"])
    probe = StepProbe(gpu_uuids=config.get("gpu_uuids"))
    summary = workloads.run(wl, args, probe)
    rank = ray.train.get_context().get_world_rank()
    box = ray.get_actor(config["summaries"], namespace="stepmem")
    out = {
        "steps": len(summary["step_times_s"]),
        "step_times_s": summary["step_times_s"],
        "probe_sent": probe.outbox.sent,
        "probe_dropped": dict(probe.outbox.dropped),
        "probe_cost_ns": list(probe.cost_ns),
    }
    ray.get(box.put.remote(rank, out), timeout=60)  # once, after training: not on its path


def _run_train(
    opts: JobOptions, echo, use_gpu: bool, gpu_uuids: dict[Any, str] | None = None
) -> dict[str, Any]:
    """The workload in a Ray Train ``TorchTrainer`` with ``opts.train_workers`` workers, one GPU
    each (``use_gpu``); ``gpu_uuids`` maps a CPU worker's device to a (replayed) GPU in tests."""
    import tempfile
    import uuid

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    workloads.parse(opts.workload, opts.workload_args)  # bad input fails here, not in a worker
    name = f"stepmem-train-summaries-{uuid.uuid4().hex[:12]}"
    box = _Summaries.options(name=name, namespace="stepmem").remote()
    storage = (
        opts.store / (opts.run_id or "run") / "train"
        if opts.store is not None
        else Path(tempfile.mkdtemp(prefix="stepmem-train-"))
    )
    trainer = TorchTrainer(
        _train_worker,
        train_loop_config={
            "workload": opts.workload,
            "args": list(opts.workload_args),
            "gpu_uuids": gpu_uuids,
            "summaries": name,
        },
        scaling_config=ScalingConfig(num_workers=opts.train_workers, use_gpu=use_gpu),
        run_config=RunConfig(storage_path=str(storage.resolve()), name="ray-train"),
    )
    echo(f"Ray Train: {opts.train_workers} worker(s), {'one GPU each' if use_gpu else 'CPU'}")
    try:
        trainer.fit()
        by_rank = ray.get(box.get.remote(), timeout=60)
    finally:
        ray.kill(box)
    first = by_rank.get(0, {})
    echo(
        f"workload {opts.workload} done in Ray Train: "
        + ", ".join(f"rank {r} {s['steps']} steps" for r, s in sorted(by_rank.items()))
    )
    return {
        "train_workers": opts.train_workers,
        "step_times_s": first.get("step_times_s", []),
        "probe_cost_ns": first.get("probe_cost_ns", []),
        "probe_dropped": first.get("probe_dropped", {}),
        "probe_sent": first.get("probe_sent"),
        "workers": {
            str(r): {"steps": s["steps"], "probe_sent": s["probe_sent"]} for r, s in by_rank.items()
        },
    }


def _run_script(opts: JobOptions, echo) -> dict[str, Any]:
    """A user's training script, run as ``python SCRIPT ARGS`` would run it, in this process,
    once the samplers are placed. Its own probe (``StepMemCallback`` or ``StepProbe``) finds
    them by name; the job collects the step records, writes the store and prints the report."""
    import runpy
    import sys

    argv, sys.argv = sys.argv, [str(opts.script), *opts.workload_args]
    t0 = time.monotonic()
    try:
        runpy.run_path(str(opts.script), run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise RuntimeError(f"{opts.script} exited with status {exc.code}") from None
    finally:
        sys.argv = argv
    seconds = time.monotonic() - t0
    echo(f"script {opts.script} done in {seconds:.1f} s")
    return {"script": str(opts.script), "args": list(opts.workload_args), "seconds": seconds}


def _run_live(opts: JobOptions, outbox: Outbox, echo) -> dict[str, Any]:
    from collector.probe.core import StepProbe

    if opts.script is not None:
        return _run_script(opts, echo)
    wl, args = workloads.parse(opts.workload, opts.workload_args)
    probe = StepProbe(outbox=outbox)
    summary = workloads.run(wl, args, probe)
    summary["probe_cost_ns"] = probe.cost_ns
    summary["probe_devices"] = [str(d) for d in probe.devices]
    summary["probe_dropped"] = dict(probe.outbox.dropped)
    echo(f"workload {opts.workload} done: {len(summary['step_times_s'])} steps")
    return summary


def run_job(opts: JobOptions, echo=print) -> list[StepRecord | dict[str, Any]]:
    spec, banner = choose_backend(opts)
    live_only = "--script" if opts.script else "--train-workers" if opts.train_workers else ""
    if live_only and spec.kind == "replay":
        raise StepmemError(
            f"{live_only} needs the live NVML backend (a GPU); the replay backend plays "
            "recorded steps"
        )
    echo(banner)
    import signal

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    local = _init_ray(opts.ray_address)
    terminate_as_interrupt(echo)  # after ray.init, which installs a SIGTERM handler of its own
    try:
        return _run_on_ray(opts, spec, banner, local, echo)
    finally:
        if local:  # ours: stopped now, not by Ray's atexit hook a signal can cut
            stop_local_ray()
        for sig, h in handlers.items():  # the caller's handlers again
            with contextlib.suppress(ValueError, TypeError):  # not the main thread / not Python's
                signal.signal(sig, h)


def _run_on_ray(
    opts: JobOptions, spec: BackendSpec, banner: str, local: bool, echo
) -> list[StepRecord | dict[str, Any]]:
    # A cluster this job started itself is a single machine: keep /metrics on loopback there.
    addr = opts.metrics_addr or ("127.0.0.1" if local else None)
    options = SamplerOptions(
        rate_hz=opts.rate_hz,
        run_id=opts.run_id,
        workload=opts.workload_label
        or (f"script:{opts.script.stem}" if opts.script is not None else "")
        or (opts.workload if spec.kind == "nvml" else "replay:" + "+".join(opts.captures)),
        window_s=opts.window_s,
        metrics_addr=addr,
        metrics_port=opts.metrics_port,
        remote_write=opts.remote_write,
        push_samples=opts.push_samples,
    )
    placed = launch_samplers(spec, options)
    refresher = None
    if opts.targets is not None:
        refresher = TargetsRefresher(opts.targets, [p.handle for p in placed])
        echo(f"Prometheus targets: {opts.targets}")
    for p in placed:
        echo(
            f"sampler {p.name} ({p.info['name']}, {p.info['total_bytes'] / GIB:.1f} GiB, "
            f"{p.info['backend']})"
        )
    replay = spec.kind == "replay"
    # Replayed steps go out one by one at their times; a live probe batches. Replayed GPUs live
    # on every node, and this process plays them all: their samplers by UUID, not by "the
    # sampler of this GPU on this node" as a probe finds its own.
    outbox = Outbox(
        {p.gpu_uuid: p.handle for p in placed}.get if replay else find_sampler,
        batch_max=1 if replay else 64,
        flush_interval_s=0.05 if replay else 0.5,
    )
    writer = drainer = None
    if opts.store is not None:
        writer = RunWriter(opts.store / options.run_id, _meta(opts, options, banner, placed))
        drainer = _Drainer(writer, placed, outbox)
        echo(f"run store: {writer.root.resolve()}")
    summary: dict[str, Any] = {}
    status = "failed"
    error: BaseException | None = None
    error_text = None  # "Type: message" of the workload's exception, for the store and --out
    try:
        if replay:
            # Align playback now that every sampler runs: the first recorded step starts in
            # REPLAY_LEAD_S seconds on every replayed GPU.
            first = min(
                min((e["t_ns"] for e in Capture.load(resolve_capture(c)).events), default=0)
                for c in spec.captures
            )
            origin = time.monotonic_ns() + int(REPLAY_LEAD_S * 1e9) - int(first / spec.speed)
            ray.get([p.handle.replay_from.remote(origin) for p in placed], timeout=60)
            for p in placed:
                p.info["replay_origin_ns"] = origin
            _replay_events(placed, spec, opts.steps, outbox, echo)
        else:
            summary = (
                _run_train(opts, echo, use_gpu=True)
                if opts.train_workers
                else _run_live(opts, outbox, echo)
            )
        status = "complete"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception as exc:
        if replay:
            raise
        # The workload died (e.g. a CUDA OOM): keep everything, report it, then fail the job.
        error = exc
        error_text = f"{type(exc).__name__}: {exc}"[:2000]
        echo(f"workload {opts.workload} failed: {type(exc).__name__}")
    finally:
        outbox.close()
        time.sleep(0.1)
        records, health = _final_records(placed, options.run_id, drainer, echo)
        if drainer is not None:
            drainer.stop()
            drainer.drain(flush_steps=True)
            writer.close(
                status,
                health=health,
                samples_lost=drainer.samples_lost,
                samplers_unreachable=drainer.unreachable,
                workload_summary=summary,
                error=error_text,
            )
        if refresher is not None:
            refresher.stop()
            write_targets(opts.targets, [])  # the run is over: no stale targets to alert on
    from collector.report import Run, render_report

    text, _ = render_report(
        Run(options.run_id, {"banner": banner, "samplers": [p.info for p in placed]}, records)
    )
    echo(text.rstrip())
    if writer is not None:
        where = shlex.quote(str(writer.root.resolve()))
        echo(f"again, or with --png/--html: stepmem report {where}")
    if opts.out:
        doc = {
            "banner": banner,
            "records": records,
            "samplers": [p.info for p in placed],
            "health": health,
            "workload": summary,
        }
        if error_text is not None:
            doc["error"] = error_text
        opts.out.write_text(json.dumps(doc, indent=1))
        echo(f"step records written to {opts.out}")
    if error is not None:
        failed = [r["step"] for r in records if r.get("error")]
        raise WorkloadFailed(error, min(failed) if failed else None) from error
    return records


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
                drainer.unreachable += 1
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
        "rate_hz": options.rate_hz,
        "window_s": options.window_s,
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


if __name__ == "__main__":
    # `ray job submit --working-dir . -- python -m collector.job [stepmem run options]`
    import sys

    from collector.cli import main

    sys.exit(main(["run", *sys.argv[1:]]))
