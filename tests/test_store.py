"""The run store: round trip, incremental atomic parts, a run killed mid-way, write failures."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from collector.model.records import StepEvent
from collector.model.step import PhaseReading, ProcessesReading, StepRecord
from collector.store import RunStore, RunWriter, StoreError


def record(step, uuid="GPU-a", **kw):
    return StepRecord.from_dict({**_record(step, uuid), **kw})


def _record(step, uuid="GPU-a"):
    return {
        "gpu_uuid": uuid,
        "step": step,
        "begin_ns": step * 10,
        "end_ns": step * 10 + 5,
        "samples": 3,
        "gap": "",
        "nvml_peak_bytes": 100 + step,
        "nvml_peak_t_ns": step * 10,
        "nvml_min_bytes": 1,
        "nvml_end_bytes": 50,
        "nvml_reserved_bytes": 7,
        "torch_allocated_peak_bytes": 90,
        "torch_reserved_peak_bytes": 95,
        "torch_end": {"reserved_bytes.all.current": 40},
        "ledger": {"parameters": 10},
        "phases": [{"phase": "optimizer", "begin_ns": step * 10, "end_ns": step * 10 + 5}],
        "seq": step,
        "pid": 7,
    }


def test_round_trip(tmp_path):
    w = RunWriter(tmp_path / "run", {"run_id": "r1"})
    w.add_samples("GPU-a", np.arange(5), np.arange(5) * 2, np.zeros(5))
    w.add_records([record(1), record(2)])
    w.add_events([StepEvent("begin", 1, 1, "GPU-a", torch={"x": 1})])
    w.flush()
    w.add_samples("GPU-a", np.arange(5, 8), np.arange(5, 8) * 2, np.zeros(3))
    w.close()
    s = RunStore(tmp_path / "run")
    assert s.meta["status"] == "complete" and s.meta["run_id"] == "r1"
    assert s.gpus() == ["GPU-a"]
    assert s.samples("GPU-a")["used"].tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    steps = s.steps()
    assert steps["step"].tolist() == [1, 2]
    assert steps["torch_end.reserved_bytes.all.current"].tolist() == [40, 40]
    assert steps["ledger.parameters"].tolist() == [10, 10]
    assert s.events()["kind"].tolist() == ["begin"]
    assert s.meta["rows_written"] == {"samples": 8, "steps": 2, "events": 1}


def test_a_directory_that_is_not_a_run_is_named(tmp_path):
    with pytest.raises(StoreError, match="not a stepmem run directory"):
        RunStore(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(StoreError, match="corrupt"):
        RunStore(tmp_path)


def test_a_run_killed_with_sigkill_midway_is_still_readable(tmp_path, record_fault):
    script = textwrap.dedent(f"""
        import os, signal, numpy as np
        from collector.model.step import StepRecord
        from collector.store import RunWriter
        w = RunWriter({str(tmp_path / "run")!r}, {{"run_id": "killed"}})
        for i in range(1000):
            w.add_samples("GPU-a", np.arange(i * 100, i * 100 + 100), np.full(100, i),
                          np.zeros(100))
            w.add_records([StepRecord("GPU-a", i + 1, 0, 1, 1, nvml_peak_bytes=i)])
            w.flush()
            if i == 6:
                os.kill(os.getpid(), signal.SIGKILL)
    """)
    res = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert res.returncode == -9
    s = RunStore(tmp_path / "run")
    assert s.meta["status"] == "running"  # never closed
    assert len(s.samples("GPU-a")) == 700 and s.steps()["step"].tolist() == list(range(1, 8))
    from collector.analysis.report import render_report
    from collector.analysis.runs import load_run

    text, _ = render_report(load_run(tmp_path / "run"))  # the report reads it too
    assert "memory per step" in text
    leftovers = [p for p in (tmp_path / "run").rglob("*") if p.name.startswith(".")]
    # at worst a temp file (and the room set aside for the final meta), never a torn part
    assert all(p.suffix == ".tmp" or p.name == ".reserve" for p in leftovers)
    record_fault(
        "the process writing a run store killed with SIGKILL after 7 flushes",
        "the store reads back (status running) with everything flushed; `stepmem report` reads it",
        steps_lost=0,
        samples_lost=0,
    )


def test_write_failures_are_counted_and_never_raised(tmp_path, caplog, record_fault):
    w = RunWriter(tmp_path / "run", {"run_id": "r"})
    steps = tmp_path / "run" / "steps"
    os.rmdir(steps)
    steps.write_text("not a directory")  # every steps part now fails to write
    w.add_records([record(1)])
    w.add_samples("GPU-a", np.arange(3), np.arange(3), np.arange(3))
    w.flush()
    w.close()
    assert w.write_errors == {"steps": 1}
    assert w.rows_written["samples"] == 3
    assert "run store write failed" in caplog.text
    record_fault(
        "run store unwritable (its steps folder replaced by a file)",
        "one clear log line; nothing raised to the caller; what could not be written counted "
        "(write_errors), the rest written",
        parts_not_written_counted=w.write_errors["steps"],
        samples_written=w.rows_written["samples"],
    )


def test_records_read_back_typed(tmp_path):
    """RunStore.records(): the StepRecords written, typed, the same (a step without NVML
    samples keeps None, not 0 or NaN)."""
    unmeasured = record(3, nvml_peak_bytes=None, nvml_end_bytes=None, samples=0)
    written = [record(1), record(2), unmeasured]
    w = RunWriter(tmp_path / "run", {"run_id": "r1"})
    w.add_records(written)
    w.close("completed")
    back = RunStore(tmp_path / "run").records()
    assert back == written
    assert back[2].nvml_peak_bytes is None and back[2].nvml_end_bytes is None


def test_a_store_written_before_seq_existed_numbers_its_steps_in_time_order(tmp_path):
    """Old stores (no seq, pid columns) still read: their steps get seq 1, 2, … by time, so
    two epochs' step 1 stay two steps."""
    old = [record(s, seq=0, pid=0) for s in (1, 2)]
    old += [record(s, seq=0, pid=0, begin_ns=s * 10 + 100, end_ns=s * 10 + 105) for s in (1, 2)]
    w = RunWriter(tmp_path / "run", {"run_id": "old"})
    w.add_records(old)
    w.close()
    back = RunStore(tmp_path / "run").records()
    assert [(r.step, r.seq) for r in back] == [(1, 1), (2, 2), (1, 3), (2, 4)]


def _non_default(name, type_text, i):
    """A value for a StepRecord field of this type, different from its default."""
    if type_text.startswith("int"):
        return 1_000 + i
    if type_text == "str":
        return f"{name}-value"
    if type_text == "dict[str, int]":
        return {"some.key": 7 + i}
    if type_text == "ProcessesReading | None":
        return ProcessesReading.from_untrusted(
            {"t_ns": 5, "device_used": 9, "procs": [[1, 2, "python"]], "baseline": 3}
        )
    if type_text == "list[PhaseReading]":
        return [PhaseReading("optimizer", 1, 2, nvml_begin_bytes=i)]
    raise AssertionError(f"StepRecord.{name}: a field of type {type_text} — teach the store it")


def test_every_step_record_field_is_stored_and_read_back(tmp_path):
    """The store's columns follow StepRecord's fields: a record with every field set to a value
    other than its default comes back equal, so a per-step number added to StepRecord is kept
    without a change to the store."""
    import dataclasses

    values = {
        f.name: _non_default(f.name, str(f.type), i)
        for i, f in enumerate(dataclasses.fields(StepRecord))
    }
    rec = StepRecord(**values)
    assert all(getattr(rec, f.name) != f.default for f in dataclasses.fields(StepRecord))
    w = RunWriter(tmp_path / "run", {"run_id": "r1"})
    w.add_records([rec])
    w.close()
    assert RunStore(tmp_path / "run").records() == [rec]


def test_the_store_itself_refuses_to_write_over_a_run(tmp_path):
    from collector.store import StoreError

    RunWriter(tmp_path / "r", {"run_id": "r"}).close("complete")
    with pytest.raises(StoreError, match="already holds a run"):
        RunWriter(tmp_path / "r", {"run_id": "r"})
    assert RunStore(tmp_path / "r").meta["status"] == "complete"


def test_a_value_no_column_can_hold_is_counted_never_kills_the_store(tmp_path):
    from collector.store import RunStore, RunWriter

    w = RunWriter(tmp_path / "run", {"run_id": "r"})
    w.add_records([StepRecord("G", 1, 1, 2, 1, ledger={"optimizer_state": 10**30})])
    w.add_samples("G", [1, 2], [3, 4], [0, 0])
    w.flush()  # never raises
    w.close()
    meta = RunStore(tmp_path / "run").meta
    assert meta["status"] == "incomplete" and meta["write_errors"] == {"steps": 1}
    assert meta["rows_written"]["samples"] == 2


def test_a_torn_part_of_the_samples_or_the_events_is_said_not_silent(tmp_path, record_fault):
    """A store copied in a hurry: the last samples part cut to 100 bytes. The report was the
    intact store's, word for word, until --png failed; now the run says which part cannot be
    read (as it does for the events), and keeps every step."""
    from collector.analysis.report import render_report
    from collector.analysis.runs import load_run

    w = RunWriter(tmp_path / "run", {"run_id": "r1"})
    w.add_samples("GPU-a", np.arange(5), np.arange(5) * 2, np.zeros(5))
    w.add_records([record(1), record(2)])
    w.add_events([StepEvent("begin", 1, 1, "GPU-a", torch={"x": 1})])
    w.close()
    root = tmp_path / "run"
    assert "cannot be read" not in render_report(load_run(root))[0]
    for folder in ("samples/GPU-a", "events"):
        (part,) = (root / folder).glob("part-*.parquet")
        part.write_bytes(part.read_bytes()[:100])
    run = load_run(root)
    text, _ = render_report(run)
    assert "1 part(s) of the NVML samples cannot be read (samples/GPU-a/part-" in text
    assert "1 part(s) of the probe's events cannot be read (events/part-" in text
    assert [r.step for r in run.streams[0].records] == [1, 2]
    record_fault(
        "a run store whose samples part and events part are cut short (a torn copy)",
        "report names each part that cannot be read and keeps every step; --png says why it "
        "cannot draw",
        steps_kept=len(run.streams[0].records),
    )


def test_a_store_that_could_not_be_created_leaves_no_folder_to_block_its_run_id(tmp_path):
    """ulimit -f: the run folder and its parts were made, meta.json could not be written; the
    folder stayed and blocked the run id ('already exists'), and report called it no run. A
    failed creation now takes back what it made — and never a folder that was there before."""
    import resource

    script = textwrap.dedent(
        f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        from collector.store import RunWriter, StoreError
        try:
            RunWriter({str(tmp_path / "runs" / "x")!r}, {{"run_id": "x"}})
        except StoreError as exc:
            print("refused:", exc)
        """
    )
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] != 0
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    assert "refused: cannot create the run store" in res.stdout, res.stdout + res.stderr
    assert not (tmp_path / "runs" / "x").exists()
    RunWriter(tmp_path / "runs" / "x", {"run_id": "x"}).close()  # the id is free again
    assert RunStore(tmp_path / "runs" / "x").meta["status"] == "complete"


def test_a_part_that_is_not_a_file_is_named_never_skipped(tmp_path, record_fault):
    """A steps part replaced by a folder: pyarrow reads a folder as an empty dataset, and the
    report listed the other part's steps with no word of the rest. Now the store is refused,
    naming the part; a samples part that is a folder is named as one that cannot be read."""
    from collector.analysis.runs import load_run
    from collector.store import StoreError

    w = RunWriter(tmp_path / "run", {"run_id": "r1"})
    w.add_samples("GPU-a", np.arange(5), np.arange(5) * 2, np.zeros(5))
    w.add_records([record(1), record(2)])
    w.flush()
    w.add_records([record(3)])
    w.close()
    root = tmp_path / "run"
    first = sorted((root / "steps").glob("part-*.parquet"))[0]
    first.unlink()
    first.mkdir()
    with pytest.raises(StoreError, match=f"{first.name} is not a regular file"):
        load_run(root)
    first.rmdir()
    (samples,) = (root / "samples/GPU-a").glob("part-*.parquet")
    samples.unlink()
    samples.mkdir()
    (root / "steps" / first.name).write_bytes(b"")  # a steps part again, empty: named too
    with pytest.raises(StoreError, match="unreadable part"):
        load_run(root)
    (root / "steps" / first.name).unlink()
    run = load_run(root)
    assert any(f"samples/GPU-a/{samples.name}" in p for p in run.meta["problems"])
    record_fault(
        "a run store whose steps part is a folder (and a samples part that is one)",
        "the steps part named, the store not read (exit 2); the samples part named as one that "
        "cannot be read, every step kept",
    )


def test_a_huge_string_in_a_store_is_cut_at_read(tmp_path, record_fault):
    """A 50 MiB step error (2.4 MB of Parquet) kept report busy past 60 s: strings from data
    are cut at read (collector.model.untrusted.MAX_TEXT_CHARS), before anything walks them."""
    from collector.analysis.report import render_report
    from collector.analysis.runs import load_run
    from collector.model.untrusted import MAX_TEXT_CHARS

    w = RunWriter(tmp_path / "run", {"run_id": "r1"})
    w.add_records([record(1, error="E" * (50 << 20)), record(2)])
    w.close()
    run = load_run(tmp_path / "run")
    err = run.streams[0].records[0].error
    assert len(err) == MAX_TEXT_CHARS + 1 and err.endswith("…")
    text, _ = render_report(run)
    assert len(text) < 200_000
    record_fault(
        "a run store whose step error is a 50 MiB string",
        f"cut to {MAX_TEXT_CHARS:,} characters at read; the report is its usual size",
        report_chars=len(text),
    )
