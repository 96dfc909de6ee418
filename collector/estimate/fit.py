"""Will it fit: an estimate's step held against a GPU (:class:`~collector.estimate.gpus.Card`) —
the bytes torch may reserve there (the card's memory less what the process holds outside
torch), whether the step's reserved peak stays under them, and if not, where the allocator
model first runs out (step, phase, module, the request and how many bytes are missing).

Paged optimizer state (CUDA managed memory) counts in NVML while its pages sit on the GPU, but
the driver moves it to the host under pressure: it does not decide whether a step fits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collector.estimate.gpus import MEASURED, Card
from collector.estimate.sequence import Simulated
from collector.model.prediction import Estimate

__all__ = ["hold", "limit_of"]


def limit_of(card: Card) -> int:
    """The bytes torch may reserve on ``card`` before the driver refuses it: its memory less
    what the driver keeps and what the process holds outside torch."""
    return max(0, card.capacity - card.driver_reserved - card.outside_torch)


def hold(out: Estimate, card: Card | None, limited: Callable[[int], Simulated]) -> None:
    """Fill ``out``'s outside-torch figure and, with a card, its fit (``limited(limit)`` plays
    the step through the allocator model with that limit)."""
    if card is None:
        c = MEASURED[0]
        out.outside_torch = c.outside_torch
        out.outside_source = f"{c.gpu}'s, assumed ({c.source})"
        return
    out.card = card.to_dict()
    out.outside_torch = card.outside_torch
    out.outside_source = card.outside_source + (
        " — assumed, not this GPU's" if card.assumed else ""
    )
    need = out.reserved_peak or 0
    limit = limit_of(card)
    fit: dict[str, Any] = {
        "fits": need <= limit,
        "limit": limit,
        "need": need,
        "headroom": limit - need,
        "retries": 0,
    }
    if need > limit:  # the allocator frees its cache and tries again before it gives up
        sim = limited(limit)
        fit["retries"] = sim.retries
        fit["fits"] = sim.oom is None
        if sim.oom is not None:
            fit.update(
                phase=sim.oom_phase,
                module=sim.oom_module,
                request=sim.oom.size,
                short=need - limit,
            )
    out.fit = fit
