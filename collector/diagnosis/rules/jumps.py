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

from collector.diagnosis.kinds import Finding, FindingKind
from collector.diagnosis.steps import Steps
from collector.diagnosis.text import g
from collector.records import StepRecord

APPEARING = ("optimizer_state", "optimizer_state_managed", "gradients", "gradient_buckets")


def _peak_phase(r: StepRecord) -> str | None:
    phases = [p for p in r.phases if p.get("torch_allocated_peak_bytes") is not None]
    if not phases:
        return None
    return max(phases, key=lambda p: p["torch_allocated_peak_bytes"])["phase"]


def _site(s: Steps, prev: StepRecord, cur: StepRecord) -> str:
    """The largest site of what ``prev`` allocated and ``cur`` still held, else of ``cur``'s
    peak, from the allocation history (empty when neither step was recorded)."""
    doc = s.sites.get(prev.step)
    if doc and doc.get("kept_to_next"):
        k = doc["kept_to_next"][0]
        return f"allocated in step {prev.step} at {k['site']} ({g(k['bytes'])})"
    doc = s.sites.get(cur.step)
    if doc and doc.get("at_peak"):
        k = doc["at_peak"][0]
        return f"the largest site live at step {cur.step}'s peak: {k['site']} ({g(k['bytes'])})"
    return ""


def rule(s: Steps) -> list[Finding]:
    if not s.has_torch:
        return []
    th = s.th

    def matches(growth: int, jump: int) -> bool:
        return abs(jump - growth) <= max(th.match_fraction * jump, th.match_bytes)

    out: list[Finding] = []
    live: list[tuple[StepRecord, StepRecord, int]] = []

    def flush() -> None:
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
        )
        live.clear()

    recs = [r for r in s.recs if r.reserved_end is not None]
    for i, (prev, cur) in enumerate(itertools.pairwise(recs)):
        d_res = (cur.reserved_end or 0) - (prev.reserved_end or 0)
        if d_res <= th.jump_bytes:
            flush()
            continue
        d_peak = (cur.torch_allocated_peak_bytes or 0) - (prev.torch_allocated_peak_bytes or 0)
        d_alloc = (cur.allocated_end or 0) - (prev.allocated_end or 0)
        if matches(d_alloc, d_res):
            if live and live[-1][1] is not prev:
                flush()
            live.append((prev, cur, d_res))
            continue
        flush()
        nums = {
            "from_step": prev.step,
            "to_step": cur.step,
            "reserved_jump": d_res,
            "allocated_peak_growth": d_peak,
        }
        head = f"Step {prev.step}→{cur.step}: torch reserved at step end +{g(d_res)}"
        if matches(d_peak, d_res) or d_peak >= th.peak_share * d_res:
            nums["cause"] = "peak"
            phase = _peak_phase(cur)
            if phase:
                nums["peak_phase"] = phase
            where = f" ({phase.replace('_', '/')})" if phase else ""
            text = f"{head}: step {cur.step}'s allocated peak grew {g(d_peak)}{where} and was kept"
            if not (matches(d_peak, d_res) or d_peak > d_res):
                nums["beyond_peak"] = d_res - d_peak
                text += f", with {g(d_res - d_peak)} more than that peak needed"
            before = recs[i - 1].ledger if i > 0 else {}
            grown = {k: v - before.get(k, 0) for k, v in prev.ledger.items() if k in APPEARING}
            new = sorted(
                (k for k in grown if grown[k] > th.new_state_bytes), key=lambda k: -grown[k]
            )
            if new:
                listed = ", ".join(f"{k.replace('_', ' ')} ({g(grown[k])})" for k in new)
                text += f": {listed} appeared in step {prev.step}."
                nums["new_state"], nums["new_state_bytes"] = new[0], grown[new[0]]
                nums["new_kinds"] = {k: grown[k] for k in new}
            else:
                text += "."
                a0, a1 = prev.allocated_begin, prev.allocated_end
                if (
                    not prev.ledger
                    and a0 is not None
                    and a1 is not None
                    and a1 - a0 > th.kept_bytes
                ):
                    nums["kept_by_step"] = a1 - a0
                    text += (
                        f" Step {prev.step} created and kept {g(a1 - a0)} of tensors, resident at "
                        f"step {cur.step}'s peak (no ledger names them: probe.watch(model, "
                        "optimizer))."
                    )
        else:
            nums["cause"] = "allocator"
            nums["segments"] = cur.segments_end - prev.segments_end
            nums["inactive_split"] = cur.inactive_split_end
            text = (
                f"{head} while the allocated peak changed by only {g(d_peak)}: the allocator's "
                f"doing, not new state ({nums['segments']:+d} segments, "
                f"{g(cur.inactive_split_end)} in inactive split blocks at step end)."
            )
        f = Finding(FindingKind.JUMP, text, nums, steps=(prev.step, cur.step))
        site = _site(s, prev, cur)
        if site:
            nums["site"] = site
            f.add(f" {site[0].upper()}{site[1:]}.")
        out.append(f)
    flush()
    return out
