"""The diagnosis on the cases issue #24 found wrong: old data that must keep its meaning, rates
over every step, the caching allocator off with a ledger, the user's own line, and findings that
must never disagree."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from collector.analysis.diagnosis import contradictions, diagnose, verdict
from collector.analysis.history import site_of
from collector.analysis.runs import check_records, load_run
from collector.model.records import ProcessMemory, Stat
from collector.model.units import GIB, MIB
from collector.replay import Capture

ROOT = Path(__file__).resolve().parent.parent


def test_an_old_capture_without_the_probes_pid_still_splits_what_lies_outside_torch(tmp_path):
    """A capture recorded before the probe put its pid in the begin event: the training process
    is the one listed process holding torch's pool, and the report says it identified it."""
    cap = Capture.load(ROOT / "captures" / "paged_nowatch.capture.parquet")
    events = []
    for e in cap.events:
        e = copy.deepcopy(e)
        e.pop("pid", None)
        e.get("torch", {}).pop(Stat.PROCESS_PID, None)
        events.append(e)
    old = dataclasses.replace(cap, events=events)
    path = old.save(tmp_path / "old.capture.parquet")
    (stream,) = load_run(path).streams
    assert all(r.process_pid == 0 for r in stream.records)
    nontorch = next(f for f in diagnose(stream.records, cap.total_bytes) if f.rule == "nontorch")
    assert "charged to no process" in nontorch.text and "cannot be split" not in nontorch.text
    assert "the probe did not name it" in nontorch.text
    # two processes that each could hold the pool: not guessed
    from collector.analysis.accounting import identify_process

    recs = [dataclasses.replace(r) for r in stream.records]
    for r in recs:
        if r.processes is not None:
            other = ProcessMemory(99, 64 * GIB, "other")
            r.processes = dataclasses.replace(r.processes, procs=[*r.procs, other])
    assert identify_process(recs) == (None, "ambiguous")


def _leak_records(missing: set[int]) -> list:
    doc = json.loads((ROOT / "benchmarks/results/h200-run2/adamw_8bit.records.json").read_text())
    base = next(r for r in doc["records"] if r["step"] == 5)
    out = []
    for k in range(1, 13):
        r = copy.deepcopy(base)
        grow = k * 256 * MIB
        r.update(step=k, seq=k, begin_ns=k * 10**9, end_ns=k * 10**9 + 8 * 10**8)
        for key in (Stat.ALLOCATED, Stat.RESERVED):
            r["torch_end"][key] += grow
        r["torch_allocated_peak_bytes"] += grow
        r["torch_reserved_peak_bytes"] += grow
        r["nvml_peak_bytes"] += grow
        r["nvml_end_bytes"] += grow
        if k in missing:  # a starved sampler: no NVML figure, the step still happened
            r.update(samples=0, gap="no_samples", nvml_peak_bytes=None, nvml_end_bytes=None,
                     nvml_min_bytes=None, nvml_peak_t_ns=None)  # fmt: skip
        out.append(r)
    return check_records(out, "leak")


def test_a_leak_rate_counts_every_step_not_only_the_measured_ones():
    """256 MiB a step exactly, with steps 3-7 unmeasured: still 256 MiB a step (dividing by the
    measured steps made it 320-400)."""
    for missing in (set(), {3, 4, 5, 6, 7}, {2, 11}):
        (leak,) = [f for f in diagnose(_leak_records(missing)) if f.rule == "leak"]
        assert leak.numbers["bytes_per_step"] == pytest.approx(256 * MIB), missing
    growing = _leak_records({3, 4, 5, 6, 7})
    for r in growing:  # no torch figures: only NVML says it, over the steps it measured
        r.torch_end = {}
    (g,) = [f for f in diagnose(growing) if f.rule == "growing"]
    assert g.numbers["pool"] == "NVML used"
    assert g.numbers["bytes_per_step"] == pytest.approx(256 * MIB)


def test_caching_off_with_a_ledger_gives_no_negative_part_and_no_swallowed_tensors():
    """PYTORCH_NO_CUDA_MEMORY_CACHING=1 under a watched fine-tune: torch's figures are 0; the
    ledger's tensors are torch's, the baseline is not the parameters and optimizer state, and no
    "other allocated" is made up from the zeros."""
    doc = json.loads((ROOT / "benchmarks/results/h200-run2/adamw_8bit.records.json").read_text())
    recs = copy.deepcopy(doc["records"])
    for r in recs:
        before_training = r["torch_end"][Stat.CONTEXT_BASELINE]
        tensors = sum(r["ledger"].get(k, 0) for k in ("parameters", "optimizer_state"))
        r["torch_end"] = {k: 0 for k in r["torch_end"]}
        # the probe's reading before training held the parameters (no reserved pool to hide
        # them in): device used - 0
        r["torch_end"][Stat.CONTEXT_BASELINE] = before_training + r["ledger"]["parameters"]
        r["torch_begin"] = {Stat.CACHING_DISABLED: 1, Stat.PROCESS_PID: 4242}
        r["ledger"]["other_allocated"] = -tensors  # allocated (0) minus the ledger's kinds
        r["torch_allocated_peak_bytes"] = r["torch_reserved_peak_bytes"] = 0
        # no cache without the caching allocator: the context, the tensors, 1 GiB of others
        used = r["nvml_end_bytes"] = before_training + tensors + GIB
        r["nvml_peak_bytes"] = max(r["nvml_peak_bytes"], used)
        r["processes"] = {"t_ns": r["end_ns"], "device_used": used, "procs": [[4242, used, "t"]]}
        for ph in r["phases"]:
            ph["torch_allocated_peak_bytes"] = ph["torch_reserved_peak_bytes"] = 0
    fs = diagnose(check_records(recs, "nocache"), doc["samplers"][0]["total_bytes"])
    text = " ".join(f.text for f in fs)
    assert "caching allocator is off" in text
    assert "other allocated" not in text and "−" not in text.replace("−0.00", "")
    acc = next(f for f in fs if f.rule == "accounting")
    # the baseline: the CUDA context and what lies outside the ledger's tensors (here 1 GiB of
    # activations, which the ledger does not name), never the 25 GiB of parameters created
    # before step 1
    assert acc.numbers["baseline"] / GIB == pytest.approx(0.60 + 1, abs=0.05)
    assert acc.numbers["torch reserved"] / GIB == pytest.approx(38.58, abs=0.1)  # the ledger
    assert contradictions(fs) == []


def test_a_site_names_the_users_line_and_the_library_it_called():
    frames = [
        {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 9,
         "name": "linear"},
        {"filename": "/x/site-packages/transformers/models/llama/modeling_llama.py", "line": 480,
         "name": "forward"},
        {"filename": "/usr/lib/python3.11/contextlib.py", "line": 81, "name": "inner"},
        {"filename": "/home/me/project/train.py", "line": 68, "name": "run"},
        {"filename": "<frozen runpy>", "line": 88, "name": "_run_code"},
    ]  # fmt: skip
    assert site_of(frames) == (
        "me/project/train.py:68 (run) → transformers/models/llama/modeling_llama.py:480 (forward)"
    )
    # the user's own line that allocates directly: named once
    assert site_of(frames[3:]) == "me/project/train.py:68 (run)"
    # stepmem's own frames (its script runner) are not the user's
    runner = {"filename": "/opt/app/collector/run/runners.py", "line": 10, "name": "run"}
    assert (
        site_of([frames[1], runner]) == "transformers/models/llama/modeling_llama.py:480 (forward)"
    )


def test_every_committed_report_leads_with_a_verdict_that_agrees_with_its_findings():
    """The leak's verdict names the user's line from the history; the steady run's names the
    state that made its jump."""
    run = load_run(ROOT / "benchmarks/results/h200-cases/runs/h200-keep-logits")
    (stream,) = run.streams
    from collector.analysis.diagnose_run import _history

    sites = {s["step"]: s for s in _history(run)["steps"]}
    fs = diagnose(stream.records, run.totals[stream.gpu_uuid], sites)
    (head, *_rest) = verdict(fs)
    assert head.startswith("Leaking: live tensors grow 252 MiB a step")
    assert "workloads/cases.py:68 (run) → transformers/" in head
    seed = load_run(ROOT / "captures" / "adamw_8bit.capture.parquet")
    lines = verdict(diagnose(seed.streams[0].records, seed.totals[seed.gpus[0]]))
    assert lines[0].startswith("Steady from step 3") and "13.48 GiB" in lines[2]


def test_a_peak_resting_on_a_step_with_a_stall_is_a_lower_bound_and_says_so():
    """The verdict's peak step had a sampling stall: the verdict and the headroom finding call
    the peak a lower bound, and the stall is named among the sampler's troubles."""
    recs = _leak_records(set())
    peak = max(recs, key=lambda r: r.nvml_peak_bytes or 0)
    peak.gap = "stall"
    found = diagnose(recs, total_bytes=140 * GIB)
    (head,) = [f for f in found if f.rule == "headroom"]
    assert head.numbers["blind_steps"] == [peak.step] and "lower bound" in head.text
    line = next(x for x in verdict(found) if x.startswith("Peak"))
    assert f"at least: step {peak.step}'s sampling missed part of it (stall)" in line
    (starved,) = [f for f in found if f.rule == "starved"]
    assert "1 of 12 steps has a stall" in starved.text and starved.numbers["stall"] == 1
    peak.gap = ""  # clean sampling: no hedge
    line = next(x for x in verdict(diagnose(recs, total_bytes=140 * GIB)) if x.startswith("Peak"))
    assert "at least" not in line
