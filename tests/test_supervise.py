"""The training command's keeper (:mod:`collector.supervise`): the command and every process
it started end with the job — asked (SIGTERM) or killed outright (SIGKILL: the kernel's
parent-death signal) — and its exit status passes through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from collector.supervise import supervised

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")

# the command: starts a grandchild (as torchrun and mp.spawn do), writes both pids, sleeps
COMMAND = textwrap.dedent(
    """
    import subprocess, sys, time
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1], "w").write(f"{__import__('os').getpid()} {kid.pid}")
    time.sleep(600)
    """
)

# the job: runs the command under its keeper the way CommandRunner does, then waits
JOB = textwrap.dedent(
    """
    import subprocess, sys
    from collector.supervise import supervised
    child = subprocess.Popen(supervised(sys.argv[1:]))
    print(child.pid, flush=True)
    child.wait()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has ended: only its parent has not read its status yet
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _wait_for(cond, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _pids(path: Path) -> list[int]:
    assert _wait_for(lambda: path.exists() and path.read_text().strip()), "command never started"
    return [int(x) for x in path.read_text().split()]


def test_a_killed_job_takes_its_command_and_the_commands_children_with_it(tmp_path, record_fault):
    script, pids = tmp_path / "cmd.py", tmp_path / "pids"
    script.write_text(COMMAND)
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, sys.executable, str(script), str(pids)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    keeper = int(job.stdout.readline())
    cmd, grandchild = _pids(pids)
    job.kill()  # SIGKILL: no handler runs in the job
    job.wait()
    t0 = time.monotonic()
    assert _wait_for(lambda: not any(map(_alive, (keeper, cmd, grandchild)))), (
        "the command outlived its job"
    )
    record_fault(
        "SIGKILL of a `--command` job while its command (and a process the command started) runs",
        "the keeper, the command and its child end with the job (PR_SET_PDEATHSIG, then the "
        "command's process group): nothing writes step events for a dead run",
        seconds_to_gone=round(time.monotonic() - t0, 2),
    )


def test_asked_to_stop_the_keeper_ends_the_group_and_says_how(tmp_path):
    script, pids = tmp_path / "cmd.py", tmp_path / "pids"
    script.write_text(COMMAND)
    keeper = subprocess.Popen(supervised([sys.executable, str(script), str(pids)]))
    cmd, grandchild = _pids(pids)
    keeper.send_signal(signal.SIGTERM)
    assert keeper.wait(30) == 128 + signal.SIGTERM
    assert _wait_for(lambda: not _alive(cmd) and not _alive(grandchild))


def test_the_commands_exit_status_passes_through():
    ok = subprocess.run(supervised([sys.executable, "-c", "raise SystemExit(3)"]), timeout=60)
    assert ok.returncode == 3
    killed = subprocess.run(
        supervised([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"]),
        timeout=60,
    )
    assert killed.returncode == 128 + 9
    missing = subprocess.run(
        supervised(["/nonexistent/train"]), capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 127 and "cannot run '/nonexistent/train'" in missing.stderr
