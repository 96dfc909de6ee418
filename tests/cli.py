"""The ``stepmem`` command as the tests run it: in a process of its own, and its one-line
errors (exit 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# sets a signal's disposition or a resource limit, then becomes the command (exec keeps both)
_LAUNCH = (
    "import os, resource, signal, sys\n"
    "sig, fsize, *cmd = sys.argv[1:]\n"
    "if sig: signal.signal(signal.SIGINT, getattr(signal, sig))\n"
    "if fsize: resource.setrlimit(resource.RLIMIT_FSIZE, (int(fsize), int(fsize)))\n"
    "os.execv(cmd[0], cmd)\n"
)


def launched(cmd: list[str], *, sigint: str = "", fsize: int | None = None) -> list[str]:
    """``cmd`` started with SIGINT set to ``sigint`` ("SIG_IGN", "SIG_DFL") and/or a file-size
    limit, by a small launcher that then execs it — never ``preexec_fn``: that forks the test
    process, a Ray driver whose gRPC threads do not survive a fork (after Ray Train had run, the
    session cluster's GCS calls then hung: ray.nodes() never answered)."""
    return [sys.executable, "-c", _LAUNCH, sigint, str(fsize or ""), *cmd]


def stepmem(*args, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "collector.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_run(tmp_path, run_id, *args, sigint: str = "", **popen):
    """`stepmem run ARGS` in a process of its own (SIGINT set to ``sigint`` where given), its
    store in tmp_path/runs/RUN_ID; returned once that store holds its first samples (at most
    120 s)."""
    import time

    runs = tmp_path / "runs"
    store = ("--store", str(runs), "--run-id", run_id)
    cmd = [sys.executable, "-m", "collector.cli", "run", *args, *store]
    proc = subprocess.Popen(launched(cmd, sigint=sigint) if sigint else cmd, text=True, **popen)
    deadline = time.monotonic() + 120
    while not list((runs / run_id / "samples").glob("*/part-*")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no samples in the run store within 120 s: {proc.communicate()}")
        time.sleep(0.2)
    return proc


def one_line_error(res, *needles):
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def bad_input(record_fault, args, res, *needles, intact: str = "nothing written"):
    """One line, exit 2, no traceback; the row names the input, the line and what stayed intact."""
    line = one_line_error(res, *needles)
    record_fault(f"bad input: stepmem {' '.join(args)}", f"{line} — {intact}")
    return line
