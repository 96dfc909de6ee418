"""Per-step memory in experiment trackers, with the real packages, offline: the Hugging Face
Trainer reporting to TensorBoard, MLflow (a file store) and W&B (offline mode) at once, each
read back with its own reader; Lightning through its own logger; a plain loop's
``probe.metrics()``. The NVML keys come from a replayed GPU's sampler on a local Ray cluster."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest

from collector.model.step import StepRecord
from collector.probe.core import StepProbe
from collector.probe.outbox import Outbox
from tests.conftest import loopback
from tests.loops import lightning_fit, plain_loop
from workloads import finetune

GIB = 1 << 30
LEDGER = "stepmem/ledger/parameters_gib"


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline W&B run: its ``.wandb`` file is LevelDB's log format (32 KiB
    blocks of chunks with a 7-byte header) after a 7-byte W&B header, each record a protobuf
    ``Record`` (wandb 0.31 ships no Python reader)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, partial, payloads = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # full
            payloads.append(chunk)
        elif kind == 2:  # first
            partial = chunk
        elif kind == 3:  # middle
            partial += chunk
        elif kind == 4:  # last
            payloads.append(partial + chunk)
    rows = []
    for p in payloads:
        rec = pb.Record()
        rec.ParseFromString(p)
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
    return rows


@pytest.mark.ray
def test_hf_trainer_sends_stepmem_keys_to_tensorboard_mlflow_and_wandb(
    kill_samplers, tmp_path, monkeypatch
):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from collector.backends import BackendSpec
    from collector.placement import launch_samplers

    # a replayed GPU playing the 7B adamw_8bit run's NVML trace (the probe's steps are this
    # tiny CPU run's; the sampler joins them against that trace)
    (gpu,) = launch_samplers(BackendSpec("replay", captures=["adamw_8bit"], gpus=1), loopback())
    kill_samplers.append(gpu.handle)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for k, v in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "WANDB_ERROR_REPORTING": "false",  # nothing leaves the machine
        "WANDB_DISABLE_GIT": "true",
    }.items():
        monkeypatch.setenv(k, v)
    steps = 16
    args = finetune.defaults(
        finetune.parser().parse_args(
            [
                "--size",
                "tiny",
                "--steps",
                str(steps),
                "--report-to",
                "tensorboard",
                "mlflow",
                "wandb",
            ]
        )
    )
    probe = StepProbe(gpu_uuids={"cpu": gpu.gpu_uuid})
    finetune.run(args, probe)
    parameters = probe.records[-1]["ledger"]["parameters"] / GIB
    assert parameters > 0

    # TensorBoard, read with its own event reader: one point per training step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    tb = {t.removeprefix("train/"): ea.Scalars(t) for t in ea.Tags()["scalars"] if "stepmem/" in t}
    assert [e.step for e in tb[LEDGER]][:steps] == list(range(1, steps + 1))
    assert tb[LEDGER][0].value == pytest.approx(parameters)

    # MLflow's file store, read with its client
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    hist = client.get_metric_history(run.info.run_id, LEDGER)
    assert sorted({m.step for m in hist}) == list(range(1, steps + 1))

    # W&B offline: the run's history rows carry the keys with the Trainer's global step
    import wandb

    wandb.finish()  # the Trainer leaves the run open (a script ends with this, or at exit)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = [r for r in _wandb_history(run_dir) if f"train/{LEDGER}" in r]
    logged = [r["train/global_step"] for r in rows][:steps]
    # every row at its own step, in order; W&B's offline writer, finished on a machine whose
    # cores two busy loops hold, once left the last row out (1 run of 8 under load)
    assert logged == list(range(1, len(logged) + 1)) and len(logged) >= steps - 1, logged

    # the sampler's NVML figures arrive once the first log has asked for them: the newest
    # joined step, with its own step number (never ahead of the training step it is logged at)
    nvml = tb.get("stepmem/nvml_peak_gib")
    assert nvml, (sorted(tb), dict(probe.outbox.dropped))
    nvml_step = {e.step: int(e.value) for e in tb["stepmem/nvml_step"]}
    assert all(1 <= joined <= s for s, joined in nvml_step.items())
    # each logged figure is the sampler's own record of the step it names
    import ray

    recs = {r.step: r for r in ray.get(gpu.handle.step_records.remote(), timeout=30)}
    for e in nvml:
        assert e.value == pytest.approx(recs[nvml_step[e.step]].nvml_peak_bytes / GIB)
    assert {m.step for m in client.get_metric_history(run.info.run_id, "stepmem/nvml_peak_gib")}


def test_a_callback_given_as_callbacks_is_moved_ahead_of_the_reporters_by_attach(caplog):
    from transformers import Trainer, TrainingArguments
    from transformers.integrations import TensorBoardCallback

    from collector.probe.hf import StepMemCallback, attach

    cb = StepMemCallback(StepProbe(outbox=Outbox(None)))
    targs = TrainingArguments(output_dir="unused", report_to=["tensorboard"], use_cpu=True)
    trainer = Trainer(model=finetune.build_model("tiny", 16, None), args=targs, callbacks=[cb])
    names = [type(c) for c in trainer.callback_handler.callbacks]
    assert names.index(StepMemCallback) > names.index(TensorBoardCallback)  # the Trainer's order
    with caplog.at_level(logging.WARNING, logger="collector.probe.hf"):
        cb.on_train_begin(targs, None, None)
    assert "attach(trainer)" in caplog.text  # said, not silently lost
    assert attach(trainer) is cb  # moved, not doubled
    assert trainer.callback_handler.callbacks[0] is cb
    assert sum(isinstance(c, StepMemCallback) for c in trainer.callback_handler.callbacks) == 1


def test_lightning_logs_the_keys_through_its_logger(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger

    from collector.probe.lightning import StepMemLightningCallback

    lightning_fit(
        StepMemLightningCallback(StepProbe(outbox=Outbox(None))),
        batches=4,
        logger=CSVLogger(tmp_path, name="run"),
        log_every_n_steps=1,
    )
    (path,) = tmp_path.glob("run/*/metrics.csv")
    rows = list(csv.DictReader(path.open()))
    mem = [int(r["step"]) for r in rows if r.get(LEDGER)]
    loss = [int(r["step"]) for r in rows if r.get("loss")]
    # on the trainer's own axis: each step's memory beside the loss that step logged
    assert mem == loss == [0, 1, 2, 3]
    assert all(float(r[LEDGER]) > 0 for r in rows if r.get(LEDGER))


def test_plain_loop_metrics_give_peaks_since_the_last_call_and_the_newest_joined_step():
    probe = StepProbe(outbox=Outbox(None))
    plain_loop(probe, steps=2)
    m = probe.metrics()
    assert m[LEDGER] > 0 and "stepmem/nvml_peak_gib" not in m  # nothing joined yet
    assert probe.outbox.want_newest  # the sender now fetches it
    # what the sender would have fetched (no Ray here), and allocator peaks (no CUDA here)
    probe.outbox.newest["GPU-a"] = StepRecord(
        "GPU-a", 7, 1, 2, 5, nvml_peak_bytes=3 * GIB, nvml_end_bytes=GIB
    )
    probe._log_peaks = {0: {"allocated_bytes.all.peak": GIB, "reserved_bytes.all.peak": 2 * GIB}}
    m = probe.metrics()
    assert (m["stepmem/nvml_peak_gib"], m["stepmem/nvml_end_gib"], m["stepmem/nvml_step"]) == (
        3.0,
        1.0,
        7.0,
    )
    assert (m["stepmem/torch_allocated_peak_gib"], m["stepmem/torch_reserved_peak_gib"]) == (1, 2)
    assert "stepmem/torch_allocated_peak_gib" not in probe.metrics()  # since the last call only
