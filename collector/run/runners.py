"""What a run runs while its samplers sample, behind one interface: a built-in workload in this
process (:class:`LiveRunner`), the same in a Ray Train ``TorchTrainer`` (:class:`TrainRunner`), a
user's script (:class:`ScriptRunner`), or the recorded steps of captures (:class:`ReplayRunner`).

Each makes the outbox its step events leave by and runs to the end, returning a summary for the
run store. A runner's exception is the workload's (``fails_as_workload``: kept, reported, the job
fails with exit 1) except a replay's, which is stepmem's own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import ray

import workloads
from collector.probe.outbox import Outbox
from collector.supervise import GRACE_S, supervised

if TYPE_CHECKING:
    from collector.backends import BackendSpec
    from collector.model.settings import JobOptions
    from collector.placement import PlacedSampler

__all__ = [
    "CommandRunner",
    "LiveRunner",
    "ReplayRunner",
    "Runner",
    "ScriptRunner",
    "TrainRunner",
    "runner_for",
]


class Runner(Protocol):
    fails_as_workload: bool

    def outbox(self, placed: list[PlacedSampler]) -> Outbox:
        """Where step events go: a probe's batches to its node's samplers."""
        ...

    def run(self, outbox: Outbox, echo) -> dict[str, Any]:
        """Run to the end; the summary goes into the run store's ``workload_summary``."""
        ...


def _probe_outbox(placed: list[PlacedSampler]) -> Outbox:
    """A live probe batches and finds the sampler of (its node, its GPU) by name; under
    ``stepmem capture`` its events also go to the capture's events file."""
    import os

    from collector.lookup import SamplerLookup
    from collector.probe.core import EVENTS_ENV

    events_file = os.environ.get(EVENTS_ENV) or None
    return Outbox(SamplerLookup(), batch_max=64, flush_interval_s=0.5, events_file=events_file)


class LiveRunner:
    """A built-in workload (``finetune``, ``spiky``, ``patterns``) in this process, under a probe
    that sends through the job's outbox."""

    fails_as_workload = True

    def __init__(self, opts: JobOptions) -> None:
        self.opts = opts

    outbox = staticmethod(_probe_outbox)

    def run(self, outbox: Outbox, echo) -> dict[str, Any]:
        from collector.probe.core import StepProbe

        wl, args = workloads.parse(self.opts.workload, self.opts.workload_args)
        probe = StepProbe(outbox=outbox)
        summary = workloads.run(wl, args, probe)
        summary["probe_cost_ns"] = probe.cost_ns
        summary["probe_devices"] = [str(d) for d in probe.devices]
        summary["probe_dropped"] = dict(probe.outbox.dropped)
        echo(f"workload {self.opts.workload} done: {len(summary['step_times_s'])} steps")
        return summary


class ScriptRunner:
    """A user's training script, run as ``python SCRIPT ARGS`` would run it, in this process,
    once the samplers are placed. Its own probe (``StepMemCallback`` or ``StepProbe``) finds
    them by name; the job collects the step records, writes the store and prints the report."""

    fails_as_workload = True

    def __init__(self, opts: JobOptions) -> None:
        self.script, self.args = opts.script, list(opts.workload_args)

    outbox = staticmethod(_probe_outbox)

    def run(self, outbox: Outbox, echo) -> dict[str, Any]:
        import runpy
        import sys

        argv, sys.argv = sys.argv, [str(self.script), *self.args]
        t0 = time.monotonic()
        try:
            runpy.run_path(str(self.script), run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise RuntimeError(f"{self.script} exited with status {exc.code}") from None
        finally:
            sys.argv = argv
        seconds = time.monotonic() - t0
        echo(f"script {self.script} done in {seconds:.1f} s")
        return {"script": str(self.script), "args": self.args, "seconds": seconds}


class CommandRunner:
    """A command (``torchrun …``, ``python -m …``, a shell script) run as the workload, in a
    process of its own with the run's environment: every process it starts that has a probe
    reports to this run — through Ray if it is connected, else through the run's spool folder
    (``STEPMEM_SPOOL``). With the replay backend, CPU processes stand in for the replayed GPUs
    of this node (``STEPMEM_CPU_AS``): the NVML trace is the capture's, the steps the
    command's. The command runs under :mod:`collector.supervise`, in a process group of its
    own: Ctrl-C or SIGTERM stops the group first (SIGTERM, then SIGKILL after 10 s), and a job
    killed outright takes the group with it."""

    fails_as_workload = True

    def __init__(self, opts: JobOptions, cpu_as: list[str] | None = None) -> None:
        self.cmd, self.cpu_as = list(opts.workload_args), cpu_as

    outbox = staticmethod(_probe_outbox)

    def run(self, outbox: Outbox, echo) -> dict[str, Any]:
        import os
        import subprocess

        from collector.probe.identity import CPU_AS_ENV

        env = dict(os.environ)
        if self.cpu_as:
            env[CPU_AS_ENV] = ",".join(self.cpu_as)
        t0 = time.monotonic()
        try:  # under its keeper: the command's whole process group ends with this job
            child = subprocess.Popen(supervised(self.cmd), env=env)
        except OSError as exc:
            raise RuntimeError(f"cannot run {self.cmd[0]!r}: {exc.strerror or exc}") from None
        try:
            rc = child.wait()
        except BaseException:  # Ctrl-C, SIGTERM: the command goes first, then the teardown
            child.terminate()  # the keeper: SIGTERM to the group, SIGKILL after 10 s
            try:
                child.wait(GRACE_S + 5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            raise
        seconds = time.monotonic() - t0
        if rc != 0:
            raise RuntimeError(f"{self.cmd[0]} exited with status {rc}")
        echo(f"command {self.cmd[0]} done in {seconds:.1f} s")
        return {"command": self.cmd[:1], "returncode": rc, "seconds": seconds}


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
    import os

    import ray.train

    import workloads
    from collector.probe.core import StepProbe
    from collector.probe.identity import CPU_AS_ENV

    if config.get("cpu_as"):  # CPU workers standing in for replayed GPUs (CI)
        os.environ[CPU_AS_ENV] = ",".join(config["cpu_as"])
    wl, args = workloads.parse(config["workload"], config["args"])
    probe = StepProbe(gpu_uuids=config.get("gpu_uuids"))
    summary = workloads.run(wl, args, probe)
    rank = ray.train.get_context().get_world_rank()
    box = ray.get_actor(config["summaries"], namespace="stepmem")
    out = {
        "steps": len(summary["step_times_s"]),
        "step_times_s": summary["step_times_s"],
        "pid": os.getpid(),
        "probe_sent": probe.outbox.sent,
        "probe_dropped": dict(probe.outbox.dropped),
        "probe_cost_ns": list(probe.cost_ns),
    }
    ray.get(box.put.remote(rank, out), timeout=60)  # once, after training: not on its path


class TrainRunner:
    """The workload in a Ray Train ``TorchTrainer`` with ``opts.train_workers`` workers, one GPU
    each (``use_gpu``); ``gpu_uuids`` maps a CPU worker's device to a (replayed) GPU in tests.
    Each worker's own probe sends to its node's samplers; the job's outbox carries nothing."""

    fails_as_workload = True

    def __init__(
        self,
        opts: JobOptions,
        run_id: str = "run",
        use_gpu: bool = True,
        gpu_uuids: dict[Any, str] | None = None,
        cpu_as: list[str] | None = None,
    ) -> None:
        self.opts, self.run_id, self.use_gpu, self.gpu_uuids = opts, run_id, use_gpu, gpu_uuids
        self.cpu_as = cpu_as

    outbox = staticmethod(_probe_outbox)

    def run(self, outbox: Outbox | None, echo) -> dict[str, Any]:
        import tempfile
        import uuid

        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        opts = self.opts
        workloads.parse(opts.workload, opts.workload_args)  # bad input fails here, not in a worker
        name = f"stepmem-train-summaries-{uuid.uuid4().hex[:12]}"
        box = _Summaries.options(name=name, namespace="stepmem").remote()
        storage = (
            opts.store / self.run_id / "train"
            if opts.store is not None
            else Path(tempfile.mkdtemp(prefix="stepmem-train-"))
        )
        trainer = TorchTrainer(
            _train_worker,
            train_loop_config={
                "workload": opts.workload,
                "args": list(opts.workload_args),
                "gpu_uuids": self.gpu_uuids,
                "cpu_as": self.cpu_as,
                "summaries": name,
            },
            scaling_config=ScalingConfig(num_workers=opts.train_workers, use_gpu=self.use_gpu),
            run_config=RunConfig(storage_path=str(storage.resolve()), name="ray-train"),
        )
        echo(
            f"Ray Train: {opts.train_workers} worker(s), "
            f"{'one GPU each' if self.use_gpu else 'CPU'}"
        )
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
                str(r): {"steps": s["steps"], "probe_sent": s["probe_sent"], "pid": s.get("pid")}
                for r, s in by_rank.items()
            },
        }


class ReplayRunner:
    """The recorded steps of the replayed captures, sent at their recorded times (see
    :class:`collector.replay_driver.ReplayDriver`). Replayed GPUs live on every node and this
    process plays them all: events go one by one to their samplers by UUID, not to "the sampler
    of this GPU on this node" as a probe finds its own."""

    fails_as_workload = False

    def __init__(self, spec: BackendSpec, placed: list[PlacedSampler], steps: int | None) -> None:
        from collector.replay_driver import ReplayDriver

        self.driver = ReplayDriver(spec, placed, steps)

    def outbox(self, placed: list[PlacedSampler]) -> Outbox:
        # batched like a probe's (one actor call per 64 events or 50 ms, not one per event:
        # each call is a task the cluster's GCS keeps track of)
        return Outbox(
            {p.gpu_uuid: p.handle for p in placed}.get, batch_max=64, flush_interval_s=0.05
        )

    @property
    def origin_ns(self) -> int | None:
        """The monotonic time capture time 0 plays at (None until aligned)."""
        return self.driver.origin_ns

    def run(self, outbox: Outbox, echo) -> dict[str, Any]:
        self.driver.align()
        self.driver.play(outbox, echo)
        return {}


def runner_for(
    opts: JobOptions, spec: BackendSpec, placed: list[PlacedSampler], run_id: str
) -> Runner:
    """The runner for ``opts`` (``run_id``: the run's, for a Ray Train run's own storage). With
    the replay backend, ``--command`` and ``--train-workers`` run on the CPU, their processes
    standing in for the replayed GPUs (:class:`CommandRunner`); otherwise a replay plays the
    captures' own steps."""
    replay = spec.kind == "replay"
    if opts.command:
        here = ray.get_runtime_context().get_node_id()
        local = [p.gpu_uuid for p in placed if p.node_id == here]
        return CommandRunner(opts, local if replay else None)
    if replay and opts.train_workers:
        return TrainRunner(opts, run_id, use_gpu=False, cpu_as=[p.gpu_uuid for p in placed])
    if replay:
        return ReplayRunner(spec, placed, opts.steps)
    if opts.script is not None:
        return ScriptRunner(opts)
    if opts.train_workers:
        return TrainRunner(opts, run_id)
    return LiveRunner(opts)
