"""The user's path end to end: `ray start --head` (CPU, loopback), `ray job submit` of a tiny
replayed run, a real Prometheus scraping the samplers through the job's file_sd file; and
`ray job stop` on a second run leaving a readable store."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from collector.analysis.runs import load_run
from tests.prom import Prometheus, free_port, require

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.ray


def _ray_bin() -> str:
    exe = Path(sys.executable).parent / "ray"
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head of its own (not the session's ray.init cluster): `ray start --head --block`
    on loopback with its own ports and temp dir, stopped by signal (never `ray stop`, which
    would stop every Ray cluster on the machine)."""
    temp = tempfile.mkdtemp(prefix="rayh")  # short: Ray's socket paths live under it
    dash = free_port()
    env = {
        **os.environ,
        # as with an activated virtual environment: `python` in an entrypoint is this one
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep the node on 127.0.0.1
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_JOB_STOP_WAIT_TIME_S": "30",  # `ray job stop`: time to flush before SIGKILL
    }
    ports = {
        "--port": free_port(),
        "--dashboard-port": dash,
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--metrics-export-port": free_port(),
        "--runtime-env-agent-port": free_port(),
        "--ray-client-server-port": free_port(),
    }
    log = open(Path(temp) / "ray-start.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            _ray_bin(),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=4",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
            *(f"{k}={v}" for k, v in ports.items()),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            r = _ray(["job", "list", "--address", address], env, timeout=30, check=False)
            if r.returncode == 0:
                break
            assert proc.poll() is None, (Path(temp) / "ray-start.log").read_text()[-2000:]
            time.sleep(1)
        else:
            pytest.fail("the Ray head's job server did not answer within 90 s")
        yield address, env, f"127.0.0.1:{ports['--port']}"
    finally:
        # --block: the head stops its processes on SIGINT; one that does not within 10 s (a
        # loaded machine) gets SIGTERM, then SIGKILL — its session's processes all go with it
        for sig, grace in ((signal.SIGINT, 10), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(grace)
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
        # `ray start` names its head in /tmp/ray/ray_current_cluster, and a stopped head stays
        # there: a later bare `ray.init()` on this machine would wait for it.
        current = Path("/tmp/ray/ray_current_cluster")
        if current.exists() and current.read_text().strip() == f"127.0.0.1:{ports['--port']}":
            current.unlink()


def _ray(args, env, timeout=120, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [_ray_bin(), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _submit(address, env, job_args, no_wait=False) -> subprocess.CompletedProcess:
    return _ray(
        [
            "job",
            "submit",
            "--address",
            address,
            "--working-dir",
            ".",
            *(["--no-wait"] if no_wait else []),
            "--",
            "python",
            "-m",
            "collector.job",
            "--backend",
            "replay",
            "--metrics-addr",
            "127.0.0.1",
            *job_args,
        ],
        env,
        timeout=300,
        check=False,
    )


def _job_id(r: subprocess.CompletedProcess) -> str:
    return next(
        w.strip("'\"")
        for w in (r.stdout + r.stderr).split()
        if w.strip("'\"").startswith("raysubmit_")
    )


def _wait_status(address, env, job_id, word: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    status = ""
    while time.monotonic() < deadline:
        status = _ray(["job", "status", "--address", address, job_id], env).stdout
        if word in status:
            break
        time.sleep(1)
    return status


def test_ray_job_submit_runs_samplers_a_store_a_report_and_is_scraped(ray_head, tmp_path):
    address, env, _ = ray_head
    require("prometheus")
    prom = Prometheus(tmp_path / "prom").start()
    try:
        store = tmp_path / "runs"
        # Replayed at half speed the run lasts about 15 s: Prometheus passes newly discovered
        # targets to its scrapers at most every 5 s, and the job clears its targets at the end.
        r = _submit(
            address,
            env,
            [
                "--capture",
                "adamw_8bit",
                "--gpus",
                "2",
                "--speed",
                "0.5",
                "--steps",
                "4",
                "--run-id",
                "ci-submit",
                "--store",
                str(store),
                "--targets",
                str(prom.targets / "ci-submit.json"),
            ],
            no_wait=True,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        job_id = _job_id(r)
        # While the job runs, Prometheus scrapes both samplers through the file the job keeps.
        query = (
            'count by (gpu_uuid) (last_over_time(stepmem_nvml_used_bytes{run="ci-submit"}[10m]))'
        )
        scraped: set[str] = set()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and len(scraped) < 2:
            scraped = {x["metric"]["gpu_uuid"] for x in prom.query(query)}
            status = _ray(["job", "status", "--address", address, job_id], env).stdout
            if any(w in status for w in ("SUCCEEDED", "FAILED", "STOPPED", "succeeded", "failed")):
                scraped = {x["metric"]["gpu_uuid"] for x in prom.query(query)}
                break
            time.sleep(0.5)
        status = _wait_status(address, env, job_id, "succeeded", 180)
        logs = _ray(["job", "logs", "--address", address, job_id], env).stdout
        assert "succeeded" in status, status + logs[-4000:]
        assert logs.count("sampler stepmem:") == 2  # one per simulated GPU
        assert "Verdict" in logs and "Step 1→2: torch reserved at step end +12.65 GiB" in (
            " ".join(logs.split())
        )
        run = load_run(store / "ci-submit")
        assert run.meta["status"] == "complete" and len(run.gpus) == 2
        assert {len(run.by_gpu[u]) for u in run.gpus} == {4}
        assert scraped == set(run.gpus), (scraped, (prom.workdir / "prometheus.log").read_text())
        steps = prom.query('max_over_time(stepmem_step{run="ci-submit"}[10m])')
        assert steps and max(float(x["value"][1]) for x in steps) >= 1
        assert json.loads((prom.targets / "ci-submit.json").read_text()) == []  # cleared at end
    finally:
        prom.stop()


def test_ray_job_stop_leaves_a_complete_readable_store(ray_head, tmp_path, record_fault):
    address, env, _ = ray_head
    store = tmp_path / "runs"
    r = _submit(
        address,
        env,
        ["--capture", "adamw_8bit", "--run-id", "ci-stop", "--store", str(store)],
        no_wait=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = _job_id(r)
    steps = store / "ci-stop" / "steps"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (steps.is_dir() and any(steps.glob("*.parquet"))):
        time.sleep(0.5)
    assert any(steps.glob("*.parquet")), "the run stored no step before it was stopped"
    _ray(["job", "stop", "--address", address, job_id], env, timeout=120)
    status = _wait_status(address, env, job_id, "was stopped", 60)
    assert "was stopped" in status, status
    run = load_run(store / "ci-stop")
    assert run.meta["status"] == "interrupted"
    (uuid,) = run.gpus
    assert 1 <= len(run.by_gpu[uuid]) < 5  # the capture holds 5 steps; it stopped before the end
    report = subprocess.run(
        [sys.executable, "-m", "collector.cli", "report", str(store / "ci-stop")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0 and "Verdict" in report.stdout, report.stderr
    record_fault(
        "`ray job stop` on a submitted run",
        "the job ends STOPPED; the run store is complete with status interrupted; "
        "`stepmem report` reads it",
        steps_stored=len(run.by_gpu[uuid]),
        samples_lost=run.meta.get("samples_lost"),
    )


def test_a_daemon_given_a_loopback_address_keeps_it_and_stops_on_sigterm(
    ray_head, tmp_path, record_fault
):
    """`RAY_ADDRESS=127.0.0.1:PORT stepmem daemon` in a plain shell (without
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER): Ray used to swap 127.0.0.1 for the machine's outward
    address, wait there for a node that never answers and ignore SIGTERM meanwhile."""
    _, env, gcs = ray_head
    env = {k: v for k, v in env.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    targets = tmp_path / "targets.json"
    daemon = [sys.executable, "-m", "collector.cli", "daemon"]
    proc = subprocess.Popen(
        [
            *daemon,
            "--backend",
            "replay",
            "--gpus",
            "1",
            "--rescan",
            "1",
            "--metrics-addr",
            "127.0.0.1",
            "--targets",
            str(targets),
        ],
        env={**env, "RAY_ADDRESS": gcs},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not (targets.exists() and json.loads(targets.read_text() or "[]")):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("no loopback target within 90 s:\n" + proc.communicate()[0][-3000:])
            time.sleep(0.5)
        (group,) = json.loads(targets.read_text())
        assert all(t.startswith("127.0.0.1:") for t in group["targets"]), group
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)  # a daemon that ignores SIGTERM fails here
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "stepmem daemon: stopped; its samplers stay" in out
    stop = subprocess.run(
        [*daemon, "--stop", "--address", gcs],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stop.returncode == 0 and "1 samplers stopped" in stop.stdout, stop.stdout + stop.stderr
    record_fault(
        "RAY_ADDRESS=127.0.0.1:PORT stepmem daemon (plain shell), then SIGTERM",
        "connects on loopback, /metrics targets on 127.0.0.1; SIGTERM: exit 0, 'stopped; its "
        "samplers stay'; `daemon --stop` removes the 1 sampler",
    )
