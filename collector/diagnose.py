"""Rules that explain a run's memory, in plain words with numbers.

Each rule reads one GPU's step records (dicts as ``stepmem run --out`` writes them, or rows of
the run store unflattened by :func:`collector.report.load_run`) and returns findings. The rules,
in order:

1. **Steady state** — the first step from which end-of-step torch reserved and NVML used change
   by less than ``STEADY_BYTES`` per step to the end of the run; if there is none, the run is
   still growing: by how much per step, in which pool. The pool named is the most specific one
   that grows at least ``POOL_SHARE`` of the fastest rate, in the order torch allocated (live
   tensors kept from step to step: a leak), torch reserved (the allocator's cache), outside the
   allocator, NVML used; memory that moves from step to step without growing over the run is
   said to be unsteady, not a leak. Rules 1, 2 and 4 read the steps that ended; a failed step is
   rule 6's.
2. **Jumps before it** — every end-of-step *reserved* increase above ``JUMP_BYTES``. A jump is
   *explained by the peak* when the step's within-step allocated peak grew by about as much
   (within ``MATCH_FRACTION`` or ``MATCH_BYTES``): the allocator reserved the higher peak for good.
   The ledger then says which state appeared in the previous step (the largest ledger growth) and
   the phase peaks say where the new peak falls; without a ledger, torch allocated from the
   previous step's begin to its end says how much it created and kept. A jump that torch
   *allocated* at step end grew
   by as much is memory kept alive past the step (a leak); consecutive ones are one finding.
   A jump that neither explains is attributed to the allocator (new segments, inactive split
   blocks), not to new state.
3. **Memory outside the allocator** — non-torch memory at the end of the last step: managed
   (paged) optimizer state when the ledger holds it; otherwise split by NVML's per-process
   readings, or said to be unsplit when there are none.
4. **Cache and fragmentation** — reserved − allocated at the last step's end and peak, inactive
   split bytes, allocator retries.
5. **Transients** — steps whose NVML within-step peak exceeds their end-of-step reading by more
   than ``TRANSIENT_BYTES`` (and 5 %): memory that came and went inside the step; the largest
   peak is split (:func:`collector.accounting.peak_split`) into torch's reserved peak in the
   phase that holds it and memory outside torch that came and went, with its time and phase.
6. **Headroom and OOM** — the largest peak against the card's capacity; a step in which the
   allocator counted an OOM or that failed with ``OutOfMemoryError``, with its NVML peak, the
   previous step's, and what the allocator held when it failed; a step that failed otherwise,
   or was interrupted (SIGTERM, Ctrl-C, ``ray job stop``).
7. **Accounting** — the allocator's mode (caching off, expandable segments); every byte of the
   last step's end by the identity of :mod:`collector.accounting`; each step-to-step change of
   a component outside torch (this process, other processes by pid and name, memory no process
   is charged for), each placed between two step marks (phase, ms into the step:
   :func:`collector.accounting.locate`). Rule 3 uses the same split and names no cause it has no
   reading for.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from collector.accounting import (
    Account,
    accounts,
    allocator_mode,
    changes,
    locate,
    nontorch_bytes,
    peak_phase,
    peak_split,
)

__all__ = ["Finding", "diagnose"]

GIB = 1 << 30
MIB = 1 << 20
STEADY_BYTES = 64 * MIB
JUMP_BYTES = 256 * MIB
MATCH_FRACTION = 0.15
MATCH_BYTES = 128 * MIB
TRANSIENT_BYTES = 256 * MIB
POOL_SHARE = 0.8
APPEARING = ("optimizer_state", "optimizer_state_managed", "gradients", "gradient_buckets")
FIRST_USE_BYTES = 64 * MIB  # memory outside torch that appeared on first use, said from here


@dataclass
class Finding:
    rule: str  # unmeasured steady_state growing jump nontorch cache transient headroom oom
    # failed interrupted empty
    text: str
    numbers: dict[str, Any] = field(default_factory=dict)


def g(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _size(n: float) -> str:
    return g(n) if abs(n) >= GIB else f"{n / MIB:.0f} MiB"


def _te(r: dict[str, Any], key: str) -> int | None:
    v = (r.get("torch_end") or {}).get(key)
    return None if v is None else int(v)


def _peak_phase(r: dict[str, Any]) -> str | None:
    phases = [p for p in r.get("phases") or [] if p.get("torch_allocated_peak_bytes") is not None]
    if not phases:
        return None
    return max(phases, key=lambda p: p["torch_allocated_peak_bytes"])["phase"]


def _matches(growth: int, jump: int) -> bool:
    """Whether ``growth`` accounts for a reserved ``jump`` (rule 2's tolerance)."""
    return abs(jump - growth) <= max(MATCH_FRACTION * jump, MATCH_BYTES)


def _flush_live(live: list[tuple[dict[str, Any], dict[str, Any], int]], out: list) -> None:
    """One finding for a run of consecutive jumps that live tensors at step end account for."""
    if not live:
        return
    first, last = live[0][0], live[-1][1]
    total = sum(d for _, _, d in live)
    each = (
        f"by {g(total)}"
        if len(live) == 1
        else f"at each of {len(live)} steps, {g(total)} in all ({g(total / len(live))} a step)"
    )
    out.append(
        Finding(
            "jump",
            f"Step {first['step']}→{last['step']}: torch reserved at step end grew {each}, and "
            "torch allocated at step end grew as much: tensors that stay alive past the step "
            "(kept references, a leak), not a higher transient peak.",
            {
                "from_step": first["step"],
                "to_step": last["step"],
                "reserved_jump": total,
                "jumps": len(live),
                "cause": "live",
            },
        )
    )
    live.clear()


def _steady_from(recs: list[dict[str, Any]]) -> int | None:
    """Index of the first record from which reserved and NVML end stay within STEADY_BYTES."""

    def series(r):
        return (_te(r, "reserved_bytes.all.current") or 0, r["nvml_end_bytes"])

    start = None
    for i in range(len(recs) - 1, 0, -1):
        a, b = series(recs[i - 1]), series(recs[i])
        if all(abs(y - x) < STEADY_BYTES for x, y in zip(a, b, strict=True)):
            start = i - 1
        else:
            break
    return start


def steps_text(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1–3, 7``."""
    parts, run = [], [steps[0]]
    for s in steps[1:]:
        if s == run[-1] + 1:
            run.append(s)
            continue
        parts.append(f"{run[0]}–{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [s]
    parts.append(f"{run[0]}–{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(parts)


def end_known(r: dict[str, Any]) -> bool:
    """Whether a step's end-of-step NVML reading describes its end (a sample within the mark
    window of the end mark; ``stale_end``: only an older one)."""
    return r.get("nvml_end_bytes") is not None and "stale_end" not in (r.get("gap") or "")


def _starved(recs: list[dict[str, Any]]) -> Finding | None:
    """Steps whose sampler fell behind: peaks that may miss a transient, end readings that
    are older than the end mark."""
    under = [r for r in recs if "undersampled" in (r.get("gap") or "")]
    stale = [r for r in recs if "stale_end" in (r.get("gap") or "")]
    if not under and not stale:
        return None
    parts = []
    if under:
        parts.append(
            f"{len(under)} of {len(recs)} steps got fewer than half the samples the rate "
            f"promised (step {steps_text([r['step'] for r in under])}): their peaks may miss "
            "a short transient"
        )
    if stale:
        parts.append(
            f"{len(stale)} end readings are older than the end mark (step "
            f"{steps_text([r['step'] for r in stale])}): left out of the end-of-step findings"
        )
    return Finding(
        "starved",
        "The sampler fell behind (too little CPU on this machine, or a stalled NVML): "
        + "; ".join(parts)
        + ".",
        {"undersampled": len(under), "stale_end": len(stale), "of": len(recs)},
    )


def _unmeasured(recs: list[dict[str, Any]]) -> Finding | None:
    """Steps without NVML samples: named, counted and left out of every NVML figure."""
    missing = [r for r in recs if r.get("nvml_peak_bytes") is None]
    if not missing:
        return None
    why = sorted({r.get("gap") or "no_samples" for r in missing})
    return Finding(
        "unmeasured",
        f"{len(missing)} of {len(recs)} steps have no NVML samples (step "
        f"{steps_text([r['step'] for r in missing])}; {', '.join(why)}): the sampler read "
        "nothing inside them — steps shorter than the sampling period (a replay sped up "
        "with --speed, a fast workload at a low --rate), a sampler starved of CPU, or NVML "
        "errors. Their NVML figures are unknown, not zero; the findings below leave them out.",
        {"steps": len(missing), "of": len(recs), "gaps": why},
    )


def _outside(ended: list[dict[str, Any]], nt: int, managed: int) -> Finding:
    """Rule 3 without a managed ledger: split by NVML's per-process readings when there are
    some; otherwise one figure, said to be unsplit (no cause is named without evidence)."""
    accs = accounts(ended)
    a = accs[-1] if accs and accs[-1].step == ended[-1]["step"] else None
    nums: dict[str, Any] = {"nontorch": nt, "managed": managed}
    if a is None or a.unsplit is not None:
        return Finding(
            "nontorch",
            f"{g(nt)} of NVML used at step end is outside the torch allocator beyond what the "
            "probe measured before training (the CUDA context, other processes then); without "
            "NVML per-process readings it cannot be split into this process's own other "
            "allocations (NCCL, cuBLAS workspaces, raw cudaMalloc), other processes and "
            "managed memory (a paged optimizer's state). Runs from captures that hold "
            "per-process snapshots, or live on a driver whose NVML lists processes, split it.",
            nums,
        )
    others = ", ".join(f"pid {pid} {name[:40]!r} {g(b)}" for pid, name, b in a.others)
    nums.update(outside=a.outside, others=a.other_processes, no_process=a.no_process)
    base = "CUDA context, libraries loaded before step 1"
    if a.first_use >= FIRST_USE_BYTES:
        nums["first_use"] = a.first_use
        base = (
            f"{g(a.before or 0)} of CUDA context before training, and {g(a.first_use)} outside "
            "torch that appeared on first use and stayed: NCCL's communicator buffers at the "
            "first collective, cuBLAS workspaces"
        )
    return Finding(
        "nontorch",
        f"At the end of step {a.step}, {g(a.device_used - a.reserved - a.baseline)} of NVML "
        f"used is outside the torch allocator beyond this process's baseline ({g(a.baseline)}: "
        f"{base}). By NVML's per-process readings: "
        f"{g(a.outside or 0)} in this process outside torch (NCCL, cuBLAS, raw cudaMalloc, "
        f"another library), {g(a.other_processes)} in other processes"
        + (f" ({others})" if others else "")
        + f", {g(a.no_process or 0)} charged to no process (CUDA managed/UVM memory such as "
        "a paged optimizer's state, which NVML's per-process figure leaves out).",
        nums,
    )


def _outside_growth(ended: list[dict[str, Any]]) -> str:
    """Which component outside torch grows from the first to the last step, by the accounting
    (no cause named without a reading)."""
    accs = [a for a in accounts(ended) if a.unsplit is None]
    if len(accs) < 2:
        return (
            "memory outside torch's allocator grows; without NVML per-process readings it "
            "cannot be split into this process, other processes and managed memory"
        )
    first, last = accs[0].components(), accs[-1].components()
    grew = {k: last[k] - first[k] for k in last if k not in ("baseline", "torch reserved")}
    grew.pop("remainder", None)
    name = max(grew, key=lambda k: grew[k])
    return (
        f"by NVML's per-process readings it is {name} "
        f"({g(grew[name])} from step {accs[0].step} to step {accs[-1].step})"
    )


def _where(w: dict[str, Any] | None, by_step: dict[int, dict[str, Any]]) -> str:
    """`` — in optimizer, 812–830 ms into step 3`` for a located change (empty if not)."""
    if w is None:
        return ""
    if w["phase"] == "between steps":
        return f" — between step {w['step'] - 1}'s end and step {w['step']}'s begin"
    t0 = by_step[w["step"]]["begin_ns"]
    span = f"{(w['from_ns'] - t0) / 1e6:.0f}–{(w['to_ns'] - t0) / 1e6:.0f} ms into step {w['step']}"
    return f" — in {w['phase']}, {span}" if w["phase"] != "step" else f" — {span}"


def _accounting(recs: list[dict[str, Any]]) -> list[Finding]:
    """Rule 7: the allocator's mode, every byte of the last step's end, and each step-to-step
    change of what lies outside torch, from the accounting identity
    (:mod:`collector.accounting`)."""
    out = _allocator_mode(recs)
    accs = accounts(recs)
    if not accs:
        return out
    out.append(_identity(accs[-1]))
    return out + _component_changes(recs, accs)


def _allocator_mode(recs: list[dict[str, Any]]) -> list[Finding]:
    """The caching allocator switched off, or running with expandable segments."""
    mode = allocator_mode(recs)
    if mode["caching_disabled"]:
        why = (
            "PYTORCH_NO_CUDA_MEMORY_CACHING is set in the run's environment"
            if mode["from_environment"]
            else "torch's statistics stay 0 while NVML moves"
        )
        return [
            Finding(
                "allocator_mode",
                f"The CUDA caching allocator is off ({why}): every tensor goes to and from the "
                "driver, torch's reserved and allocated read 0, so the memory tensors use "
                "counts as outside torch below and the torch columns say nothing.",
                mode,
            )
        ]
    if mode["expandable_segments"]:
        return [
            Finding(
                "allocator_mode",
                "The allocator runs with expandable segments (PYTORCH_CUDA_ALLOC_CONF): "
                "reserved grows and shrinks in place, so fewer, larger segments and less "
                "inactive split memory are expected.",
                mode,
            )
        ]
    return []


def _identity(a: Account) -> Finding:
    """Every byte of one step's end: NVML used as the sum of the accounting's components."""
    live = ""
    if a.live:
        live = ": " + ", ".join(f"{k.replace('_', ' ')} {g(v)}" for k, v in a.live.items())
    torch_part = (
        f"torch reserved {g(a.reserved)} (live tensors {g(a.allocated)}{live}; cached-free "
        f"{g(a.cached_free)}; inactive split {g(a.inactive_split)})"
    )
    if a.unsplit is not None:
        rest = f"outside torch, unsplit {g(a.unsplit)} ({a.unsplit_why})"
    else:
        when = ""
        if a.read_after_ms is not None and a.read_after_ms >= 0:
            when = f" (per-process reading taken {a.read_after_ms:.0f} ms after the end mark)"
        elif a.read_after_ms is not None:
            when = (
                f" (per-process reading taken {-a.read_after_ms:.0f} ms before the end "
                "mark, the last time device memory moved)"
            )
        rest = (
            f"outside torch in this process {g(a.outside or 0)} + other processes "
            f"{g(a.other_processes)} + no process (managed/UVM) {g(a.no_process or 0)} + "
            f"remainder {g(a.remainder)}{when}"
        )
    base = g(a.baseline)
    if a.first_use >= FIRST_USE_BYTES:
        base += (
            f" ({g(a.before or 0)} before training, the CUDA context; {g(a.first_use)} that "
            "appeared outside torch on first use during training and stayed: NCCL's "
            "communicator buffers, cuBLAS workspaces)"
        )
    return Finding(
        "accounting",
        f"Every byte at the end of step {a.step}: NVML used {g(a.device_used)} = baseline "
        f"{base} + {torch_part} + {rest}.",
        {"step": a.step, "first_use": a.first_use, **{k: v for k, v in a.components().items()}},
    )


def _component_changes(recs: list[dict[str, Any]], accs: list[Account]) -> list[Finding]:
    """Each step-to-step change outside torch reserved (rule 2 explains reserved's jumps), one
    finding per component, each change placed between two step marks."""
    by_component: dict[str, list[dict[str, Any]]] = {}
    by_step = {r["step"]: r for r in recs}
    for c in changes(accs):
        if c["component"] != "torch reserved":
            where = locate(c, by_step)
            if where is not None:
                c["where"] = where
            by_component.setdefault(c["component"], []).append(c)
    unread = [x.step for x in accs if x.unsplit is not None]
    gaps = ""
    if unread and len(unread) < len(accs):
        gaps = (
            f"; no per-process reading describes the end of step(s) {steps_text(unread)}, so "
            "a change there is measured from the step before them"
        )
    out = []
    for name, cs in by_component.items():
        steps = ", ".join(
            f"{'+' if c['delta'] > 0 else '−'}{g(abs(c['delta']))} at step {c['step']}"
            + (f" (since step {c['since']}'s end)" if c["since"] != c["step"] - 1 else "")
            + _where(c.get("where"), by_step)
            + (f" ({'; '.join(c['who'])})" if c.get("who") else "")
            for c in cs
        )
        out.append(
            Finding(
                "component_change",
                f"{name[0].upper()}{name[1:]} changed from one step's end to the next: {steps} "
                "(end of the step before to end of that step; torch reserved did not account "
                f"for it){gaps}.",
                {"component": name, "changes": cs},
            )
        )
    return out


@dataclass
class _Steps:
    """One GPU's records as the rules read them."""

    recs: list[dict[str, Any]]  # the steps that ended (every step if none did)
    all_steps: list[dict[str, Any]]  # every step, a failed one included
    ended: list[dict[str, Any]]  # ended steps with an end-of-step NVML reading
    peaked: list[dict[str, Any]]  # steps with a within-step NVML peak
    has_torch: bool
    total_bytes: int | None


def _rule_unmeasured(s: _Steps) -> list[Finding]:
    """Steps without an NVML sample inside them, named."""
    all_steps = s.all_steps
    out: list[Finding] = []
    for found in (_unmeasured(all_steps), _starved(all_steps)):
        if found is not None:
            out.append(found)
    return out


def _rule_steady(s: _Steps) -> list[Finding]:
    """1. Steady state, or growth: by how much a step, in which pool."""
    ended = s.ended
    has_torch = s.has_torch
    out: list[Finding] = []
    # 1. steady state, or growth (steps whose end NVML reading exists)
    k = _steady_from(ended) if len(ended) >= 3 else None
    if k is not None and len(ended) - k >= 2:
        first = ended[k]
        out.append(
            Finding(
                "steady_state",
                f"Steady state from step {first['step']}: end-of-step memory stays "
                f"within {STEADY_BYTES // MIB} MiB a step (torch reserved "
                f"{g(_te(first, 'reserved_bytes.all.current') or 0)}, NVML "
                f"{g(first['nvml_end_bytes'])}).",
                {"step": first["step"]},
            )
        )
    elif len(ended) >= 3:
        n = len(ended) - 1
        rates = {
            "torch allocated": (
                (_te(ended[-1], "allocated_bytes.all.current") or 0)
                - (_te(ended[0], "allocated_bytes.all.current") or 0)
            )
            / n,
            "torch reserved": (
                (_te(ended[-1], "reserved_bytes.all.current") or 0)
                - (_te(ended[0], "reserved_bytes.all.current") or 0)
            )
            / n,
        }
        if has_torch:
            rates["outside the allocator"] = (
                (nontorch_bytes(ended[-1]) or 0) - (nontorch_bytes(ended[0]) or 0)
            ) / n
        rates["NVML used"] = (ended[-1]["nvml_end_bytes"] - ended[0]["nvml_end_bytes"]) / n
        fastest = max(rates.values())
        if fastest < STEADY_BYTES / n:  # it moves from step to step but does not grow
            out.append(
                Finding(
                    "unsteady",
                    f"No steady state: end-of-step memory moves by {STEADY_BYTES // MIB} MiB "
                    f"or more between steps {ended[0]['step']}–{ended[-1]['step']} without "
                    "growing over them (NVML "
                    f"{g(ended[0]['nvml_end_bytes'])} at the first, "
                    f"{g(ended[-1]['nvml_end_bytes'])} at the last).",
                    {"first": ended[0]["step"], "last": ended[-1]["step"]},
                )
            )
            return out
        pool = next(p for p in rates if rates[p] >= POOL_SHARE * fastest)
        why = {
            "torch allocated": "live tensors accumulate from step to step — something keeps "
            "references to them (a leak)",
            "torch reserved": "the allocator's cache grows while live tensors do not",
            "outside the allocator": _outside_growth(ended),
            "NVML used": "device memory grows",
        }[pool]
        out.append(
            Finding(
                "growing",
                f"No steady state: end-of-step memory still grows at the last step; "
                f"{pool} grows {_size(rates[pool])} a step on average over steps "
                f"{ended[0]['step']}–{ended[-1]['step']}: {why}.",
                {"pool": pool, "bytes_per_step": rates[pool]},
            )
        )
    return out


def _rule_jumps(s: _Steps) -> list[Finding]:
    """2. Each end-of-step jump of torch reserved before the steady state, attributed."""
    recs = s.recs
    has_torch = s.has_torch
    out: list[Finding] = []
    # 2. jumps in reserved, attributed
    live: list[tuple[dict[str, Any], dict[str, Any], int]] = []  # a run of "live" jumps
    if has_torch:
        for prev, cur in itertools.pairwise(recs):
            d_res = (_te(cur, "reserved_bytes.all.current") or 0) - (
                _te(prev, "reserved_bytes.all.current") or 0
            )
            if d_res <= JUMP_BYTES:
                _flush_live(live, out)
                continue
            d_peak = (cur.get("torch_allocated_peak_bytes") or 0) - (
                prev.get("torch_allocated_peak_bytes") or 0
            )
            d_alloc = (_te(cur, "allocated_bytes.all.current") or 0) - (
                _te(prev, "allocated_bytes.all.current") or 0
            )
            if _matches(d_alloc, d_res):
                # Live tensors at step end grew as much: memory kept past the step (a leak or
                # a growing cache of the workload's own), not a higher transient peak.
                if live and live[-1][1] is not prev:
                    _flush_live(live, out)
                live.append((prev, cur, d_res))
                continue
            _flush_live(live, out)
            text = (
                f"Step {prev['step']}→{cur['step']}: torch reserved at step end grew by "
                f"{g(d_res)}. "
            )
            nums = {
                "from_step": prev["step"],
                "to_step": cur["step"],
                "reserved_jump": d_res,
                "allocated_peak_growth": d_peak,
            }
            if _matches(d_peak, d_res) or d_peak > d_res:
                # the peak grew at least as much: the allocator reserved the higher peak (what
                # it did not reserve anew came from blocks it already cached)
                text += (
                    f"The within-step allocated peak grew by {g(d_peak)} between the same "
                    "steps: the allocator reserved the higher peak and kept it."
                )
                before = recs[recs.index(prev) - 1]["ledger"] if recs.index(prev) > 0 else {}
                grown = {
                    kind: v - (before or {}).get(kind, 0)
                    for kind, v in (prev.get("ledger") or {}).items()
                    # what appears during training (parameters exist before it); gradients
                    # and DDP's buckets stay when they are zeroed rather than set to None
                    if kind in APPEARING
                }
                new = sorted((k for k in grown if grown[k] > JUMP_BYTES), key=lambda k: -grown[k])
                if new:
                    listed = " and ".join(f"{k.replace('_', ' ')} ({g(grown[k])})" for k in new)
                    text += (
                        f" {listed[0].upper()}{listed[1:]} appeared in step {prev['step']} and "
                        f"{'was' if len(new) == 1 else 'were'} resident during step {cur['step']}"
                    )
                    nums["new_state"], nums["new_state_bytes"] = new[0], grown[new[0]]
                    nums["new_kinds"] = {k: grown[k] for k in new}
                    phase = _peak_phase(cur)
                    if phase:
                        text += f", whose peak falls in its {phase.replace('_', '/')} phase"
                        nums["peak_phase"] = phase
                    text += "."
                elif not prev.get("ledger"):
                    text += _kept_without_ledger(prev, cur, nums)
                nums["cause"] = "peak"
            else:
                seg = (_te(cur, "segment.all.current") or 0) - (
                    _te(prev, "segment.all.current") or 0
                )
                split = _te(cur, "inactive_split_bytes.all.current") or 0
                text += (
                    f"The within-step allocated peak changed by only {g(d_peak)}: the jump "
                    f"comes from the allocator, not from new state ({seg:+d} segments, "
                    f"{g(split)} in inactive split blocks at step end)."
                )
                nums["cause"] = "allocator"
            out.append(Finding("jump", text, nums))
        _flush_live(live, out)
    return out


def _nvml_peak_phase(r: dict[str, Any]) -> str | None:
    ph = peak_phase(r)
    return None if ph is None else ph["phase"]


def _nvml_peak_where(r: dict[str, Any]) -> str:
    """`` (in its optimizer phase, 812 ms in)`` for a step's NVML peak."""
    t, phase = r.get("nvml_peak_t_ns"), _nvml_peak_phase(r)
    parts = [f"in its {phase.replace('_', '/')} phase"] if phase else []
    if t is not None and r.get("begin_ns") is not None:
        parts.append(f"{(t - r['begin_ns']) / 1e6:.0f} ms in")
    return f" ({', '.join(parts)})" if parts else ""


def _kept_without_ledger(prev: dict[str, Any], cur: dict[str, Any], nums: dict[str, Any]) -> str:
    """Without a ledger, what the allocator itself shows: live tensors that step ``prev``
    created and kept (allocated at its end minus at its begin)."""
    a0 = (prev.get("torch_begin") or {}).get("allocated_bytes.all.current")
    a1 = _te(prev, "allocated_bytes.all.current")
    if a0 is None or a1 is None or a1 - a0 <= JUMP_BYTES:
        return ""
    nums["kept_by_step"] = a1 - a0
    return (
        f" Torch allocated grew {g(a1 - a0)} from step {prev['step']}'s begin to its end: live "
        f"tensors created in step {prev['step']} and kept, resident during step "
        f"{cur['step']}'s peak (optimizer state created by the first optimizer step is the "
        "usual case). There is no ledger to name them: give the probe the model and optimizer "
        "(probe.watch) for that, or read the allocation history for the line."
    )


def _rule_outside(s: _Steps) -> list[Finding]:
    """3. Memory outside the allocator at the last step that has an NVML end reading."""
    ended = s.ended
    out: list[Finding] = []
    # 3. memory outside the allocator (at the last step whose end NVML reading exists)
    nt = nontorch_bytes(ended[-1]) if ended else None
    if nt is not None:
        last_nt = ended[-1]
    if nt is not None:
        managed = (last_nt.get("ledger") or {}).get("optimizer_state_managed", 0)
        if managed > JUMP_BYTES:
            out.append(
                Finding(
                    "nontorch",
                    f"{g(nt)} of NVML used at step end is outside the torch allocator; "
                    f"managed (paged) optimizer state accounts for {g(managed)} of it: "
                    "absent from torch allocated and reserved, present in NVML device "
                    "used once its pages sit on the GPU.",
                    {"nontorch": nt, "managed": managed},
                )
            )
        else:
            out.append(_outside(ended, nt, managed))
    return out


def _rule_accounting(s: _Steps) -> list[Finding]:
    """7. The allocator's mode, every byte of the last step's end, component changes."""
    return _accounting(s.recs)


def _rule_cache(s: _Steps) -> list[Finding]:
    """4. Cache and fragmentation at the last step."""
    recs = s.recs
    has_torch = s.has_torch
    out: list[Finding] = []
    last = recs[-1]
    # 4. cache and fragmentation
    if has_torch:
        res, alloc = (
            _te(last, "reserved_bytes.all.current") or 0,
            _te(last, "allocated_bytes.all.current") or 0,
        )
        split = _te(last, "inactive_split_bytes.all.current") or 0
        retries = _te(last, "num_alloc_retries") or 0
        peak_gap = (last.get("torch_reserved_peak_bytes") or 0) - (
            last.get("torch_allocated_peak_bytes") or 0
        )
        out.append(
            Finding(
                "cache",
                f"At the end of step {last['step']} the allocator holds {g(res - alloc)} "
                f"more than live tensors use (reserved {g(res)}, allocated {g(alloc)}); "
                f"at the peak the gap is {g(peak_gap)}; {g(split)} sit in inactive "
                f"split blocks; {retries} allocation retries so far.",
                {
                    "cached_end": res - alloc,
                    "cached_peak": peak_gap,
                    "inactive_split": split,
                    "retries": retries,
                },
            )
        )
    return out


def _rule_transients(s: _Steps) -> list[Finding]:
    """5. Steps whose NVML peak rose well above their end reading."""
    peaked = s.peaked
    out: list[Finding] = []
    # 5. transients
    spikes = [
        r
        for r in peaked
        if r.get("nvml_end_bytes") is not None
        and r["nvml_peak_bytes"] - r["nvml_end_bytes"]
        > max(TRANSIENT_BYTES, 0.05 * r["nvml_end_bytes"])
    ]
    if spikes:
        big = max(spikes, key=lambda r: r["nvml_peak_bytes"] - r["nvml_end_bytes"])
        splits = [p for p in map(peak_split, spikes) if p is not None]
        outside = [p for p in splits if p.transient_outside > JUMP_BYTES]
        most = max(outside, key=lambda p: p.transient_outside) if outside else None
        out.append(
            Finding(
                "transient",
                f"{len(spikes)} of {len(peaked)} measured steps peak well above their end-of-step "
                f"reading; the largest, step {big['step']}, rose "
                f"{g(big['nvml_peak_bytes'] - big['nvml_end_bytes'])} above its end "
                f"reading and fell back inside the step{_peak_text(big)}."
                + (
                    f" In {len(outside)} step(s) the peak held memory outside torch's allocator "
                    "that was gone by the step's end (this process or another: per-process "
                    f"memory is read at step ends only), up to at least "
                    f"{g(most.transient_outside)} (step {most.step})."
                    if most is not None
                    else ""
                ),
                {
                    "steps": len(spikes),
                    "largest_step": big["step"],
                    "largest_bytes": big["nvml_peak_bytes"] - big["nvml_end_bytes"],
                    "splits": [vars(p) for p in splits],
                },
            )
        )
    return out


def _peak_text(r: dict[str, Any]) -> str:
    """`` (in its optimizer phase, 812 ms in): torch's reserved pool peaked 3.10 GiB above its
    end, and at least 0.50 GiB more lay outside torch's allocator`` for a step's peak."""
    p = peak_split(r)
    if p is None:
        return ""
    res_end = _te(r, "reserved_bytes.all.current") or 0
    text = (
        f"{_nvml_peak_where(r)}: torch's reserved pool peaked {g(p.reserved_peak - res_end)} "
        "above its end"
    )
    if p.transient_outside:
        text += f", and at least {g(p.transient_outside)} more lay outside torch's allocator"
    return text


def _rule_headroom_and_failures(s: _Steps) -> list[Finding]:
    """6. Headroom, OOM, failed and interrupted steps."""
    peaked = s.peaked
    all_steps = s.all_steps
    total_bytes = s.total_bytes
    out: list[Finding] = []
    # 6. headroom and OOM
    top = max(peaked, key=lambda r: r["nvml_peak_bytes"]) if peaked else None
    if total_bytes and top is not None:
        unseen = len(all_steps) - len(peaked)
        of = f" (of the {len(peaked)} steps with samples: {unseen} have none)" if unseen else ""
        out.append(
            Finding(
                "headroom",
                f"Largest within-step peak{of}: {g(top['nvml_peak_bytes'])} in step "
                f"{top['step']}{_nvml_peak_where(top)}, "
                f"{100 * top['nvml_peak_bytes'] / total_bytes:.1f} % of "
                f"the card's {g(total_bytes)}; headroom "
                f"{g(total_bytes - top['nvml_peak_bytes'])}.",
                {
                    "peak": top["nvml_peak_bytes"],
                    "total": total_bytes,
                    "phase": _nvml_peak_phase(top),
                },
            )
        )
    prev_ooms, prev = 0, None
    for r in all_steps:
        ooms = _te(r, "num_ooms") or 0
        error = r.get("error") or ""
        if ooms > prev_ooms or "OutOfMemory" in error:
            text = f"Step {r['step']} hit a CUDA out-of-memory error" + (
                " and failed" if error else ""
            )
            if r.get("nvml_peak_bytes") is None:
                text += "; NVML has no sample inside it"
            else:
                text += f"; the NVML peak inside it reached {g(r['nvml_peak_bytes'])}"
                if total_bytes:
                    text += f" of the card's {g(total_bytes)}"
            nums = {"step": r["step"], "peak": r.get("nvml_peak_bytes"), "failed": bool(error)}
            if prev is not None and prev.get("nvml_peak_bytes") is not None:
                text += f"; step {prev['step']} before it peaked at {g(prev['nvml_peak_bytes'])}"
                if prev.get("nvml_end_bytes") is not None:
                    text += f" and ended at {g(prev['nvml_end_bytes'])}"
                nums["previous_peak"] = prev["nvml_peak_bytes"]
            alloc = _te(r, "allocated_bytes.all.current")
            if alloc is not None:
                text += (
                    f"; torch held {g(alloc)} allocated and its within-step allocated peak "
                    f"was {g(r.get('torch_allocated_peak_bytes') or 0)} when it failed"
                )
                nums["allocated_at_failure"] = alloc
            out.append(Finding("oom", text + ".", nums))
        elif error == "KeyboardInterrupt":
            out.append(
                Finding(
                    "interrupted",
                    f"The run was stopped during step {r['step']} (SIGTERM, Ctrl-C or "
                    "`ray job stop`); the steps before it are complete.",
                    {"step": r["step"]},
                )
            )
        elif error:
            out.append(
                Finding(
                    "failed",
                    f"Step {r['step']} failed with {error}; "
                    + (
                        "NVML has no sample inside it."
                        if r.get("nvml_peak_bytes") is None
                        else f"its NVML peak was {g(r['nvml_peak_bytes'])}."
                    ),
                    {"step": r["step"], "error": error, "peak": r.get("nvml_peak_bytes")},
                )
            )
        prev_ooms, prev = ooms, r
    return out


# The rules in the order their findings are reported (each a small function of the steps).
RULES = (
    _rule_unmeasured,
    _rule_steady,
    _rule_jumps,
    _rule_outside,
    _rule_accounting,
    _rule_cache,
    _rule_transients,
    _rule_headroom_and_failures,
)


def diagnose(recs: list[dict[str, Any]], total_bytes: int | None = None) -> list[Finding]:
    """Findings for one GPU's records (sorted by step), rule by rule (:data:`RULES`). A step
    without NVML samples has None NVML figures (never 0 bytes): it is named and left out of
    every rule that reads NVML."""
    all_steps = sorted(recs, key=lambda r: r["step"])
    if not all_steps:
        return [Finding("empty", "No complete step was recorded.")]
    ended_ok = [r for r in all_steps if not r.get("error")] or all_steps
    steps = _Steps(
        recs=ended_ok,
        all_steps=all_steps,
        ended=[r for r in ended_ok if end_known(r)],
        peaked=[r for r in all_steps if r.get("nvml_peak_bytes") is not None],
        has_torch=_te(all_steps[0], "reserved_bytes.all.current") is not None,
        total_bytes=total_bytes,
    )
    return [f for rule in RULES for f in rule(steps)]
