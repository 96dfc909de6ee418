"""One stream's step records (a training process on one GPU) as every rule reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from collector.analysis.accounting import accounts, allocator_mode, identify_process
from collector.analysis.diagnosis.kinds import THRESHOLDS, Thresholds
from collector.model.account import Account
from collector.model.step import StepRecord

__all__ = ["Steps"]


@dataclass
class Steps:
    """``all_steps`` in the order they ran; ``recs`` the ones that ended (every step if none
    did); ``ended`` those with an end-of-step NVML reading that describes the end; ``peaked``
    those with a within-step NVML peak. ``sites``: the allocation history's summary per
    recorded step (:func:`collector.analysis.history.summary`'s ``steps``), when the run has one."""

    all_steps: list[StepRecord]
    total_bytes: int | None = None
    sites: dict[int, dict[str, Any]] = field(default_factory=dict)
    verbose: bool = False
    th: Thresholds = THRESHOLDS
    time_scale: float = 1.0  # a replay at Nx: its steps took 1/N of the recorded run's time

    def __post_init__(self) -> None:
        self.recs = [r for r in self.all_steps if not r.failed] or list(self.all_steps)
        self.ended = [r for r in self.recs if r.end_known]
        self.peaked = [r for r in self.all_steps if r.measured]
        self.has_torch = bool(self.all_steps) and self.all_steps[0].has_torch
        self.position = {id(r): i for i, r in enumerate(self.all_steps)}
        self.by_step = {r.step: r for r in self.all_steps}
        self.pid, self.pid_source = identify_process(self.all_steps)
        self.mode = allocator_mode(self.all_steps)
        self._accounts: list[Account] | None = None

    @property
    def floor(self) -> int:
        """Figures under this are noise unless ``--verbose``."""
        return self.th.floor(self.total_bytes)

    def shown(self, n: int | None) -> bool:
        """Whether a component of ``n`` bytes is worth a word (always, with ``--verbose``)."""
        return self.verbose or (n is not None and abs(n) >= self.floor)

    def ms(self, ns: int) -> str:
        """``812 ms``: a time inside a step as the recorded run took it (a replay's wall time
        times its speed)."""
        return f"{ns * self.time_scale / 1e6:.0f}"

    def span(self, a: StepRecord, b: StepRecord) -> int:
        """How many steps lie from ``a`` to ``b`` (by the order they ran, measured or not)."""
        return self.position[id(b)] - self.position[id(a)]

    @property
    def accounts(self) -> list[Account]:
        if self._accounts is None:
            self._accounts = accounts(self.recs, self.pid)
        return self._accounts
