"""Recording captures on a real GPU: NVML at a fixed rate while a command runs.

The command's step probe writes its events to the file named by ``STEPMEM_EVENTS``; they are
stored in the capture with their times moved onto the capture's clock, so a replay plays the
steps together with the memory trace. NVML per-process snapshots are taken twice a second.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from collector.model.errors import StepmemError
from collector.model.settings import Rate
from collector.model.units import GIB
from collector.nvml import LiveBackend, NvmlError, NvmlNotFound
from collector.probe.core import EVENTS_ENV
from collector.replay import Capture, ReplayBackend, ReplayDevice
from collector.sampler import Sampler

__all__ = ["record"]

PROCESS_SNAPSHOT_S = 0.5  # a per-process snapshot this often, and at every step mark
MARK_POLL_S = 0.02  # how often the command's new step marks are looked for


class _MarkWatcher:
    """The newest step mark the recorded command appended to its events file since the last
    look, as ``[step, kind]`` (None: none new). Reads only what was appended."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.tail = path, 0, b""

    def new(self) -> list[Any] | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return None
        self.offset += len(chunk)
        lines = (self.tail + chunk).split(b"\n")
        self.tail = lines.pop()
        newest = None
        for line in lines:
            try:
                ev = json.loads(line)
                newest = [int(ev["step"]), str(ev["kind"])]
            except (ValueError, KeyError, TypeError):
                continue
        return newest


def _process_snapshot(device: Any, t0: int, at: list[Any] | None) -> dict[str, Any] | None:
    try:
        found = device.processes()
    except NvmlError:
        return None  # counted by the funnel; a capture without process lists is still a capture
    snap: dict[str, Any] = {
        "t_ns": time.monotonic_ns() - t0,
        "procs": [[p.pid, p.used_bytes, p.name] for p in found],
    }
    if at is not None:
        snap["at"] = at
    return snap


MAX_RING_BYTES = 4 << 30  # a capture's ring, at most (24 bytes a sample)


def _capacity(rate: Rate, seconds: float) -> int:
    """Ring samples for ``seconds`` at ``rate``; :class:`StepmemError` when that would take
    more memory than :data:`MAX_RING_BYTES`."""
    n = int(rate.samples_in(seconds) * 1.2) + 1024
    if 24 * n > MAX_RING_BYTES:
        raise StepmemError(
            f"stepmem capture: {seconds:g} s at {rate} needs {24 * n / GIB:.1f} GiB of "
            f"memory for its samples (at most {MAX_RING_BYTES >> 30} GiB); record for less "
            "time (--max-seconds, --duration) or at a lower --rate"
        )
    return n


def replayed_events(device: ReplayDevice, t0: int, t_last: int) -> list[dict[str, Any]]:
    """The step events a replayed GPU played between ``t0`` and ``t_last`` (monotonic), with
    ``t_ns`` relative to ``t0``: the first pass through its capture only (a looping replay
    repeats step numbers), and only steps whose begin and end both fell in the recording."""
    out = []
    for ev in device.capture.events:
        t = device.origin_ns + int(ev["t_ns"] / device.speed)
        if t0 <= t <= t_last:
            out.append({**ev, "t_ns": t - t0, "gpu_uuid": device.uuid})
    kinds: dict[int, set[str]] = {}
    for ev in out:
        kinds.setdefault(ev["step"], set()).add(ev["kind"])
    return [ev for ev in out if {"begin", "end"} <= kinds[ev["step"]]]


def _run_while_sampling(
    device: Any, t0: int, command: list[str] | None, seconds: float
) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]], bool]:
    """Run ``command`` (or wait ``seconds``) while the sampler runs; a command still running
    after ``seconds`` is terminated. Returns its exit code, the step events its probe wrote (on
    the sampler's clock, from ``t0``), the per-process snapshots taken at each step mark and
    every :data:`PROCESS_SNAPSHOT_S` between them, and whether Ctrl-C (or SIGTERM) cut it
    short: then the command is stopped and what was recorded until then is returned, to be
    kept."""
    procs: list[dict[str, Any]] = []
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="stepmem-capture-") as tmp:
        events_path = Path(tmp) / "events.jsonl"
        env = {**os.environ, EVENTS_ENV: str(events_path)}
        try:
            child = subprocess.Popen(command, env=env) if command else None
        except OSError as exc:
            raise StepmemError(
                f"stepmem capture: cannot run {command[0]!r}: {exc.strerror or exc}"
            ) from None
        deadline = time.monotonic() + seconds
        rc = 0
        marks = _MarkWatcher(events_path)
        next_snap = 0.0
        try:
            while time.monotonic() < deadline:
                at = marks.new()  # a step mark since the last look: a snapshot for it now
                if at is not None or time.monotonic() >= next_snap:
                    snap = _process_snapshot(device, t0, at)
                    if snap is not None:
                        procs.append(snap)
                    next_snap = time.monotonic() + PROCESS_SNAPSHOT_S
                if child is not None and child.poll() is not None:
                    rc = child.returncode
                    break
                time.sleep(MARK_POLL_S)
            else:
                if child is not None:
                    child.terminate()
                    rc = child.wait()
        except KeyboardInterrupt:
            interrupted = True
            if child is not None and child.poll() is None:
                child.terminate()
                try:
                    rc = child.wait(10)
                except subprocess.TimeoutExpired:
                    child.kill()
                    rc = child.wait()
        if not interrupted:
            time.sleep(0.2)  # the tail after the command exits
        events = []
        if events_path.exists():
            for line in events_path.read_text().splitlines():
                try:
                    ev = json.loads(line)
                    ev["t_ns"] -= t0
                except (ValueError, TypeError, KeyError):  # a line cut by the stop
                    continue
                events.append(ev)
    return rc, events, procs, interrupted


def _trim_and_rebase(
    w: Any,
    events: list[dict[str, Any]],
    procs: list[dict[str, Any]],
    t0: int,
    trim_s: float | None,
) -> Any:
    """Keep the samples (and snapshots) from ``trim_s`` before the first step event to ``trim_s``
    after the last (all of them when ``trim_s`` is None), and move events and snapshots from the
    sampler's origin ``t0`` onto the first kept sample (in place). Returns the kept samples."""
    if trim_s is not None and events:
        lo = min(ev["t_ns"] for ev in events) + t0 - int(trim_s * 1e9)
        hi = max(ev["t_ns"] for ev in events) + t0 + int(trim_s * 1e9)
        keep = (w.t_ns >= lo) & (w.t_ns <= hi)
        w = type(w)(w.t_ns[keep], w.used[keep], w.reserved[keep])
        procs[:] = [p for p in procs if lo <= p["t_ns"] + t0 <= hi]
    first = int(w.t_ns[0])
    for ev in events:  # events are on the sampler's clock origin t0; rebase onto the first sample
        ev["t_ns"] -= first - t0
    for snap in procs:
        snap["t_ns"] -= first - t0
    return w


def record(
    out: Path,
    uuid: str | None,
    rate: Rate,
    command: list[str] | None,
    duration_s: float | None,
    max_s: float = 600.0,
    trim_s: float | None = None,
    notes: dict[str, Any] | None = None,
    backend: LiveBackend | ReplayBackend | None = None,
    echo=print,
) -> Capture:
    """Sample one GPU while ``command`` runs (or for ``duration_s``) and save a capture.

    The ring is sized for ``max_s`` seconds at ``rate`` (24 bytes a sample); a command still
    running after ``max_s`` is terminated. ``trim_s`` keeps only the samples from ``trim_s``
    before the first step event to ``trim_s`` after the last (for compact ``max``-rate captures).
    ``backend`` defaults to live NVML; a :class:`ReplayBackend` resamples a capture (at another
    rate, say, to see what a slower sampler would have caught).
    """
    backend = backend or LiveBackend()
    infos = {d.uuid: d for d in backend.devices()}
    if uuid is None:
        uuid = next(iter(infos))
    if uuid not in infos:
        raise NvmlNotFound(f"no GPU with UUID {uuid} on this node (have: {', '.join(infos)})")
    seconds = max_s if command is not None or duration_s is None else min(duration_s, max_s)
    capacity = _capacity(rate, seconds)
    device = backend.open(uuid)
    sampler = Sampler(device, rate, capacity=capacity)
    sampler.start()
    t0 = sampler.started_ns
    rc, events, procs, interrupted = _run_while_sampling(device, t0, command, seconds)
    sampler.stop()
    w = sampler.ring.snapshot()
    if not events and isinstance(device, ReplayDevice):
        events = replayed_events(device, t0, int(w.t_ns[-1]) if len(w) else t0)
    if w.lost or sampler.ring.count > sampler.ring.capacity:
        echo(f"warning: the ring overran; the capture keeps the last {len(w)} samples")
    w = _trim_and_rebase(w, events, procs, t0, trim_s)
    info = infos[uuid]
    cap = Capture(
        t_ns=(w.t_ns - w.t_ns[0]).astype(np.int64),
        used=w.used,
        reserved=w.reserved,
        device={
            "uuid": info.uuid,
            "index": info.index,
            "name": info.name,
            "total_bytes": info.total_bytes,
            "driver": info.driver,
            "memory_info_version": device.memory_info_version,
            "backend": device.backend,
        },
        rate_hz=rate.hz,
        command="stepmem capture " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        recorded_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        processes=procs,
        events=events,
        notes={
            "returncode": rc,
            "samples": len(w),
            "errors": dict(sampler.errors),
            "missed_deadlines": sampler.missed,
            **({"interrupted": True} if interrupted else {}),
            **(notes or {}),
        },
    )
    cap.save(out)
    span = (w.t_ns[-1] - w.t_ns[0]) / 1e9
    echo(
        f"captured {len(w)} samples over {span:.1f} s ({len(w) / max(span, 1e-9):.0f} Hz), "
        f"{len(events)} step events, command exit {rc} -> {out}"
        + (" (interrupted: what was recorded until then is kept)" if interrupted else "")
    )
    if interrupted:
        raise KeyboardInterrupt
    return cap
