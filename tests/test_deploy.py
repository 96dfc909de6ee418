"""The Kubernetes manifests (KubeRay RayCluster/RayJob, Prometheus Operator PodMonitor), checked
without a cluster: structure, agreement with each other, with stepmem's own CLI and with the
project's pins."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from collector.cli import build_parser

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


@pytest.mark.ray
def test_the_local_quick_start_brings_up_ray_prometheus_with_rules_and_alertmanager(tmp_path):
    import json
    import os
    import subprocess
    import urllib.request

    from tests.conftest import wait_for
    from tests.prom import free_port, require

    require("prometheus")
    import shutil

    if shutil.which("alertmanager") is None:
        require("prometheus-alertmanager")  # Debian's name for it
    ports = {k: free_port() for k in ("RAY", "DASHBOARD", "PROM", "AM")}
    env = {
        **os.environ,
        "STEPMEM_LOCAL_DIR": str(tmp_path / "local"),
        **{f"STEPMEM_{k}_PORT": str(v) for k, v in ports.items()},
    }
    up = ROOT / "deploy" / "local" / "up.sh"
    down = ROOT / "deploy" / "local" / "down.sh"
    try:
        r = subprocess.run([str(up)], env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"http://127.0.0.1:{ports['DASHBOARD']}" in r.stdout

        def get(port, path):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
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
        assert get(ports["DASHBOARD"], "/api/version")["ray_version"]
    finally:
        d = subprocess.run([str(down)], env=env, capture_output=True, text=True, timeout=120)
    assert d.stdout.count("stopped") == 3, d.stdout + d.stderr
