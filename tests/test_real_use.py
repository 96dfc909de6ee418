"""stepmem in ordinary real use rather than the lab: steps numbered per epoch, two runs sharing
one Ray cluster, a disk that fills up, a run stopped with Ctrl-C, a sampler's node lost, a
remote-write receiver that is gone or redirects. Each on a real local Ray cluster (replay
backend) through the real command, each recording its fault-table row once its assertions pass.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from collector.store import RunStore
from tests.caps import GIB, MIB, stepped
from tests.cli import launched, stepmem
from tests.conftest import wait_for

pytestmark = pytest.mark.ray

CLI = [sys.executable, "-m", "collector.cli"]


def _lines(text: str, needle: str) -> list[str]:
    return [ln for ln in text.splitlines() if needle in ln]


def test_steps_numbered_per_epoch_are_all_kept_in_order(tmp_path, record_fault):
    """Two epochs of steps 1-3 (enumerate(loader) restarting): six steps everywhere."""
    cap = stepped([1, 2, 3, 1, 2, 3], grow=256 * MIB).save(tmp_path / "epochs.capture.parquet")
    res = stepmem("run", "--capture", str(cap), "--store", str(tmp_path / "runs"), "--run-id", "ep")
    assert res.returncode == 0, res.stderr
    store = RunStore(tmp_path / "runs" / "ep")
    recs = store.records()
    assert [(r.step, r.seq) for r in recs] == [(1, 1), (2, 2), (3, 3), (1, 4), (2, 5), (3, 6)]
    peaks = [r.nvml_peak_bytes for r in recs]
    assert peaks == sorted(peaks) and peaks[-1] - peaks[0] == 5 * 256 * MIB  # each its own
    for text in (res.stdout, stepmem("report", str(tmp_path / "runs" / "ep")).stdout):
        assert "Step numbers repeat" in text
        rows = [ln for ln in text.splitlines() if ln.startswith("│") and "│ # " not in ln]
        assert len(rows) == 6, text
    # the diagnosis numbers them by their order: a growth over six steps, not "step 1→1"
    assert "1→1" not in res.stdout
    assert (
        stepmem("compare", str(tmp_path / "runs" / "ep"), str(tmp_path / "runs" / "ep")).returncode
        == 0
    )
    record_fault(
        "steps numbered per epoch (1-3, 1-3): the caller's numbers repeat",
        "every step stored and reported, in the order it ran, each with its own peak (# beside "
        "the caller's number); nothing merged or lost",
        steps_stored=len(recs),
        steps_lost=6 - len(recs),
    )


@pytest.fixture
def ray_head(tmp_path):
    """A `ray start --head --block` on loopback in a session of its own, as a shared cluster:
    its address. Stopped by signalling that session only (`ray stop` would stop every Ray
    process on the machine, this test session's own cluster and driver among them)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    ray = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--include-dashboard=false", "--num-cpus=2", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:  # the GCS answers on its port
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if head.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("the Ray head did not start")
                time.sleep(0.5)
        time.sleep(2)  # the raylet registers just after the GCS answers
        yield f"127.0.0.1:{port}"
    finally:
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            try:
                head.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            # the head is gone; whatever of its session is left goes too
            subprocess.run(["pkill", "-KILL", "-s", str(head.pid)], capture_output=True)
            break


def test_two_runs_on_one_cluster_keep_their_own_data_and_samplers(tmp_path, ray_head, record_fault):
    short = stepped([1, 2, 3], base=10 * GIB).save(tmp_path / "short.capture.parquet")
    long = stepped(list(range(1, 13)), base=30 * GIB).save(tmp_path / "long.capture.parquet")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    runs = tmp_path / "runs"

    def run(cap, run_id):
        return subprocess.Popen(
            [*CLI, "run", "--address", ray_head, "--capture", str(cap), "--store", str(runs),
             "--run-id", run_id],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip

    b = run(long, "long")
    time.sleep(1.0)  # both share the one replayed GPU UUID of this node, as two jobs one GPU
    a = run(short, "short")
    _, err_a = a.communicate(timeout=300)
    _, err_b = b.communicate(timeout=300)
    assert a.returncode == 0 and b.returncode == 0, (err_a, err_b)
    sa, sb = RunStore(runs / "short"), RunStore(runs / "long")
    assert sa.meta["status"] == sb.meta["status"] == "complete"
    assert [r.step for r in sa.records()] == [1, 2, 3]
    assert [r.step for r in sb.records()] == list(range(1, 13))  # short's end stopped nothing
    (ua,), (ub,) = sa.gpus(), sb.gpus()
    assert ua == ub  # the same GPU, as a real one shared by two jobs
    # each store holds only its own run's memory: 10 GiB + steps vs 30 GiB + steps
    assert sa.samples(ua)["used"].max() < 12 * GIB and sb.samples(ub)["used"].min() >= 30 * GIB
    assert all(r.nvml_peak_bytes < 12 * GIB for r in sa.records())
    assert all(r.nvml_peak_bytes >= 30 * GIB for r in sb.records())
    assert "unreachable" not in err_b
    record_fault(
        "two runs at once on one Ray cluster and one GPU (a 3-step and a 12-step replay)",
        "each run places and stops its own samplers: each store holds only its own steps and "
        "samples; the first to finish stops nothing of the other",
        steps_lost=(3 - len(sa.records())) + (12 - len(sb.records())),
        foreign_samples=int((sa.samples(ua)["used"] >= 30 * GIB).sum()),
    )


def _tiny_fs(path: Path, size: str) -> bool:
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True)  # fmt: skip
    return res.returncode == 0


def test_a_full_disk_leaves_an_incomplete_store_that_says_so_and_fails_the_run(
    tmp_path, record_fault
):
    disk = tmp_path / "disk"
    if not _tiny_fs(disk, "320k"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        cap = stepped(list(range(1, 51)), step_s=0.2)  # enough samples even when loaded
        rng = np.random.default_rng(0)
        cap.used = cap.used + rng.integers(
            0, 64 * MIB, len(cap.used)
        )  # samples that do not compress
        cap.save(tmp_path / "noisy.capture.parquet")
        res = stepmem("run", "--capture", str(tmp_path / "noisy.capture.parquet"),
                      "--store", str(disk), "--run-id", "full")  # fmt: skip
        assert res.returncode == 3, (res.stdout[-2000:], res.stderr[-2000:])
        assert "the run ended but its record is incomplete" in res.stderr
        meta = json.loads((disk / "full" / "meta.json").read_text())
        assert meta["status"] == "incomplete" and meta["write_errors"] and meta["problems"]
        assert not list((disk / "full").glob(".meta.json*.tmp"))
        rep = stepmem("report", str(disk / "full"))
        assert rep.returncode == 0
        lines = rep.stdout.splitlines()
        first = next(i for i, ln in enumerate(lines) if ln.startswith("Run INCOMPLETE"))
        assert first <= 3 and "could not write" in lines[first + 1], lines[:6]
        record_fault(
            "the disk holding the run store fills up mid-run (a 320 KiB tmpfs)",
            "exit 3, one line naming what could not be written; meta.json written from the room "
            "set aside: status incomplete with the write errors; the report leads with them",
            parts_not_written=sum(meta["write_errors"].values()),
        )
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_ctrl_c_with_no_store_still_writes_the_steps_done(tmp_path, record_fault):
    cap = stepped(list(range(1, 41)), step_s=0.25).save(tmp_path / "long.capture.parquet")
    out = tmp_path / "r.json"
    proc = subprocess.Popen([*CLI, "run", "--capture", str(cap), "--no-store", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "replayed step 4" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    doc = json.loads(out.read_text())
    assert doc["status"] == "interrupted" and len(doc["records"]) >= 4
    assert "(the run was interrupted)" in rest
    record_fault(
        "Ctrl-C during `stepmem run --no-store --out FILE`",
        "exit 130; FILE holds every step that ended, marked interrupted",
        steps_kept=len(doc["records"]),
    )


def test_a_replayed_run_that_failed_fails_its_replay_and_its_headroom_says_what_was_measured(
    tmp_path,
):
    cap = stepped([1, 2, 3, 4])
    end = next(e for e in reversed(cap.events) if e["kind"] == "end")
    end["phase"] = "error:OutOfMemoryError"
    path = cap.save(tmp_path / "oom.capture.parquet")
    res = stepmem("run", "--capture", str(path), "--no-store")
    assert res.returncode == 1, res.stderr
    assert "failed at step 4" in res.stderr and "OutOfMemoryError, as recorded" in res.stderr
    assert "Step 4 hit a CUDA out-of-memory error" in res.stdout


def _processes_of(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every descendant of ``pid``."""
    out = []
    kids = {pid}
    for _ in range(6):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if ppid in kids and int(entry.name) not in kids:
                kids.add(int(entry.name))
                out.append((int(entry.name), cmd))
    return out


def test_a_sampler_killed_mid_replay_is_realigned_and_the_store_says_what_was_lost(
    tmp_path, record_fault
):
    """The sampler's process killed at step 8 of 40: Ray restarts it; the new one reads nothing
    until the run aligns it again, so every later step shows the capture's own values (none
    from the wrong moment); the steps in flight are lost, and the store and the exit say so."""
    cap = stepped(list(range(1, 41)), step_s=0.25, spike=2 * GIB)
    path = cap.save(tmp_path / "long.capture.parquet")
    runs = tmp_path / "runs"
    proc = subprocess.Popen([*CLI, "run", "--capture", str(path), "--store", str(runs),
                             "--run-id", "ks"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    killed = []
    for line in proc.stdout:
        if "replayed step 8" in line:
            killed = [
                p for p, cmd in _processes_of(proc.pid) if cmd.startswith("ray::SamplerActor")
            ]
            for p in killed:
                os.kill(p, signal.SIGKILL)
            break
    _, err = proc.communicate(timeout=240)
    assert len(killed) == 1, _processes_of(proc.pid)
    assert proc.returncode == 3, err[-2000:]
    meta = json.loads((runs / "ks" / "meta.json").read_text())
    assert meta["status"] == "incomplete" and meta["sampler_restarts"]
    assert any("restart" in p for p in meta["problems"])
    recs = RunStore(runs / "ks").records()
    # every step measured after the restart is the capture's own: base + k x 256 MiB, the
    # 2 GiB transient inside the step, back down at its end
    expect = {r.step: 10 * GIB + r.step * 256 * MIB for r in recs}
    late = [r for r in recs if r.step > 12 and r.nvml_peak_bytes is not None and not r.gap]
    assert len(late) >= 10  # a loaded machine flags some (undersampled, stale_end); never all
    assert all(r.nvml_peak_bytes == expect[r.step] + 2 * GIB for r in late), [
        (r.step, r.nvml_peak_bytes / GIB) for r in late
    ]
    assert all(r.nvml_end_bytes == expect[r.step] for r in late)
    rep = stepmem("report", str(runs / "ks"))
    assert "Run INCOMPLETE" in rep.stdout and "restart" in rep.stdout
    if len(recs) < 40:  # the steps in flight have a row and a line, not a silent hole
        n = 40 - len(recs)
        assert f"Lost: {n} step{'s' if n > 1 else ''} this process ran" in rep.stdout, rep.stdout
    record_fault(
        "a replayed run's sampler process killed (SIGKILL) at step 8 of 40",
        "Ray restarts it and the run re-aligns its replay: every later step's peak and end equal "
        "the capture's; exit 3 and store status incomplete, naming the restart and the steps it "
        "lost",
        steps_stored=len(recs),
        wrong_values_after_restart=sum(
            1 for r in late if r.nvml_peak_bytes != expect[r.step] + 2 * GIB
        ),
    )


# -- remote write -------------------------------------------------------------------------------


class _Receiver(BaseHTTPRequestHandler):
    hits: list = []  # noqa: RUF012 - set per server
    redirect_to = ""

    def _answer(self):
        self.hits.append({"method": self.command, "path": self.path,
                          "auth": self.headers.get("Authorization")})  # fmt: skip
        if self.redirect_to:
            self.send_response(302)
            self.send_header("Location", self.redirect_to)
            self.end_headers()
        else:
            self.send_response(204)
            self.end_headers()

    do_GET = do_POST = _answer

    def log_message(self, *a):
        pass


def _serve(redirect_to: str = "") -> tuple[ThreadingHTTPServer, list]:
    hits: list = []
    handler = type("H", (_Receiver,), {"hits": hits, "redirect_to": redirect_to})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, hits


def test_remote_write_never_follows_a_redirect_with_the_token(monkeypatch, record_fault):
    from collector.export.remote_write import RemoteWriteConfig, RemoteWriter

    thief, stolen = _serve()
    bouncer, asked = _serve(f"http://127.0.0.1:{thief.server_port}/stolen")
    monkeypatch.setenv("RW_TOKEN", "SuperSecretToken123")
    url = f"http://127.0.0.1:{bouncer.server_port}/api/v1/write"
    w = RemoteWriter(RemoteWriteConfig(url=url, bearer_token_env="RW_TOKEN", flush_interval_s=0.05))
    for i in range(10):
        w.push("stepmem_x", {"gpu": "0"}, 1_700_000_000_000 + i, 1.0)
    w.close(timeout=5)
    try:
        assert asked and all(h["method"] == "POST" for h in asked)
        assert stolen == []  # nothing, and no token, went to the redirect's target
        assert w.sent == 0 and w.dropped["redirected"] == 10
    finally:
        thief.shutdown()
        bouncer.shutdown()
    record_fault(
        "remote-write receiver answers 302 to another host (a bearer token configured)",
        "the redirect is not followed: nothing and no token reach the other host; the samples "
        "are counted as redirected, never as sent",
        requests_to_other_host=len(stolen),
        samples_counted_sent=w.sent,
    )


@pytest.mark.parametrize(
    "answer",
    [b"GARBAGE\r\n\r\n", b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 200 + b"\r\n"],
    ids=["not-http", "200-headers"],
)
def test_a_receiver_that_does_not_speak_http_never_ends_the_writer(answer, record_fault):
    """C4, W6: a URL pointing at the wrong port (an SSH or Redis server): every POST fails,
    counted and retried; the writer thread lives on, and what was never sent is counted once."""
    import socket

    from collector.export.remote_write import RemoteWriteConfig, RemoteWriter

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.5)
    served = threading.Event()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            with c:
                c.settimeout(1.0)
                try:
                    c.recv(65536)
                    c.sendall(answer)
                except OSError:
                    pass
            served.set()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}/api/v1/write"
    w = RemoteWriter(RemoteWriteConfig(url=url, flush_interval_s=0.02, backoff_min_s=0.02))
    for i in range(10):
        w.push("stepmem_x", {"gpu": "0"}, 1_700_000_000_000 + i, 1.0)
    w._wake.set()
    assert served.wait(30)
    alive = w._thread.is_alive()
    w.close(timeout=2)
    stop.set()
    srv.close()
    st = w.stats()
    assert alive and st["sent"] == 0 and st["errors"].get("not_http", 0) >= 1, st
    assert st["pending"] == 0 and st["dropped"] == {"gave_up": 10}, st  # once, not twice
    record_fault(
        f"remote-write receiver that is not HTTP ({answer[:12]!r}…)",
        "each POST counted as failed and retried; the writer thread lives; 10 unsent samples "
        "counted once as given up",
        not_http=st["errors"]["not_http"],
    )


def test_a_run_says_what_remote_write_could_not_deliver_and_stores_no_secret(
    tmp_path, record_fault
):
    cap = stepped([1, 2, 3]).save(tmp_path / "c.capture.parquet")
    url = "http://127.0.0.1:9/api/v1/write?api_key=KeyInQuery777"
    res = stepmem("run", "--capture", str(cap), "--store", str(tmp_path / "runs"),
                  "--run-id", "rw", "--remote-write", url)  # fmt: skip
    assert res.returncode == 0, res.stderr
    (line,) = _lines(res.stdout, "remote write:")
    assert line.startswith("remote write: 0 of ") and "gave_up" in line and "connection" in line
    run = tmp_path / "runs" / "rw"
    everything = b"".join(p.read_bytes() for p in run.rglob("*") if p.is_file())
    assert b"KeyInQuery777" not in everything
    assert "KeyInQuery777" not in res.stdout + res.stderr
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in run.rglob("*") if p.is_file())
    record_fault(
        "remote write to a receiver that is not there (a key in the URL's query)",
        f"the run ends with `{line[:60]}…`; the key is in no file of the store (redacted from "
        "the stored command line); the store is private (0700/0600)",
    )


def _children(pid: int, name: bytes) -> list[int]:
    """Processes whose parent is ``pid`` and whose command is ``name``."""
    out = []
    for st in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = st.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and (st.parent / "comm").read_bytes().strip() == name:
                out.append(int(st.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_during_a_capture_keeps_what_was_recorded(tmp_path, sig, record_fault):
    """Ctrl-C, or SIGTERM, stops a capture and keeps what it recorded — also when the capture
    was started with SIGINT ignored (a background job of a shell, ``nohup … &``: Python then
    installs no handler of its own)."""
    out = tmp_path / "partial.capture.parquet"
    # SIGINT ignored, as a shell's background job starts
    proc = subprocess.Popen(launched([*CLI, "capture", "--backend", "replay", "--capture",
                                      "spiky", "--out", str(out), "--", "sleep", "60"],
                                     sigint="SIG_IGN"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    # the signal once the capture is recording: its command (a child of the capture) is running
    wait_for(lambda: _children(proc.pid, b"sleep"), timeout=120)
    time.sleep(1)  # a second of samples to keep
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, (stdout, stderr)
    from collector.replay import Capture

    cap = Capture.load(out)
    assert cap.notes.get("interrupted") is True and cap.duration_ns > 1e9
    assert "interrupted: what was recorded until then is kept" in stdout
    record_fault(
        "Ctrl-C during `stepmem capture -- CMD`"
        if sig == signal.SIGINT
        else "SIGTERM to `stepmem capture -- CMD`",
        "exit 130; the command stopped; the capture of what was recorded is written (notes: "
        "interrupted)",
        seconds_kept=round(cap.duration_ns / 1e9, 1),
    )


def test_a_replay_shows_the_captures_own_end_readings(tmp_path, record_fault):
    """The spiky capture releases each transient just before its step's end mark: every step
    the replay did not flag ends at the capture's 1.72 GiB — the transient never shows as
    end-of-step memory (a sample is stamped with the moment whose value it shows) — and
    peaks at the capture's value."""
    from collector.replay import Capture, resolve_capture

    cap = Capture.load(resolve_capture("spiky"))
    res = stepmem("run", "--capture", "spiky", "--store", str(tmp_path / "runs"), "--run-id", "sp")
    assert res.returncode == 0, res.stderr
    recs = RunStore(tmp_path / "runs" / "sp").records()
    begins = {e["step"]: e["t_ns"] for e in cap.events if e["kind"] == "begin"}
    ends = {e["step"]: e["t_ns"] for e in cap.events if e["kind"] == "end"}
    clean = [r for r in recs if not r.gap]
    assert len(recs) == 40 and len(clean) >= 10, [r.gap for r in recs]  # loaded: some flagged
    wrong_end = [r.step for r in clean if r.nvml_end_bytes != cap.used[-1]]
    wrong_peak = [
        r.step for r in clean if r.nvml_peak_bytes != cap.max_in_force(begins[r.step], ends[r.step])
    ]
    assert wrong_end == [] and wrong_peak == [], (wrong_end, wrong_peak)
    record_fault(
        "the spiky capture replayed at 1x (transients of 512 MiB-4 GiB released just before "
        "each step's end)",
        "every step not flagged ends at the capture's own reading (1.72 GiB) and peaks at its "
        "transient: none shows the transient as end-of-step memory",
        steps_flagged=len(recs) - len(clean),
        wrong_end_readings=len(wrong_end),
    )
