"""Export against a real Prometheus on loopback: scrape through file_sd, remote write of every
step at its own time, window gauges, promtool, outages and rejections."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import threading
import time
import urllib.request

import pytest
import ray

from collector.backends import BackendSpec
from collector.export.file_sd import TargetsRefresher
from collector.export.remote_write import RemoteWriteConfig, RemoteWriter
from collector.model.settings import Sampling
from collector.placement import launch_samplers
from collector.probe.core import StepProbe
from collector.probe.outbox import Outbox
from collector.replay import Capture, resolve_capture
from tests.cli import one_line_error, stepmem
from tests.conftest import loopback, wait_for
from tests.prom import Prometheus, free_port, require

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    p = Prometheus(tmp_path_factory.mktemp("prom")).start()
    yield p
    p.stop()


def metrics_text(info) -> str:
    url = f"http://{info.metrics_addr}:{info.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_scraped_and_pushed_steps_land_in_prometheus(prom, kill_samplers, tmp_path):
    steps = 200
    cap = Capture.load(resolve_capture("spiky"))
    rw = RemoteWriteConfig(url=f"{prom.url}/api/v1/write", flush_interval_s=0.2)
    placed = launch_samplers(
        BackendSpec("replay", captures=["spiky"], gpus=2),
        loopback(
            run_id="t-export",
            sampling=Sampling(window_s=10.0),
            remote_write=rw,
            push_samples=True,
        ),
    )
    kill_samplers.extend(p.handle for p in placed)
    assert all(p.info.metrics_addr == "127.0.0.1" for p in placed)  # the node's address
    refresher = TargetsRefresher(
        prom.targets / "stepmem.json", [p.handle for p in placed], interval_s=1.0
    )
    try:
        wait_for(lambda: prom.scalar('sum(up{job="stepmem", run="t-export"})') == 2, timeout=40)
        gpu = placed[0]
        probe = StepProbe(
            gpu_uuids={"cpu": gpu.gpu_uuid},
            outbox=Outbox(lambda u: gpu.handle, flush_interval_s=0.1),
        )
        for i in range(1, steps + 1):
            with probe.step(i):
                time.sleep(0.005)
        probe.close()
        wait_for(lambda: len(ray.get(gpu.handle.step_records.remote())) == steps, timeout=30)
        records = {r.step: r for r in ray.get(gpu.handle.step_records.remote())}
        sel = f'job="stepmem-steps", gpu_uuid="{gpu.gpu_uuid}"'
        wait_for(
            lambda: prom.scalar(f"count_over_time(stepmem_step{{{sel}}}[10m])") == steps, timeout=30
        )
        # Every step at its own step-end timestamp, with the step record's value.
        (step_series,) = prom.query(f"stepmem_step{{{sel}}}[10m]")
        (peak_series,) = prom.query(f"stepmem_step_nvml_peak_bytes{{{sel}}}[10m]")
        step_at = {ts: int(float(v)) for ts, v in step_series["values"]}
        peak_at = {ts: int(float(v)) for ts, v in peak_series["values"]}
        assert sorted(step_at.values()) == list(range(1, steps + 1))
        offset = gpu.info.wall_offset_ns
        for ts, step in step_at.items():
            rec = records[step]
            if rec.nvml_peak_bytes is None:  # no sample inside the step: no series, never 0
                assert ts not in peak_at
                continue
            assert peak_at[ts] == rec.nvml_peak_bytes
            assert abs(ts - (rec.end_ns + offset) / 1e9) < 0.05  # the step's own end time
        assert peak_at  # a 5 ms step at 1 kHz: a starved sampler may miss some, never all
        # Window gauges: the 10 s window holds whole laps of the replayed capture by now.
        elapsed = (time.monotonic_ns() - gpu.info.started_ns) / 1e9
        time.sleep(max(0.0, 6.0 - elapsed) + 1.5)  # two laps of the capture, then a scrape
        win = f'job="stepmem", gpu_uuid="{gpu.gpu_uuid}"'
        assert prom.scalar(f"stepmem_nvml_used_window_max_bytes{{{win}}}") == cap.used.max()
        assert prom.scalar(f"stepmem_nvml_used_window_min_bytes{{{win}}}") == cap.used.min()
        assert prom.scalar(f"stepmem_window_seconds{{{win}}}") == 10.0
        assert prom.scalar(f"stepmem_steps_joined_total{{{win}}}") == steps
        (series,) = prom.query(f"stepmem_nvml_total_bytes{{{win}}}")
        assert not any(k.startswith("exported_") for k in series["metric"])  # honor_labels
        # The raw trace, pushed as per-millisecond maxima, reaches the capture's peak too.
        raw = f'stepmem_nvml_used_bytes{{job="stepmem-samples", gpu_uuid="{gpu.gpu_uuid}"}}'
        assert prom.scalar(f"max_over_time({raw}[10m])") == cap.used.max()
        assert prom.scalar(f"count_over_time({raw}[10m])") > 1000
    finally:
        refresher.stop()


def test_promtool_finds_nothing_wrong_in_live_metrics(kill_samplers):
    promtool = require("promtool")
    (p,) = launch_samplers(
        BackendSpec("replay", captures=["adamw_8bit"], gpus=1), loopback(run_id="t-promtool")
    )
    kill_samplers.append(p.handle)
    cap = Capture.load(resolve_capture("adamw_8bit"))
    ends = [e for e in cap.events if e["kind"] == "end"]
    now = time.monotonic_ns()  # one recorded step, with its torch figures and ledger
    p.handle.record_events.remote(
        [
            {**ends[1], "kind": "begin", "t_ns": now - 50_000_000, "gpu_uuid": p.gpu_uuid},
            {**ends[1], "t_ns": now - 10_000_000, "gpu_uuid": p.gpu_uuid},
        ]
    )
    wait_for(lambda: len(ray.get(p.handle.step_records.remote())) == 1, timeout=20)
    text = metrics_text(p.info)
    for name in (
        "stepmem_step_ledger_bytes",
        "stepmem_torch_alloc_retries_total",
        "stepmem_nvml_used_window_max_bytes",
        "stepmem_sampler_samples_total",
    ):
        assert name in text
    res = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0 and res.stdout.strip() == "" and res.stderr.strip() == "", res


def test_buffered_steps_arrive_after_prometheus_starts_and_drops_are_counted(
    tmp_path, record_fault
):
    port = free_port()
    writer = RemoteWriter(
        RemoteWriteConfig(
            url=f"http://127.0.0.1:{port}/api/v1/write",
            buffer_max=50,
            batch_max=20,
            flush_interval_s=0.1,
            backoff_min_s=0.1,
            backoff_max_s=0.5,
            timeout_s=2,
        )
    )
    now_ms = int(time.time() * 1000)
    labels = {"node": "n", "gpu": "0", "gpu_uuid": "GPU-outage", "run": "t-outage"}
    t0 = time.perf_counter()
    for i in range(80):
        writer.push("stepmem_step", labels, now_ms - 80 + i, float(i))
    assert time.perf_counter() - t0 < 0.1  # the caller never waits on the network
    wait_for(lambda: writer.last_error.startswith("connection"), timeout=10)
    assert writer.stats()["dropped"] == {"buffer_full": 30} and writer.sent == 0
    prom = Prometheus(tmp_path, port=port).start()
    try:
        wait_for(lambda: writer.sent == 50, timeout=30)
        series = 'stepmem_step{job="stepmem-steps", gpu_uuid="GPU-outage"}'
        wait_for(lambda: prom.scalar(f"count_over_time({series}[10m])") == 50, timeout=20)
        (res,) = prom.query(f"{series}[10m]")
        assert [float(v) for _, v in res["values"]] == [float(i) for i in range(30, 80)]
    finally:
        writer.close(timeout=1)
        prom.stop()
    record_fault(
        "Prometheus down, 80 steps pushed, then started",
        "pushes never block; the buffer (50) arrived after Prometheus started; the 30 oldest "
        "beyond it counted as buffer_full",
        samples_lost_uncounted=0,
        samples_dropped_counted=30,
        samples_arrived=50,
    )


def test_a_400_is_logged_with_its_reason_and_not_retried(prom, caplog, record_fault):
    labels = {"node": "n", "gpu": "0", "gpu_uuid": "GPU-reject", "run": "t-reject"}
    now_ms = int(time.time() * 1000)
    first = RemoteWriter(RemoteWriteConfig(url=f"{prom.url}/api/v1/write", flush_interval_s=0.1))
    first.push("stepmem_step", labels, now_ms, 1.0)
    wait_for(lambda: first.sent == 1, timeout=20)
    first.close(timeout=1)
    late = RemoteWriter(RemoteWriteConfig(url=f"{prom.url}/api/v1/write", flush_interval_s=0.1))
    with caplog.at_level(logging.WARNING, logger="collector.export.remote_write"):
        late.push("stepmem_step", labels, now_ms - 60_000, 2.0)  # older than the series' head
        wait_for(lambda: late.stats()["dropped"].get("rejected_4xx") == 1, timeout=20)
        time.sleep(0.5)
    assert late.requests == 1 and late.sent == 0  # no retry
    assert "HTTP 400" in caplog.text and "out of order" in caplog.text
    late.close(timeout=1)
    record_fault(
        "remote write answered 400 (out-of-order sample)",
        "logged with Prometheus' reason, counted as rejected_4xx, not retried",
        requests=late.requests,
        samples_rejected_counted=1,
    )


def test_credentials_never_reach_logs_metrics_or_repr(
    prom, tmp_path, caplog, kill_samplers, record_fault
):
    secret = "planted-s3cret-7f3a9"
    token = tmp_path / "token"
    token.write_text(secret + "\n")
    rw = RemoteWriteConfig(
        url=f"{prom.url}/api/v1/write", bearer_token_file=str(token), flush_interval_s=0.1
    )
    with caplog.at_level(logging.DEBUG):
        writer = RemoteWriter(rw)
        writer.push(
            "stepmem_step",
            {"node": "n", "gpu": "0", "gpu_uuid": "GPU-s", "run": "s"},
            int(time.time() * 1000),
            1.0,
        )
        wait_for(lambda: writer.sent == 1, timeout=20)
        (p,) = launch_samplers(
            BackendSpec("replay", captures=["idle"], gpus=1),
            loopback(run_id="t-secret", remote_write=rw),
        )
        kill_samplers.append(p.handle)
        text = metrics_text(p.info)
        info = ray.get(p.handle.info.remote())
        health = ray.get(p.handle.health.remote())
    for where in (caplog.text, text, repr(writer), repr(rw), str(info), str(health)):
        assert secret not in where
    writer.close(timeout=1)
    record_fault(
        "a remote-write bearer token planted in a file",
        "absent from logs (DEBUG), /metrics, repr, the actor's info and health",
        places_checked=6,
    )


def test_raw_samples_become_per_millisecond_maxima_and_the_open_millisecond_waits():
    w = RemoteWriter(
        RemoteWriteConfig(url=f"http://127.0.0.1:{free_port()}/w", flush_interval_s=60)
    )
    try:
        ms = 1_000_000
        t = [5 * ms + 100, 5 * ms + 900, 6 * ms + 1, 6 * ms + 2, 8 * ms, 8 * ms + 5]
        used = [10, 30, 7, 9, 4, 6]
        held = w.push_samples({"gpu_uuid": "GPU-a"}, t, used, wall_offset_ns=0)
        assert held == 2  # the last millisecond (8) may still get samples
        assert [(tm, v) for _, tm, v in w._buf] == [(5, 30.0), (6, 9.0)]
        assert w.push_samples({"gpu_uuid": "GPU-a"}, t[-2:], used[-2:], 0, final=True) == 0
        assert [(tm, v) for _, tm, v in w._buf][-1] == (8, 6.0)
        assert {dict(k)["job"] for k, _, _ in w._buf} == {"stepmem-samples"}
    finally:
        w.close(timeout=0.1)


class FaultyProxy:
    """A loopback HTTP proxy in front of the real Prometheus that answers the first ``fail``
    requests with ``fail_status`` (503; 429 with ``retry_after``) and delays every request by
    ``delay_s`` (a slow receiver). It notes each request's time and User-Agent."""

    def __init__(
        self,
        upstream: str,
        fail: int = 0,
        delay_s: float = 0.0,
        fail_status: int = 503,
        retry_after: str | None = None,
        answer: bytes = b"overloaded",
    ) -> None:
        import http.server
        import threading

        proxy = self
        self.fail, self.delay_s, self.requests, self.failed = fail, delay_s, 0, 0
        self.times: list[float] = []
        self.agents: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                proxy.requests += 1
                proxy.times.append(time.monotonic())
                proxy.agents.append(self.headers.get("User-Agent", ""))
                time.sleep(proxy.delay_s)
                if proxy.failed < proxy.fail:
                    proxy.failed += 1
                    self.send_response(fail_status)
                    if retry_after is not None:
                        self.send_header("Retry-After", retry_after)
                    self.end_headers()
                    self.wfile.write(answer)
                    return
                req = urllib.request.Request(
                    upstream + self.path, data=body, headers=dict(self.headers), method="POST"
                )
                try:
                    with urllib.request.urlopen(req, timeout=10) as r:
                        status = r.status
                except urllib.error.HTTPError as exc:
                    status = exc.code
                self.send_response(status)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _push_timed(writer, labels, n, t0_ms):
    worst = 0.0
    for i in range(n):
        t = time.perf_counter()
        writer.push("stepmem_step", labels, t0_ms + i, float(i))
        worst = max(worst, time.perf_counter() - t)
    return worst


def test_a_receivers_error_body_is_inert_in_the_log_and_the_last_error(caplog):
    """S9: a 400 whose body sets the window title, clears the screen and conceals text reached
    the sampler's log and the run's last line; the receiver's words are printed inert."""
    evil = b"\x1b]0;PWNED\x07\x1b[2J\x1b[8mhidden"
    proxy = FaultyProxy("http://127.0.0.1:1", fail=1, fail_status=400, answer=evil)
    writer = RemoteWriter(RemoteWriteConfig(url=f"{proxy.url}/api/v1/write", flush_interval_s=0.05))
    labels = {"node": "n", "gpu": "0", "gpu_uuid": "GPU-ansi", "run": "t-ansi"}
    try:
        with caplog.at_level(logging.WARNING, logger="collector.export.remote_write"):
            writer.push("stepmem_step", labels, int(time.time() * 1000), 1.0)
            wait_for(lambda: writer.stats()["dropped"].get("rejected_4xx") == 1, timeout=20)
    finally:
        writer.close(timeout=1)
        proxy.close()
    assert writer.last_error.startswith("HTTP 400: ") and "hidden" in writer.last_error
    for text in (writer.last_error, caplog.text):
        assert not any(c in text for c in "\x1b\x07"), repr(text)


def test_5xx_answers_are_retried_and_everything_catches_up(prom, record_fault):
    proxy = FaultyProxy(prom.url, fail=3)
    writer = RemoteWriter(
        RemoteWriteConfig(
            url=f"{proxy.url}/api/v1/write",
            batch_max=20,
            flush_interval_s=0.05,
            backoff_min_s=0.1,
            backoff_max_s=0.4,
        )
    )
    labels = {"node": "n", "gpu": "0", "gpu_uuid": "GPU-5xx", "run": "t-5xx"}
    try:
        worst = _push_timed(writer, labels, 100, int(time.time() * 1000) - 200)
        wait_for(lambda: writer.sent == 100, timeout=30)
        series = 'stepmem_step{job="stepmem-steps", gpu_uuid="GPU-5xx"}'
        wait_for(lambda: prom.scalar(f"count_over_time({series}[10m])") == 100, timeout=20)
        assert proxy.failed == 3 and writer.stats()["dropped"] == {}
        assert worst < 0.01  # the caller never waits on the receiver
    finally:
        writer.close(timeout=1)
        proxy.close()
    record_fault(
        "remote write answered 503 three times",
        "retried with backoff; all samples arrived after recovery; the pushing thread never waited",
        samples_lost=0,
        worst_push_ms=round(worst * 1000, 3),
        retried_requests=proxy.failed,
    )


def test_a_slow_receiver_never_slows_the_caller_and_the_buffer_stays_bounded(prom, record_fault):
    proxy = FaultyProxy(prom.url, delay_s=0.5)
    writer = RemoteWriter(
        RemoteWriteConfig(
            url=f"{proxy.url}/api/v1/write", buffer_max=100, batch_max=50, flush_interval_s=0.05
        )
    )
    labels = {"node": "n", "gpu": "0", "gpu_uuid": "GPU-slow", "run": "t-slow"}
    try:
        t0 = int(time.time() * 1000) - 1000
        worst = _push_timed(writer, labels, 50, t0)  # the first batch goes out, slowly
        time.sleep(0.1)
        worst = max(worst, _push_timed(writer, labels, 400, t0 + 50))  # a burst meanwhile
        assert writer.stats()["pending"] <= 100  # bounded
        dropped = writer.stats()["dropped"].get("buffer_full", 0)
        assert dropped > 0
        # every sample is sent or counted as dropped (the last batch may still be in flight)
        wait_for(lambda: writer.sent + writer.stats()["dropped"]["buffer_full"] == 450, timeout=30)
        dropped = writer.stats()["dropped"]["buffer_full"]
        series = 'stepmem_step{job="stepmem-steps", gpu_uuid="GPU-slow"}'
        wait_for(lambda: prom.scalar(f"count_over_time({series}[10m])") == writer.sent, timeout=20)
        assert worst < 0.01
    finally:
        writer.close(timeout=1)
        proxy.close()
    record_fault(
        "remote-write receiver 0.5 s per request, a burst of 450 samples",
        "the caller never waits; buffer bounded at 100; the oldest dropped and counted; the "
        "rest arrived",
        worst_push_ms=round(worst * 1000, 3),
        samples_sent=writer.sent,
        samples_dropped_counted=dropped,
    )


def test_a_429_is_retried_after_the_wait_the_receiver_asks_for(prom, record_fault):
    from importlib.metadata import version

    proxy = FaultyProxy(prom.url, fail=2, fail_status=429, retry_after="1")
    writer = RemoteWriter(
        RemoteWriteConfig(
            url=f"{proxy.url}/api/v1/write",
            flush_interval_s=0.05,
            backoff_min_s=0.05,  # without Retry-After the retries would come within 0.1 s
            backoff_max_s=0.1,
        )
    )
    labels = {"node": "n", "gpu": "0", "gpu_uuid": "GPU-429", "run": "t-429"}
    try:
        _push_timed(writer, labels, 30, int(time.time() * 1000) - 200)
        wait_for(lambda: writer.sent == 30, timeout=30)
        series = 'stepmem_step{job="stepmem-steps", gpu_uuid="GPU-429"}'
        wait_for(lambda: prom.scalar(f"count_over_time({series}[10m])") == 30, timeout=20)
        waits = [b - a for a, b in zip(proxy.times, proxy.times[1:], strict=False)][:2]
        assert proxy.failed == 2 and writer.stats()["throttled"] == 2
        assert writer.stats()["dropped"] == {}
        assert all(w >= 0.9 for w in waits), waits  # Retry-After: 1 honoured, twice
        assert set(proxy.agents) == {f"stepmem/{version('stepmem')}"}
    finally:
        writer.close(timeout=1)
        proxy.close()
    record_fault(
        "remote write answered 429 with Retry-After: 1, twice",
        "kept the batch, waited as asked, then everything arrived; User-Agent names the version",
        waits_s=[round(w, 2) for w in waits],
        samples_lost=0,
    )


def test_a_finished_runs_series_end_with_stale_markers(prom, record_fault):
    writer = RemoteWriter(RemoteWriteConfig(url=f"{prom.url}/api/v1/write", flush_interval_s=0.05))
    labels = {"node": "n", "gpu": "0", "gpu_uuid": "GPU-stale", "run": "t-stale"}
    series = 'stepmem_step{job="stepmem-steps", gpu_uuid="GPU-stale"}'
    try:
        t0 = int(time.time() * 1000) - 3000
        for i in range(5):
            writer.push("stepmem_step", labels, t0 + 100 * i, float(i))
        wait_for(lambda: writer.sent == 5, timeout=20)
        wait_for(lambda: prom.scalar(series) == 4.0, timeout=20)  # live: the last value shows
        assert writer.mark_stale() == 1
        wait_for(lambda: writer.sent == 6, timeout=20)
        wait_for(lambda: prom.query(series) == [], timeout=20)  # ended, not 5 minutes later
        assert prom.scalar(f"count_over_time({series}[10m])") == 5  # the data is all there
    finally:
        writer.close(timeout=1)
    record_fault(
        "a run ends: its pushed series would linger in Prometheus for its 5-minute lookback",
        "stale markers sent at the end: the series is gone from instant queries at once, its 5 "
        "samples all kept",
    )


@pytest.mark.ray
def test_per_process_memory_is_labelled_by_ray_name_not_pid(kill_samplers):
    """The neighbour capture: the training process (registered under its Ray name, as a probe's
    outbox does) and a second process that comes at step 3 (not registered: 'other')."""
    from collector.probe.outbox import ray_process_label

    cap = Capture.load(resolve_capture("neighbour"))
    trainer_pid = int(cap.events[0]["torch"]["process_pid"])  # the probe's begin events say
    (gpu,) = launch_samplers(
        BackendSpec("replay", captures=["neighbour"], gpus=1, speed=8.0), loopback()
    )
    kill_samplers.append(gpu.handle)
    ray.get(gpu.handle.register_process.remote(trainer_pid, ray_process_label()))
    assert ray.get(gpu.handle.info.remote()).processes == {str(trainer_pid): "driver"}

    def series() -> dict[str, float]:
        out = {}
        for line in metrics_text(gpu.info).splitlines():
            m = re.match(r'stepmem_process_used_bytes\{.*process="([^"]+)".*\} (\S+)$', line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    got: dict[str, float] = {}

    def neighbour_came() -> bool:  # about 1.6 s in; one scrape read whole
        got.clear()
        got.update(series())
        return "other" in got

    wait_for(neighbour_came, timeout=60)
    assert set(got) == {"driver", "other"}  # two series, no pid anywhere
    by_pid = {int(p[0]): p[1] for snap in cap.processes for p in snap["procs"] if p[1] is not None}
    assert got["driver"] == by_pid[trainer_pid]
    assert got["other"] in {v for pid, v in by_pid.items() if pid != trainer_pid}


@pytest.mark.ray
def test_ray_metrics_gauges_reach_rays_own_metrics_endpoint(kill_samplers):
    """--ray-metrics: the headline gauges as Ray's metrics agent serves them (what a Prometheus
    that scrapes Ray sees), each series with the GPU's UUID; Ray exports every ~10 s."""
    from tests.replays import replay_steps

    cap = Capture.load(resolve_capture("adamw_8bit"))
    speed = 4.0
    (gpu,) = launch_samplers(
        BackendSpec("replay", captures=["adamw_8bit"], gpus=1, speed=speed),
        loopback(run_id="t-ray-metrics", ray_metrics=True),
    )
    kill_samplers.append(gpu.handle)
    replay_steps([gpu], cap, 2, speed)
    port = ray._private.worker.global_worker.node.metrics_export_port
    got: dict[str, float] = {}

    def exported() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            lines = [ln for ln in r.read().decode().splitlines() if ln.startswith("ray_stepmem_")]
        mine = [ln for ln in lines if 'run="t-ray-metrics"' in ln]
        assert all(f'gpu_uuid="{gpu.gpu_uuid}"' in ln for ln in mine)
        got.clear()
        got.update({ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in mine})
        return got.get("ray_stepmem_last_step", 0) >= 2

    wait_for(exported, timeout=90)
    top = int(cap.used.max())
    assert 0 < got["ray_stepmem_nvml_used_window_max_bytes"] <= top
    assert got["ray_stepmem_headroom_bytes"] >= cap.total_bytes - top
    assert 0 < got["ray_stepmem_last_step_nvml_peak_bytes"] <= top
    assert "ray_stepmem_torch_ooms" in got and "ray_stepmem_torch_alloc_retries" in got


@pytest.mark.ray
def test_a_metrics_port_in_use_is_one_line_and_leaves_no_sampler(tmp_path, record_fault):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        args = ["run", "--metrics-port", str(port), "--store", str(tmp_path / "runs")]
        res = stepmem(*args)
        line = one_line_error(res, f"cannot serve /metrics on 127.0.0.1:{port}")
    record_fault("bad input: stepmem run --metrics-port <a port in use>", line)


def test_retry_after_that_is_not_a_number_is_ignored():
    from collector.export.remote_write import retry_after_s

    for value in ("nan", "inf", "-inf", "NaN", "1e400"):
        assert retry_after_s(value) is None
    assert retry_after_s("2") == 2.0


def test_metrics_keeps_its_threads_bounded_under_idle_connections(record_fault):
    import socket
    import urllib.request

    from collector.export.prometheus import MAX_CONNECTIONS, SamplerCollector, serve

    server, port = serve(SamplerCollector(lambda: []), "127.0.0.1", 0)
    before = threading.active_count()
    socks = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # never finished
            socks.append(s)
        # every connection is served by a thread of its own, or its slot is taken over by a
        # newer one (the oldest whose request is not in goes)
        wait_for(lambda: server.taken_over >= len(socks) - MAX_CONNECTIONS, timeout=60)
        grown = threading.active_count() - before
        assert 0 < grown <= MAX_CONNECTIONS
        # and while the idle clients hold every slot, a scrape gets one
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the slots come back when the idle clients go
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                ok = r.status == 200
                break
        except OSError:
            time.sleep(0.1)
    assert ok
    server.shutdown()
    record_fault(
        "300 idle connections to a sampler's /metrics",
        f"at most {MAX_CONNECTIONS} threads (one a connection); each newcomer takes over the "
        "oldest slot whose request is not in, so a scrape gets through while they are held",
        threads_added=grown,
    )


def test_an_idle_connection_that_times_out_is_counted_not_printed(monkeypatch, capfd):
    """L4: socketserver printed a traceback for every client that went idle past the timeout;
    anyone who reaches the port could fill the job's log. Now each is counted."""
    import socket

    from collector.export import prometheus
    from collector.export.prometheus import SamplerCollector, serve

    monkeypatch.setattr(prometheus._QuietHandler, "timeout", 0.2)
    server, port = serve(SamplerCollector(lambda: []), "127.0.0.1", 0)
    try:
        socks = []
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # never finished
            socks.append(s)
        wait_for(lambda: sum(server.failed.values()) >= 3, timeout=60)
    finally:
        for s in socks:
            s.close()
        server.shutdown()
    assert set(server.failed) <= {"TimeoutError", "timeout"}, server.failed
    assert "Traceback" not in capfd.readouterr().err


def test_a_sampler_on_a_loopback_cluster_serves_metrics_on_loopback(kill_samplers, record_fault):
    """N5 (second tester): with no --metrics-addr, /metrics listens where Ray registered the
    node (127.0.0.1 on this loopback-only cluster), not on the machine's outward address."""
    from collector.model.settings import SamplerOptions

    placed = launch_samplers(
        BackendSpec("replay", captures=["idle"], gpus=1), SamplerOptions(run_id="t-bind")
    )
    kill_samplers.extend(p.handle for p in placed)
    assert [p.info.metrics_addr for p in placed] == ["127.0.0.1"]
    record_fault(
        "a sampler on a loopback-only Ray cluster, no --metrics-addr",
        "/metrics binds 127.0.0.1, the node's registered address (it bound the outward one)",
    )


def test_slow_clients_lose_their_slots_at_the_request_deadline(monkeypatch, record_fault):
    """N4 (second tester): sixteen clients trickling a header byte now and then, never idle
    long enough to time out, lose their slots at the whole-request deadline; a scrape then
    gets through."""
    import contextlib
    import socket
    import urllib.request

    from collector.export import prometheus
    from collector.export.prometheus import MAX_CONNECTIONS, SamplerCollector, serve

    monkeypatch.setattr(prometheus, "REQUEST_DEADLINE_S", 1.0)
    server, port = serve(SamplerCollector(lambda: []), "127.0.0.1", 0)
    stop = threading.Event()
    socks = [
        socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_CONNECTIONS)
    ]

    def trickle() -> None:
        while not stop.wait(0.2):
            for s in socks:
                with contextlib.suppress(OSError):
                    s.send(b"X")

    threading.Thread(target=trickle, daemon=True).start()
    try:
        wait_for(lambda: server.failed["deadline"] >= MAX_CONNECTIONS, timeout=60)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.status == 200
    finally:
        stop.set()
        for s in socks:
            s.close()
        server.shutdown()
    record_fault(
        f"{MAX_CONNECTIONS} clients trickling a byte every 0.2 s at a sampler's /metrics",
        "each connection is cut at the whole-request deadline; scrapes get through again",
        cut=server.failed["deadline"],
    )


def test_slow_clients_that_reconnect_cannot_keep_a_scrape_out(record_fault):
    """L9: sixteen clients that trickle a byte and reconnect the moment they are cut took the
    slots back at once and refused 26 of 30 scrapes. A scrape sends its whole request at once,
    so it takes over the slot of the oldest slow client and is answered: 20 of 20 here."""
    import contextlib
    import socket
    import urllib.request

    from collector.export.prometheus import MAX_CONNECTIONS, SamplerCollector, serve

    server, port = serve(SamplerCollector(lambda: []), "127.0.0.1", 0)
    stop = threading.Event()

    def attacker() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                with s:
                    s.sendall(b"GET /metrics HTTP/1.1\r\n")
                    s.settimeout(0.2)
                    while not stop.is_set():
                        try:
                            if not s.recv(1):
                                break  # cut by the server: reconnect at once
                        except TimeoutError:
                            s.send(b"X")

    threads = [threading.Thread(target=attacker, daemon=True) for _ in range(MAX_CONNECTIONS)]
    for t in threads:
        t.start()
    ok = 0
    try:
        wait_for(lambda: len(server._open) >= MAX_CONNECTIONS, timeout=30)
        for _ in range(20):
            url = f"http://127.0.0.1:{port}/metrics"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=10) as r:
                ok += r.status == 200
    finally:
        stop.set()
        server.shutdown()
    assert ok == 20, f"{ok} of 20 scrapes answered"
    assert server.taken_over >= 20
    record_fault(
        f"{MAX_CONNECTIONS} slow clients that reconnect as soon as they are cut, and 20 scrapes",
        "each scrape takes over the oldest slow client's slot and is answered",
        scrapes_answered=ok,
    )
