"""Playing the recorded step events of replayed GPUs, in time with their NVML traces.

The samplers of a replay run each play a capture (GPU ``k`` of a node plays capture
``k % len(captures)``, :meth:`collector.replay.ReplayBackend.capture_for`). Once they all run,
:meth:`ReplayDriver.align` restarts every one so that the first recorded step starts
:data:`REPLAY_LEAD_S` seconds from now; :meth:`ReplayDriver.play` then sends each GPU's recorded
events at their recorded times (scaled by the speed), so the step records match the real run's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray

from collector.model.errors import StepmemError
from collector.model.records import StepEvent

if TYPE_CHECKING:
    from collector.backends import BackendSpec
    from collector.placement import PlacedSampler
    from collector.probe.outbox import Outbox

__all__ = ["REPLAY_LEAD_S", "ReplayDriver"]

REPLAY_LEAD_S = 0.5  # lead between aligning replayed GPUs and the first replayed step


def numbered(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A capture's events in time order, each with the ``seq`` of its step: the capture's own
    (a probe that wrote it), else 1, 2, … in the order steps begin per process (captures
    recorded before ``seq`` existed), so a replay keys its steps as a live run does — also on a
    sampler that Ray restarted mid-replay."""
    out, count, current = [], {}, {}
    for ev in sorted(events, key=lambda e: e["t_ns"]):
        pid = ev.get("pid", 0)
        if not ev.get("seq"):
            if ev["kind"] == "begin":
                count[pid] = count.get(pid, 0) + 1
                current[pid] = count[pid]
            ev = {**ev, "seq": current.get(pid, 0)}
        out.append(ev)
    return [e for e in out if e["seq"]]


class ReplayDriver:
    """Alignment and playback for the replayed GPUs ``placed`` (launched with ``spec``);
    ``steps`` plays steps 1..steps only (None: every recorded step)."""

    def __init__(self, spec: BackendSpec, placed: list[PlacedSampler], steps: int | None) -> None:
        self.spec, self.placed, self.steps = spec, placed, steps
        self.origin_ns: int | None = None
        backends = {n: spec.build(n) for n in {p.node_id for p in placed}}
        # each GPU's capture, as its sampler plays it (by UUID on its node)
        self.captures = {p.gpu_uuid: backends[p.node_id].capture_for(p.gpu_uuid) for p in placed}

    def align(self) -> int:
        """Restart playback on every replayed GPU so its capture time 0 falls at one monotonic
        origin, chosen so the first recorded step starts in :data:`REPLAY_LEAD_S`. Returns it.
        Each capture plays once: after its end the GPU holds its last value (looping would
        start the recorded process over right after its last step, and the sample after that
        step's end mark would be the capture's first)."""
        first = min(
            (min((e["t_ns"] for e in c.events), default=0) for c in self.captures.values()),
            default=0,
        )
        origin = time.monotonic_ns() + int(REPLAY_LEAD_S * 1e9) - int(first / self.spec.speed)
        ray.get([p.handle.replay_from.remote(origin, loop=False) for p in self.placed], timeout=60)
        self.origin_ns = origin
        return origin

    def plan(self) -> list[tuple[int, dict[str, Any]]]:
        """(monotonic time, event) for every event to send, in time order."""
        if self.origin_ns is None:
            raise RuntimeError("align() first: the plan is on the aligned clock")
        plan = []
        for p in self.placed:
            for ev in numbered(self.captures[p.gpu_uuid].events):
                if self.steps is not None and ev["seq"] > self.steps:
                    continue
                t = self.origin_ns + int(ev["t_ns"] / self.spec.speed)
                plan.append((t, {**ev, "t_ns": t, "gpu_uuid": p.gpu_uuid}))
        plan.sort(key=lambda x: x[0])
        return plan

    def play(self, outbox: Outbox, echo) -> int:
        """Send the plan at its times. Returns the number of step ends sent."""
        held = {}
        for c in self.captures.values():
            held[c.name] = max((e["seq"] for e in numbered(c.events)), default=0)
        if self.steps is not None and self.steps > max(held.values(), default=0):
            echo(
                f"note: --steps {self.steps}, but the capture(s) hold "
                + ", ".join(f"{n} steps ({name})" for name, n in held.items())
                + ": every recorded step is played"
            )
        plan = self.plan()
        if not plan:
            raise StepmemError("the replayed captures hold no step events")
        done = 0
        for t, ev in plan:
            delay = (t - time.monotonic_ns()) / 1e9
            if delay > 0:
                time.sleep(delay)
            outbox.put(StepEvent.from_dict(ev))
            outbox.maybe_flush()
            if ev["kind"] == "end":
                done += 1
                if done % max(1, len(self.placed)) == 0:
                    echo(f"  replayed step {ev['step']}")
        outbox.flush()
        if outbox.dropped:
            echo(
                f"warning: {sum(outbox.dropped.values())} events could not be sent: "
                f"{dict(outbox.dropped)}"
            )
        return done
