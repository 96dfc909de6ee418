"""Daemon mode on a real local Ray cluster: detached samplers, idempotent rescans, found by a
probe, removed by --stop."""

import json

import pytest
import ray

from collector.backends import BackendSpec
from collector.daemon import run_daemon, stop_daemon
from collector.lookup import SamplerLookup, list_samplers
from tests.conftest import loopback

pytestmark = pytest.mark.ray


def test_daemon_places_detached_samplers_and_rescans_without_doubling(ray_cluster, tmp_path):
    targets = tmp_path / "stepmem.json"
    spec = BackendSpec("replay", captures=["idle"], gpus=2)
    try:
        n = run_daemon(
            spec,
            loopback(run_id="daemon"),
            rescan_s=0.5,
            targets=targets,
            duration_s=1.5,
            echo=lambda *a: None,
        )
        assert n == 2
        names = list_samplers()
        assert len(names) == 2
        entries = json.loads(targets.read_text())
        assert len(entries) == 2 and all(e["targets"][0].startswith("127.0.0.1:") for e in entries)
        # a second daemon pass (another process, later) reuses them
        assert (
            run_daemon(
                spec, loopback(run_id="daemon"), rescan_s=0.2, duration_s=0.2, echo=lambda *a: None
            )
            == 2
        )
        assert list_samplers() == names
        uuid = entries[0]["labels"]["gpu_uuid"]
        handle = SamplerLookup().find(uuid)  # what a job's probe does
        assert handle is not None and ray.get(handle.info.remote()).gpu_uuid == uuid
    finally:
        stopped = stop_daemon(echo=lambda *a: None)
    assert stopped == 2 and list_samplers() == []


def test_a_job_runs_its_own_samplers_and_leaves_the_daemons_running(ray_cluster, tmp_path):
    """A run places samplers of its own (its data never mixes with the daemon's or another
    run's), removes them at its end, and never stops the daemon's."""
    from collector.model.settings import JobOptions
    from collector.run.job import run_job

    spec = BackendSpec("replay", captures=["adamw_8bit"], gpus=1)
    try:
        run_daemon(
            spec, loopback(run_id="daemon"), rescan_s=0.2, duration_s=0.2, echo=lambda *a: None
        )
        (name,) = list_samplers()
        records = run_job(
            JobOptions(
                captures=["adamw_8bit"],
                gpus=1,
                speed=4.0,
                steps=2,
                store=tmp_path / "runs",
                sampler=loopback(),
            ),
            echo=lambda *a: None,
        ).records
        assert [r.step for r in records] == [1, 2]
        handle = ray.get_actor(name, namespace="stepmem")
        assert list_samplers() == [name]  # the run's own are gone with it
        health = ray.get(handle.health.remote())
        assert health.alive is True  # still sampling
        assert health.events_received == 0  # the run's steps went to the run's samplers
    finally:
        stop_daemon(echo=lambda *a: None)


def test_stop_ends_a_running_daemon_before_it_places_them_again(ray_cluster, tmp_path):
    """`daemon --stop` while the daemon runs: it removed the samplers and emptied the targets,
    and the daemon put both back at its next rescan, silently. Now --stop ends the daemon
    first (it looks every half second), then removes what it placed."""
    import threading
    import time

    targets = tmp_path / "d.json"
    spec = BackendSpec("replay", captures=["idle"], gpus=1)
    said: list[str] = []
    ended = threading.Event()

    def daemon():
        run_daemon(spec, loopback(run_id="daemon"), rescan_s=0.3, targets=targets, echo=said.append)
        ended.set()

    t = threading.Thread(target=daemon, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not list_samplers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list_samplers(), "the daemon placed nothing"
    lines: list[str] = []
    try:
        assert stop_daemon(targets, echo=lines.append) == 1
    finally:
        stop_daemon(echo=lambda *a: None)
    assert ended.wait(30), "the daemon kept running"
    assert any(x.startswith("stopped the running daemon (pid ") for x in lines), lines
    assert "stepmem daemon: stopped by `stepmem daemon --stop`" in said
    # the daemon has ended: nothing can come back
    assert list_samplers() == [] and json.loads(targets.read_text()) == []
