"""The accounting identity and allocation sites, on captures recorded on the H200 (replayed
through the real pipeline: samplers on a local Ray cluster, per-process readings joined to the
step records, the store, the diagnosis)."""

import shutil
from pathlib import Path

import pytest

from collector.analysis.accounting import accounts, allocator_mode
from collector.analysis.diagnosis import diagnose
from tests.conftest import loopback
from tests.records import typed

GIB = 1 << 30
HISTORY = (
    Path(__file__).resolve().parent.parent
    / "benchmarks/results/h200-accounting/history/paged_nowatch"
)


def _replay(capture: str, tmp_path: Path, result: bool = False):
    from collector.model.settings import JobOptions
    from collector.run.job import run_job

    opts = JobOptions(
        backend="replay",
        captures=[capture],
        speed=1.0,  # real time: the per-process readings pair with samples as recorded
        store=tmp_path / "runs",
        sampler=loopback(run_id=f"acct-{capture}"),
    )
    res = run_job(opts, echo=lambda *a: None)
    return res if result else typed(res.records)


def offline(capture: str) -> list:
    """A committed capture's steps joined offline (:mod:`collector.analysis.offline`)."""
    from collector.analysis.runs import load_run

    run = load_run(Path(__file__).parent.parent / "captures" / f"{capture}.capture.parquet")
    return run.streams[0].records


def _identity_holds(recs: list[dict]) -> list:
    accs = accounts(recs)
    assert accs, "no step has an account"
    # the end reading is the step's own: never above its within-step peak
    assert all(r.nvml_end_bytes <= r.nvml_peak_bytes for r in recs if r.samples)
    for a in accs:  # the components are the device's used memory, to the byte
        assert sum(a.components().values()) == a.device_used
    return accs


def _change(findings, component):
    return next(
        f for f in findings if f.rule == "component_change" and f.numbers["component"] == component
    )


@pytest.mark.ray
def test_memory_allocated_outside_torch_mid_run_is_found_at_its_step(ray_cluster, tmp_path):
    """4 GiB from cuMemAlloc in the training process from step 3 until step 6 begins."""
    # where exactly: the capture joined offline; then the same through the live pipeline
    change = _change(diagnose(offline("outside")), "outside torch, this process")
    first, gone = change.numbers["changes"]
    assert first.step == 3 and first.delta / GIB == pytest.approx(4.0, abs=0.05)
    assert first.where.step == 3 and first.where.phase == "step"  # inside step 3
    # freed as step 6 begins. The capture has no sample between 1.8 ms before step 5's end mark
    # and 1.7 ms after it (its sampler waited on NVML there), and the one after already shows
    # the free: the replay, which plays only captured samples, cannot tell which side of the
    # mark it fell on, and the end reading takes the lower one (a release just before a mark
    # shows only after it). So: step 5's end, or between steps 5 and 6; never earlier.
    assert gone.delta / GIB == pytest.approx(-4.0, abs=0.05)
    assert (gone.where.step, gone.where.phase) in {(5, "step"), (6, "between steps")}
    assert all(c.component != "other processes" for c in change.numbers["changes"])
    res = _replay("outside", tmp_path, result=True)
    recs = typed(res.records)
    _identity_holds(recs)
    live = _change(diagnose(recs), "outside torch, this process").numbers["changes"]
    assert live[0].step in (3, 4) and live[0].delta / GIB == pytest.approx(4.0, abs=0.05)
    assert live[-1].delta / GIB == pytest.approx(-4.0, abs=0.05)
    # the live series (/metrics, remote write): the sampler's baseline so far, summing to NVML
    from collector.model.series import step_values

    step3 = next(r for r in recs if r.step == 3)
    series = {
        labels["component"]: v
        for name, labels, v in step_values(step3)
        if name == "stepmem_step_account_bytes"
    }
    assert series["outside_torch"] / GIB == pytest.approx(4.0, abs=0.05)
    assert sum(series.values()) == step3.nvml_end_bytes
    # the picture stacks the components and labels the change at its step
    from collector.analysis.runs import load_run
    from collector.analysis.timeline import _panels, render_png

    (panel,) = _panels(load_run(res.store))
    assert panel["changes"][0].step == 3
    s3 = next(s for s in panel["steps"] if s["step"] == 3)
    assert sum(s3["account"].values()) == pytest.approx(s3["nvml_end"], abs=1e-6)
    png = render_png(load_run(res.store), tmp_path / "t.png")
    assert png.stat().st_size > 10_000


@pytest.mark.ray
def test_a_second_process_on_the_gpu_is_named_when_it_comes_and_goes(ray_cluster, tmp_path):
    # where exactly: the capture's own samples and snapshots, joined offline (what a replay
    # whose sampler kept every sample gives)
    cs = _change(diagnose(offline("neighbour")), "other processes").numbers["changes"]
    assert [c.step for c in cs] == [3, 6]
    assert cs[0].delta / GIB == pytest.approx(2.6, abs=0.1) and cs[1].delta < 0
    assert "came" in cs[0].who[0] and "python -c" in cs[0].who[0]
    assert "left" in cs[1].who[0]
    assert cs[0].where.step == 3 and cs[1].where.step == 6
    # through the live pipeline on this (maybe loaded) machine: a per-process reading that
    # moved with the next step is not used, so a change may be measured a step later; it is
    # found, named, and never placed before it happened
    recs = _replay("neighbour", tmp_path)
    _identity_holds(recs)
    cs = _change(diagnose(recs), "other processes").numbers["changes"]
    assert cs[0].step in (3, 4) and cs[-1].step in (6, 7)
    assert cs[0].delta / GIB == pytest.approx(2.6, abs=0.1) and cs[-1].delta < 0
    assert "came" in cs[0].who[0] and "left" in cs[-1].who[0]


@pytest.mark.ray
def test_caching_allocator_off_is_said(ray_cluster, tmp_path):
    recs = _replay("nocache", tmp_path)
    mode = allocator_mode(recs)
    assert mode.caching_disabled and mode.from_environment and mode.stats_zero
    fs = diagnose(recs)
    f = next(f for f in fs if f.rule == "allocator_mode")
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING" in f.text
    growing = next(f for f in fs if f.rule == "growing")
    assert "per-process readings outside torch, this process" in growing.text
    assert "the caching allocator is off" in growing.text
    # 256 MiB a step, the last step included (its end is not the capture starting over)
    assert growing.numbers["bytes_per_step"] == pytest.approx(256 << 20, rel=0.05)
    accs = _identity_holds(recs)
    # a snapshot taken after the next step's 256 MiB came is one unsplit figure, saying why
    for a in accs:
        assert a.unsplit is None or "moved 256 MiB" in a.unsplit_why


@pytest.mark.ray
def test_a_paged_optimizer_without_watch_is_memory_no_process_is_charged_for(ray_cluster, tmp_path):
    """No ledger (the probe never saw the optimizer): the managed state is found from NVML's
    per-process readings, not guessed as cuBLAS or NCCL."""
    recs = _replay("paged_nowatch", tmp_path)
    assert not any(r.ledger for r in recs)
    accs = _identity_holds(recs)
    last = accs[-1]
    assert last.no_process / GIB == pytest.approx(0.51, abs=0.05)
    assert abs(last.outside) < 64 << 20
    nontorch = next(f for f in diagnose(recs) if f.rule == "nontorch")
    # the managed state is what no process is charged for; cuBLAS is named only as what the
    # baseline's first-use part usually is, not as the 0.51 GiB
    assert "0.51 GiB charged to no process" in nontorch.text


def test_without_per_process_readings_nothing_outside_torch_is_named():
    from collector.analysis.runs import load_run

    run = load_run(
        Path(__file__).parent.parent / "benchmarks/results/h200-run2/adamw_8bit.records.json"
    )
    recs = run.by_gpu[run.gpus[0]]
    assert all(a.unsplit is not None for a in accounts(recs))
    nontorch = next(f for f in diagnose(recs) if f.rule == "nontorch")
    assert "cannot be split" in nontorch.text


def _rec(step, used, procs, snap_used, reserved=GIB):
    return {
        "gpu_uuid": "GPU-x",
        "step": step,
        "begin_ns": step * 10**9 - 8 * 10**8,
        "samples": 800,
        "end_ns": step * 10**9,
        "nvml_end_bytes": used,
        "torch_begin": {"process_pid": 7},
        "torch_end": {"reserved_bytes.all.current": reserved, "context_baseline_bytes": GIB // 2},
        "processes": {"t_ns": step * 10**9 + 5 * 10**6, "device_used": snap_used, "procs": procs},
    }


def test_a_reading_taken_after_the_next_step_allocated_is_not_split_and_changes_skip_it():
    """Step 2's per-process reading came after step 3 had allocated 300 MiB: that step is one
    unsplit figure (with why), and the 4 GiB outside torch that step 2 added is measured from
    step 1's end to step 3's, never against step 2's other baseline."""
    mib = 1 << 20
    recs = [
        _rec(1, 3 * GIB, [[7, 2 * GIB, "train"]], 3 * GIB),
        _rec(2, 7 * GIB, [[7, 6 * GIB + 300 * mib, "train"]], 7 * GIB + 300 * mib),
        _rec(3, 7 * GIB, [[7, 6 * GIB, "train"]], 7 * GIB),
    ]
    recs = typed(recs)
    a1, a2, a3 = accounts(recs)
    assert a1.unsplit is None and a3.unsplit is None
    assert a2.unsplit is not None and "moved 300 MiB" in a2.unsplit_why
    for a in (a1, a2, a3):
        assert sum(a.components().values()) == a.device_used
    from collector.analysis.accounting import changes

    (c,) = changes([a1, a2, a3])
    assert (c.component, c.step, c.since, c.delta) == (
        "outside torch, this process",
        3,
        1,
        4 * GIB,
    )
    text = _change(diagnose(recs), "outside torch, this process").text
    assert "+4.00 GiB at step 3 (since step 1's end)" in text and "describes step 2's end" in text


def test_a_change_before_the_first_split_step_is_still_found_unsplit():
    """Steps 1–2 have no usable per-process reading; 4 GiB outside torch come at step 3: the
    change is reported as memory outside torch (unsplit), not lost for want of a split pair."""
    recs = [
        _rec(1, 3 * GIB, [], 3 * GIB),
        _rec(2, 3 * GIB, [], 3 * GIB),
        _rec(3, 7 * GIB, [[7, 6 * GIB, "train"]], 7 * GIB),
        _rec(4, 7 * GIB, [[7, 6 * GIB, "train"]], 7 * GIB),
    ]
    from collector.analysis.accounting import changes

    (c,) = changes(accounts(typed(recs)))
    assert (c.component, c.step, c.since, c.delta) == (
        "outside torch (unsplit)",
        3,
        2,
        4 * GIB,
    )


def test_allocation_sites_from_the_h200_history():
    """The small paged run's history: bitsandbytes' init_state allocates in step 1 what is still
    live at the end of step 2; activations come from the Llama forward."""
    from collector.analysis import history

    doc = history.summary(HISTORY)
    s1 = doc["steps"][0]
    assert s1["step"] == 1 and s1["peak_phase"] == "forward_backward"
    assert any(
        "bitsandbytes/optim/optimizer.py" in r["site"] and "init_state" in r["site"]
        for r in s1["kept_to_next"]
    )
    assert any("modeling_llama.py" in r["site"] for r in s1["at_peak"])
    assert doc["trace_time_us"][0] <= doc["marks_time_us"][1]  # one wall clock


def test_sites_are_the_innermost_frame_outside_torch():
    from collector.analysis.history import NO_FRAMES, site_of, step_sites

    frame = lambda f, n, line: {"filename": f, "name": n, "line": line}  # noqa: E731
    bnb = [
        frame("/v/site-packages/torch/utils.py", "empty", 1),
        frame("/v/site-packages/bitsandbytes/optim/optimizer.py", "init_state", 300),
    ]
    assert site_of(bnb) == "bitsandbytes/optim/optimizer.py:300 (init_state)"
    assert site_of([]) == NO_FRAMES
    marks = [
        {"step": 1, "kind": "begin", "phase": "", "wall_us": 100},
        {"step": 1, "kind": "phase", "phase": "optimizer", "wall_us": 200},
        {"step": 1, "kind": "end", "phase": "", "wall_us": 300},
        {"step": 2, "kind": "begin", "phase": "", "wall_us": 400},
        {"step": 2, "kind": "end", "phase": "", "wall_us": 600},
    ]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "time_us": 110, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 100, "time_us": 150},
        {"action": "alloc", "addr": 2, "size": 50, "time_us": 210, "frames": bnb},
        {"action": "alloc", "addr": 3, "size": 500, "time_us": 410, "frames": []},
        {"action": "free_completed", "addr": 3, "size": 500, "time_us": 500},
    ]
    s1, s2 = step_sites({"device_traces": [trace]}, marks)
    assert (s1.peak_bytes, s1.peak_phase) == (100, "forward_backward")
    assert [x.bytes for x in s1.kept_to_next] == [50]
    assert s2.peak_bytes == 550 and {x.bytes for x in s2.at_peak} == {500, 50}
    assert s2.kept_to_next == []  # no step 3 recorded


def test_the_report_lists_allocation_sites_of_a_store_with_history(tmp_path):
    from collector.analysis.report import render_report
    from collector.analysis.runs import load_run

    src = Path(__file__).parent.parent / "benchmarks/results/h200-accounting/runs/paged_nowatch"
    run_dir = tmp_path / "paged_nowatch"
    shutil.copytree(src, run_dir)
    shutil.copytree(HISTORY, run_dir / "history")
    text, _ = render_report(load_run(run_dir))
    assert "Allocation sites" in text and "init_state" in text and "memory_viz" in text


def test_the_probe_reads_the_allocator_mode_from_the_environment(monkeypatch):
    from collector.probe.identity import allocator_mode as mode

    monkeypatch.delenv("PYTORCH_NO_CUDA_MEMORY_CACHING", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    m = mode()
    assert m["allocator_expandable_segments"] == 1 and m["allocator_caching_disabled"] == 0
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    assert mode()["allocator_caching_disabled"] == 1


def test_history_records_the_first_steps_and_the_step_after_a_jump(tmp_path, monkeypatch):
    """The probe's history recorder (torch's recorder faked: CI has no GPU; on the H200 it is
    the real one): steps 1–3 in one snapshot, nothing for steps 4–6, then the two steps after a
    jump of torch reserved (what the first allocated and the second still held), at most
    HISTORY_JUMPS times; the summary says why each was kept."""
    import pickle

    import torch

    from collector.analysis import history
    from collector.probe.recording import HISTORY_AFTER_JUMP, HISTORY_JUMPS, AllocationHistory

    calls = []
    monkeypatch.setattr(
        torch.cuda.memory,
        "_record_memory_history",
        lambda enabled=None, **kw: calls.append(enabled),
    )
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"device_traces": [[]]})
    h = AllocationHistory(tmp_path, steps=3)
    reserved = {
        1: 1,
        2: 2,
        3: 2,
        4: 2,
        5: 2,
        6: 3,
        7: 3,
        8: 3,
        9: 3,
        10: 4,
        11: 4,
        12: 4,
        13: 5,
        14: 5,
    }  # GiB
    for step in range(1, 15):
        h.begin(step)
        h.end(step, reserved[step] * GIB)
    assert not h.errors
    names = sorted(p.name for p in tmp_path.glob("history-steps-*.pickle"))
    # jumps at the ends of steps 6, 10 and 13: steps 7-8 and 11-12 recorded, not 14
    assert HISTORY_JUMPS == 2 and HISTORY_AFTER_JUMP == 2
    assert names == [
        "history-steps-1-3.pickle",
        "history-steps-11-12.pickle",
        "history-steps-7-8.pickle",
    ]
    assert calls == ["all", None] * 3  # started and stopped once per snapshot, never left on
    assert pickle.loads((tmp_path / names[1]).read_bytes()) == {"device_traces": [[]]}
    doc = history.summary(tmp_path)
    assert [(s["step"], s["after_jump"]) for s in doc["steps"]] == [
        (1, 0),
        (2, 0),
        (3, 0),
        (7, GIB),
        (8, 0),
        (11, GIB),
        (12, 0),
    ]


def test_a_stale_end_reading_is_left_out_of_the_table_the_findings_and_the_export():
    """Steps 3 and 4 of a loaded replay got end readings from before their end marks (4 GiB of
    a transient still in them): the rule says they are left out, and so they are — no
    'outside torch changed' finding built from them, '—' in the table, no exported end."""
    from collector.analysis.report import _row
    from collector.model.series import SERIES

    recs = [_rec(s, 3 * GIB, [[7, 2 * GIB, "train"]], 3 * GIB) for s in range(1, 7)]
    for s in (3, 4):
        recs[s - 1]["nvml_end_bytes"] = 7 * GIB  # the transient's sample, before the end mark
        recs[s - 1]["gap"] = "stale_end"
        recs[s - 1]["processes"]["device_used"] = 7 * GIB
        recs[s - 1]["processes"]["procs"] = [[7, 6 * GIB, "train"]]
    recs = typed(recs)
    stale = recs[2]
    assert stale.nvml_end_bytes == 7 * GIB and stale.nvml_end is None  # kept, not used
    assert stale.nontorch_end is None
    assert [a.step for a in accounts(recs)] == [1, 2, 5, 6]
    found = diagnose(recs)
    assert not [f for f in found if f.rule == "component_change"], [f.text for f in found]
    assert any("left out" in f.text and "step 3–4" in f.text for f in found)
    assert _row(stale, seq=False)[2] == "—"  # the nvml end column
    (end,) = [s for s in SERIES if s.metric.name == "stepmem_step_nvml_end_bytes"]
    assert list(end.values(stale)) == [] and list(end.values(recs[0])) == [({}, 3 * GIB)]


def test_one_baseline_everywhere_the_column_the_finding_and_every_byte_agree():
    """The quick-start capture: the table's non-torch column, the 'outside torch' finding and
    the every-byte line (and the exported account) name one figure beyond one baseline — the
    CUDA context before training — where they gave 0.14, 0.01 beyond a 0.74 baseline, and a
    third split (new-user trial N6/N12)."""
    from collector.analysis.runs import load_run
    from collector.model.account import account
    from collector.model.kinds import Component
    from collector.model.series import SERIES

    run = load_run(Path(__file__).parent.parent / "captures/adamw_8bit.capture.parquet")
    recs = run.by_gpu[run.gpus[0]]
    found = diagnose(recs)
    nontorch = next(f for f in found if f.rule == "nontorch")
    ident = next(f for f in found if f.rule == "accounting")
    last = next(r for r in reversed(recs) if r.step == ident.numbers["step"])
    accs = {a.step: a for a in accounts(recs)}
    comp = accs[last.step].components()
    beyond = sum(v for k, v in comp.items() if k not in (Component.BASELINE, "torch reserved"))
    assert comp[Component.BASELINE] == last.context_baseline  # the probe's, before training
    assert beyond == last.nontorch_end  # the column
    assert comp[Component.FIRST_USE] > 100 << 20  # cuBLAS's workspaces, on the H200
    assert f"{beyond / GIB:.2f} GiB lies outside torch beyond the baseline (CUDA context" in (
        nontorch.text
    )
    assert f"baseline {last.context_baseline / GIB:.2f} + torch reserved" in ident.text
    # live, the sampler's account has the same baseline
    (acc_series,) = [s for s in SERIES if s.metric.name == "stepmem_step_account_bytes"]
    live = dict((labels["component"], v) for labels, v in acc_series.values(last))
    assert live["baseline"] == last.context_baseline
    assert account(last, last.process_pid, None) is not None


def _bomb(blocks: int, steps: int, sites: int = 1):
    """A history of ``blocks`` live allocations (sharing ``sites`` stacks) and ``steps`` steps."""
    stacks = [
        [{"filename": f"/v/site-packages/lib{i}.py", "name": "f", "line": 1}] for i in range(sites)
    ]
    trace = [
        {
            "action": "alloc",
            "addr": i * 512,
            "size": 512,
            "frames": stacks[i % sites],
            "time_us": 10 + i,
        }
        for i in range(blocks)
    ]
    t = blocks + 100
    marks = [{"step": 1, "kind": "begin", "phase": "", "wall_us": 1}]
    marks.append({"step": 1, "kind": "end", "phase": "", "wall_us": t})
    for s in range(2, steps + 1):
        marks.append({"step": s, "kind": "begin", "phase": "", "wall_us": t + 2 * s})
        marks.append({"step": s, "kind": "end", "phase": "", "wall_us": t + 2 * s + 1})
    return {"device_traces": [trace]}, marks


def test_the_history_walk_keeps_sums_per_mark_not_a_copy_of_every_live_block():
    """100,000 live blocks and 2,000 steps of marks (the round-5 bomb: 3 MB of pickle, 200 KB of
    marks; 4.4 GB in 6.6 s when each end mark copied the live set): every step's sums are right,
    and the walk's memory is that of one live set."""
    import tracemalloc

    from collector.analysis.history import step_sites

    snap, marks = _bomb(100_000, 2_000)
    tracemalloc.start()
    try:
        steps = step_sites(snap, marks, top=3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(steps) == 2_000
    assert [(s.bytes, s.count) for s in steps[-1].at_end] == [(512 * 100_000, 100_000)]
    assert [(s.bytes, s.count) for s in steps[0].kept_to_next] == [(512 * 100_000, 100_000)]
    assert steps[1].kept_to_next == []  # step 2 allocated nothing
    assert peak < 150 << 20, f"{peak / 2**20:.0f} MiB"


def test_a_history_asking_too_many_site_sums_is_refused_in_one_line():
    """Many distinct sites live at many marks: the work the reader does is bounded, and what it
    will not do is said (a HistoryError, which the report prints as one line)."""
    from collector.analysis.history import MAX_SITE_READS, HistoryError, step_sites

    snap, marks = _bomb(20_000, 2_000, sites=5_000)
    assert MAX_SITE_READS < 5_000 * 2 * 2_000
    with pytest.raises(HistoryError, match="site sums"):
        step_sites(snap, marks, top=3)


def test_an_older_two_rank_capture_gives_no_negative_figure():
    """Two ranks on one GPU, recorded before each rank's own per-process reading existed: rank
    0's records carry a reading of the GPU's processes taken before its own pool grew (its
    figure below its torch reserved), and the probe's reading before training held the other
    rank's memory, since freed. Neither may become a negative baseline ("CUDA context before
    training, −1.21 GiB"): such steps are one unsplit figure, never below 0, summing as ever."""
    recs = [
        _rec(1, 6 * GIB, [[7, 2 * GIB, "rank0"], [8, 3 * GIB, "rank1"]], 6 * GIB, 3 * GIB),
        _rec(2, 6 * GIB, [[7, 2 * GIB, "rank0"], [8, 3 * GIB, "rank1"]], 6 * GIB, 3 * GIB),
    ]
    for r in recs:
        r["torch_end"]["context_baseline_bytes"] = 4 * GIB  # read while rank 1 loaded
    typed_recs = typed(recs)
    for a in accounts(typed_recs):
        assert a.unsplit is not None and "below torch's own pool" in a.unsplit_why
        comp = a.components()
        assert all(v >= 0 for v in comp.values()), comp
        assert sum(comp.values()) == a.device_used
    text = "\n".join(f.text for f in diagnose(typed_recs))
    assert "−" not in text and "-1" not in text, text
