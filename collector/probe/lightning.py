"""PyTorch Lightning adapter (``pip install 'stepmem[lightning]'``).

What a step is here: one optimizer update, as for the HF adapter — ``accumulate_grad_batches``
batches, then ``optimizer.step()``. Steps are numbered from 1 (``trainer.global_step`` after the
update). One difference to know when reading the ledger: Lightning zeroes gradients *before the
backward of the next step's first batch*, not after the optimizer step, so the end-of-step
reading still holds the gradients (the HF Trainer has freed them by ``on_step_end``).

Phases: ``forward_backward`` ends at ``on_before_optimizer_step``; ``optimizer`` ends with the
step. Only automatic optimization with one optimizer is marked.

Trackers: every ``log_every_n_steps`` steps the ``stepmem/*`` keys
(:meth:`StepProbe.metrics`) go to each of the trainer's loggers on the step axis of the
metrics the module logs in that step (``self.log("loss", …)``): Lightning logs those at the
number of optimizer steps taken *before* the update, which is ``trainer.global_step - 1`` once
the update is done.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from collector.model.kinds import Phase
from collector.probe.core import StepProbe

__all__ = ["StepMemLightningCallback"]


class StepMemLightningCallback(Callback):
    """``lightning.Trainer(..., callbacks=[StepMemLightningCallback()])``."""

    def __init__(self, probe: StepProbe | None = None) -> None:
        self.probe = probe or StepProbe()

    def _accum(self, trainer: Any) -> int:
        return max(1, int(trainer.accumulate_grad_batches))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.probe.watch(pl_module, trainer.optimizers[0] if trainer.optimizers else None)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % self._accum(trainer) == 0:
            self.probe.begin(trainer.global_step + 1)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.probe.phase(Phase.OPTIMIZER)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        last = batch_idx + 1 == trainer.num_training_batches
        if (batch_idx + 1) % self._accum(trainer) == 0 or last:
            self.probe.end()
            step = trainer.global_step
            if trainer.loggers and step % max(1, int(trainer.log_every_n_steps)) == 0:
                metrics = self.probe.metrics()
                for logger in trainer.loggers:  # beside the loss this update logged
                    logger.log_metrics(metrics, step=max(0, step - 1))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.probe.close()
