"""A run's accounting, from its steps' accounts (:mod:`collector.model.account`): the
training process and how it is known, the baseline (this process's smallest memory outside
torch over the run), how the allocator ran, each component's change between steps, and where
inside a step a change outside torch happened.

The process is known by the pid the probe puts in its begin event; a capture recorded before
the probe did that is matched to the one listed process that holds at least torch's reserved
pool at every step (:func:`identify_process`), and the report says so.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from collector.model.account import (
    CHANGE_BYTES,
    Account,
    account,
    held_by_torch,
    mark_points,
    outside_share,
)
from collector.model.kinds import Component
from collector.model.records import Stat
from collector.model.step import StepRecord

__all__ = [
    "AllocatorMode",
    "Change",
    "Where",
    "accounts",
    "allocator_mode",
    "changes",
    "identify_process",
    "locate",
]


def identify_process(recs: Sequence[StepRecord]) -> tuple[int | None, str]:
    """The training process's pid, and how it is known: from the probe (its begin event), or,
    for records whose probe did not say (captures recorded before it did), the one process of
    NVML's per-process readings that holds at least torch's reserved pool at every step that
    has a reading. ``(None, why)`` when neither tells."""
    for r in recs:
        if r.process_pid:
            return r.process_pid, "probe"
    candidates: set[int] | None = None
    for r in recs:
        reserved = r.reserved_end
        if not r.procs or reserved is None:
            continue
        holding = {p.pid for p in r.procs if p.used_bytes is not None and p.used_bytes >= reserved}
        candidates = holding if candidates is None else candidates & holding
    if candidates is not None and len(candidates) == 1:
        return next(iter(candidates)), "identified"
    return None, "ambiguous" if candidates else "none"


def accounts(recs: Sequence[StepRecord], pid: int | None = None) -> list[Account]:
    """The account of every step of one GPU that has one, in step order. ``pid``: the training
    process (default: :func:`identify_process`)."""
    if pid is None:
        pid, _ = identify_process(recs)
    caching_off = allocator_mode(recs).caching_disabled
    base = None
    for r in recs:
        held = held_by_torch(r, caching_off)
        v = outside_share(r.procs, pid, held) if held is not None else None
        if v is not None:
            base = v if base is None else min(base, v)
    out = [account(r, pid, base, caching_off) for r in recs if not r.failed]
    return [a for a in out if a is not None]


@dataclass(frozen=True)
class AllocatorMode:
    """How the allocator ran: caching off (from the probe's reading of the environment, or
    from the figures themselves: torch's statistics stay 0 while NVML moves), whether the
    environment said so, and expandable segments."""

    caching_disabled: bool
    from_environment: bool
    stats_zero: bool
    expandable_segments: bool


def allocator_mode(recs: Sequence[StepRecord]) -> AllocatorMode:
    """How the allocator ran (see :class:`AllocatorMode`)."""
    flags: dict[str, Any] = {}
    for r in recs:
        if Stat.CACHING_DISABLED in r.torch_begin:
            flags = r.torch_begin
            break
    with_torch = [r for r in recs if r.torch_end]
    zero = all(
        not r.reserved_end
        and not r.end_stat(Stat.RESERVED_PEAK)
        and not r.end_stat(Stat.DEVICE_ALLOCS)
        for r in with_torch
    )
    stats_zero = any(r.measured for r in recs) and zero and bool(with_torch)
    return AllocatorMode(
        caching_disabled=bool(flags.get(Stat.CACHING_DISABLED)) or stats_zero,
        from_environment=bool(flags),
        stats_zero=stats_zero,
        expandable_segments=bool(flags.get(Stat.EXPANDABLE_SEGMENTS)),
    )


@dataclass(frozen=True)
class Where:
    """The stretch between two step marks where a change happened: ``phase`` is what the
    earlier mark opened (``"between steps"``: from the step before's end to this one's begin)."""

    step: int
    phase: str
    from_ns: int
    to_ns: int


@dataclass
class Change:
    """A component's change from the end of step ``since`` to the end of step ``step``
    (bytes); ``who``: processes that came or left, for a change of other processes; ``where``:
    the stretch between two marks it happened in, once :func:`locate` found one."""

    step: int
    since: int
    component: Component
    delta: int
    who: list[str] = field(default_factory=list)
    where: Where | None = None


def _who(prev: Account, cur: Account) -> list[str]:
    pa = {(pid, n) for pid, n, _ in prev.others}
    pb = {(pid, n) for pid, n, _ in cur.others}
    who = [f"pid {pid} {n[:40]!r} came" for pid, n in sorted(pb - pa)]
    return who + [f"pid {pid} {n[:40]!r} left" for pid, n in sorted(pa - pb)]


def changes(accs: list[Account], threshold: int = CHANGE_BYTES) -> list[Change]:
    """Each component's change above ``threshold`` from one step's end to a later one's, in
    step order. With per-process readings: between consecutive steps that have them (an
    unsplit step has another baseline, so the two are never compared; ``since`` is the step
    it is measured from), and, for a move outside torch that falls where no such pair covers
    it, :attr:`Component.OUTSIDE_UNSPLIT` from one step to the next. Without any: every
    component from one step to the next."""
    split = [a for a in accs if a.unsplit is None]
    out: list[Change] = []
    for prev, cur in itertools.pairwise(split or accs):
        a, b = prev.components(), cur.components()
        found = [
            Change(cur.step, prev.step, name, b[name] - a[name])
            for name in b
            if name is not Component.REMAINDER and name in a and abs(b[name] - a[name]) > threshold
        ]
        if split:
            who = _who(prev, cur)
            for c in found:
                if c.component is Component.OTHER_PROCESSES and who:
                    c.who = who
        out += found
    if split:
        outside = [c for c in out if c.component is not Component.TORCH_RESERVED]
        for prev, cur in itertools.pairwise(accs):
            d = cur.outside_all - prev.outside_all
            if abs(d) > threshold and not any(c.since < cur.step <= c.step for c in outside):
                out.append(Change(cur.step, prev.step, Component.OUTSIDE_UNSPLIT, d))
    return sorted(out, key=lambda c: c.step)


def locate(change: Change, by_step: dict[int, StepRecord]) -> Where | None:
    """Where between the end of step ``since`` and the end of step ``step`` the memory outside
    torch moved by at least half of the change: the first stretch between two marks that did.
    None when the marks' readings are missing or no single stretch holds half of it (it came
    in pieces)."""
    prev = mark_points(by_step.get(change.since))
    if not prev:
        return None
    last = prev[-1]
    half = abs(change.delta) / 2
    sign = 1 if change.delta > 0 else -1
    for s in range(change.since + 1, change.step + 1):
        pts = mark_points(by_step.get(s))
        if not pts:
            return None
        opened = "between steps"
        for name, t, v in pts:
            if last[2] is not None and v is not None and (v - last[2]) * sign >= half:
                return Where(s, opened, last[1], t)
            opened, last = name, (name, t, v)
    return None
