"""The main job: samplers on every GPU, a workload under the probe, step records out.

On a machine with GPUs it runs a real workload (``finetune`` or ``spiky``) under the step probe
with live NVML samplers. Without a GPU it runs the same pipeline on the replay backend: sampler
actors play captures recorded on an H200 and the step events recorded with them are sent again,
at their recorded times, through the probe's outbox — so the step records match the real run.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from collector.export.file_sd import TargetsRefresher, write_targets
from collector.export.values import nontorch_bytes
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

__all__ = ["JobOptions", "run_job"]

log = logging.getLogger(__name__)

GIB = 1 << 30
REPLAY_LEAD_S = 0.5  # lead between aligning replayed GPUs and the first replayed step


@dataclass
class JobOptions:
    backend: str = "auto"  # auto | nvml | replay
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
    workload_label: str = ""  # the `workload` label; default: the workload or the captures


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
        return BackendSpec("nvml"), (
            f"stepmem: live NVML backend, workload {opts.workload}, "
            f"sampling at {_rate(opts.rate_hz)}"
        )
    for name in opts.captures:  # fail here, in one line, not inside a sampler actor
        Capture.load(resolve_capture(name))
    caps = ", ".join(Path(c).name.removesuffix(".capture.parquet") for c in opts.captures)
    # Committed captures travel by name: each node's actors resolve them in their own install.
    spec = BackendSpec("replay", captures=list(opts.captures), gpus=opts.gpus, speed=opts.speed)
    why = "no GPU here" if opts.backend == "auto" else "asked for"
    return spec, (
        f"stepmem: REPLAY backend ({why}) — playing NVML captures recorded on a real "
        f"GPU, not this machine: {caps}; {spec.gpus or len(opts.captures)} simulated GPU(s) "
        f"per node at {opts.speed:g}x speed"
    )


def _rate(rate_hz: float) -> str:
    return "max rate" if rate_hz == 0 else f"{rate_hz:g} Hz"


def _init_ray(address: str | None) -> bool:
    """Connect to the cluster (``address``, else ``RAY_ADDRESS``), or start a local one on
    loopback. Returns True when this process started a local cluster."""
    import os

    if ray.is_initialized():
        return False
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, namespace="stepmem")
        return False
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        namespace="stepmem",
        configure_logging=False,
    )
    return True


def _replay_events(placed: list[PlacedSampler], spec: BackendSpec, steps: int | None, echo) -> int:
    """Send each simulated GPU's recorded events at their recorded times. Returns steps sent."""
    plan: list[tuple[int, dict[str, Any]]] = []
    for p in placed:
        cap = Capture.load(resolve_capture(spec.captures[p.info["index"] % len(spec.captures)]))
        origin, speed = p.info["replay_origin_ns"], p.info["replay_speed"]
        for ev in cap.events:
            if steps is not None and ev["step"] > steps:
                continue
            t = origin + int(ev["t_ns"] / speed)
            plan.append((t, {**ev, "t_ns": t, "gpu_uuid": p.gpu_uuid}))
    if not plan:
        raise RuntimeError("the replayed captures hold no step events")
    plan.sort(key=lambda x: x[0])
    outbox = Outbox(lambda uuid: find_sampler(uuid), batch_max=1, flush_interval_s=0.05)
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
    outbox.close()
    if outbox.dropped:
        echo(
            f"warning: {sum(outbox.dropped.values())} events could not be sent: "
            f"{dict(outbox.dropped)}"
        )
    return done


def _run_live(opts: JobOptions, echo) -> dict[str, Any]:
    from collector.probe.core import StepProbe

    probe = StepProbe()
    if opts.workload == "finetune":
        from workloads import finetune as wl
    elif opts.workload == "spiky":
        from workloads import spiky as wl
    else:
        raise ValueError(f"unknown workload {opts.workload!r} (finetune, spiky)")
    args = wl.parser().parse_args(opts.workload_args)
    if opts.workload == "finetune":
        args = wl.defaults(args)
    summary = wl.run(args, probe)
    probe.close()
    summary["probe_cost_ns"] = probe.cost_ns
    summary["probe_devices"] = [str(d) for d in probe.devices]
    summary["probe_dropped"] = dict(probe.outbox.dropped)
    echo(f"workload {opts.workload} done: {len(summary['step_times_s'])} steps")
    return summary


def run_job(opts: JobOptions, echo=print) -> list[StepRecord | dict[str, Any]]:
    spec, banner = choose_backend(opts)
    echo(banner)
    local = _init_ray(opts.ray_address)
    # A cluster this job started itself is a single machine: keep /metrics on loopback there.
    addr = opts.metrics_addr or ("127.0.0.1" if local else None)
    options = SamplerOptions(
        rate_hz=opts.rate_hz,
        run_id=opts.run_id,
        workload=opts.workload_label
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
    summary: dict[str, Any] = {}
    if spec.kind == "replay":
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
        _replay_events(placed, spec, opts.steps, echo)
    else:
        summary = _run_live(opts, echo)
    time.sleep(0.1)
    records = []
    for p in placed:
        records.extend(ray.get(p.handle.step_records.remote(flush=True), timeout=60))
    records.sort(key=lambda r: (r["gpu_uuid"], r["step"]))
    # Stop sampling, join what is pending and flush remote write on every sampler.
    health = ray.get([p.handle.stop.remote() for p in placed], timeout=60)
    if refresher is not None:
        refresher.stop()
        write_targets(opts.targets, [])  # the run is over: no stale targets left to alert on
    print_table(records, echo)
    if opts.out:
        doc = {
            "banner": banner,
            "records": records,
            "samplers": [p.info for p in placed],
            "health": health,
            "workload": summary,
        }
        opts.out.write_text(json.dumps(doc, indent=1))
        echo(f"step records written to {opts.out}")
    return records


def print_table(records: list[dict[str, Any]], echo=print) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="stepmem: memory per step (GiB)", show_lines=False)
    for col in (
        "gpu",
        "step",
        "s",
        "samples",
        "nvml peak",
        "nvml end",
        "alloc peak",
        "alloc end",
        "resv peak",
        "resv end",
        "non-torch",
        "opt state",
        "managed",
        "gap",
    ):
        table.add_column(col, justify="right")

    def g(v: Any) -> str:
        return "" if v is None else f"{v / GIB:.2f}"

    for r in records:
        te, led = r.get("torch_end") or {}, r.get("ledger") or {}
        table.add_row(
            r["gpu_uuid"][4:12],
            str(r["step"]),
            f"{(r['end_ns'] - r['begin_ns']) / 1e9:.2f}",
            str(r["samples"]),
            g(r["nvml_peak_bytes"]),
            g(r["nvml_end_bytes"]),
            g(r.get("torch_allocated_peak_bytes")),
            g(te.get("allocated_bytes.all.current")),
            g(r.get("torch_reserved_peak_bytes")),
            g(te.get("reserved_bytes.all.current")),
            g(nontorch_bytes(r)),
            g(led.get("optimizer_state")),
            g(led.get("optimizer_state_managed")),
            r.get("gap", ""),
        )
    console = Console(width=160)
    with console.capture() as cap:
        console.print(table)
    echo(cap.get().rstrip())
