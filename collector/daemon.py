"""Daemon mode: samplers that outlive jobs.

``stepmem daemon`` places detached sampler actors on every GPU node of a running cluster and
rescans every ``--rescan`` seconds, so nodes that join later get theirs (placement is idempotent:
an existing sampler is reused). They are named ``stepmem:daemon:<node>:<uuid>``; a job's probes
find them when their own job placed none. With ``--targets`` it keeps a Prometheus ``file_sd``
file current. ``stepmem daemon --stop`` removes the daemon's samplers (never a running job's)
and empties its targets file.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray

from collector.backends import BackendSpec
from collector.export.file_sd import infos_of, write_targets
from collector.lookup import DAEMON, NAMESPACE, list_samplers
from collector.model.settings import SamplerOptions
from collector.placement import PlacedSampler, launch_samplers

__all__ = ["run_daemon", "stop_daemon"]

log = logging.getLogger(__name__)


def scan(spec: BackendSpec, options: SamplerOptions, targets: Path | None) -> list[PlacedSampler]:
    """One pass: a detached sampler on every GPU of every alive node; targets rewritten."""
    placed = launch_samplers(spec, options, detached=True)
    if targets is not None:
        write_targets(targets, infos_of([p.handle for p in placed], timeout_s=10))
    return placed


def run_daemon(
    spec: BackendSpec,
    options: SamplerOptions,
    rescan_s: float = 30.0,
    targets: Path | None = None,
    duration_s: float | None = None,
    echo=print,
) -> int:
    """Scan now and every ``rescan_s`` until interrupted (or for ``duration_s``). Returns the
    number of samplers placed at the last scan. The samplers stay when this returns."""
    deadline = None if duration_s is None else time.monotonic() + duration_s
    known: set[str] = set()
    placed: list[PlacedSampler] = []
    while True:
        placed = scan(spec, options, targets)
        new = {p.name for p in placed} - known
        for name in sorted(new):
            echo(f"sampler {name}")
        known |= new
        if deadline is not None and time.monotonic() >= deadline:
            return len(placed)
        time.sleep(
            rescan_s if deadline is None else min(rescan_s, max(0.0, deadline - time.monotonic()))
        )


def stop_daemon(targets: Path | None = None, echo=print) -> int:
    """Kill every sampler of the daemon (a running job's own are left alone) and empty the
    targets file — ``targets``, and the one the daemon kept (its samplers remember it) when it
    is on this machine — so Prometheus stops scraping them. Returns how many were stopped."""
    names = list_samplers(DAEMON)
    files = {targets} if targets is not None else set()
    stopped = 0
    for name in names:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # gone meanwhile
            continue
        try:
            kept = ray.get(handle.info.remote(), timeout=10).targets
            if kept:
                files.add(Path(kept))
        except Exception:  # a sampler that does not answer is stopped all the same
            pass
        ray.kill(handle, no_restart=True)
        stopped += 1
        echo(f"stopped {name}")
    for path in files:
        if path.exists() or path == targets:
            write_targets(path, [])
            echo(f"emptied {path}")
    return stopped
