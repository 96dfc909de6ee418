"""Driving replayed samplers from a test: their capture's recorded step events sent at their
times on the replay's clock."""

from __future__ import annotations

import time

import ray

from collector.replay import Capture


def replay_steps(placed, cap: Capture, steps: int, speed: float) -> None:
    """Start the samplers' replay 0.3 s from now and send the capture's recorded step events of
    the first `steps` steps at their times on that replay clock."""
    first = min(e["t_ns"] for e in cap.events)
    origin = time.monotonic_ns() + 300_000_000 - int(first / speed)
    ray.get([p.handle.replay_from.remote(origin) for p in placed])
    plan = []
    for e in cap.events:
        if e["step"] <= steps:
            plan.append(dict(e, t_ns=origin + int(e["t_ns"] / speed)))
    for e in sorted(plan, key=lambda e: e["t_ns"]):
        delay = (e["t_ns"] - time.monotonic_ns()) / 1e9
        if delay > 0:
            time.sleep(delay)
        for p in placed:
            p.handle.record_events.remote([dict(e, gpu_uuid=p.gpu_uuid)])
