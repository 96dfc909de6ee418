"""Captures (format, validation) and the replay backend, on the captures recorded on the H200."""

import json
import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from collector.nvml import NvmlGpuLost, NvmlNotFound
from collector.replay import (
    Capture,
    CaptureError,
    ReplayBackend,
    ReplayDevice,
    builtin_captures,
    replay_uuid,
    resolve_capture,
)
from tests.caps import CASES, hostile, stepped
from tests.cli import bad_input, one_line_error, stepmem
from tests.records import RECORDS, ROOT

GIB = 1 << 30


def small_capture() -> Capture:
    t = np.array([0, 1_000, 2_000, 3_000], dtype=np.int64)
    return Capture(
        t_ns=t,
        used=np.array([1, 5, 2, 9], dtype=np.int64),
        reserved=np.zeros(4, dtype=np.int64),
        device={"uuid": "GPU-x", "total_bytes": 100, "name": "X"},
        name="small",
    )


class Clock:
    def __init__(self, t=0):
        self.t = t

    def __call__(self):
        return self.t


def test_committed_captures_are_real_h200_recordings():
    caps = builtin_captures()
    assert {"idle", "adamw_8bit", "paged_adamw_8bit", "spiky"} <= set(caps)
    total = sum(p.stat().st_size for p in caps.values())
    assert total < 4 * (1 << 20)  # compact: a few MiB in all
    for name, path in caps.items():
        cap = Capture.load(path)
        assert cap.device["name"] == "NVIDIA H200"
        assert cap.device["memory_info_version"] == 2
        assert cap.command.startswith("stepmem capture ")
        assert np.all(np.diff(cap.t_ns) >= 0)
        assert (cap.reserved > 0).all()  # v2 reports driver-reserved memory apart
        if name != "idle":
            assert {e["kind"] for e in cap.events} >= {"begin", "end"}


def test_the_7b_captures_hold_the_seed_effects():
    unpaged = Capture.load(resolve_capture("adamw_8bit"))
    paged = Capture.load(resolve_capture("paged_adamw_8bit"))
    ends = {e["step"]: e for e in unpaged.events if e["kind"] == "end"}
    r1, r2 = (ends[s]["torch"]["reserved_bytes.all.current"] for s in (1, 2))
    assert r2 - r1 > 10 * GIB  # the step-2 jump in reserved memory
    pend = [e for e in paged.events if e["kind"] == "end"][-1]
    assert pend["ledger"]["optimizer_state_managed"] > 10 * GIB


def test_save_load_round_trip(tmp_path):
    cap = small_capture()
    cap.events = [{"kind": "begin", "step": 1, "t_ns": 5, "gpu_uuid": "GPU-x"}]
    path = cap.save(tmp_path / "s.capture.parquet")
    back = Capture.load(path)
    assert back.used.tolist() == [1, 5, 2, 9] and back.events == cap.events
    assert back.device == cap.device and back.name == "s"


def test_max_in_force_counts_the_value_held_at_the_window_start():
    cap = small_capture()
    assert cap.max_in_force(1_500, 2_500) == 5  # 5 is in force from 1000 until 2000
    assert cap.max_in_force(2_000, 2_999) == 2
    assert cap.max_in_force(0, 3_000) == 9


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        (b"this is not parquet", "not a readable Parquet file"),
        ("plain-parquet", "not a stepmem capture"),
    ],
)
def test_bad_captures_give_one_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.capture.parquet"
    if content == "plain-parquet":
        pq.write_table(pa.table({"a": [1, 2]}), path)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(CaptureError, match=message):
        Capture.load(path)


def test_truncated_capture_is_rejected(tmp_path):
    src = resolve_capture("idle").read_bytes()
    path = tmp_path / "cut.capture.parquet"
    path.write_bytes(src[: len(src) // 2])
    with pytest.raises(CaptureError):
        Capture.load(path)


def test_unknown_capture_name_lists_the_committed_ones():
    with pytest.raises(CaptureError, match="adamw_8bit"):
        resolve_capture("no-such-capture")


def test_replay_plays_the_value_in_force_at_real_speed_and_faster():
    from collector.model.records import DeviceInfo

    clock = Clock(10_000)
    info = DeviceInfo("GPU-r", 0, "X", 100)
    dev = ReplayDevice(small_capture(), info, origin_ns=10_000, speed=1.0, clock=clock)
    seen = []
    for t in (10_000, 10_999, 11_000, 12_500, 13_000):
        clock.t = t
        seen.append(dev.read()[0])
    assert seen == [1, 1, 5, 2, 9]
    fast = ReplayDevice(small_capture(), info, origin_ns=0, speed=2.0, clock=clock)
    clock.t = 1_000  # capture time 2000
    assert fast.read()[0] == 2
    assert fast.monotonic_of(3_000) == 1_500


def test_replay_loops_and_can_lose_the_gpu():
    from collector.model.records import DeviceInfo

    clock = Clock(0)
    dev = ReplayDevice(small_capture(), DeviceInfo("GPU-r", 0, "X", 100), 0, clock=clock)
    clock.t = 4_000 + 1_000  # one lap (3000 + one median period) later, at capture time 1000
    assert dev.read()[0] == 5
    dev.lose_at(6_000)
    clock.t = 6_000
    with pytest.raises(NvmlGpuLost):
        dev.read()


def test_replayed_gpus_have_stable_distinct_uuids():
    a = ReplayBackend(["idle"], gpus=3, node_id="n1")
    b = ReplayBackend(["idle"], gpus=3, node_id="n1")
    c = ReplayBackend(["idle"], gpus=3, node_id="n2")
    ua = [d.uuid for d in a.devices()]
    assert ua == [d.uuid for d in b.devices()]
    assert len(set(ua) | {d.uuid for d in c.devices()}) == 6
    assert all(u.startswith("GPU-") and len(u) == 40 for u in ua)
    assert ua[1] == replay_uuid(a.captures[0].device["uuid"], "n1", 1)
    with pytest.raises(NvmlNotFound):
        a.open("GPU-not-here")


def test_replay_backend_rejects_bad_settings():
    with pytest.raises(ValueError, match="at least 1"):
        ReplayBackend(["idle"], gpus=0)
    with pytest.raises(ValueError, match="speed"):
        ReplayBackend(["idle"], speed=0)
    with pytest.raises(CaptureError):
        ReplayBackend([])


def test_only_a_replayed_gpu_takes_replay_controls():
    """The sampler actor's replay-only calls (``replay_from``, ``inject_fault``) check the device
    against the declared :class:`ReplayControl` protocol: a replayed GPU has it, a live one not."""
    from collector.backends import ReplayControl
    from collector.nvml import LiveDevice

    backend = ReplayBackend(["idle"], 1, node_id="n")
    device = backend.open(backend.devices()[0].uuid)
    assert isinstance(device, ReplayControl)
    live = LiveDevice.__new__(LiveDevice)  # no NVML here: the protocol reads attributes only
    assert not isinstance(live, ReplayControl)


def write_capture(path: Path, meta) -> Path:
    table = pa.table({"t_ns": [0, 1000], "used": [1, 2], "reserved": [0, 0]})
    raw = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    pq.write_table(table.replace_schema_metadata({b"stepmem.capture": raw}), path)
    return path


DEVICE = {"uuid": "GPU-x", "total_bytes": 1 << 30}


EV = {"kind": "begin", "step": 1, "t_ns": 0}


@pytest.mark.parametrize(
    ("name", "meta", "needle"),
    [
        ("device-as-string", {"format": 1, "device": "GPU-x", "events": [EV]}, "'device' must"),
        ("list-metadata", [1, 2], "a JSON object was expected"),
        (
            "event-without-t_ns",
            {"format": 1, "device": DEVICE, "events": [{"kind": "begin", "step": 1}]},
            "events[0].t_ns",
        ),
        ("events-as-dict", {"format": 1, "device": DEVICE, "events": {}}, "'events' must"),
        ("no-step-events", {"format": 1, "device": DEVICE, "events": []}, "no step events"),
    ],
)
def test_malformed_captures_are_one_line(tmp_path, name, meta, needle, record_fault):
    cap = write_capture(tmp_path / f"{name}.capture.parquet", meta)
    args = ["run", "--capture", str(cap)]
    bad_input(record_fault, ["run", "--capture", f"{name}.capture.parquet"], stepmem(*args), needle)


def test_a_capture_resampled_by_replay_keeps_its_step_events(tmp_path, record_fault):
    from collector.replay import Capture, resolve_capture

    out = tmp_path / "rs.capture.parquet"
    args = ["capture", "--backend", "replay", "--capture", "spiky", "--rate", "200"]
    res = stepmem(*args, "--duration", "3.5", "--out", str(out))
    assert res.returncode == 0, res.stderr
    src, cap = Capture.load(resolve_capture("spiky")), Capture.load(out)
    assert len(cap.events) == len(src.events) > 0
    assert [(e["kind"], e["step"]) for e in cap.events] == [
        (e["kind"], e["step"]) for e in src.events
    ]
    # the relative timing survives (within the 5 ms a 200 Hz sampler's start can shift it)
    d_src = src.events[-1]["t_ns"] - src.events[0]["t_ns"]
    d_cap = cap.events[-1]["t_ns"] - cap.events[0]["t_ns"]
    assert abs(d_cap - d_src) < 5_000_000
    same = stepmem(*args, "--duration", "1", "--out", str(out), "--capture", str(out))
    line = one_line_error(same, "is the capture being resampled")
    assert Capture.load(out).events == cap.events  # the input is intact
    record_fault(
        "capture --backend replay (resampling spiky at 200 Hz)",
        f"the new capture keeps all {len(cap.events)} step events; --out equal to the input: "
        f"'{line}', exit 2, input intact",
    )


@pytest.mark.ray
def test_a_replay_too_fast_to_sample_says_so_and_never_reports_zero(tmp_path, record_fault):
    """`--speed 1e9` plays every step in well under a sampling period: no step has samples."""
    out = tmp_path / "r.json"
    args = ["run", "--speed", "1e9", "--steps", "500", "--out", str(out)]
    res = stepmem(*args, "--store", str(tmp_path / "runs"), "--run-id", "fast")
    # F11: a run that measured nothing on the GPU does not exit as if it had
    assert res.returncode == 3, res.stderr
    assert "nothing was measured on the GPU" in res.stderr
    assert "--steps 500, but the capture(s) hold 5 steps (adamw_8bit)" in res.stdout
    assert "have no NVML samples" in res.stdout
    # no NVML figure is made up: no peak, no headroom, no (negative) memory outside torch
    assert "Largest within-step peak" not in res.stdout and "headroom" not in res.stdout
    assert "outside the torch allocator" not in res.stdout
    assert not re.search(r"-\d+(\.\d+)? GiB", res.stdout)  # no negative figure anywhere
    doc = json.loads(out.read_text())
    unmeasured = [r for r in doc["records"] if r["nvml_peak_bytes"] is None]
    assert len(unmeasured) == len(doc["records"]) > 0
    assert all(r["gap"] == "no_samples" for r in unmeasured)
    rep = stepmem("report", str(tmp_path / "runs" / "fast"))
    assert rep.returncode == 0 and "have no NVML samples" in rep.stdout
    cmp = stepmem("compare", str(RECORDS), str(out))
    assert cmp.returncode == 1 and "Cannot compare" in cmp.stdout
    record_fault(
        "replay at --speed 1e9 (steps far shorter than the sampling period)",
        "steps shown as '—' and named (no_samples), no 0.00 GiB figure; the run exits 3, "
        "'nothing was measured on the GPU'; compare against it exits 1 'Cannot compare'",
        steps_without_samples=len(unmeasured),
        steps=len(doc["records"]),
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_capture_holding_what_no_gpu_gives_is_one_line(tmp_path, case, record_fault):
    cap = hostile(tmp_path / "bad.capture.parquet", case)
    t0 = time.monotonic()
    res = stepmem("run", "--capture", str(cap), "--no-store", timeout=60)
    line = one_line_error(res, CASES[case])
    assert time.monotonic() - t0 < 30  # refused before Ray starts, never a hang
    record_fault(
        f"hostile capture: {case}",
        f"{line} — nothing started",
        seconds=round(time.monotonic() - t0, 1),
    )


def test_a_capture_with_more_rows_than_a_replay_holds_is_refused(tmp_path, monkeypatch):
    from collector import replay
    from collector.replay import Capture, CaptureError

    path = stepped([1, 2]).save(tmp_path / "c.capture.parquet")
    monkeypatch.setattr(replay, "MAX_ROWS", 100)
    replay._load_cached.cache_clear()
    with pytest.raises(CaptureError, match="at most 100"):
        Capture.load(path)
    monkeypatch.undo()
    replay._load_cached.cache_clear()
    dev = replay.ReplayBackend([str(path)]).open(
        replay.ReplayBackend([str(path)]).devices()[0].uuid
    )
    import numpy as np

    assert isinstance(dev._used, np.ndarray)  # 8 bytes a value, not a Python int each


def test_a_capture_whose_step_ends_before_it_begins_is_refused(tmp_path):
    """Step 1's end moved 1 µs before its begin: the replay dropped the step without a word
    (exit 0, steps 2 and 3 only); now the capture is refused naming the event."""
    import copy
    import dataclasses

    from collector.replay import Capture

    cap = Capture.load(ROOT / "captures" / "spiky.capture.parquet")
    events = copy.deepcopy(cap.events)
    begin = next(e for e in events if e["kind"] == "begin" and e["step"] == 1)
    end = next(e for e in events if e["kind"] == "end" and e["step"] == 1)
    end["t_ns"] = begin["t_ns"] - 1000
    bad = dataclasses.replace(cap, events=events).save(tmp_path / "bad.capture.parquet")
    with pytest.raises(CaptureError, match=r"the end of step 1, comes before its begin"):
        Capture.load(bad)
    res = stepmem("run", "--capture", str(bad), "--no-store", "--steps", "3")
    assert res.returncode == 2 and "comes before its begin" in res.stderr, res.stderr
