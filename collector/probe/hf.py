"""Hugging Face ``Trainer`` adapter.

What a step is here: one optimizer update. Under gradient accumulation ``N`` the Trainer calls
``on_step_begin`` before the first of the ``N`` micro-batches and ``on_step_end`` after
``optimizer.step()``, the scheduler step and ``model.zero_grad()`` — so the end-of-step reading
is taken with gradients already freed (the seed report's readings were taken there too). Steps
are numbered from 1 (``state.global_step`` after the update).

Phases: ``forward_backward`` (all micro-batches, gradient clipping) ends at
``on_pre_optimizer_step``; ``optimizer`` (``optimizer.step()``, the scheduler step and
``zero_grad``) ends with the step. The phase mark carries the allocator peaks of the phase before
it, so a step's peak can be placed in forward/backward or in the optimizer step. (No mark at
``on_optimizer_step``: the scheduler and ``zero_grad`` allocate nothing worth a ≈0.1 ms read.)

Trackers: ``on_log`` adds :meth:`StepProbe.metrics`'s ``stepmem/*`` keys to each log, so they
land on the training-step axis of whatever ``report_to`` names, provided the callback runs
first: add it with :func:`attach`.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from collector.model.kinds import Phase
from collector.probe.core import StepProbe

__all__ = ["StepMemCallback", "attach"]

log = logging.getLogger(__name__)


def attach(trainer: Any, probe: StepProbe | None = None, watch: bool = True) -> StepMemCallback:
    """Add stepmem to ``trainer`` ahead of its reporting callbacks, so the ``stepmem/*`` keys
    it adds to each log reach TensorBoard, W&B, MLflow… The Trainer calls callbacks in order
    and puts ``report_to``'s before those passed as ``callbacks=``, where the keys would come
    too late. Returns the callback (a stepmem callback already there is moved, not doubled)."""
    handler = trainer.callback_handler
    cb = next((c for c in handler.callbacks if isinstance(c, StepMemCallback)), None)
    if cb is None:
        cb = StepMemCallback(probe, watch=watch)
    else:
        handler.callbacks.remove(cb)
    cb.ahead = True
    handler.callbacks.insert(0, cb)
    return cb


class StepMemCallback(TrainerCallback):
    """``Trainer(..., callbacks=[StepMemCallback()])``. Reads every CUDA device the model uses.
    ``watch=False`` leaves the model and optimizer alone: no ledger (what a probe of your own
    that never calls ``watch()`` records)."""

    def __init__(self, probe: StepProbe | None = None, watch: bool = True) -> None:
        self.probe = probe or StepProbe()
        self.watch = watch
        self.ahead = False  # placed before the reporting callbacks (attach)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        reporters = [r for r in (getattr(args, "report_to", None) or []) if r != "none"]
        if reporters and not self.ahead:
            log.warning(
                "stepmem: the stepmem/* keys will not reach %s: the Trainer runs reporting "
                "callbacks before those given as callbacks=; add stepmem with "
                "collector.probe.hf.attach(trainer) instead",
                ", ".join(reporters),
            )
        if self.watch:
            self.probe.watch(kwargs.get("model"), kwargs.get("optimizer"))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch and self.probe.optimizer is None and kwargs.get("optimizer") is not None:
            self.probe.watch(optimizer=kwargs["optimizer"])
        self.probe.begin(state.global_step + 1)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.probe.phase(Phase.OPTIMIZER)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.probe.end()

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any
    ) -> None:
        """Add the ``stepmem/*`` keys (:meth:`StepProbe.metrics`) to the Trainer's log."""
        if logs is not None:
            logs.update(self.probe.metrics())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.probe.close()
