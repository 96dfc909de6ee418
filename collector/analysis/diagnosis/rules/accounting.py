"""The allocator's mode (caching off, expandable segments); every byte of the last step's end
by the identity of :mod:`collector.model.account`; each step-to-step change of a component
outside torch (this process, other processes by pid and name, memory no process is charged
for), placed between two step marks (:func:`collector.analysis.accounting.locate`)."""

from __future__ import annotations

import dataclasses

from collector.analysis.accounting import Change, Where, changes, locate
from collector.analysis.diagnosis.kinds import Finding, FindingKind
from collector.analysis.diagnosis.steps import Steps
from collector.analysis.diagnosis.text import steps_text
from collector.model.account import Account
from collector.model.kinds import Component
from collector.model.units import gib, gib_figure


def _mode(s: Steps) -> list[Finding]:
    mode = s.mode
    if mode.caching_disabled:
        why = (
            "PYTORCH_NO_CUDA_MEMORY_CACHING is set in the run's environment"
            if mode.from_environment
            else "torch's statistics stay 0 while NVML moves"
        )
        return [
            Finding(
                FindingKind.ALLOCATOR_MODE,
                f"The CUDA caching allocator is off ({why}): tensors go to and from the driver "
                "and torch's figures read 0; below, torch holds what the ledger names "
                "(parameters, gradients, optimizer state) and the rest counts as outside torch.",
                dataclasses.asdict(mode),
            )
        ]
    if mode.expandable_segments:
        return [
            Finding(
                FindingKind.ALLOCATOR_MODE,
                "The allocator runs with expandable segments (PYTORCH_CUDA_ALLOC_CONF): reserved "
                "grows and shrinks in place, so fewer, larger segments and less inactive split "
                "memory are expected.",
                dataclasses.asdict(mode),
            )
        ]
    return []


def _identity(s: Steps, a: Account) -> Finding:
    """Every byte of one step's end: NVML used as the sum of the accounting's components (in
    GiB, named once at the end; components under the noise floor summed unless verbose)."""

    def n(v: int | None) -> str:
        return gib_figure(v or 0)

    def parts(items: list[tuple[str, int | None]]) -> list[str]:
        named = [f"{k} {n(v)}" for k, v in items if s.shown(v)]
        small = sum(v or 0 for k, v in items if not s.shown(v))
        if small and not s.verbose:
            named.append(f"smaller parts {n(small)}")
        return named

    live = ", ".join(f"{k.words} {n(v)}" for k, v in a.live.items() if s.shown(v))
    inner = [f"live {n(a.allocated)}" + (f": {live}" if live else "")]
    if not a.caching_off:
        if s.shown(a.cached_free):
            inner.append(f"cached-free {n(a.cached_free)}")
        if s.shown(a.inactive_split):
            inner.append(f"inactive split {n(a.inactive_split)}")
    held = "torch's tensors (ledger)" if a.caching_off else Component.TORCH_RESERVED
    comp = a.components()
    terms = [
        f"baseline {n(comp[Component.BASELINE])}",
        f"{held} {n(a.reserved)} ({'; '.join(inner)})",
    ]
    if a.unsplit is not None:
        terms += parts([(f"outside torch, unsplit ({a.unsplit_why})", a.unsplit)])
    else:
        terms += parts(
            [
                ("first use (kept since)", comp.get(Component.FIRST_USE)),
                ("outside torch in this process", a.outside),
                (Component.OTHER_PROCESSES, a.other_processes),
                (Component.NO_PROCESS, a.no_process),
                (Component.REMAINDER, a.remainder),
            ]
        )
    when = ""
    if s.verbose and a.read_after_ms is not None:
        when = (
            f" (per-process reading {a.read_after_ms:.0f} ms after the end mark)"
            if a.read_after_ms >= 0
            else f" (per-process reading {-a.read_after_ms:.0f} ms before the end mark, the "
            "last time device memory moved)"
        )
    return Finding(
        FindingKind.ACCOUNTING,
        f"Every byte at step {a.step}'s end: NVML used {n(a.device_used)} = "
        + " + ".join(terms)
        + f" GiB{when}.",
        {"step": a.step, "first_use": a.first_use, **a.components()},
        steps=(a.step, a.step),
    )


def _where(w: Where | None, s: Steps) -> str:
    """`` — in optimizer, 812–830 ms into step 3`` for a located change (empty if not)."""
    if w is None:
        return ""
    if w.phase == "between steps":
        return f" — between step {w.step - 1}'s end and step {w.step}'s begin"
    t0 = s.by_step[w.step].begin_ns
    span = f"{s.ms(w.from_ns - t0)}–{s.ms(w.to_ns - t0)} ms into step {w.step}"
    return f" — in {w.phase}, {span}" if w.phase != "step" else f" — {span}"


def _component_changes(s: Steps, accs: list[Account]) -> list[Finding]:
    by_component: dict[Component, list[Change]] = {}
    for c in changes(accs):
        if c.component is not Component.TORCH_RESERVED:
            c.where = locate(c, s.by_step)
            by_component.setdefault(c.component, []).append(c)
    unread = [x.step for x in accs if x.unsplit is not None]
    gaps = ""
    if unread and len(unread) < len(accs):
        gaps = (
            f" (no per-process reading describes step {steps_text(unread)}'s end: a change "
            "there is measured from the step before)"
        )
    out = []
    for name, cs in by_component.items():
        listed = ", ".join(
            f"{'+' if c.delta > 0 else '−'}{gib(abs(c.delta))} at step {c.step}"
            + (f" (since step {c.since}'s end)" if c.since != c.step - 1 else "")
            + _where(c.where, s)
            + (f" ({'; '.join(c.who)})" if c.who else "")
            for c in cs
        )
        out.append(
            Finding(
                FindingKind.COMPONENT_CHANGE,
                f"{name[0].upper()}{name[1:]} changed from one step's end to the next: "
                f"{listed}{gaps}.",
                {"component": name, "changes": cs},
                steps=(cs[0].step, cs[-1].step),
            )
        )
    return out


def rule(s: Steps) -> list[Finding]:
    out = _mode(s)
    accs = s.accounts
    if not accs:
        return out
    out.append(_identity(s, accs[-1]))
    return out + _component_changes(s, accs)
