"""Will it fit: an estimate's step held against a GPU (:class:`Target`: a
:class:`~collector.estimate.gpus.Card`, a safety margin, and a per-process memory fraction as
``torch.cuda.set_per_process_memory_fraction`` sets one) — the bytes torch may reserve there (the
card's memory less what the driver keeps and what the process holds outside torch), whether the
step's reserved peak stays under them, and if not, whether the allocator gets by on freeing its
cache (retries) or where it first runs out (step, phase, module, the request and how many bytes
are missing).

Paged optimizer state (CUDA managed memory) counts in NVML while its pages sit on the GPU, but
the driver moves it to the host under pressure: it does not decide whether a step fits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from collector.estimate.alloc_log import Simulated
from collector.estimate.gpus import MEASURED, Card
from collector.model.errors import EstimateError
from collector.model.prediction import CardInfo, Estimate, Fit

__all__ = ["MAX_MARGIN", "Target", "check", "hold", "limit_of"]

MAX_MARGIN = 0.5  # a margin over half the card is a typo, not a margin


def limit_of(card: Card) -> int:
    """The bytes torch may reserve on ``card`` before the driver refuses it: its memory less
    what the driver keeps and what the process holds outside torch."""
    return max(0, card.capacity - card.driver_reserved - card.outside_torch)


def check(margin: float, fraction: float | None = None) -> None:
    """:class:`EstimateError` for a margin (a share, 0 to 0.5) or a memory fraction (above 0,
    at most 1) out of range."""
    if not (math.isfinite(margin) and 0 <= margin <= MAX_MARGIN):
        raise EstimateError(
            f"--margin {margin * 100:g}: a percentage from 0 to {MAX_MARGIN * 100:g}"
        )
    if fraction is not None and not (math.isfinite(fraction) and 0 < fraction <= 1):
        raise EstimateError(f"--memory-fraction {fraction:g}: a fraction above 0 and at most 1")


@dataclass(frozen=True)
class Target:
    """What a step is held against: ``card``; ``margin``, the share of torch's limit kept free
    (0 ≤ margin ≤ 0.5); ``fraction``, a per-process memory fraction (0 < fraction ≤ 1) as
    ``set_per_process_memory_fraction`` applies it: torch may reserve that share of the memory
    CUDA reports (the card less what the driver keeps)."""

    card: Card
    margin: float = 0.0
    fraction: float | None = None

    def __post_init__(self) -> None:
        check(self.margin, self.fraction)

    @property
    def limit(self) -> int:
        """What torch may reserve: the card's limit, or the fraction's when that is lower."""
        limit = limit_of(self.card)
        if self.fraction is not None:
            limit = min(
                limit, int(self.fraction * (self.card.capacity - self.card.driver_reserved))
            )
        return limit

    @property
    def usable(self) -> int:
        """The limit less the margin: what a step must stay under to be said to fit."""
        return int(self.limit * (1 - self.margin))


def hold(out: Estimate, target: Target | None, limited: Callable[[int, bool], Simulated]) -> None:
    """Fill ``out``'s outside-torch figure and, with a target, its fit (``limited(limit,
    fraction)`` plays the steps through the allocator model with that limit, ``fraction``: one
    set by ``set_per_process_memory_fraction``)."""
    if target is None:
        c = MEASURED[0]
        out.outside_torch = c.outside_torch
        out.outside_source = f"{c.gpu}'s, assumed ({c.source})"
        return
    card = target.card
    out.card = CardInfo(**card.to_dict())
    out.outside_torch = card.outside_torch
    out.outside_source = card.outside_source + (
        " — assumed, not this GPU's" if card.assumed else ""
    )
    need = out.reserved_peak or 0
    usable = target.usable
    fit = Fit(
        fits=need <= usable,
        limit=target.limit,
        usable=usable,
        margin=target.margin,
        fraction=target.fraction,
        need=need,
        headroom=usable - need,
    )
    if need > usable:  # the allocator frees its cache and tries again before it gives up
        sim = limited(usable, target.fraction is not None)
        fit = replace(fit, retries=sim.retries, fits=sim.oom is None)
        if sim.oom is not None:
            fit = replace(
                fit,
                phase=sim.oom_phase,
                module=sim.oom_module,
                request=sim.oom.size,
                short=need - usable,
            )
    out.fit = fit
