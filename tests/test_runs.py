"""Reading a run back as the untrusted data it is: records files, run stores, their metadata and
allocation histories. Anything malformed is one line and exit 2, never a traceback, a hang or
code run; each case records its fault-table row once its assertions pass."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from collector.model.units import GIB
from tests.cli import one_line_error, stepmem
from tests.records import RECORDS, ROOT, seed_doc


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


def _set(i, **kw):
    def mutate(doc):
        doc["records"][i].update(kw)

    return mutate


@pytest.mark.parametrize(
    ("case", "mutate", "needle"),
    [
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
    doc = seed_doc()
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
    from collector.analysis import history

    doc = history.summary(ROOT / "benchmarks/results/h200-accounting/history/paged_nowatch")
    assert doc["trace_entries"] > 1000 and doc["steps"]


def test_a_process_that_numbered_its_steps_twice_keeps_every_step(tmp_path):
    """Records written by two probes of one process before seq was per process (or a capture
    that repeats seq): every step is read, numbered again in time order, and the report says
    so instead of refusing the run."""
    doc = json.loads(RECORDS.read_text())
    for i, r in enumerate(doc["records"]):
        r["seq"], r["pid"] = 1 + i % 2, 4242  # 1, 2, 1, 2, 1
    doc["records"].append(dict(doc["records"][1]))  # and one stored twice over
    f = tmp_path / "twice.json"
    f.write_text(json.dumps(doc))
    r = stepmem("report", str(f))
    assert r.returncode == 0, r.stderr
    assert "numbered its steps twice over" in r.stdout and "stored twice" in r.stdout
    from collector.analysis.runs import load_run

    run = load_run(f)
    assert [x.seq for s in run.streams for x in s.records] == [1, 2, 3, 4, 5]


def test_a_sampler_listed_twice_is_one_gpu_and_ranks_stay_inside_the_world(tmp_path):
    """M4, M2: meta.json listing one sampler twice reports one GPU; a rank of 70,000 in a world
    of 2^40 is refused in one line."""
    doc = json.loads(RECORDS.read_text())
    doc["samplers"].append(dict(doc["samplers"][0]))
    f = tmp_path / "twice.json"
    f.write_text(json.dumps(doc))
    from collector.analysis.runs import load_run

    assert len(load_run(f).gpus) == 1
    doc = json.loads(RECORDS.read_text())
    doc["records"][0].update(rank=70_000, world_size=1 << 40)
    f.write_text(json.dumps(doc))
    r = stepmem("report", str(f))
    assert r.returncode == 2 and "world_size" in r.stderr, r.stderr
