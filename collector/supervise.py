"""The training command's keeper: ``python -m collector.supervise JOB_PID CMD…`` runs CMD in a
process group of its own and ends that whole group — the command and every process it started
(torchrun's ranks, ``torch.multiprocessing.spawn``'s children) — when it is asked to (SIGTERM,
SIGINT: the job stopping) or when the job that started it dies without asking (SIGKILL, the OOM
killer): on Linux the kernel tells it then (``PR_SET_PDEATHSIG``). Without it a SIGKILLed
``stepmem run --command`` left its command running and writing step events for nobody.

It imports nothing of stepmem and nothing heavy: it starts in the time of a bare interpreter.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["GRACE_S", "main", "supervised"]

GRACE_S = 10.0  # SIGTERM first; SIGKILL what is left after this
PR_SET_PDEATHSIG = 1


def supervised(cmd: list[str]) -> list[str]:
    """CMD run under the keeper, for :class:`subprocess.Popen` in the job's process."""
    return [sys.executable, "-m", "collector.supervise", str(os.getpid()), *cmd]


def _die_with_parent(sig: int) -> bool:
    """Ask the kernel for ``sig`` when the parent dies (Linux); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _end_group(pgid: int, first: int = signal.SIGTERM) -> None:
    """``first`` (the signal the keeper got: Ctrl-C's SIGINT reaches the command as SIGINT) to
    the command's whole group; SIGKILL to it after :data:`GRACE_S`."""
    for sig, wait in ((first, GRACE_S), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            # the group, not child.poll(): inside child.wait() (a signal handler) poll() cannot
            # take the wait lock and says "running"; an unreaped child is a zombie, ended
            if not _group_alive(pgid):
                return
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. A zombie has ended (an orphan's, in a
    container whose init does not reap, stays one): on Linux ``/proc`` tells them apart."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while read
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m collector.supervise JOB_PID CMD…", file=sys.stderr)
        return 2
    job = int(argv[0])
    _die_with_parent(signal.SIGTERM)
    if os.getppid() != job:  # the job died before the request took: nobody to report to
        return 128 + signal.SIGTERM
    try:
        child = subprocess.Popen(argv[1:], start_new_session=True)
    except OSError as exc:
        print(f"cannot run {argv[1]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)
        _end_group(child.pid, signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    rc = child.wait()
    if _group_alive(child.pid):  # what the command left running would write for nobody
        _end_group(child.pid)
    if stopping:
        return 128 + stopping[0]
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
