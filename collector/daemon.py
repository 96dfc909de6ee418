"""Daemon mode: samplers that outlive jobs.

``stepmem daemon`` places detached sampler actors on every GPU node of a running cluster and
rescans every ``--rescan`` seconds, so nodes that join later get theirs (placement is idempotent:
an existing sampler is reused). They are named ``stepmem:daemon:<node>:<uuid>``; a job's probes
find them when their own job placed none. With ``--targets`` it keeps a Prometheus ``file_sd``
file current. ``stepmem daemon --stop`` stops a running daemon first (through the cluster's
key-value store: the daemon looks every half second and ends; else its next rescan would place
them again), then removes the daemon's samplers (never a running job's) and empties its targets
file.
"""

from __future__ import annotations

import json
import logging
import os
import socket
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

RUNNING_KEY = "daemon:running"  # {"pid", "host", "since"} of the daemon that runs
STOP_KEY = "daemon:stop"  # set by --stop: the running daemon ends at its next look
LOOK_S = 0.5  # how often a sleeping daemon looks for a stop
STOP_WAIT_S = 10.0  # how long --stop waits for the daemon to end


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


def _get(key: str) -> bytes | None:
    return _kv()._internal_kv_get(key, namespace=NAMESPACE)


def _stop_asked() -> bool:
    return bool(_kv()._internal_kv_exists(STOP_KEY, namespace=NAMESPACE))


def _sleep(seconds: float) -> bool:
    """Sleep ``seconds``, looking for a stop; True when one was asked."""
    end = time.monotonic() + seconds
    while True:
        if _stop_asked():
            return True
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(LOOK_S, left))


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
    kv = _kv()
    kv._internal_kv_del(STOP_KEY, namespace=NAMESPACE)  # a daemon that starts starts afresh
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    kv._internal_kv_put(RUNNING_KEY, json.dumps(me), namespace=NAMESPACE)
    try:
        while True:
            placed = scan(spec, options, targets)
            new = {p.name for p in placed} - known
            for name in sorted(new):
                echo(f"sampler {name}")
            known |= new
            if deadline is not None and time.monotonic() >= deadline:
                return len(placed)
            wait = rescan_s if deadline is None else max(0.0, deadline - time.monotonic())
            if _sleep(min(rescan_s, wait)):
                echo("stepmem daemon: stopped by `stepmem daemon --stop`")
                return len(placed)
    finally:
        try:  # only our own mark: a daemon started since has its own
            mine = _get(RUNNING_KEY)
            if mine is not None and json.loads(mine).get("pid") == me["pid"]:
                kv._internal_kv_del(RUNNING_KEY, namespace=NAMESPACE)
        except Exception:  # the cluster went away: nothing to clear
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_running(echo) -> None:
    """Ask a running daemon to end, and wait up to :data:`STOP_WAIT_S` for it to."""
    raw = _get(RUNNING_KEY)
    if raw is None:
        return
    try:
        who = json.loads(raw)
        pid, host = int(who["pid"]), str(who["host"])[:64]
        name = f"pid {pid} on {host}"
    except (ValueError, KeyError, TypeError):
        pid, host, name = 0, "", "of unknown pid"
    if host == socket.gethostname() and pid > 0 and not _alive(pid):  # killed: its mark stayed
        _kv()._internal_kv_del(RUNNING_KEY, namespace=NAMESPACE)
        return
    _kv()._internal_kv_put(STOP_KEY, str(time.time_ns()), namespace=NAMESPACE)
    end = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < end:
        if _get(RUNNING_KEY) is None:
            echo(f"stopped the running daemon ({name})")
            return
        time.sleep(0.1)
    echo(
        f"stepmem daemon: a daemon ({name}) did not end within {STOP_WAIT_S:.0f} s: if it "
        "still runs it will place its samplers again (stop that process)"
    )


def stop_daemon(targets: Path | None = None, echo=print) -> int:
    """Kill every sampler of the daemon (a running job's own are left alone) and empty the
    targets file — ``targets``, and the one the daemon kept (its samplers remember it) when it
    is on this machine — so Prometheus stops scraping them. A running daemon is stopped first
    (it would place them again at its next rescan). Returns how many samplers were stopped."""
    _stop_running(echo)
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
