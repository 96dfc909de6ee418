"""A run's processes: a run killed with SIGKILL or interrupted three times leaves no Ray process
behind and no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector.store import RunStore
from tests.cli import start_run


def _start_slow_run(tmp_path):
    """A replayed run slow enough to be interrupted mid-way, in a session of its own (a Ctrl-C
    reaches its whole process group, as in a terminal); returns it once the store holds its
    first samples."""
    import os
    import subprocess

    proc = start_run(
        tmp_path,
        "cut",
        *("--speed", "0.05"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in the order written (unbuffered)
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    # the token the run's Ray processes inherited (the driver's own /proc environ shows only the
    # environment it was started with)
    marks = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != proc.pid:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        marks |= {v.split(b"=", 1)[1].decode() for v in environ if b"STEPMEM_RAY_OWNER=" in v}
    (token,) = marks
    return proc, token


def _ray_processes_gone(token, timeout_s):
    """Seconds until no process carries the run's reaper token (None: some were still there)."""
    import time

    from collector.reaper import marked

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not marked(token):
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


@pytest.mark.ray
def test_a_sigkilled_run_leaves_no_ray_process_behind(tmp_path, record_fault):
    import os
    import signal

    from collector.reaper import marked

    proc, token = _start_slow_run(tmp_path)
    assert len(marked(token)) >= 5  # GCS, raylet, dashboard pieces, agents, workers
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    # Ray alone left DashboardAgent and RuntimeEnvAgent for 65 s here (90-150 s seen before)
    gone = _ray_processes_gone(token, 30)
    assert gone is not None, [Path(f"/proc/{p}/cmdline").read_bytes() for p in marked(token)]
    store = RunStore(tmp_path / "runs" / "cut")
    assert store.meta["status"] == "running"  # unfinished, and what was flushed is kept
    # the run was killed once its first part was on disk (how many samples that part holds
    # depends on how busy the machine is): every flushed sample reads back
    assert sum(len(store.samples(u)) for u in store.gpus()) >= 1
    record_fault(
        "SIGKILL of a running `stepmem run` (local Ray cluster)",
        f"every Ray process of the run gone {gone:.1f} s later; the store keeps its flushed "
        "parts and reads as unfinished",
        seconds_to_no_orphans=round(gone, 1),
    )


@pytest.mark.ray
def test_three_ctrl_c_stop_the_run_once_without_a_traceback_or_orphans(tmp_path, record_fault):
    import os
    import signal
    import time

    proc, token = _start_slow_run(tmp_path)
    for _ in range(3):
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole process group
        time.sleep(0.3)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, rest
    assert "Traceback" not in rest and "Exception ignored" not in rest, rest
    assert "stepmem: already stopping" in rest and rest.rstrip().endswith("stepmem: interrupted")
    gone = _ray_processes_gone(token, 30)
    assert gone is not None
    store = RunStore(tmp_path / "runs" / "cut")
    assert store.meta["status"] == "interrupted"
    assert sum(len(store.samples(u)) for u in store.gpus()) > 100
    record_fault(
        "three Ctrl-C during `stepmem run`",
        "one stop: 'already stopping' for the 2nd and 3rd, exit 130, no traceback, store "
        f"status interrupted; no Ray process left {gone:.1f} s after exit",
        seconds_to_no_orphans=round(gone, 1),
    )
