"""Hostile input, the adversarial trial's round 3: captures, records, flags and files that a
careless or malicious hand could give stepmem. Each gets one line and exit 2 before anything
starts — never a traceback, a hang, a wrong number or code run — and its row in the fault table.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.caps import CASES, hostile, stepped
from tests.test_cli import one_line_error, stepmem

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "results" / "h200-run2" / "adamw_8bit.records.json"
GIB = 1 << 30


# -- captures ----------------------------------------------------------------------------------


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


def test_rich_markup_in_a_phase_name_is_printed_as_text(tmp_path):
    """A phase named like Rich markup is data: the run and its report print it as it is."""
    cap = hostile(tmp_path / "markup.capture.parquet", "phase with markup")
    from collector.replay import Capture

    assert Capture.load(cap).events[0]["phase"] == "[red]opt[/red][/x]"  # a valid capture
    from collector.report import render_report
    from collector.runs import Run

    rec = json.loads(RECORDS.read_text())
    recs = rec["records"]
    recs[0]["phases"][1]["phase"] = "[red]opt[/red][/x]"
    rec["banner"] = "[/bold]oops"
    text, _ = render_report(Run("r", rec, recs))
    assert "[/bold]oops" in text


# -- records ------------------------------------------------------------------------------------


def _doc():
    return json.loads(RECORDS.read_text())


def _set(i, **kw):
    def mutate(doc):
        doc["records"][i].update(kw)

    return mutate


@pytest.mark.parametrize(
    ("case", "mutate", "needle"),
    [
        ("a step given twice", lambda d: d["records"].append(dict(d["records"][1])), "given twice"),
        ("a negative peak", _set(1, nvml_peak_bytes=-1), "non-negative number of bytes"),
        ("a peak of 10^30 bytes", _set(1, nvml_peak_bytes=10**30), "non-negative number of bytes"),
        ("a peak above the card", _set(1, nvml_peak_bytes=200 * GIB), "more than the card's"),
        ("NaN in torch_end", lambda d: d["records"][0]["torch_end"].update(x=float("nan")),
         "finite numbers"),
        ("Infinity in torch_end", lambda d: d["records"][0]["torch_end"].update(x=float("inf")),
         "finite numbers"),
        ("rank outside the world", _set(0, rank=3, world_size=2), "outside world size"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", ["report", "compare"])
def test_records_with_impossible_values_are_one_line(
    tmp_path, case, mutate, needle, command, record_fault
):
    doc = _doc()
    mutate(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc, allow_nan=True))
    args = ["report", str(bad)] if command == "report" else ["compare", str(RECORDS), str(bad)]
    line = one_line_error(stepmem(*args), needle)
    if command == "compare":
        record_fault(f"hostile records: {case}", line)


def test_records_nested_deeper_than_json_reads_are_one_line(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    one_line_error(stepmem("report", str(deep)), "deep.json", "nested too deeply")


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, record_fault):
    bomb = tmp_path / "laughs.yml"
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for x, y in zip("bcdefgh", "abcdefg", strict=True):
        lines.append(f"{x}: &{x} [" + ",".join([f"*{y}"] * 9) + "]")
    bomb.write_text("\n".join(lines) + "\n")
    before = bomb.read_bytes()
    t0 = time.monotonic()
    res = stepmem("baseline", str(RECORDS), "--out", str(bomb), "--merge", "--workload", "x")
    line = one_line_error(res, "not a stepmem baseline file", "aliases")
    assert time.monotonic() - t0 < 30 and bomb.read_bytes() == before
    record_fault("hostile input: a YAML alias bomb as baseline --merge --out", line,
                 seconds=round(time.monotonic() - t0, 1))  # fmt: skip


# -- flags --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["run", "--rate", "1e-300"], ["--rate", "below 0.1 Hz"]),
        (["run", "--speed", "1e300"], ["--speed", "at most 1e+09"]),
        (["run", "--window", "1e300"], ["--window", "at most 86400"]),
        (["daemon", "--rescan", "1e300"], ["--rescan", "at most 86400"]),
        (["compare", str(RECORDS), str(RECORDS), "--tolerance", "5"], ["500 %", "5%"]),
        (["run", "--remote-write", "http://alice:secret@127.0.0.1:9/w"], ["holds credentials"]),
    ],
)
def test_flags_out_of_any_sane_range_are_one_line(args, needles, record_fault):
    line = one_line_error(stepmem(*args, timeout=60), *needles)
    assert "secret" not in line
    record_fault(
        f"bad input: stepmem {' '.join(a if a != str(RECORDS) else 'R.json' for a in args)}", line
    )


def test_tolerance_as_a_percentage(tmp_path):
    res = stepmem("compare", str(RECORDS), str(RECORDS), "--tolerance", "5%")
    assert res.returncode == 0 and "No peak grew by more than 5 %" in res.stdout


def test_a_garbage_ray_address_is_one_line(record_fault):
    env = {**os.environ, "RAY_ADDRESS": "garbage:::1"}
    res = subprocess.run(
        [sys.executable, "-m", "collector.cli", "run", "--no-store", "--steps", "1"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    line = one_line_error(res, "garbage:::1")
    record_fault("bad input: RAY_ADDRESS=garbage:::1 stepmem run", line)


# -- outputs ------------------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path):
    from collector.store import RunWriter

    doc = _doc()
    w = RunWriter(tmp_path / "run", {"run_id": "run", "samplers": doc["samplers"]})
    w.add_records(doc["records"])
    w.close("complete")
    return tmp_path / "run"


def test_an_output_never_overwrites_an_input(tmp_path, run_dir, record_fault):
    base = tmp_path / "base.json"
    base.write_text(RECORDS.read_text())
    cap = stepped([1, 2]).save(tmp_path / "x.capture.parquet")
    meta = str(run_dir / "meta.json")
    cases = {
        "report RUN --out RUN/meta.json": ["report", str(run_dir), "--out", meta],
        "compare BASE NEW --markdown BASE": ["compare", str(base), str(RECORDS), "--markdown",
                                             str(base)],
        "run --capture X --out X": ["run", "--no-store", "--capture", str(cap), "--out", str(cap)],
        "baseline R --out R": ["baseline", str(base), "--out", str(base), "--workload", "x"],
    }  # fmt: skip
    before = {p: p.read_bytes() for p in (run_dir / "meta.json", base, cap)}
    for what, args in cases.items():
        line = one_line_error(stepmem(*args, timeout=60), "input of this command")
        record_fault(f"bad input: stepmem {what}", f"{line} — the input byte for byte the same")
    assert {p: p.read_bytes() for p in before} == before


@pytest.mark.parametrize(
    ("what", "args", "needle"),
    [
        ("report --out into a folder that cannot be written", ["--out", "/proc/r.txt"],
         "cannot write in /proc"),
        ("report --png into a missing folder", ["--png", "{tmp}/nodir/r.png"], "does not exist"),
        ("report --html into a missing folder", ["--html", "{tmp}/nodir/r.html"], "does not exist"),
        ("report --png ending in /", ["--png", "{tmp}/new.png/"], "is a directory"),
    ],
)  # fmt: skip
def test_report_outputs_that_cannot_be_written_are_one_line_before_any_work(
    tmp_path, run_dir, what, args, needle, record_fault
):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    res = stepmem("report", str(run_dir), *args)
    line = one_line_error(res, needle)
    assert res.stdout == ""  # refused before the report was computed
    assert not (tmp_path / "new.png").exists()
    record_fault(f"bad input: stepmem {what}", line)


@pytest.mark.parametrize(
    ("what", "args", "needle"),
    [
        ("compare --markdown into a missing folder",
         ["compare", str(RECORDS), str(RECORDS), "--markdown", "{tmp}/nodir/c.md"],
         "does not exist"),
        ("baseline --out into a folder that cannot be written",
         ["baseline", str(RECORDS), "--out", "/proc/b.yml", "--workload", "x"],
         "cannot write in /proc"),
        ("dashboards --out into a folder that cannot be written",
         ["dashboards", "--out", "/proc/dash"], "--out"),
        ("dashboards --out onto a file", ["dashboards", "--out", "{tmp}/f"], "is a file"),
        ("run --targets into a folder that cannot be written",
         ["run", "--no-store", "--targets", "/proc/t.json"], "cannot write in /proc"),
        ("capture -- a command that does not exist",
         ["capture", "--backend", "replay", "--out", "{tmp}/c.capture.parquet", "--",
          "/nonexistent/cmd"], "no such file"),
    ],
)  # fmt: skip
def test_other_outputs_and_commands_that_cannot_be_used_are_one_line(
    tmp_path, what, args, needle, record_fault
):
    (tmp_path / "f").write_text("a file")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    line = one_line_error(stepmem(*args, timeout=60), needle)
    record_fault(f"bad input: stepmem {what}", line)


# -- a run store is data, never code -----------------------------------------------------------


class _Planted:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_a_planted_pickle_in_a_run_store_is_never_run(tmp_path, run_dir, record_fault):
    witness = tmp_path / "PWNED"
    hist = run_dir / "history"
    hist.mkdir()
    (hist / "marks.json").write_text("[]")
    with open(hist / "history-steps-1-1.pickle", "wb") as f:
        pickle.dump(_Planted(witness), f)
    res = stepmem("report", str(run_dir))
    assert res.returncode == 0, res.stderr
    assert not witness.exists()
    assert "is unreadable" in res.stdout and "posix.system" in res.stdout
    record_fault(
        "a run store with a planted pickle (os.system) in history/",
        "`stepmem report` reads it as data only: the pickle is refused unread, named in one "
        "line; the report is printed; no code ran",
        code_run=int(witness.exists()),
    )


def test_a_real_memory_snapshot_still_reads(tmp_path):
    from collector import history

    doc = history.summary(ROOT / "benchmarks/results/h200-accounting/history/paged_nowatch")
    assert doc["trace_entries"] > 1000 and doc["steps"]


# -- the CI gate ----------------------------------------------------------------------------


def _write(tmp_path, name, doc):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


def _more_steps(doc, n, grow):
    last = doc["records"][-1]
    for k in range(1, n + 1):
        r = json.loads(json.dumps(last))
        r.update(step=last["step"] + k, begin_ns=last["begin_ns"] + k * 10**10,
                 end_ns=last["end_ns"] + k * 10**10,
                 nvml_peak_bytes=last["nvml_peak_bytes"] + k * grow)  # fmt: skip
        doc["records"].append(r)
    return doc


@pytest.mark.parametrize(
    ("case", "make", "needle"),
    [
        ("NEW interrupted", lambda d: d | {"status": "interrupted"}, "NEW did not finish"),
        ("NEW still running (killed)", lambda d: d | {"status": "running"}, "NEW did not finish"),
        ("NEW incomplete", lambda d: d | {"status": "incomplete"}, "NEW did not finish"),
        ("NEW shorter", lambda d: d | {"records": d["records"][:2]}, "NEW stopped early"),
        ("NEW with more steps, leaking", lambda d: _more_steps(d, 25, 1 << 30), "grew from"),
        ("NEW failed with an OOM",
         lambda d: d | {"records": [*d["records"][:-1],
                                    d["records"][-1] | {"error": "OutOfMemoryError"}]},
         "failed (OutOfMemoryError)"),
        ("NEW with a GPU the samplers do not list",
         lambda d: d | {"records": [*d["records"], d["records"][0] | {"gpu_uuid": "GPU-extra"}]},
         "GPU counts differ"),
    ],
)  # fmt: skip
def test_the_ci_gate_never_passes_a_new_run_that_regressed_or_did_not_finish(
    tmp_path, case, make, needle, record_fault
):
    new = _write(tmp_path, "new", make(_doc()))
    res = stepmem("compare", str(RECORDS), str(new))
    assert res.returncode == 1, res.stdout
    assert needle in res.stdout, res.stdout
    record_fault(f"compare gate: {case}", f"exit 1, '{needle}'")


def test_the_ci_gate_judges_a_base_peak_of_zero_and_says_the_largest_change(tmp_path):
    doc = _doc()
    for r in doc["records"]:
        r["torch_reserved_peak_bytes"] = 0
    base = _write(tmp_path, "base", doc)
    res = stepmem("compare", str(base), str(RECORDS))
    assert res.returncode == 1 and "grew from 0.00 GiB to 81.79 GiB (new)" in res.stdout
    paged = ROOT / "benchmarks" / "results" / "h200-run2" / "paged_adamw_8bit.records.json"
    res = stepmem("compare", str(RECORDS), str(paged))
    # the largest change, with its sign: torch allocated peak -16.7 %, not "+0.0 %"
    assert "torch allocated peak, largest over the run: 79.49 GiB" in res.stdout
    assert "-16.7 %: NEW uses less" in res.stdout


def test_compare_pointer_is_a_command_that_runs(tmp_path):
    doc = _doc()
    doc["status"] = "interrupted"
    new = _write(tmp_path, "new", doc)
    res = stepmem("compare", str(RECORDS), str(new))
    line = next(ln for ln in res.stdout.splitlines() if "stepmem report" in ln)
    cmd = line.split("`stepmem report ", 1)[1].split("`", 1)[0]
    assert stepmem("report", cmd).returncode == 0


# -- the sampler's own bounds -----------------------------------------------------------------


def test_unended_steps_and_phase_marks_cannot_grow_a_sampler():
    from collector import sampler as smp
    from collector.records import StepEvent
    from tests.test_sampler import joiner_with

    j = joiner_with([(t * 1_000_000, 1) for t in range(10)])
    for pid in range(smp.MAX_OPEN + 500):  # begins without ends, one per process
        j.add(StepEvent("begin", 1, 1 + pid, "GPU-test", seq=1, pid=pid))
    assert j.open_steps == smp.MAX_OPEN and j.rejected["open_dropped"] == 500
    assert 7 not in j._open  # the oldest processes' open steps went first
    last = smp.MAX_OPEN + 499
    for k in range(smp.MAX_PHASES + 100):  # phase marks of one open step
        j.add(StepEvent("phase", 1, 5000 + k, "GPU-test", phase=f"p{k}", seq=1, pid=last))
    assert len(j._open[last][2]) == smp.MAX_PHASES and j.rejected["phases_dropped"] == 100
    far = StepEvent(
        "end", 1, time.monotonic_ns() + 2 * smp.MAX_FUTURE_NS, "GPU-test", seq=1, pid=last
    )
    j.add(far)
    assert j.rejected["future_timestamp"] == 1 and j.pending == 0


def test_a_value_no_column_can_hold_is_counted_never_kills_the_store(tmp_path):
    from collector.store import RunStore, RunWriter

    w = RunWriter(tmp_path / "run", {"run_id": "r"})
    w.add_records([{"gpu_uuid": "G", "step": 1, "begin_ns": 1, "end_ns": 2, "samples": 1,
                    "ledger": {"optimizer_state": 10**30}}])  # fmt: skip
    w.add_samples("G", [1, 2], [3, 4], [0, 0])
    w.flush()  # never raises
    w.close()
    meta = RunStore(tmp_path / "run").meta
    assert meta["status"] == "incomplete" and meta["write_errors"] == {"steps": 1}
    assert meta["rows_written"]["samples"] == 2


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
        grown = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # one thread a connection, never more than the bound
            grown = max(grown, threading.active_count() - before)
            time.sleep(0.02)
        assert 0 < grown <= MAX_CONNECTIONS and server.refused > 0
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
        f"at most {MAX_CONNECTIONS} threads (one a connection), the rest closed at once and "
        "counted; scraping works again as soon as they go",
        threads_added=grown,
    )
