"""The tracing core both estimates stand on — the config path (:mod:`.trace`) and a user's
script (:mod:`.script`): what torch's tracker files turned into our memory kinds and module
peaks, the tracker's per-module peak update made fast, the allocation log played through the
allocator model per traced step and held against a card, and the notes both paths print.

The fake-tensor toolkit beside it is :mod:`.fakes` (placeholders for values read, conversions
and parameter subclasses on fake tensors) with :mod:`.swap` (an attribute bent for a block and
put back); neither path imports the other.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

from collector.estimate.alloc_log import AllocationLog, Simulated, simulate
from collector.estimate.allocator import AllocatorConfig
from collector.estimate.fit import Target, hold
from collector.model.kinds import ESTIMATE_KINDS, MemoryKind, Phase
from collector.model.prediction import Estimate, ModulePeak, StepFigures

__all__ = [
    "MAX_STEPS_TRACED",
    "MICRO_TRACED",
    "MODULE_DEPTH",
    "attention_note",
    "hold_steps",
    "holder_of",
    "index_peaks",
    "module_peaks",
    "parts_of",
    "quiet",
    "step_counters",
]

# MemTracker's reference types (their string values, stable since torch 2.5) → ours
_TRACKER = {
    "Parameter": MemoryKind.PARAMETERS,
    "Buffer": MemoryKind.BUFFERS,
    "Gradient": MemoryKind.GRADIENTS,
    "Optstate": MemoryKind.OPTIMIZER_STATE,
    "Activation": MemoryKind.ACTIVATIONS,
    "Temp": MemoryKind.TEMPORARIES,
    "Other": MemoryKind.OTHER,
    # FSDPMemTracker's (FSDP2): a rank's shards, the all-gathered copies, the collectives' buffers
    "Sharded Param": MemoryKind.PARAMETERS,
    "Unsharded Param": MemoryKind.UNSHARDED_PARAMETERS,
    "Sharded Grad": MemoryKind.GRADIENTS,
    "Unsharded Grad": MemoryKind.UNSHARDED_GRADIENTS,
    "All Gather": MemoryKind.COMMUNICATION,
    "Reduce Scatter": MemoryKind.COMMUNICATION,
    "OptState": MemoryKind.OPTIMIZER_STATE,
    "Inputs": MemoryKind.ACTIVATIONS,
}


@functools.cache
def _phases() -> dict[Any, Phase]:
    """The peak states of torch's trackers (their members: ``MemTracker``'s ``_ModState``,
    ``FSDPMemTracker``'s ``_FSDPModState``) → our phases; read at first use, so importing the
    estimate does not import torch."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState
    from torch.distributed._tools.mem_tracker import _ModState

    return {
        _ModState.PEAK_FW: Phase.FORWARD,
        _ModState.PEAK_BW: Phase.BACKWARD,
        _FSDPModState.PEAK_FW: Phase.FORWARD,
        _FSDPModState.PEAK_BW: Phase.BACKWARD,
    }


MAX_STEPS_TRACED = 2
MICRO_TRACED = 2  # micro-batches traced a step: from the second on, each holds what the last did
MODULE_DEPTH = 4  # module names kept in the per-module account (Model.model.layers.N)


def parts_of(snap: dict[Any, dict[Any, int]], device: Any) -> dict[MemoryKind, int]:
    """One device's bytes by kind (optimizer step counters live on the host under CUDA)."""
    out = dict.fromkeys(ESTIMATE_KINDS, 0)
    for dev, dev_snap in snap.items():
        if dev != device:
            continue
        for k, v in dev_snap.items():
            name = _TRACKER.get(str(getattr(k, "value", k)))
            if name:
                out[name] += int(v)
    return out


def module_peaks(tracker: Any, root: str, device: Any) -> list[ModulePeak]:
    out = []
    for stats in list(tracker.memory_tracking.values()):
        name = stats.mod_fqn
        if name.count(".") >= MODULE_DEPTH or name.split(".")[0] != root:
            continue  # deeper than the account keeps, or an autograd Function ("Func")
        for state, snaps in stats.snapshots.items():
            phase = _phases().get(state)
            if phase is None:
                continue
            for snap in snaps:
                parts = parts_of(snap, device)
                out.append(ModulePeak(name, phase, sum(parts.values()), parts))
    return out


def step_counters(opt: Any) -> list[Any]:
    """The optimizer's per-parameter ``step`` tensors (CPU scalars under CUDA unless capturable:
    on the CPU stand-in they are on the traced device, where CUDA would not hold them)."""
    import torch

    return [st["step"] for st in opt.state.values() if isinstance(st.get("step"), torch.Tensor)]


def holder_of(mods: list[ModulePeak], peak: int) -> ModulePeak | None:
    """The innermost module whose pass holds the step's peak (the deepest name at that total)."""
    at = [m for m in mods if m.total >= peak]
    if not at:
        return max(mods, key=lambda m: m.total) if mods else None
    return max(at, key=lambda m: m.module.count("."))


def index_peaks(tracker: Any) -> None:
    """The same per-module peak update as MemTracker's ``_update_peak_stats``, looked up by the
    active modules' names instead of a walk over every module on every operator (which made a
    7B trace spend most of its time there: O(operators x modules)). Left as torch's when its
    internals are not the ones this was written against."""
    need = ("memory_tracking", "_mod_tracker", "_curr_mem_snap", "_peak_mem", "_peak_mem_snap")
    if not all(hasattr(tracker, n) for n in need):
        return
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    by_name: dict[str, list[Any]] = {}
    seen = [-1]

    def update(peak_state: Any) -> None:
        if len(tracker.memory_tracking) != seen[0]:
            by_name.clear()
            for stats in tracker.memory_tracking.values():
                by_name.setdefault(stats.mod_fqn, []).append(stats)
            seen[0] = len(tracker.memory_tracking)
        snap = tracker._curr_mem_snap
        for name in tracker._mod_tracker.parents:
            for stats in by_name.get(name, ()):
                if peak_state not in stats.snapshots:
                    continue
                for dev, dev_snap in snap.items():
                    if stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                        stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                        stats.snapshots[peak_state][-1][dev] = deepcopy(dev_snap)
        for dev, dev_snap in snap.items():
            if tracker._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                tracker._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                tracker._peak_mem_snap[dev] = deepcopy(dev_snap)

    tracker._update_peak_stats = update


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        # ModTracker warns on every recomputed (checkpointed) forward; deprecations are noise
        warnings.filterwarnings("ignore", message=".*module hierarchy tracking")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def attention_note(chosen: dict[str, int]) -> list[str]:
    if not chosen:
        return []
    kinds = ", ".join(f"{k} ({n} calls)" for k, n in sorted(chosen.items()))
    note = f"attention traced on the kernel CUDA picks: {kinds}"
    if "math" in chosen:
        note += " — the math kernel keeps each layer's attention probabilities for backward"
    return [note]


def hold_steps(
    out: Estimate, log: AllocationLog, allocator: AllocatorConfig, target: Target | None
) -> None:
    """What the GPU holds: the sequence through the allocator model, per traced step; with a
    card, whether the step fits it and, if not, where it first runs out."""
    sim = simulate(log.events, allocator, streams=log.streams)
    out.allocator = allocator.describe()
    out.steps = _steps(sim)
    hold(
        out,
        target,
        lambda limit, fraction: simulate(
            log.events,
            allocator,
            limit=limit,
            fraction=fraction,
            where=log.where,
            streams=log.streams,
        ),
    )


def _steps(sim: Simulated) -> list[StepFigures]:
    """Each traced step: allocated and reserved peaks (and the phase of the reserved one) and
    what stays at its end, as torch's counters would read them."""
    out = []
    for step in range(1, MAX_STEPS_TRACED + 1):
        phases = [p for p in sim.intervals if p.startswith(f"{step} ")]
        if not phases:
            continue
        whole = sim.over(*phases)
        top = max(phases, key=lambda p: sim.intervals[p].reserved_peak)
        out.append(
            StepFigures(
                step,
                allocated_peak=whole.allocated_peak,
                reserved_peak=whole.reserved_peak,
                allocated_end=whole.allocated,
                reserved_end=whole.reserved,
                reserved_peak_phase=top.split(" ", 1)[1],
            )
        )
    return out
