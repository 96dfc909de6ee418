"""A local Ray cluster goes when the process that started it goes, even by SIGKILL.

``ray.init()`` starting a local cluster forks a GCS, a raylet, a dashboard, a log monitor and,
under the raylet, workers and two agents (DashboardAgent, RuntimeEnvAgent). When the driver is
killed (SIGKILL, the OOM killer) or interrupted inside Ray's own ``atexit`` shutdown, the agents
notice their raylet is gone but then wait on a GCS that is gone too: with Ray 2.60 two of them
stayed 65 s on a 2-core machine (90-150 s seen before), holding ports.

:func:`guard` marks the environment every one of those processes inherits with a token
(``STEPMEM_RAY_OWNER``; workers rename their command line, so the command line cannot be used)
and starts a small watcher in a session of its own. When the driver is gone, the watcher sends
SIGTERM to every process carrying the token, then SIGKILL after :data:`GRACE_S`. :func:`reap`
does the same in-process after a clean ``ray.shutdown()``. Linux only (``/proc``); elsewhere a
no-op.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

MARK = "STEPMEM_RAY_OWNER"
GRACE_S = 5.0  # SIGTERM → SIGKILL
POLL_S = 0.5  # how often the watcher looks for its driver


def guard() -> str | None:
    """Before ``ray.init`` starts a local cluster: mark the environment its processes inherit and
    start the watcher. Returns the token (None where /proc is missing)."""
    if not Path("/proc/self/environ").exists():
        return None
    token = f"{os.getpid()}-{secrets.token_hex(6)}"
    env = {k: v for k, v in os.environ.items() if k != MARK}  # the watcher does not reap itself
    subprocess.Popen(
        [sys.executable, "-m", "collector.reaper", str(os.getpid()), token],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the terminal's process group does not reach it
        close_fds=True,
    )
    os.environ[MARK] = token
    return token


def marked(token: str, mark: str = MARK) -> list[int]:
    """Live processes (not zombies) whose environment carries ``token`` (under ``mark``), this
    one excepted."""
    needle = f"{mark}={token}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z":
            pids.append(int(entry.name))
    return pids


def reap(
    token: str,
    grace_s: float = GRACE_S,
    settle_s: float = 1.0,
    most_s: float = 30.0,
    mark: str = MARK,
) -> int:
    """SIGTERM every process carrying ``token`` (under ``mark``), SIGKILL what is left after
    ``grace_s``; then look again until none has been seen for ``settle_s`` (at most
    ``most_s``): a raylet that was still dying can start its agents once more after the first
    sweep, and those must go too. Returns how many there were."""
    seen = set(marked(token, mark))
    for pid in seen:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and marked(token, mark):
        time.sleep(0.1)
    end = time.monotonic() + most_s
    quiet_since = time.monotonic()
    while time.monotonic() < end:
        left = marked(token, mark)
        if left:
            seen |= set(left)
            for pid in left:
                _signal(pid, signal.SIGKILL)
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= settle_s:
            break
        time.sleep(0.1)
    return len(seen)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):  # exited meanwhile
        os.kill(pid, sig)


def main(argv: list[str]) -> int:
    """The watcher: ``python -m collector.reaper DRIVER_PID TOKEN``."""
    driver, token = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.getppid() == driver:  # reparented: the driver is gone, however it went
        time.sleep(POLL_S)
    reap(token)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
