"""A user's script's steps, traced: the marks its probe lines make (:mod:`collector.model.marks`)
cut the one tracker that watches the whole script into steps.

:class:`ScriptSteps` listens for the marks. At each step's begin it starts the tracker's peak
afresh (and the live counters' peaks, as the probe resets torch's at each mark), at each phase it
marks the allocation log, and at each end it keeps the step's peak by kind, what stays at its
end and — for the last step traced — the module peaks; after :data:`STEPS_TRACED` steps it ends
the script (:class:`~collector.model.marks.TraceDone`).
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

from collector.estimate.alloc_log import AllocationLog
from collector.estimate.tracing import module_peaks, parts_of
from collector.estimate.tracker import file_quantisation_state
from collector.model.kinds import MemoryKind, Phase
from collector.model.marks import TraceDone
from collector.model.prediction import ModulePeak

__all__ = ["STEPS_TRACED", "ScriptSteps"]

STEPS_TRACED = 2  # step 2 holds what step 1's optimizer step made: the steady one


@dataclass
class ScriptSteps:
    """The listener (see the module doc). ``live`` (a :class:`~.counters.LiveAllocator`) has its
    peaks reset at each mark, as the probe resets torch's."""

    tracker: Any
    log: AllocationLog | None
    device: Any
    live: Any = None
    per_step: list[dict[MemoryKind, int]] = field(default_factory=list)
    at_end: dict[MemoryKind, int] = field(default_factory=dict)
    modules: list[ModulePeak] = field(default_factory=list)
    in_optimizer: bool = False
    models: list[Any] = field(default_factory=list)
    roots: list[Any] = field(default_factory=list)  # modules whose forward ran outside others'
    optimizers: list[Any] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)  # the script's own step numbers
    _n: int = 0
    _open: bool = False
    _before_opt: int | None = None
    _best: int = -1

    def __post_init__(self) -> None:
        """The tracker keeps one forward per module between resets; a script's step may run
        several (micro-batches): at a root module's next forward the records start afresh,
        the largest micro-batch's module peaks kept."""
        real = self.tracker._pre_fw_hook

        def pre_forward(module: Any, inputs: Any) -> None:
            mt = self.tracker._mod_tracker
            again = module in self.tracker.memory_tracking and not mt.is_bw
            if again and set(mt.parents) <= {"Global", mt.get_known_fqn(module)}:
                self._keep_modules()
                self.tracker.reset_mod_stats()
            real(module, inputs)

        self.tracker._pre_fw_hook = pre_forward

    def _keep_modules(self) -> None:
        mods = module_peaks(self.tracker, self.root(), self.device)
        top = max((m.total for m in mods), default=-1)
        if top > self._best:
            self._best, self.modules = top, mods

    # -- what the script shows the probe ------------------------------------------------------

    def watch(self, model: Any, optimizer: Any) -> None:
        if model is not None and all(m is not model for m in self.models):
            self.models.append(model)
        self.add_optimizer(optimizer)

    def add_optimizer(self, optimizer: Any) -> None:
        """``optimizer``, or the one a wrapper (accelerate's, Lightning's) holds."""
        while optimizer is not None and hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer
        if optimizer is not None and all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)

    def begin(self, step: int) -> None:
        if self._open:  # a begin without an end: the step before is ended here
            self.end()
        self._n += 1
        self._open = True
        self.numbers.append(int(step) if isinstance(step, int) else self._n)
        self._before_opt = None
        if self.log is not None:
            self.log.mark(f"{self._n} {Phase.STEP}")
        self._file_quantisation_state()
        self._restart_peaks()
        self.tracker.reset_mod_stats()
        self._best, self.modules = -1, []

    def phase(self, name: str) -> None:
        if not self._open:
            return
        if name == Phase.OPTIMIZER:
            self._before_opt = self._peak_total()
        if self.log is not None:
            self.log.mark(f"{self._n} {str(name)[:40]}")
        if self.live is not None:
            self.live.reset_peaks()

    def end(self) -> None:
        if not self._open:
            return
        self._open = False
        parts = parts_of(self.tracker.get_tracker_snapshot("peak"), self.device)
        self.at_end = parts_of(self.tracker.get_tracker_snapshot("current"), self.device)
        # torch files every allocation of the optimizer step as optimizer state; what is not
        # resident after it was the step's temporaries
        state = MemoryKind.OPTIMIZER_STATE
        extra = max(0, parts[state] - self.at_end[state])
        parts[state] -= extra
        parts[MemoryKind.OPTIMIZER_STEP_TEMPORARIES] += extra
        if self._before_opt is not None:
            self.in_optimizer = sum(parts.values()) > self._before_opt
        self.per_step.append(parts)
        self._keep_modules()
        if self.log is not None:
            self.log.mark(f"{self._n} {Phase.END}")
        if self.live is not None:
            self.live.reset_peaks()
        if self._n >= STEPS_TRACED:
            raise TraceDone

    def fail(self, exc: BaseException | None) -> None:
        self._open = False  # the exception goes on; the estimate keeps the steps it has

    # -- reading it ---------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        return len(self.per_step)

    def root(self) -> str:
        """The class name the tracker files the model's modules under: the first module whose
        forward ran outside any other's (a Lightning module's network, not the module itself,
        when ``training_step`` calls it), else the model the probe was given."""
        top = self.roots or self.models
        return type(top[0]).__name__ if top else ""

    def _file_quantisation_state(self) -> None:
        """A quantised weight's state (bitsandbytes' 4-bit ``absmax``, its nested absmax and
        maps; 8-bit ``SCB``) is part of the weight: filed as parameters, not as the
        activations the tracker takes any tensor made outside a module's pass for."""
        file_quantisation_state(self.tracker, self.models or self.roots)

    def _peak_total(self) -> int:
        return sum(parts_of(self.tracker.get_tracker_snapshot("peak"), self.device).values())

    def _restart_peaks(self) -> None:
        """The tracker's peak from now (what is held now), as a step's own."""
        from torch.distributed._tools.mem_tracker import _TOTAL_KEY

        now = deepcopy(self.tracker.get_tracker_snapshot("current"))
        self.tracker._peak_mem_snap = now
        self.tracker._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in now.items()}
        if self.live is not None:
            self.live.reset_peaks()
