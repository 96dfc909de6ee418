"""The probe inside a Ray Train ``train_loop_per_worker`` sends its steps to the node's sampler."""

import json

import pytest
import ray

from collector.backends import BackendSpec
from collector.placement import launch_samplers
from tests.conftest import loopback, wait_for

pytestmark = pytest.mark.ray
pytest.importorskip("torch")


def train_loop(config):
    import torch

    from collector.probe.core import StepProbe
    from workloads import finetune

    model = finetune.build_model("tiny", 32, None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # A CPU worker has no CUDA device: address its events to the replayed GPU of this node.
    probe = StepProbe(gpu_uuids={"cpu": config["uuid"]}).watch(model, opt)
    ids = torch.randint(0, finetune.SHAPES["tiny"]["vocab_size"], (1, 32))
    for step in range(1, config["steps"] + 1):
        with probe.step(step):
            model(input_ids=ids, labels=ids).loss.backward()
            probe.phase("optimizer")
            opt.step()
            opt.zero_grad()
    probe.close()
    with open(config["out"], "w") as f:  # one node: the test reads it back
        json.dump({"steps": len(probe.records), "sent": probe.outbox.sent}, f)


def test_probe_in_a_torch_trainer_worker_reaches_the_sampler(kill_samplers, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    (placed,) = launch_samplers(BackendSpec("replay", captures=["idle"], gpus=1), loopback())
    kill_samplers.append(placed.handle)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"uuid": placed.gpu_uuid, "steps": 4, "out": str(tmp_path / "w.json")},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False),
        run_config=RunConfig(storage_path=str(tmp_path), name="probe"),
    )
    trainer.fit()
    assert json.loads((tmp_path / "w.json").read_text()) == {"steps": 4, "sent": 12}
    wait_for(lambda: len(ray.get(placed.handle.step_records.remote())) == 4, timeout=30)
    records = ray.get(placed.handle.step_records.remote())
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert all(r.samples > 0 and r.ledger["parameters"] > 0 for r in records)
    assert [p.phase for p in records[0].phases] == ["forward_backward", "optimizer"]
    # the worker told the sampler who it is: its memory series is labelled by rank, not pid
    assert list(ray.get(placed.handle.info.remote()).processes.values()) == ["train_rank_0"]


def test_the_job_runs_a_workload_in_a_torch_trainer(kill_samplers, tmp_path):
    """`stepmem run --train-workers N`: the job's Ray Train path, with a CPU worker whose probe
    addresses the replayed GPU of this node."""
    from collector.model.settings import JobOptions
    from collector.run.runners import TrainRunner

    (placed,) = launch_samplers(BackendSpec("replay", captures=["idle"], gpus=1), loopback())
    kill_samplers.append(placed.handle)
    args = ["--pattern", "leak", "--steps", "3", "--leak-mib", "1", "--base-mib", "4"]
    opts = JobOptions(workload="patterns", workload_args=args, train_workers=1, store=tmp_path)
    lines = []
    runner = TrainRunner(opts, "t", use_gpu=False, gpu_uuids={"cpu": placed.gpu_uuid})
    summary = runner.run(None, lines.append)
    assert summary["train_workers"] == 1 and len(summary["step_times_s"]) == 3, summary
    assert summary["probe_sent"] == 6 and not summary["probe_dropped"]  # begin + end, 3 steps
    assert "Ray Train: 1 worker(s), CPU" in lines
    wait_for(lambda: len(ray.get(placed.handle.step_records.remote())) == 3, timeout=30)
    assert [r.step for r in ray.get(placed.handle.step_records.remote())] == [1, 2, 3]
