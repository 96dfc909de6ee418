"""Allocation history with Python stacks, recorded in the training process for a few steps
(the first ones, the step after a jump of torch reserved, and at out-of-memory) and saved where
:mod:`collector.analysis.history` reads it."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "HISTORY_AFTER_JUMP",
    "HISTORY_JUMPS",
    "HISTORY_JUMP_BYTES",
    "HISTORY_MAX_ENTRIES",
    "HISTORY_STEPS",
    "AllocationHistory",
]

log = logging.getLogger(__name__)

HISTORY_STEPS = 3  # steps recorded with allocation stacks when a history folder is given
HISTORY_MAX_ENTRIES = 200_000  # trace entries PyTorch keeps (a ring); older ones are dropped
HISTORY_JUMP_BYTES = 256 << 20  # a jump of torch reserved this large gets its next step recorded
HISTORY_JUMPS = 2  # jumps whose next steps are recorded, at most, in a run
HISTORY_AFTER_JUMP = 2  # steps recorded after a jump: the one after it and the next (what the
# first allocated and the second still holds is what the jump kept)


class AllocationHistory:
    """Which line allocated it: PyTorch's allocation history with Python stacks
    (``torch.cuda.memory._record_memory_history``) for the first ``steps`` steps, saved as one
    snapshot when they end (``history-steps-A-B.pickle``, open it in PyTorch's memory_viz) with
    the wall-clock time of each step mark (``marks.json``), so each allocation is placed in its
    step and phase. After that, when torch's reserved memory jumps by more than
    :data:`HISTORY_JUMP_BYTES` from one step's end to the next, the :data:`HISTORY_AFTER_JUMP`
    steps after it are recorded too (``history-steps-N-M.pickle``, at most :data:`HISTORY_JUMPS`
    jumps a run), so what the first of them allocated and the second still held is known. And a
    snapshot when the allocator runs out of memory (``oom-step-N.pickle``). Between recordings
    nothing is recorded and the steps pay nothing. Never raises into training; what failed is
    counted in ``errors``."""

    def __init__(self, folder: Path, steps: int) -> None:
        self.folder, self.steps = folder, max(0, steps)
        self.first: int | None = None
        self.recording = False
        self.marks: list[dict[str, Any]] = []
        self.saved: list[str] = []
        self.errors: Counter[str] = Counter()
        self.cost_ns = 0  # time spent starting, snapshotting and stopping (not per allocation)
        self.window_done = self.steps == 0  # the first steps' recording is over
        self.jumps_left = HISTORY_JUMPS
        self.armed: int | None = None  # the step to record after a jump
        self.armed_jump = 0  # that jump, bytes
        self.recorded_from: int | None = None  # first step of the recording in progress
        self._reserved: int | None = None  # torch reserved at the last step's end

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn()
        except Exception as exc:  # history is an aid; training goes on without it
            self.errors[f"{what}:{type(exc).__name__}"] += 1
            log.debug("memory history %s failed: %s", what, exc)
            return None
        finally:
            self.cost_ns += time.perf_counter_ns() - t0

    def begin(self, step: int) -> None:
        if (self.first is None and self.steps) or (step == self.armed and not self.recording):
            if self.first is None:
                self.first = step
            self.armed = None

            def start() -> None:
                import torch

                self.folder.mkdir(parents=True, exist_ok=True)
                torch.cuda.memory._record_memory_history(
                    enabled="all", context="all", stacks="python", max_entries=HISTORY_MAX_ENTRIES
                )
                self.recording = True
                self.recorded_from = step

            self._guard("start", start)
        jump, self.armed_jump = self.armed_jump, 0
        self.mark(step, "begin", **({"after_jump": jump} if jump else {}))

    def mark(self, step: int, kind: str, phase: str = "", **extra: Any) -> None:
        if self.recording:
            self.marks.append(
                {
                    "step": step,
                    "kind": kind,
                    "phase": phase,
                    "wall_us": time.time_ns() // 1000,
                    **extra,
                }
            )

    def end(self, step: int, reserved: int | None = None) -> None:
        """``reserved``: torch's reserved bytes at this end (all devices), to find jumps."""
        jump = (
            reserved - self._reserved if reserved is not None and self._reserved is not None else 0
        )
        self._reserved = reserved if reserved is not None else self._reserved
        self.mark(step, "end", reserved_jump=jump)
        first = self.recorded_from
        if self.recording and first is not None:
            if not self.window_done and step >= first + self.steps - 1:
                self.window_done = True
                self._save_and_stop(first, step)
            elif self.window_done and step >= first + HISTORY_AFTER_JUMP - 1:  # after a jump
                self._save_and_stop(first, step)
        elif self.window_done and jump > HISTORY_JUMP_BYTES and self.jumps_left > 0:
            self.jumps_left -= 1
            self.armed, self.armed_jump = step + 1, jump  # record the next step

    def _save_and_stop(self, first: int, last: int) -> None:
        name = f"history-steps-{first}-{last}.pickle"
        self._guard("snapshot", lambda: self._save(name))
        self._guard("stop", self._stop)
        self.recorded_from = None

    def _stop(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False

    def _save(self, name: str) -> None:
        import pickle

        import torch

        snap = torch.cuda.memory._snapshot()
        with open(self.folder / name, "wb") as f:
            pickle.dump(snap, f)
        (self.folder / "marks.json").write_text(json.dumps(self.marks))
        self.saved.append(name)

    def attach_oom_observer(self, current_step: Callable[[], int | None]) -> None:
        def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
            step = current_step()
            self._guard("oom", lambda: self._save(f"oom-step-{step}.pickle"))

        def attach() -> None:
            import torch

            torch._C._cuda_attach_out_of_memory_observer(observer)

        self._guard("attach", attach)
