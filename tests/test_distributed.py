"""Distributed training measured per rank, on CPU gloo ranks standing in for GPUs: the ledger
under FSDP2 and DDP against PyTorch's own memory trackers, one probe per rank under torchrun,
``torch.multiprocessing.spawn`` and Ray Train, the per-rank join, and the rank findings."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from collector.store import RunStore
from tests.cli import stepmem
from tests.records import typed

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
GIB = 1 << 30


def torchrun(
    *args: str, cwd: Path, timeout: int = 600, nproc: int = 2
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


# the ledger's kinds against each tracker's categories (their names as the trackers spell them)
CATEGORIES = {
    "fsdp2": {
        "parameters": "Sharded Param",
        "gradients": "Sharded Grad",
        "optimizer_state": "OptState",
    },
    "ddp": {"parameters": "Parameter", "gradients": "Gradient", "optimizer_state": "Optstate"},
}


@pytest.mark.parametrize("shard", ["fsdp2", "ddp"])
def test_the_ledger_equals_pytorchs_own_tracker_on_every_rank(tmp_path, shard, record_fault):
    res = torchrun("-m", "workloads.distributed", "--shard", shard, "--steps", "3",
                   "--track", str(tmp_path / "t"), cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    worst = 0.0
    for rank in (0, 1):
        doc = json.loads((tmp_path / f"t.rank{rank}.json").read_text())
        tracked, led = doc["current"]["cpu"], doc["ledger"]
        for kind, category in CATEGORIES[shard].items():
            assert tracked[category] > 0
            diff = abs(led[kind] - tracked[category]) / tracked[category]
            worst = max(worst, diff)
            assert diff <= 0.01, (rank, kind, led[kind], category, tracked[category])
        if shard == "fsdp2":  # sharded: each rank holds about half
            assert led["parameters"] < 0.6 * 2 * tracked["Sharded Param"]
            assert led["unsharded_parameters_peak"] == doc["unsharded_param_peak"] > 0
        else:  # DDP's buckets: a second copy of the gradients without gradient_as_bucket_view
            assert led["gradient_buckets"] == led["gradient_bucket_bytes"] >= led["gradients"]
    record_fault(
        f"{shard} on 2 gloo ranks (torchrun): the ledger against PyTorch's "
        f"{'FSDPMemTracker' if shard == 'fsdp2' else 'MemTracker'} on the same step",
        "parameters, gradients and optimizer state equal the tracker's categories on every rank"
        + ("; the unsharded-parameter peak equals the tracker's" if shard == "fsdp2" else ""),
        largest_difference_percent=round(100 * worst, 3),
    )


def test_ddp_with_bucket_views_has_no_second_copy(tmp_path):
    res = torchrun("-m", "workloads.distributed", "--shard", "ddp", "--bucket-view",
                   "--steps", "3", "--track", str(tmp_path / "t"), cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    led = json.loads((tmp_path / "t.rank0.json").read_text())["ledger"]
    assert led["gradient_buckets"] == 0 and led["gradient_bucket_bytes"] >= led["gradients"] > 0


def _run_command(tmp_path, run_id, *cmd: str, capture: str = "idle"):
    return stepmem("run", "--backend", "replay", "--capture", capture,
                   "--store", str(tmp_path / "runs"), "--run-id", run_id, "--command", "--",
                   *cmd, timeout=600)  # fmt: skip


@pytest.mark.ray
def test_torchrun_ranks_each_report_their_own_steps(tmp_path, record_fault):
    res = _run_command(tmp_path, "tr", str(BIN / "torchrun"), "--standalone",
                       "--nproc-per-node", "2", "-m", "workloads.distributed",
                       "--shard", "fsdp2", "--steps", "4")  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    recs = RunStore(tmp_path / "runs" / "tr").records()
    by_rank = {r: [x for x in recs if x.rank == r] for r in (0, 1)}
    assert [len(v) for v in by_rank.values()] == [4, 4]
    assert all(x.world_size == 2 for x in recs)
    assert len({x.pid for x in by_rank[0]} | {x.pid for x in by_rank[1]}) == 2
    for xs in by_rank.values():
        assert [x.seq for x in xs] == [1, 2, 3, 4] and [x.step for x in xs] == [1, 2, 3, 4]
        assert xs[-1].ledger["parameters"] > 0 and xs[-1].ledger["unsharded_parameters_peak"] > 0
    assert "rank 0 of 2" in res.stdout and "rank 1 of 2" in res.stdout
    assert "Fleet — 2 ranks of the run" in res.stdout
    # a "Fleet" heading only above what the fleet rule found (it stood empty before)
    assert not re.search(r"^Fleet\n(?! • )", res.stdout, re.M), res.stdout
    # the capture played beside the CPU ranks is not their memory: no NVML figure, no verdict
    # on it (it read 0 bytes, "headroom 140 GiB", before)
    assert all(x.gap == "stand_in" and x.nvml_peak_bytes is None for x in recs)
    assert "No NVML figure: CPU processes stood in for the GPU" in res.stdout
    assert "headroom" not in res.stdout
    record_fault(
        "torchrun with 2 FSDP2 ranks on one (replayed) GPU under `stepmem run --command`",
        "each rank's probe reports through the run's spool (no Ray in the ranks); every step of "
        "each rank kept apart, keyed by its pid and seq; a table and a fleet row a rank",
        steps_lost=8 - len(recs),
    )


@pytest.mark.ray
def test_spawned_ranks_and_a_rank_that_dies_are_named(tmp_path, record_fault):
    """torch.multiprocessing.spawn ranks (the H200 case whose events were all lost), one of
    which crashes inside its step 3 (no cleanup, no flush): the other's four steps and the dead
    one's first two are kept, the report names the rank that stopped, the run fails as its
    command did."""
    script = tmp_path / "spawn_ddp.py"
    script.write_text(SPAWN)
    res = _run_command(tmp_path, "sp", sys.executable, str(script), str(tmp_path / "done"))
    assert res.returncode == 1 and "exited with status" in res.stderr
    recs = RunStore(tmp_path / "runs" / "sp").records()
    steps = {r: [x.step for x in recs if x.rank == r] for r in (0, 1)}
    assert steps[0] == [1, 2, 3, 4] and steps[1] == [1, 2]
    rep = stepmem("report", str(tmp_path / "runs" / "sp"))
    assert "Rank 1 (GPU 0" in rep.stdout and "stopped after step 2: 2 of 4 steps" in rep.stdout
    assert "Run FAILED" in rep.stdout
    record_fault(
        "2 DDP ranks from torch.multiprocessing.spawn under `stepmem run --command`, rank 1 "
        "killed inside step 3",
        "every step that ended is kept per rank; the report names the rank that stopped; the run "
        "fails (exit 1) as its command did",
        steps_kept=len(recs),
    )


SPAWN = """
import os, sys, time
from pathlib import Path
import torch
import torch.multiprocessing as mp

def rank(r, world, done):
    os.environ.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r))
    from collector.probe.core import StepProbe
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    probe = StepProbe().watch(model, opt)
    for step in range(1, 5):
        probe.begin(step)
        if r == 1 and step == 3:  # crash 2 s into step 3, once rank 0 has finished
            deadline = time.monotonic() + 60
            while not Path(done).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(2)
            os._exit(17)
        model(torch.randn(8, 256)).sum().backward()
        opt.step()
        probe.end()
    probe.close()
    if r == 0:
        Path(done).touch()

if __name__ == "__main__":
    mp.spawn(rank, args=(2, sys.argv[1]), nprocs=2)
"""


@pytest.mark.ray
def test_ray_train_workers_are_ranks_with_ddp_buckets(tmp_path):
    res = stepmem("run", "--backend", "replay", "--capture", "idle", "--store",
                  str(tmp_path / "runs"), "--run-id", "rt", "--train-workers", "2",
                  "--workload", "distributed", "--", "--shard", "ddp", "--steps", "3",
                  timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    recs = RunStore(tmp_path / "runs" / "rt").records()
    assert sorted((x.rank, x.step) for x in recs) == [(r, s) for r in (0, 1) for s in (1, 2, 3)]
    assert all(x.ledger["gradient_buckets"] > 0 for x in recs)  # DDP's second copy, named


# -- the rank findings -------------------------------------------------------------------------


def _ranks(n: int, odd: int | None = None, extra: int = 0) -> list[dict]:
    """Records of an ``n``-rank run, one GPU each, from the H200 7B run's step records: rank
    ``odd`` holds ``extra`` more bytes of optimizer state."""
    doc = json.loads((ROOT / "benchmarks/results/h200-run2/adamw_8bit.records.json").read_text())
    out = []
    for r in range(n):
        for rec in doc["records"]:
            x = copy.deepcopy(rec)
            x.update(gpu_uuid=f"GPU-{r}", rank=r, world_size=n, pid=1000 + r)
            if r == odd:
                x["torch_allocated_peak_bytes"] += extra
                x["ledger"]["optimizer_state"] += extra
            out.append(x)
    return out


def _fleet(n, **kw):
    from collector.analysis.report import render_report
    from collector.analysis.runs import Run

    doc = json.loads((ROOT / "benchmarks/results/h200-run2/adamw_8bit.records.json").read_text())
    (s,) = doc["samplers"]
    samplers = [{**s, "gpu_uuid": f"GPU-{r}", "index": r % 8, "node_id": f"node-{r // 8}"}
                for r in range(n)]  # fmt: skip
    text, _ = render_report(Run("fleet", {"samplers": samplers}, typed(_ranks(n, **kw))))
    return text[text.index("Fleet —") :]


def test_a_rank_out_of_balance_is_named_with_the_component_that_differs():
    fleet = _fleet(8, odd=5, extra=6 * GIB)
    assert "Rank 5 (GPU 5) is out of balance: its allocated peak 85.49 GiB is +6.00 GiB" in fleet
    assert "optimizer state (+6.00 GiB)" in fleet
    assert fleet.count("IMBALANCED") == 1
    assert "out of balance" not in _fleet(8)


def test_only_ranks_above_are_out_of_balance():
    # a rank 6 GiB under the others holds less, which is what the other ranks should envy
    assert "out of balance" not in _fleet(8, odd=3, extra=-6 * GIB)
    # two ranks: the higher one is held against the lower, and the lower is not named
    two = _fleet(2, odd=1, extra=6 * GIB)
    assert "Rank 1 (GPU 1) is out of balance" in two and "above the other rank" in two
    assert "optimizer state (+6.00 GiB)" in two and "Rank 0 (GPU 0) is out" not in two


def test_the_fleet_of_64_ranks_stays_readable():
    fleet = _fleet(64, odd=17, extra=6 * GIB)
    table = [ln for ln in fleet.splitlines() if ln.startswith("│")]
    assert len(table) <= 16  # the highest, the lowest, the odd one, and a line for the rest
    assert any("more" in ln for ln in table) and "Rank 17 (GPU 17) is out of balance" in fleet


def test_ranks_that_disagree_on_the_world_size_are_said():
    from collector.analysis.report import render_report
    from collector.analysis.runs import Run

    recs = _ranks(2)
    for x in recs:
        if x["rank"] == 1:
            x["world_size"] = 4
    text, _ = render_report(Run("w", {"samplers": []}, typed(recs)))
    assert "do not agree on the world size (2, 4)" in text


def test_unrelated_processes_are_never_out_of_balance():
    """Two captures replayed on two GPUs (or two single-process runs): each is rank 0 of a
    world of one — no rank out of balance, however far apart their peaks."""
    from collector.analysis.report import render_report
    from collector.analysis.runs import Run

    recs = _ranks(2, odd=1, extra=60 * GIB)
    for x in recs:
        x.update(rank=0, world_size=1)
    text, _ = render_report(Run("two", {"samplers": []}, typed(recs)))
    assert "out of balance" not in text and "IMBALANCED" not in text
    assert "Rank 1 (GPU 1) is out of balance" in _fleet(2, odd=1, extra=60 * GIB)  # ranks are


def test_a_gpu_without_a_step_is_no_phantom_rank():
    """Two ranks on GPUs 0 and 1 of three: GPU 2's sampler ran, no process reported to it —
    it is no third rank, and no rank of a world of one that disagrees with the others."""
    from collector.analysis.report import render_report
    from collector.analysis.runs import Run

    doc = json.loads((ROOT / "benchmarks/results/h200-run2/adamw_8bit.records.json").read_text())
    (s,) = doc["samplers"]
    samplers = [{**s, "gpu_uuid": f"GPU-{r}", "index": r} for r in range(3)]
    text, _ = render_report(Run("idle", {"samplers": samplers}, typed(_ranks(2))))
    assert "Fleet — 2 ranks, and 1 GPU without a step of the run" in text
    assert "do not agree on the world size" not in text


def test_spawned_ranks_without_local_rank_stand_in_for_one_gpu_each(monkeypatch):
    """torch.multiprocessing.spawn sets no LOCAL_RANK: a CPU rank stands in for the GPU of its
    rank, as a torchrun rank does (both landed on GPU 0)."""
    from collector.probe.identity import CPU_AS_ENV, cpu_stands_in_for

    monkeypatch.setenv(CPU_AS_ENV, "GPU-a,GPU-b")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    got = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        got.append(cpu_stands_in_for())
    assert got == ["GPU-a", "GPU-b"]
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun's local rank still decides
    assert cpu_stands_in_for() == "GPU-a"


def test_a_rank_is_the_one_its_process_settled_on():
    """A probe whose first step ran before the process group existed says rank 0 of 1 there
    and rank 1 of 2 after: the stream is rank 1 of 2 (it was labelled rank 0 beside the real
    rank 0), and the world sizes agree."""
    from collector.analysis.report import render_report
    from collector.analysis.runs import Run

    recs = [x for x in _ranks(2) if x["step"] <= 3]
    for x in recs:
        x["gpu_uuid"] = "GPU-0"
        if x["rank"] == 1 and x["step"] == 1:
            x.update(rank=0, world_size=1)
    run = Run("late", {"samplers": []}, typed(recs))
    assert sorted((s.rank, s.world_size) for s in run.streams) == [(0, 2), (1, 2)]
    text, _ = render_report(run)
    assert "do not agree on the world size" not in text and "rank 1 of 2 (pid 1001)" in text
