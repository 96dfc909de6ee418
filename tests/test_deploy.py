"""The Kubernetes manifests (KubeRay RayCluster/RayJob, Prometheus Operator PodMonitor), checked
without a cluster: structure, agreement with each other, with stepmem's own CLI and with the
project's pins."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from collector.cli.subcommands import build_parser

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"


def load(name):
    return yaml.safe_load((K8S / name).read_text())


@pytest.fixture(scope="module")
def manifests():
    return load("raycluster.yaml"), load("rayjob.yaml"), load("podmonitor.yaml")


def ray_pin() -> str:
    (pin,) = re.findall(r'"ray\[default\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    return pin


def job_args(rayjob) -> list[str]:
    words = shlex.split(rayjob["spec"]["entrypoint"])
    assert words[:3] == ["python", "-m", "collector.job"]
    return words[3:]


def test_kinds_versions_and_the_image(manifests):
    cluster, job, monitor = manifests
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    spec = cluster["spec"]
    assert spec["rayVersion"] == ray_pin()
    (base,) = re.findall(r"^FROM rayproject/ray:([0-9.]+)-", (K8S / "Dockerfile").read_text(), re.M)
    assert base == ray_pin()
    images = {
        c["image"]
        for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        for c in g["template"]["spec"]["containers"]
    }
    assert len(images) == 1


def test_the_rayjob_brings_the_same_cluster_and_cleans_up(manifests):
    cluster, job, _ = manifests
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]
    # the dashboard and job API run code for whoever reaches them: token auth on
    assert cluster["spec"]["authOptions"] == {"mode": "token"}
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) >= 10  # time to flush on `ray job stop`


def test_the_entrypoint_is_a_valid_stepmem_run(manifests):
    _, job, _ = manifests
    ns = build_parser().parse_args(["run", *job_args(job)])  # exits on an unknown option
    assert ns.metrics_port > 0 and ns.train_workers >= 1
    assert ns.metrics_addr in (None, "")  # the pod's own IP, never 0.0.0.0
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    gpus = sum(
        int(g["replicas"]) * int(c["resources"]["limits"]["nvidia.com/gpu"])
        for g in workers
        for c in g["template"]["spec"]["containers"]
    )
    assert ns.train_workers <= gpus


def test_the_podmonitor_finds_every_gpus_sampler_and_only_on_gpu_workers(manifests):
    cluster, job, monitor = manifests
    ns = build_parser().parse_args(["run", *job_args(job)])
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert all(e["honorLabels"] is True and e["path"] == "/metrics" for e in endpoints)
    head = cluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= head.items()  # no samplers on the CPU head
    for group in cluster["spec"]["workerGroupSpecs"]:
        tpl = group["template"]
        assert selector.items() <= tpl["metadata"]["labels"].items()
        assert int(group["minReplicas"]) <= int(group["replicas"]) <= int(group["maxReplicas"])
        (container,) = tpl["spec"]["containers"]
        n_gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        # GPU i's sampler serves on metrics_port + i: one named port per GPU, each scraped.
        expected = {ns.metrics_port + i for i in range(n_gpus)}
        assert {ports[e["port"]] for e in endpoints} == expected
        assert all(len(name) <= 15 for name in ports)  # Kubernetes' limit on port names


def _stack_env(tmp_path, ports, **extra):
    import os

    env = {
        **os.environ,
        "HOME": str(tmp_path / "home"),  # Ray writes its auth token under ~/.ray
        "STEPMEM_LOCAL_DIR": str(tmp_path / "local"),
        **{f"STEPMEM_{k}_PORT": str(v) for k, v in ports.items()},
        **extra,
    }
    # as a user's shell has it: Ray's default, token authentication on
    env.pop("RAY_AUTH_MODE", None)
    return env


def _require_stack_binaries():
    import shutil

    from tests.prom import require

    require("prometheus")
    if shutil.which("alertmanager") is None:
        require("prometheus-alertmanager")  # Debian's name for it


def _port_free(port) -> bool:
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _who_listens(ports) -> str:
    import subprocess

    return subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout + str(ports)


@pytest.mark.ray
def test_the_local_quick_start_brings_up_ray_prometheus_with_rules_and_alertmanager(
    tmp_path, record_fault
):
    import json
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    from tests.conftest import wait_for
    from tests.prom import free_port

    _require_stack_binaries()
    ports = {k: free_port() for k in ("RAY", "DASHBOARD", "AGENT", "PROM", "AM")}
    env = _stack_env(tmp_path, ports)
    # As on a machine where a local `ray.init()` ran before: a token in ~/.ray, so `ray start`
    # turns token authentication on (the dashboard answered the old up.sh 401 and it gave up)
    ray_bin = Path(sys.executable).parent / "ray"
    subprocess.run(
        [str(ray_bin), "get-auth-token", "--generate"], env=env, capture_output=True, check=True
    )
    up = ROOT / "deploy" / "local" / "up.sh"
    down = ROOT / "deploy" / "local" / "down.sh"
    current = Path("/tmp/ray/ray_current_cluster")
    head = f"127.0.0.1:{ports['RAY']}"
    try:
        r = subprocess.run([str(up)], env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"http://127.0.0.1:{ports['DASHBOARD']}" in r.stdout
        assert "Ray token auth on" in r.stdout

        def get(port, path, headers=None):
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.load(resp)

        groups = get(ports["PROM"], "/api/v1/rules")["data"]["groups"]
        names = {rule["name"] for g in groups for rule in g["rules"]}
        assert {"StepMemPeakNearCapacity", "StepMemReservedGrowing"} <= names, names
        want = [f"http://127.0.0.1:{ports['AM']}/api/v2/alerts"]

        def active():
            ams = get(ports["PROM"], "/api/v1/alertmanagers")["data"]["activeAlertmanagers"]
            return [a["url"] for a in ams]

        wait_for(lambda: active() == want, timeout=60)  # discovered shortly after start
        assert get(ports["AM"], "/api/v2/status")["cluster"]["status"] in ("disabled", "ready")
        # token authentication is on: without the token the dashboard refuses, with it answers
        with pytest.raises(urllib.error.HTTPError) as refused:
            get(ports["DASHBOARD"], "/api/version")
        assert refused.value.code == 401
        token = (tmp_path / "home" / ".ray" / "auth_token").read_text().strip()
        auth = {"Authorization": f"Bearer {token}"}
        assert get(ports["DASHBOARD"], "/api/version", auth)["ray_version"]
        # a run that reaches this head without a token: stepmem's one line, not Ray's twenty
        # InvalidAuthToken lines first
        bare = subprocess.run(
            [sys.executable, "-m", "collector.cli", "run", "--address", head, "--no-store"],
            env={**env, "RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert bare.returncode == 2, bare.stdout + bare.stderr
        assert "wants an auth token" in bare.stderr, bare.stderr
        assert "InvalidAuthToken" not in bare.stdout + bare.stderr, bare.stderr
        # `ray start` names its head the machine's current cluster (shortly after it serves)
        wait_for(lambda: current.exists() and current.read_text().strip() == head, timeout=30)
        # a second up.sh is refused: it would answer its checks with this stack's servers
        again = subprocess.run([str(up)], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 1 and "already up" in again.stderr, again.stderr
        # the hint names the folder down.sh needs (a bare down.sh finds no stack there)
        hint = f"STEPMEM_LOCAL_DIR={tmp_path / 'local'} deploy/local/down.sh"
        assert hint in again.stderr and f"Stop everything: {hint}" in r.stdout
        # the printed submit command works as printed, from a shell without the venv on PATH
        lines = r.stdout.splitlines()
        start = next(i for i, ln in enumerate(lines) if ln.startswith("Submit a run")) + 1
        end = next(i for i in range(start, len(lines)) if not lines[i].endswith("\\"))
        cmd = "\n".join(lines[start : end + 1]).replace("\\\n", " ")
        assert "benchmarks/results" in cmd  # 29 of its 32 MB are not the job's to upload
        assert "RAY_AUTH_MODE=token" in cmd and "/.venv/bin/python -m collector.job" in cmd
        job = subprocess.run(
            cmd + " --steps 2 --store " + str(tmp_path / "runs"),
            shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "replayed step 2" in job.stdout and "succeeded" in job.stdout
    finally:
        d = subprocess.run([str(down)], env=env, capture_output=True, text=True, timeout=120)
    assert d.stdout.count("stopped") == 3, d.stdout + d.stderr
    # a stopped head is not left as the machine's "current" Ray cluster
    assert not current.exists() or current.read_text().strip() != head
    busy = {k: p for k, p in ports.items() if not _port_free(p)}  # nothing left behind
    assert not busy, _who_listens(busy)
    record_fault(
        "deploy/local/up.sh where Ray turns token auth on (a token in ~/.ray)",
        "the stack comes up once its job agent answers and says 'Ray token auth on'; the "
        "dashboard refuses without the token, answers with it; a run without the token is told "
        "in one line, before Ray's retries; the printed `ray job submit` "
        "line runs a job as printed (no venv on PATH); a second up.sh is refused; down.sh "
        "leaves no port held",
    )


def test_up_refuses_a_port_another_program_holds(tmp_path, record_fault):
    """A port of the stack already held (another Ray's job agent, say): up.sh says which and
    starts nothing, rather than a head that cannot take jobs."""
    import socket
    import subprocess

    from tests.prom import free_port

    ports = {k: free_port() for k in ("RAY", "DASHBOARD", "AGENT", "PROM", "AM")}
    env = _stack_env(tmp_path, ports)
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports["AGENT"]))
        held.listen()
        up = ROOT / "deploy" / "local" / "up.sh"
        r = subprocess.run([str(up)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"port(s) {ports['AGENT']}" in r.stderr, r.stderr
    assert not list((tmp_path / "local").glob("*.pid"))
    record_fault(
        "deploy/local/up.sh when its job agent's port is held by another program",
        f"'{r.stderr.strip().splitlines()[0][:90]}…', exit 1; nothing started",
    )


@pytest.mark.ray
def test_a_local_stack_that_does_not_come_up_is_stopped_again(tmp_path, record_fault):
    """A Ray that never answers: up.sh says so, exits 1, and stops Prometheus and Alertmanager
    it had started (nothing left running, ports free, no pid files)."""
    import subprocess

    from tests.prom import free_port

    _require_stack_binaries()
    fake_ray = tmp_path / "ray"
    fake_ray.write_text("#!/bin/sh\nexec sleep 600\n")  # starts, never serves a dashboard
    fake_ray.chmod(0o755)
    ports = {k: free_port() for k in ("RAY", "DASHBOARD", "AGENT", "PROM", "AM")}
    env = _stack_env(tmp_path, ports, RAY_BIN=str(fake_ray), STEPMEM_UP_TIMEOUT_S="5")
    up = ROOT / "deploy" / "local" / "up.sh"
    r = subprocess.run([str(up)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Ray did not start" in r.stdout
    assert not list((tmp_path / "local").glob("*.pid"))
    assert all(_port_free(ports[k]) for k in ("PROM", "AM")), ports
    record_fault(
        "deploy/local/up.sh when Ray never answers",
        f"'{r.stdout.strip().splitlines()[-1]}', exit 1; Prometheus and Alertmanager it had "
        "started are stopped, their ports free",
    )


@pytest.mark.ray
def test_a_head_that_exits_at_once_is_seen_at_once_and_worker_ports_are_refused(
    tmp_path, record_fault
):
    """A Ray head that died at start (its agent port inside Ray's worker-port range) made up.sh
    wait its whole timeout and say 'Ray did not start'; now such a port is refused before
    anything starts, and a head that exits is seen at once, with the end of its log. down.sh
    without the stack's STEPMEM_LOCAL_DIR said nothing and stopped nothing; now it says so, and
    up.sh's hints carry the folder."""
    import subprocess
    import time

    from tests.prom import free_port

    up, down = ROOT / "deploy" / "local" / "up.sh", ROOT / "deploy" / "local" / "down.sh"
    ports = {k: free_port() for k in ("RAY", "DASHBOARD", "PROM", "AM")}
    r = subprocess.run([str(up)], env=_stack_env(tmp_path, {**ports, "AGENT": 15365}),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 1 and "port 15365 lies in Ray's worker-port range" in r.stderr
    assert not list((tmp_path / "local").glob("*.pid"))
    _require_stack_binaries()
    fake_ray = tmp_path / "ray"
    fake_ray.write_text("#!/bin/sh\necho 'ValueError: Ray component worker_ports ...'\nexit 1\n")
    fake_ray.chmod(0o755)
    env = _stack_env(tmp_path, {**ports, "AGENT": free_port()}, RAY_BIN=str(fake_ray))
    t0 = time.monotonic()
    r = subprocess.run([str(up)], env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 1 and "Ray's head exited at once" in r.stdout, r.stdout + r.stderr
    assert "ValueError: Ray component worker_ports" in r.stdout
    assert not list((tmp_path / "local").glob("*.pid"))
    nothing = subprocess.run([str(down)], env={**env, "STEPMEM_LOCAL_DIR": str(tmp_path / "x")},
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "no stack found in" in nothing.stderr and "STEPMEM_LOCAL_DIR" in nothing.stderr
    record_fault(
        "deploy/local/up.sh whose Ray head exits at once (or a port in Ray's worker range)",
        "a worker-range port refused before anything starts; a head that exits seen at once "
        "with the end of its log (it waited the whole timeout), exit 1, the rest stopped",
        seconds_to_answer=round(took, 1),
    )
