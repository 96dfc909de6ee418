"""``stepmem compare``, the CI gate: it passes only a whole run it could judge, fails a
regression, and says why it cannot compare (steps without samples, different shapes)."""

from __future__ import annotations

import copy
import json

import pytest

from collector.analysis.compare import compare
from collector.analysis.runs import load_run
from tests.cli import stepmem
from tests.records import RECORDS, ROOT, seed_doc, typed, unmeasured_run


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
    from collector.analysis.runs import Run

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
    run = Run("r", {**meta, "status": "complete"}, typed(recs))
    md, failed = compare(run, run, 0.05)
    assert not failed, md
    assert "2 of NEW's 100 steps have no NVML samples (2.0 %, within the 5 % allowed)" in md
    grown = copy.deepcopy(recs)
    grown[70]["nvml_peak_bytes"] = int(grown[70]["nvml_peak_bytes"] * 1.2)
    md, failed = compare(run, Run("g", {**meta, "status": "complete"}, typed(grown)), 0.05)
    assert failed and "NVML within-step peak grew" in md and "Cannot compare" not in md
    md, failed = compare(run, run, 0.05, max_unsampled=0.01)
    assert failed and "Cannot compare" in md and "more than the 1 % allowed" in md
    record_fault(
        "compare: 2 of 100 steps without NVML samples (a starved sampler)",
        "judged on the other 98 (said); +20 % in one step still fails; --max-unsampled 1% refuses",
    )


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
    new = _write(tmp_path, "new", make(seed_doc()))
    res = stepmem("compare", str(RECORDS), str(new))
    assert res.returncode == 1, res.stdout
    assert needle in res.stdout, res.stdout
    record_fault(f"compare gate: {case}", f"exit 1, '{needle}'")


def test_the_ci_gate_judges_a_base_peak_of_zero_and_says_the_largest_change(tmp_path):
    doc = seed_doc()
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
    doc = seed_doc()
    doc["status"] = "interrupted"
    new = _write(tmp_path, "new", doc)
    res = stepmem("compare", str(RECORDS), str(new))
    line = next(ln for ln in res.stdout.splitlines() if "stepmem report" in ln)
    cmd = line.split("`stepmem report ", 1)[1].split("`", 1)[0]
    assert stepmem("report", cmd).returncode == 0


def test_a_gate_that_judged_nothing_fails_and_says_why(tmp_path, record_fault):
    """W5: no records at all, or steps without any NVML or torch figure, in both runs: the
    gate cannot pass, it says there was nothing to judge."""
    empty = seed_doc()
    empty["records"], empty["samplers"] = [], []
    blind = seed_doc()
    for r in blind["records"]:
        for k in list(r):
            if k.startswith(("nvml_", "torch_")):
                r[k] = None if not k.startswith("torch_begin") and k != "torch_end" else {}
        r["phases"] = []
    for name, doc, says in (
        ("empty", empty, "recorded no step"),
        ("blind", blind, "nothing could be judged"),
    ):
        f = _write(tmp_path, name, doc)
        r = stepmem("compare", str(f), str(f))
        assert r.returncode == 1, (name, r.stdout, r.stderr)
        assert "Cannot compare" in r.stdout and says in r.stdout, r.stdout
        record_fault(f"compare of two runs that measured nothing ({name})", "exit 1: " + says)


def test_compare_says_when_the_cards_differ(tmp_path):
    base = seed_doc()
    new = copy.deepcopy(base)
    new["samplers"][0]["name"] = "NVIDIA H100 80GB HBM3"
    new["samplers"][0]["total_bytes"] = 150754820096 + (1 << 30)
    r = stepmem("compare", str(_write(tmp_path, "b", base)), str(_write(tmp_path, "n", new)))
    assert "Different GPUs" in r.stdout and "H100" in r.stdout, r.stdout + r.stderr
    assert "GiB GiB" not in r.stdout, r.stdout
    # one H200 replaying two captures is one card
    base["samplers"][0]["name"] = "NVIDIA H200 (replay of adamw_8bit)"
    new = copy.deepcopy(base)
    new["samplers"][0]["name"] = "NVIDIA H200 (replay of paged_adamw_8bit)"
    r = stepmem("compare", str(_write(tmp_path, "b2", base)), str(_write(tmp_path, "n2", new)))
    assert "Different GPUs" not in r.stdout, r.stdout


def test_a_run_name_cannot_break_out_of_the_markdown_code_span(tmp_path):
    f = _write(tmp_path, "x`](http:evil) **PASS**", seed_doc())
    r = stepmem("compare", str(f), str(f))
    assert "`x'](http:evil) **PASS**`" in r.stdout, r.stdout


def test_a_new_run_of_another_workload_cannot_pass_the_gate(tmp_path, record_fault):
    """A CI job pointed at the wrong baseline: NEW is another workload (spiky against the 7B
    fine-tune, by the samplers' labels or, in a records file written before them, by the
    runner's summary). It was 'No peak grew by more than 5 %', exit 0; now 'Cannot compare',
    naming both, unless --other-workload asks for it."""
    spiky = ROOT / "benchmarks/results/h200-run2/spiky.records.json"
    r = stepmem("compare", str(RECORDS), str(spiky))
    assert r.returncode == 1 and "Cannot compare" in r.stdout, r.stdout
    assert "BASE is a run of 'finetune', NEW of 'spiky'" in r.stdout, r.stdout
    asked = stepmem("compare", str(RECORDS), str(spiky), "--other-workload")
    assert "BASE is a run of 'finetune'" in asked.stdout and "Cannot compare" not in asked.stdout
    assert asked.returncode == 0, asked.stdout  # spiky uses less: judged, and passes
    # the labels the samplers carry now: two replays of different captures
    base, new = seed_doc(), seed_doc()
    base["samplers"][0]["workload"] = "replay:adamw_8bit"
    new["samplers"][0]["workload"] = "replay:spiky"
    r = stepmem("compare", str(_write(tmp_path, "b", base)), str(_write(tmp_path, "n", new)))
    assert r.returncode == 1 and "NEW of 'replay:spiky'" in r.stdout, r.stdout
    assert stepmem("compare", str(RECORDS), str(RECORDS)).returncode == 0  # one workload
    record_fault(
        "compare: NEW of another workload than BASE (a gate pointed at the wrong baseline)",
        "exit 1, 'Cannot compare', both workloads named; --other-workload judges them anyway",
    )


def test_two_stand_in_runs_are_told_there_is_no_gpu_memory_to_gate(record_fault):
    """CPU ranks standing in for a GPU (CI's ``stepmem run --command``) carry a ledger but no
    GPU memory: the gate cannot pass them, and says what can be gated instead."""
    from collector.analysis.runs import Run

    doc = json.loads(RECORDS.read_text())
    recs = copy.deepcopy(doc["records"])
    for r in recs:
        r.update(samples=0, gap="stand_in", nvml_peak_bytes=None, nvml_peak_t_ns=None,
                 nvml_min_bytes=None, nvml_end_bytes=None, nvml_reserved_bytes=None,
                 torch_allocated_peak_bytes=None, torch_reserved_peak_bytes=None, torch_begin={},
                 torch_end={}, phases=[])  # fmt: skip
    meta = {k: v for k, v in doc.items() if k != "records"}
    run = Run("cpu", {**meta, "status": "complete"}, typed(recs))
    md, failed = compare(run, run, 0.05)
    assert failed, md
    assert "both runs are CPU processes standing in for a GPU" in md, md
    assert "stepmem estimate --gpu CARD" in md and "neither run measured" not in md, md
    record_fault(
        "compare: two runs of CPU ranks standing in for a GPU",
        "fails the gate, saying the stand-ins hold no GPU memory to gate and what can be gated",
    )
