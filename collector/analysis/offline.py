"""A capture's steps, joined here: the capture's own NVML samples and the probe's step events
recorded with it go through the sampler's join (:class:`collector.sampler.StepJoiner` over a
:class:`collector.sampler.RingBuffer` holding every captured sample, per-process readings from
the capture's snapshots), with no Ray cluster and no clock: what a replay whose sampler kept up
with every sample gives. ``stepmem report X.capture.parquet`` reads a capture this way.
"""

from __future__ import annotations

from pathlib import Path

from collector.join import StepJoiner
from collector.model.records import DeviceInfo, SamplerInfo, StepEvent
from collector.model.step import ProcessesReading, StepRecord
from collector.procwatch import as_reading
from collector.replay import Capture, ReplayDevice
from collector.replay_driver import numbered
from collector.sampler import Sampler

__all__ = ["records_from_capture"]

_NEVER = 1 << 62  # the join's clock: no event of a capture lies in its future


def records_from_capture(cap: Capture) -> list[StepRecord]:
    """Every step of ``cap`` joined with its samples, in the order the steps ran."""
    info = DeviceInfo(
        uuid=str(cap.device["uuid"]),
        index=int(cap.device.get("index", 0)),
        name=str(cap.device.get("name", "")),
        total_bytes=cap.total_bytes,
    )
    device = ReplayDevice(cap, info, origin_ns=0, speed=1.0, loop=False)
    sampler = Sampler(device, rate=cap.rate_hz or 1000.0, capacity=max(2, len(cap.t_ns)))
    for t, used, reserved in zip(
        cap.t_ns.tolist(), cap.used.tolist(), cap.reserved.tolist(), strict=True
    ):
        sampler.ring.append(t, used, reserved)

    def processes(rec: StepRecord) -> ProcessesReading | None:
        if not cap.processes:
            return None
        t, used, procs = device.processes_reading(rec.end_ns)
        return as_reading(t, used, procs)

    joiner = StepJoiner(sampler, processes=processes, clock=lambda: _NEVER)
    for ev in numbered(cap.events):
        joiner.add(StepEvent.from_dict({**ev, "gpu_uuid": info.uuid}))
    return sorted(joiner.poll(force=True), key=lambda r: (r.begin_ns, r.pid))


def capture_run_meta(path: Path, cap: Capture) -> dict:
    """The run metadata a report of a capture shows."""
    span = int(cap.t_ns[-1] - cap.t_ns[0]) if len(cap.t_ns) > 1 else 0
    achieved = (len(cap.t_ns) - 1) * 1e9 / span if span else 0.0
    rate = f"{cap.rate_hz:g} Hz" if cap.rate_hz else f"--rate max: {achieved:,.0f} Hz recorded"
    return {
        "banner": (
            f"capture {path.name}: its NVML samples and step events joined here, as a replay "
            f"whose sampler kept every sample would ({rate}; recorded by: {cap.command[:120]})"
        ),
        "status": "complete",
        "samplers": [
            SamplerInfo(
                gpu_uuid=str(cap.device["uuid"]),
                node_id="capture",
                index=int(cap.device.get("index", 0)),
                total_bytes=cap.total_bytes,
                name=str(cap.device.get("name", "")),
            )
        ],
    }
