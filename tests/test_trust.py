"""Nothing lost, nothing wrong, never a traceback: the failures a new user met on a fresh clone.

Each test feeds one bad input or one hostile situation to the real command and checks the one
line the user sees, the exit code, and that no data was lost or written wrongly. Each records
its row for the fault table (``python benchmarks/faults.py``) once its assertions pass.
"""

from __future__ import annotations

import copy
import json
import re
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from collector.compare import compare
from collector.diagnosis import diagnose
from collector.report import render_report
from collector.runs import load_run
from collector.store import RunStore, RunWriter
from tests.test_cli import one_line_error, start_run, stepmem

ROOT = Path(__file__).resolve().parent.parent
H200 = ROOT / "benchmarks" / "results" / "h200-run2"
RECORDS = H200 / "adamw_8bit.records.json"


def bad_input(record_fault, args, res, *needles, intact: str = "nothing written"):
    """One line, exit 2, no traceback; the row names the input, the line and what stayed intact."""
    line = one_line_error(res, *needles)
    record_fault(f"bad input: stepmem {' '.join(args)}", f"{line} — {intact}")
    return line


# -- 1. a run never overwrites another, and stays inside --store --------------------------------


def test_an_existing_run_id_is_refused_and_the_old_run_is_untouched(tmp_path, record_fault):
    old = tmp_path / "runs" / "x"
    RunWriter(old, {"run_id": "x"}).close()
    before = (old / "meta.json").read_bytes()
    args = ["run", "--store", str(tmp_path / "runs"), "--run-id", "x", "--steps", "1"]
    res = stepmem(*args)
    bad_input(
        record_fault,
        ["run", "--store", "runs", "--run-id", "x"],
        res,
        "already exists",
        str(old),
        intact="the existing run's meta.json byte for byte the same",
    )
    assert (old / "meta.json").read_bytes() == before
    assert sorted(p.name for p in old.iterdir()) == ["events", "meta.json", "samples", "steps"]


@pytest.mark.parametrize("run_id", ["../escaped", "a/b", "/abs", ".", "..", "x" * 200])
def test_a_run_id_that_is_not_a_plain_name_is_refused(tmp_path, run_id, record_fault):
    (tmp_path / "runs").mkdir()
    res = stepmem("run", "--store", str(tmp_path / "runs"), "--run-id", run_id)
    line = one_line_error(res, "--run-id")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert list((tmp_path / "runs").iterdir()) == []
    if run_id == "../escaped":
        record_fault(
            "bad input: stepmem run --run-id ../escaped",
            f"{line} — nothing written inside or outside --store",
        )


def test_the_store_itself_refuses_to_write_over_a_run(tmp_path):
    from collector.store import StoreError

    RunWriter(tmp_path / "r", {"run_id": "r"}).close("complete")
    with pytest.raises(StoreError, match="already holds a run"):
        RunWriter(tmp_path / "r", {"run_id": "r"})
    assert RunStore(tmp_path / "r").meta["status"] == "complete"


# -- 2. a step without NVML samples is never 0 bytes ------------------------------------------


def unmeasured_run() -> tuple[list[dict], int]:
    """The H200 adamw_8bit records with steps 3-5 stripped of their NVML figures, as a sampler
    that read nothing inside them leaves them."""
    doc = json.loads(RECORDS.read_text())
    recs = copy.deepcopy(doc["records"])
    for r in recs:
        if r["step"] in (3, 4, 5):
            r.update(
                samples=0,
                gap="no_samples",
                nvml_peak_bytes=None,
                nvml_peak_t_ns=None,
                nvml_min_bytes=None,
                nvml_end_bytes=None,
                nvml_reserved_bytes=None,
            )
            for ph in r.get("phases") or []:
                ph["nvml_peak_bytes"] = None
    return recs, doc["samplers"][0]["total_bytes"]


def test_steps_without_samples_are_named_and_left_out_not_zero(tmp_path):
    recs, total = unmeasured_run()
    fs = diagnose(recs, total)
    assert fs[0].rule == "unmeasured" and "3 of " in fs[0].text and "step 3–5" in fs[0].text
    nontorch = next(f for f in fs if f.rule == "nontorch")
    assert nontorch.numbers["nontorch"] > 0
    head = next(f for f in fs if f.rule == "headroom")
    assert head.numbers["peak"] == max(r["nvml_peak_bytes"] or 0 for r in recs)
    # the table shows them as missing
    from collector.runs import Run

    out, _ = render_report(Run("r", {"samplers": []}, recs))
    row3 = next(
        line for line in out.splitlines() if line.strip().startswith("│ 3 ") or " 3 │" in line
    )
    assert "—" in row3 and "0.00" not in row3.split("│")[2]


def test_an_oom_step_without_samples_never_reached_zero():
    recs, total = unmeasured_run()
    last = max(r["step"] for r in recs)
    failed = next(r for r in recs if r["step"] == last)
    failed.update(
        error="OutOfMemoryError", samples=0, gap="no_samples", nvml_peak_bytes=None,
        nvml_end_bytes=None, nvml_min_bytes=None, nvml_peak_t_ns=None,
    )  # fmt: skip
    (oom,) = [f for f in diagnose(recs, total) if f.rule == "oom"]
    assert "reached 0.00" not in oom.text and "NVML has no sample inside it" in oom.text


def test_compare_fails_when_the_new_runs_steps_lack_samples(tmp_path, record_fault):
    recs, _ = unmeasured_run()
    doc = json.loads(RECORDS.read_text())
    new = tmp_path / "new.json"
    new.write_text(json.dumps({**doc, "records": recs}))
    res = stepmem("compare", str(RECORDS), str(new))
    assert res.returncode == 1, res
    assert "Cannot compare" in res.stdout and "3 of NEW's steps have no NVML samples" in res.stdout
    assert "0.00 →" not in res.stdout and "→ 0.00" not in res.stdout
    # the other way round: BASE's largest peak is unknown as well, so NEW cannot be judged
    res2 = stepmem("compare", str(new), str(RECORDS))
    assert res2.returncode == 1 and "3 of BASE's steps have no NVML samples" in res2.stdout
    record_fault(
        "compare: NEW's steps 3-5 without NVML samples",
        "exit 1, 'Cannot compare: 3 of NEW's steps have no NVML samples'; no 0.00 GiB cell",
    )


def test_a_few_unsampled_steps_of_a_long_run_do_not_stop_the_gate(tmp_path, record_fault):
    """A 100-step run whose sampler was starved in 2 steps (a loaded CI machine), against
    itself: judged on the other 98 steps' NVML and every step's torch peaks, and it says so;
    a growth in NEW is still caught; above --max-unsampled it cannot be compared."""
    from collector.runs import Run

    doc = json.loads(RECORDS.read_text())
    steady = [r for r in doc["records"] if r["step"] >= 3]
    recs = []
    for k in range(100):
        x = copy.deepcopy(steady[k % len(steady)])
        x.update(step=k + 1, seq=k + 1)
        recs.append(x)
    for r in recs[40:42]:
        r.update(samples=0, gap="no_samples", nvml_peak_bytes=None, nvml_peak_t_ns=None,
                 nvml_min_bytes=None, nvml_end_bytes=None, nvml_reserved_bytes=None)  # fmt: skip
    meta = {k: v for k, v in doc.items() if k != "records"}
    run = Run("r", {**meta, "status": "complete"}, recs)
    md, failed = compare(run, run, 0.05)
    assert not failed, md
    assert "2 of NEW's 100 steps have no NVML samples (2.0 %, within the 5 % allowed)" in md
    grown = copy.deepcopy(recs)
    grown[70]["nvml_peak_bytes"] = int(grown[70]["nvml_peak_bytes"] * 1.2)
    md, failed = compare(run, Run("g", {**meta, "status": "complete"}, grown), 0.05)
    assert failed and "NVML within-step peak grew" in md and "Cannot compare" not in md
    md, failed = compare(run, run, 0.05, max_unsampled=0.01)
    assert failed and "Cannot compare" in md and "more than the 1 % allowed" in md
    record_fault(
        "compare: 2 of 100 steps without NVML samples (a starved sampler)",
        "judged on the other 98 (said); +20 % in one step still fails; --max-unsampled 1% refuses",
    )


@pytest.mark.ray
def test_a_replay_too_fast_to_sample_says_so_and_never_reports_zero(tmp_path, record_fault):
    """`--speed 1e9` plays every step in well under a sampling period: no step has samples."""
    out = tmp_path / "r.json"
    args = ["run", "--speed", "1e9", "--steps", "500", "--out", str(out)]
    res = stepmem(*args, "--store", str(tmp_path / "runs"), "--run-id", "fast")
    assert res.returncode == 0, res.stderr
    assert "--steps 500, but the capture(s) hold 5 steps (adamw_8bit)" in res.stdout
    assert "have no NVML samples" in res.stdout
    # no NVML figure is made up: no peak, no headroom, no (negative) memory outside torch
    assert "Largest within-step peak" not in res.stdout and "headroom" not in res.stdout
    assert "outside the torch allocator" not in res.stdout
    assert not re.search(r"-\d+(\.\d+)? GiB", res.stdout)  # no negative figure anywhere
    doc = json.loads(out.read_text())
    unmeasured = [r for r in doc["records"] if r["nvml_peak_bytes"] is None]
    assert unmeasured and all(r["gap"] == "no_samples" for r in unmeasured)
    rep = stepmem("report", str(tmp_path / "runs" / "fast"))
    assert rep.returncode == 0 and "have no NVML samples" in rep.stdout
    cmp = stepmem("compare", str(RECORDS), str(out))
    assert cmp.returncode == 1 and "Cannot compare" in cmp.stdout
    record_fault(
        "replay at --speed 1e9 (steps far shorter than the sampling period)",
        "steps shown as '—' and named (no_samples), no 0.00 GiB figure; compare against it "
        "exits 1 'Cannot compare'",
        steps_without_samples=len(unmeasured),
        steps=len(doc["records"]),
    )


# -- 4. compare checks every GPU ----------------------------------------------------------------


def test_compare_of_runs_with_different_gpu_counts_fails(tmp_path, record_fault):
    doc = json.loads(RECORDS.read_text())
    two = copy.deepcopy(doc)
    s2 = {**doc["samplers"][0], "gpu_uuid": "GPU-second", "index": 1}
    two["samplers"].append(s2)
    two["records"] += [{**r, "gpu_uuid": "GPU-second"} for r in copy.deepcopy(doc["records"])]
    p2 = tmp_path / "two.json"
    p2.write_text(json.dumps(two))
    res = stepmem("compare", str(RECORDS), str(p2))
    assert res.returncode == 1 and "GPU counts differ: BASE has 1, NEW has 2" in res.stdout
    md, failed = compare(load_run(p2), load_run(p2), 0.05)
    assert not failed and "### GPU 1" in md  # the same shape: every GPU compared
    record_fault(
        "compare: a 1-GPU BASE against a 2-GPU NEW",
        "exit 1, 'Cannot compare: GPU counts differ: BASE has 1, NEW has 2'",
    )


# -- 5. report says how the run ended -----------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "needle"), [("interrupted", "INTERRUPTED"), ("running", "UNFINISHED")]
)
def test_report_says_a_run_was_interrupted_or_never_finished(
    tmp_path, status, needle, record_fault
):
    doc = json.loads(RECORDS.read_text())
    w = RunWriter(tmp_path / "run", {"run_id": "r", "samplers": doc["samplers"]})
    w.add_records(copy.deepcopy(doc["records"][:4]))
    if status == "running":
        w.flush()  # SIGKILL: never closed
    else:
        w.close(status)
    res = stepmem("report", str(tmp_path / "run"))
    assert res.returncode == 0 and needle in res.stdout
    (line,) = [ln for ln in res.stdout.splitlines() if needle in ln]
    how = "stopped by a signal" if status == "interrupted" else "killed (SIGKILL), never closed"
    record_fault(f"`stepmem report` on a run {how}", f"the report says so: '{line.strip()}'")


# -- never a traceback ----------------------------------------------------------------------------


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


def _run_doc() -> dict:
    return json.loads(RECORDS.read_text())


@pytest.mark.parametrize(
    ("case", "mutate", "needle"),
    [
        ("records as a dict", lambda d: d.update(records={}), "'records' must be a list"),
        ("step as a string", lambda d: d["records"][0].update(step="1"), "record 0: step"),
        (
            "nvml peak as a string",
            lambda d: d["records"][2].update(nvml_peak_bytes="88 GiB"),
            "record 2: nvml_peak_bytes",
        ),
        ("torch_end as a list", lambda d: d["records"][1].update(torch_end=[1]), "torch_end"),
        ("samplers as a string", lambda d: d.update(samplers="gpu0"), "'samplers' must be"),
        (
            "total_bytes as a string",
            lambda d: d["samplers"][0].update(total_bytes="140GiB"),
            "samplers[0].total_bytes",
        ),
    ],
)
@pytest.mark.parametrize("command", ["report", "compare", "baseline"])
def test_records_with_wrong_types_are_one_line(
    tmp_path, case, mutate, needle, command, record_fault
):
    doc = _run_doc()
    mutate(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    args = {
        "report": ["report", str(bad)],
        "compare": ["compare", str(RECORDS), str(bad)],
        "baseline": ["baseline", str(bad), "--out", str(tmp_path / "b.yml")],
    }[command]
    # baseline reads only the records and the samplers' workload: its line names the file
    line = one_line_error(stepmem(*args), needle if command != "baseline" else "bad.json")
    assert not (tmp_path / "b.yml").exists()
    if command == "report":
        record_fault(f"bad input: stepmem report RECORDS ({case})", line)


@pytest.mark.parametrize(
    ("case", "meta", "needle"),
    [
        ("a list", [1, 2, 3], "must be a JSON object"),
        (
            "samplers with a string index",
            {
                "format": 1,
                "samplers": [{"gpu_uuid": "G", "node_id": "n", "index": "0", "total_bytes": 1}],
            },
            "samplers[0].index",
        ),
        ("status as a number", {"format": 1, "status": 3}, "status must be a string"),
    ],
)
def test_a_malformed_meta_json_is_one_line(tmp_path, case, meta, needle, record_fault):
    run = tmp_path / "run"
    (run / "steps").mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps(meta))
    line = one_line_error(stepmem("report", str(run)), needle)
    record_fault(f"bad input: stepmem report RUN (meta.json: {case})", line)


def test_baseline_never_overwrites_a_file_that_is_not_a_baseline(tmp_path, record_fault):
    rules = ROOT / "deploy" / "prometheus" / "rules" / "stepmem.yml"
    other = tmp_path / "alerts.yml"
    other.write_text(rules.read_text())
    broken = tmp_path / "broken.yml"
    broken.write_text("groups: [unclosed\n")
    lines = {}
    for target, merge, needle in (
        (broken, True, "not a stepmem baseline file"),
        (other, False, "not a stepmem baseline file"),
        (other, True, "not a stepmem baseline file"),
    ):
        before = target.read_text()
        args = ["baseline", str(RECORDS), "--out", str(target), "--workload", "finetune"]
        args += ["--merge"] if merge else []
        lines[target.name] = one_line_error(stepmem(*args), needle)
        assert target.read_text() == before
    for name, what in (("broken.yml", "INVALID.yml"), ("alerts.yml", "ALERT_RULES.yml")):
        record_fault(
            f"bad input: stepmem baseline RECORDS --merge --out {what}",
            f"{lines[name]} — the file is left byte for byte as it was",
        )
    # a baseline file with another workload: kept with --merge, refused without it
    mine = tmp_path / "baselines.yml"
    assert stepmem("baseline", str(RECORDS), "--out", str(mine), "--workload", "a").returncode == 0
    one_line_error(
        stepmem("baseline", str(RECORDS), "--out", str(mine), "--workload", "b"), "--merge"
    )
    res = stepmem("baseline", str(RECORDS), "--out", str(mine), "--workload", "b", "--merge")
    assert res.returncode == 0
    from collector.baseline import read_rules

    assert sorted(read_rules(mine)) == ["a", "b"]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["run", "--capture", "idle"], ["holds no step events"]),
        (["run", "--backend", "nvml"], ["needs a GPU", "--backend replay"]),
        (["run", "--metrics-port", "65535", "--gpus", "2"], ["65536", "65535"]),
        (["run", "--metrics-addr", "no-such-host.invalid"], ["--metrics-addr", "does not resolve"]),
        (["run", "--out", "/nonexistent/dir/r.json"], ["--out", "does not exist"]),
        (["run", "--out", "/proc/r.json"], ["--out", "cannot write in /proc"]),
        (["run", "--out", "/tmp"], ["--out", "is a directory"]),
        (["run", "--gpus", "10000"], ["--gpus 10000", "at most 64"]),
        (["run", "--speed", "1e-9"], ["--speed", "longest replay is one day"]),
        (["run", "--workload", "spiky"], ["--workload", "--capture spiky"]),
        (["run", "--", "--optim", "adamw_8bit"], ["workload arguments", "replay"]),
        (["devices", "--backend", "nvml"], ["NVML"]),
        (["daemon", "--gpus", "10000", "--backend", "replay"], ["at most 64"]),
    ],
)
def test_checked_before_anything_starts(args, needles, record_fault):
    res = stepmem(*args, timeout=60)
    line = one_line_error(res, *needles)
    record_fault(f"bad input: stepmem {' '.join(args)}", line)


def test_a_bug_says_it_is_a_bug(monkeypatch, capsys):
    from collector import cli

    def broken(ns):
        raise KeyError("internal")

    monkeypatch.setattr(cli, "_cmd_dashboards", broken)
    rc = cli.main(["dashboards", "--out", "/tmp/unused"])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_BUG and "Traceback" in err and "this is a bug in stepmem" in err


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


# -- the run store's default: durable, and said ---------------------------------------------------


def test_the_default_store_outlives_a_submitted_jobs_working_directory(tmp_path, monkeypatch):
    from collector.cli import default_store

    for var in ("STEPMEM_STORE", "RAY_JOB_CONFIG_JSON_ENV_VAR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert default_store() == Path("runs")  # a plain run: here
    # `ray job submit` runs the entrypoint in a copy of the working dir that Ray deletes
    copy_dir = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "pkg"
    copy_dir.mkdir(parents=True)
    monkeypatch.chdir(copy_dir)
    assert default_store() == tmp_path / "home" / "stepmem-runs"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # set by Ray for a submitted job
    assert default_store() == tmp_path / "home" / "stepmem-runs"
    monkeypatch.setenv("STEPMEM_STORE", str(tmp_path / "mine"))  # the user's choice wins
    assert default_store() == tmp_path / "mine"


# -- clean processes: a killed or thrice-interrupted run leaves no Ray process behind ----------


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
