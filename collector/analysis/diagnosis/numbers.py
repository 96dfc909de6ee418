"""The figures behind each kind of finding (:attr:`Finding.numbers`), every key named once.

A finding's numbers stay a dict (rules fill them as they find things, the consistency pass folds
one finding's into another's, golden cases compare them as data); each kind's keys are declared
here as a ``TypedDict`` — the pattern of torch's ``_Snapshot``/``_Segment`` in ``torch/_utils.py``
— and :func:`unknown_keys` names any key a finding carries that its kind does not declare (the
tests run it over every golden case and committed run). Byte figures are bytes, steps are the
user's step numbers.
"""

from __future__ import annotations

from typing import Any, TypedDict

from collector.analysis.diagnosis.kinds import Finding, FindingKind, Pool
from collector.model.kinds import Component, Phase

__all__ = ["NUMBERS", "unknown_keys"]


class StarvedNumbers(TypedDict, total=False):
    of: int  # steps measured
    hole: int  # steps flagged with each gap
    stall: int
    undersampled: int
    stale_end: int


class UnmeasuredNumbers(TypedDict, total=False):
    steps: int  # steps without NVML samples
    of: int  # steps in the stream
    gaps: list[str]  # their Gap values


class SteadyNumbers(TypedDict, total=False):
    step: int  # the first step of the steady state
    reserved_end: int
    nvml_end: int


class LeakNumbers(TypedDict, total=False):
    from_step: int
    to_step: int
    bytes_per_step: float
    reserved_per_step: float
    pool: Pool
    jumps: int  # live-tensor jumps folded into it (consistency)
    site: str  # the allocation site the history names


class GrowingNumbers(TypedDict, total=False):
    from_step: int
    to_step: int
    bytes_per_step: float
    pool: Pool
    component: Component | None


class UnsteadyNumbers(TypedDict, total=False):
    first: int
    last: int


class JumpNumbers(TypedDict, total=False):
    from_step: int
    to_step: int
    reserved_jump: int
    allocated_peak_growth: int
    cause: str  # "peak" | "live" | "allocator"
    peak_phase: Phase | str
    beyond_peak: int
    new_state: str
    new_state_bytes: int
    new_kinds: dict[str, int]
    kept_by_step: int
    segments: int
    inactive_split: int
    jumps: int
    site: str


class FragmentationNumbers(TypedDict, total=False):
    inactive_split: int
    inactive_split_named: bool
    retries: int
    at_steps: list[int]
    jumps: list[tuple[int, int, int]]  # (from step, to step, reserved jump) folded in
    unexplained_growth: int
    growth_in_leak: int
    bytes_per_step: float
    summary: str
    text_without_growth: str


class NontorchNumbers(TypedDict, total=False):
    nontorch: int
    outside: int
    others: int
    no_process: int
    managed: int
    first_use: int


class AllocatorModeNumbers(TypedDict, total=False):
    expandable_segments: bool
    caching_disabled: bool
    from_environment: bool
    stats_zero: bool


# the account's components are its keys (their report names), beside the step and first use
AccountingNumbers = TypedDict(
    "AccountingNumbers",
    {"step": int, "first_use": int, **{c.value: int for c in Component}},
    total=False,
)


class ComponentChangeNumbers(TypedDict, total=False):
    component: Component
    changes: list[Any]  # the account's changes (delta and where)


class CacheNumbers(TypedDict, total=False):
    cached_peak: int
    cached_end: int
    inactive_split: int
    retries: int


class TransientNumbers(TypedDict, total=False):
    steps: int
    typical_peak: int
    largest_bytes: int
    largest_step: int
    phase: Phase | str | None
    phase_steps: list[int]
    splits: list[Any]
    view: str


class HeadroomNumbers(TypedDict, total=False):
    step: int
    peak: int
    total: int
    phase: Phase | str | None
    peak_gap: str
    blind_steps: list[int]


class OomNumbers(TypedDict, total=False):
    step: int
    peak: int | None
    previous_peak: int
    allocated_at_failure: int
    failed: bool


class FailedNumbers(TypedDict, total=False):
    step: int
    error: str
    peak: int


class InterruptedNumbers(TypedDict, total=False):
    step: int


class ImbalanceNumbers(TypedDict, total=False):
    rank: int
    gpu: int
    pid: int
    alloc_peak: int
    median: float
    diff: float
    component: Component | None
    component_diff: int


class EmptyNumbers(TypedDict, total=False):
    pass


NUMBERS: dict[FindingKind, type] = {
    FindingKind.EMPTY: EmptyNumbers,
    FindingKind.UNMEASURED: UnmeasuredNumbers,
    FindingKind.STARVED: StarvedNumbers,
    FindingKind.STEADY: SteadyNumbers,
    FindingKind.LEAK: LeakNumbers,
    FindingKind.GROWING: GrowingNumbers,
    FindingKind.UNSTEADY: UnsteadyNumbers,
    FindingKind.JUMP: JumpNumbers,
    FindingKind.FRAGMENTATION: FragmentationNumbers,
    FindingKind.NONTORCH: NontorchNumbers,
    FindingKind.ALLOCATOR_MODE: AllocatorModeNumbers,
    FindingKind.ACCOUNTING: AccountingNumbers,
    FindingKind.COMPONENT_CHANGE: ComponentChangeNumbers,
    FindingKind.CACHE: CacheNumbers,
    FindingKind.TRANSIENT: TransientNumbers,
    FindingKind.HEADROOM: HeadroomNumbers,
    FindingKind.OOM: OomNumbers,
    FindingKind.FAILED: FailedNumbers,
    FindingKind.INTERRUPTED: InterruptedNumbers,
    FindingKind.IMBALANCE: ImbalanceNumbers,
}


def unknown_keys(f: Finding) -> list[str]:
    """The keys of ``f.numbers`` its kind does not declare (empty: every one is named)."""
    declared = NUMBERS[f.kind].__annotations__
    return sorted(str(k) for k in f.numbers if k not in declared)
