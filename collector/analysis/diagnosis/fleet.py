"""Rules over a run's streams side by side (ranks, GPUs), where :mod:`.rules` read one stream
each: a rank out of balance with the others."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from collector.analysis.diagnosis.kinds import THRESHOLDS, Finding, FindingKind, Thresholds
from collector.analysis.runs import Stream
from collector.model.kinds import MemoryKind
from collector.model.units import GIB, gib

__all__ = ["Ranked", "imbalance"]

# the ledger's parts a rank's allocated peak is compared by
PARTS = (
    MemoryKind.PARAMETERS,
    MemoryKind.GRADIENTS,
    MemoryKind.OPTIMIZER_STATE,
    MemoryKind.OTHER_ALLOCATED,
)


@dataclass(frozen=True)
class Ranked:
    """One stream as the fleet compares it: its highest torch allocated peak (None: none
    read), and whether its sampler was lost at the end of the run."""

    stream: Stream
    alloc: int | None
    lost: bool


def _ledger(row: Ranked) -> dict[MemoryKind, int]:
    last = next((r for r in reversed(row.stream.records) if r.ledger), None)
    return {k: last.ledger_of(k) if last else 0 for k in PARTS}


def _name(kind: MemoryKind | None) -> str:
    if kind is MemoryKind.OTHER_ALLOCATED:
        return "other allocated (activations, temporaries)"
    return kind.words if kind else ""


def imbalance(rows: list[Ranked], th: Thresholds = THRESHOLDS) -> list[Finding]:
    """Ranks whose highest torch allocated peak lies more than ``imbalance_share`` (and
    ``imbalance_bytes``) above the median of all ranks (with two ranks: above the lower one),
    each with the ledger part that differs most from the median rank's (parameters, gradients,
    optimizer state, other allocated: activations and temporaries). Only ranks above: the
    alert's rule (``StepMemRankImbalance``), and the rank to look at."""
    # ranks of one job: a world of several, the size most streams agree on (two unrelated
    # processes — replays of two captures, two single-process runs — are not out of balance)
    worlds = [r.stream.world_size for r in rows if r.stream.world_size > 1 and r.stream.records]
    if not worlds:
        return []
    world = statistics.mode(worlds)
    ranked = [
        r for r in rows if r.alloc is not None and not r.lost and r.stream.world_size == world
    ]
    if len(ranked) < 2:
        return []
    allocs = [r.alloc or 0 for r in ranked]
    # what the ranks are held against: the median, or with two ranks the lower of them (the
    # median of two is their mean, and would make both look odd)
    med = statistics.median(allocs) if len(ranked) > 2 else min(allocs)
    if len(ranked) > 2:
        parts_med = {k: statistics.median(_ledger(r)[k] for r in ranked) for k in PARTS}
    else:
        parts_med = _ledger(min(ranked, key=lambda r: r.alloc or 0))
    against = "the median of the ranks" if len(rows) > 2 else "the other rank"
    out = []
    for row in ranked:
        diff = (row.alloc or 0) - med
        if diff <= max(th.imbalance_share * med, th.imbalance_bytes):
            continue
        led = _ledger(row)
        deltas = {k: led[k] - parts_med[k] for k in PARTS}
        part = max(deltas, key=lambda k: abs(deltas[k])) if any(deltas.values()) else None
        st = row.stream
        what = (
            f"; the ledger component that differs most: {_name(part)} "
            f"({deltas[part] / GIB:+.2f} GiB)"
            if part
            else ""
        )
        out.append(
            Finding(
                FindingKind.IMBALANCE,
                f"Rank {st.rank} (GPU {st.gpu}) is out of balance: its allocated peak "
                f"{gib(row.alloc or 0)} is {diff / GIB:+.2f} GiB ({100 * diff / med:+.0f} %) "
                f"above {against} ({gib(med)}){what}.",
                {
                    "rank": st.rank,
                    "gpu": st.gpu,
                    "pid": st.pid,
                    "alloc_peak": row.alloc,
                    "median": med,
                    "diff": diff,
                    "component": part,
                    "component_diff": deltas[part] if part else 0,
                },
            )
        )
    return out
