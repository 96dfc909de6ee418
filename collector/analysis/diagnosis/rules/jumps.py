"""Each end-of-step jump of torch reserved above ``jump_bytes``, attributed to one cause:

* **peak** — the step's within-step allocated peak grew about as much (``match_fraction`` or
  ``match_bytes``) or more: the allocator reserved the higher peak and kept it. The ledger
  says which state appeared in the step before (kinds that grew more than
  ``new_state_bytes``), the phase marks where the new peak falls; without a ledger, what
  torch allocated from that step's begin to its end (above ``kept_bytes``).
* **live** — torch allocated at step end grew as much: tensors kept past the step (consecutive
  ones are one finding; under a leak, the consistency pass folds them into it).
* **allocator** — neither: new segments or split blocks, not new state (the consistency pass
  folds these into the fragmentation finding).

A jump cites the allocation history's sites of the step that made it, when it was recorded."""

from __future__ import annotations

import itertools

from collector.analysis.diagnosis.kinds import Finding, FindingKind
from collector.analysis.diagnosis.steps import Steps
from collector.model.kinds import MemoryKind
from collector.model.step import StepRecord
from collector.model.units import gib

# kinds a step can make that stay resident, in the order a jump names them
APPEARING = (
    MemoryKind.OPTIMIZER_STATE,
    MemoryKind.OPTIMIZER_STATE_MANAGED,
    MemoryKind.GRADIENTS,
    MemoryKind.GRADIENT_BUCKETS,
)


def _site(s: Steps, prev: StepRecord, cur: StepRecord) -> str:
    """The largest site of what ``prev`` allocated and ``cur`` still held, else of ``cur``'s
    peak, from the allocation history (empty when neither step was recorded)."""
    doc = s.sites.get(prev.step)
    if doc and doc.get("kept_to_next"):
        k = doc["kept_to_next"][0]
        return f"allocated in step {prev.step} at {k['site']} ({gib(k['bytes'])})"
    doc = s.sites.get(cur.step)
    if doc and doc.get("at_peak"):
        k = doc["at_peak"][0]
        return f"the largest site live at step {cur.step}'s peak: {k['site']} ({gib(k['bytes'])})"
    return ""


def _matches(s: Steps, growth: int, jump: int) -> bool:
    return abs(jump - growth) <= max(s.th.match_fraction * jump, s.th.match_bytes)


def _kept_alive(live: list[tuple[StepRecord, StepRecord, int]]) -> Finding:
    """Consecutive jumps that torch allocated at step end grew with: one finding."""
    first, last = live[0][0], live[-1][1]
    total = sum(d for _, _, d in live)
    each = (
        f"by {gib(total)}"
        if len(live) == 1
        else f"at each of {len(live)} steps, {gib(total)} in all ({gib(total / len(live))} a step)"
    )
    return Finding(
        FindingKind.JUMP,
        f"Step {first.step}→{last.step}: torch reserved at step end grew {each}, and "
        "torch allocated at step end grew as much: tensors kept alive past the step, "
        "not a higher transient peak.",
        {
            "from_step": first.step,
            "to_step": last.step,
            "reserved_jump": total,
            "jumps": len(live),
            "cause": "live",
        },
        steps=(first.step, last.step),
    )


def _appeared(
    s: Steps, before: dict[str, int], prev: StepRecord, cur: StepRecord, nums: dict
) -> str:
    """What made the higher peak: the state that appeared in ``prev`` (by the ledger), or
    without a ledger what ``prev`` created and kept (by the allocator)."""
    grown = {k: v - before.get(k, 0) for k, v in prev.ledger.items() if k in APPEARING}
    new = sorted((k for k in grown if grown[k] > s.th.new_state_bytes), key=lambda k: -grown[k])
    if new:
        listed = ", ".join(f"{k.replace('_', ' ')} ({gib(grown[k])})" for k in new)
        nums["new_state"], nums["new_state_bytes"] = new[0], grown[new[0]]
        nums["new_kinds"] = {k: grown[k] for k in new}
        return f": {listed} appeared in step {prev.step}."
    a0, a1 = prev.allocated_begin, prev.allocated_end
    if not prev.ledger and a0 is not None and a1 is not None and a1 - a0 > s.th.kept_bytes:
        nums["kept_by_step"] = a1 - a0
        return (
            f". Step {prev.step} created and kept {gib(a1 - a0)} of tensors, "
            f"resident at step {cur.step}'s peak (no ledger names them: "
            "probe.watch(model, optimizer))."
        )
    return "."


def _jump(s: Steps, before: dict[str, int], prev: StepRecord, cur: StepRecord, d_res: int):
    """A jump the allocated peak explains (``peak``) or does not (``allocator``)."""
    d_peak = (cur.torch_allocated_peak_bytes or 0) - (prev.torch_allocated_peak_bytes or 0)
    nums: dict = {
        "from_step": prev.step,
        "to_step": cur.step,
        "reserved_jump": d_res,
        "allocated_peak_growth": d_peak,
    }
    head = f"Step {prev.step}→{cur.step}: torch reserved at step end +{gib(d_res)}"
    if _matches(s, d_peak, d_res) or d_peak >= s.th.peak_share * d_res:
        nums["cause"] = "peak"
        phase = cur.allocated_peak_phase
        if phase:
            nums["peak_phase"] = phase
        where = f" ({phase.replace('_', '/')})" if phase else ""
        text = f"{head}: step {cur.step}'s allocated peak grew {gib(d_peak)}{where} and was kept"
        if not (_matches(s, d_peak, d_res) or d_peak > d_res):
            nums["beyond_peak"] = d_res - d_peak
            text += f", with {gib(d_res - d_peak)} more than that peak needed"
        text += _appeared(s, before, prev, cur, nums)
    else:
        nums["cause"] = "allocator"
        nums["segments"] = cur.segments_end - prev.segments_end
        nums["inactive_split"] = cur.inactive_split_end
        text = (
            f"{head} while the allocated peak changed by only {gib(d_peak)}: the allocator's "
            f"doing, not new state ({nums['segments']:+d} segments, "
            f"{gib(cur.inactive_split_end)} in inactive split blocks at step end)."
        )
    f = Finding(FindingKind.JUMP, text, nums, steps=(prev.step, cur.step))
    site = _site(s, prev, cur)
    if site:
        nums["site"] = site
        f.add(f" {site[0].upper()}{site[1:]}.")
    return f


def rule(s: Steps) -> list[Finding]:
    if not s.has_torch:
        return []
    out: list[Finding] = []
    live: list[tuple[StepRecord, StepRecord, int]] = []

    def flush() -> None:
        if live:
            out.append(_kept_alive(live))
            live.clear()

    recs = [r for r in s.recs if r.reserved_end is not None]
    for i, (prev, cur) in enumerate(itertools.pairwise(recs)):
        d_res = (cur.reserved_end or 0) - (prev.reserved_end or 0)
        if d_res <= s.th.jump_bytes:
            flush()
            continue
        d_alloc = (cur.allocated_end or 0) - (prev.allocated_end or 0)
        if _matches(s, d_alloc, d_res):
            if live and live[-1][1] is not prev:
                flush()
            live.append((prev, cur, d_res))
            continue
        flush()
        out.append(_jump(s, recs[i - 1].ledger if i > 0 else {}, prev, cur, d_res))
    flush()
    return out
