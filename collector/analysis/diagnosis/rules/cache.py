"""The allocator's cache at the last step, and fragmentation.

**Fragmentation** is named when torch reserved grew without new tensors to show for it: jumps of
reserved with a flat allocated peak (:mod:`.jumps`' ``allocator`` cause) or reserved growing over
the run while live tensors do not, adding up to ``fragmentation_bytes``; or when inactive split
blocks (free space inside segments the allocator cannot hand out whole) hold at least
``split_share`` of reserved and the noise floor; or when the allocator had to free its cache to
satisfy a request (allocation retries). It says what expandable segments change: segments that
grow in place instead of a new one for each size that does not fit."""

from __future__ import annotations

import itertools

from collector.analysis.diagnosis.kinds import Finding, FindingKind
from collector.analysis.diagnosis.steps import Steps
from collector.analysis.diagnosis.text import steps_text
from collector.model.units import gib

EXPANDABLE = (
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True grows segments in place instead of adding "
    "one per new size"
)


def rule(s: Steps) -> list[Finding]:
    if not s.has_torch or s.mode.caching_disabled:
        return []
    th = s.th
    recs = [r for r in s.recs if r.reserved_end is not None]
    if not recs:
        return []
    last = recs[-1]
    res, alloc = last.reserved_end or 0, last.allocated_end or 0
    split, retries = last.inactive_split_end, last.retries
    peak_gap = (last.torch_reserved_peak_bytes or 0) - (last.torch_allocated_peak_bytes or 0)
    out = [
        Finding(
            FindingKind.CACHE,
            f"At the end of step {last.step} the allocator caches {gib(res - alloc)} beyond live "
            f"tensors (reserved {gib(res)}, allocated {gib(alloc)}); at the peak the gap is "
            f"{gib(peak_gap)}; {gib(split)} in inactive split blocks; {retries} allocation "
            "retries.",
            {
                "cached_end": res - alloc,
                "cached_peak": peak_gap,
                "inactive_split": split,
                "retries": retries,
            },
            steps=(last.step, last.step),
            minor=not (s.shown(res - alloc) or s.shown(split) or retries),
        )
    ]
    # reserved growth with no tensors to show for it: jumps whose allocated peak stayed flat
    growth, where = 0, []
    for prev, cur in itertools.pairwise(recs):
        d_res = (cur.reserved_end or 0) - (prev.reserved_end or 0)
        d_peak = (cur.torch_allocated_peak_bytes or 0) - (prev.torch_allocated_peak_bytes or 0)
        d_alloc = (cur.allocated_end or 0) - (prev.allocated_end or 0)
        unexplained = d_res - max(d_peak, d_alloc, 0)
        if d_res > th.jump_bytes and unexplained > max(th.match_fraction * d_res, th.match_bytes):
            growth += unexplained
            where.append(cur.step)
    big_split = split >= max(th.split_share * res, s.floor)
    reasons = []
    if growth >= th.fragmentation_bytes:
        reasons.append(
            f"reserved grew {gib(growth)} beyond the allocated peak and live tensors (step "
            f"{steps_text(where)})"
        )
    if big_split:
        reasons.append(f"{gib(split)} ({100 * split / res:.0f} %) in inactive split blocks")
    if retries:
        reasons.append(f"{retries} allocation retries (the cache freed to fit a request)")
    if not reasons:
        return out
    advice = "expandable segments are already on" if s.mode.expandable_segments else EXPANDABLE

    def said(parts: list[str]) -> str:
        return f"Fragmentation: {'; '.join(parts)}. {advice[0].upper()}{advice[1:]}."

    grew = growth >= th.fragmentation_bytes
    out.append(
        Finding(
            FindingKind.FRAGMENTATION,
            said(reasons),
            {
                "unexplained_growth": growth,
                "at_steps": where,
                "inactive_split": split,
                "inactive_split_named": big_split,
                "retries": retries,
                # the same without the growth (a leak explains that growth: consistency pass)
                "text_without_growth": said(reasons[1:] if grew else reasons),
                "summary": f"Fragmentation: {reasons[0]}.",
            },
            steps=(where[0] if where else last.step, last.step),
        )
    )
    return out
