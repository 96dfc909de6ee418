"""A measured run that ran out of memory, or whose peak sat within the estimate's margin of its
card, offers the plans that make it fit: ``stepmem estimate --like RUN --gpu CARD --plan``, the
search (:mod:`collector.estimate.plans`) from the run's own model, optimizer and batch (its
workload summary), held against the card it ran on. The report prints the command; the search
traces a step a plan (minutes for a 7B), so it runs when asked, not with every report."""

from __future__ import annotations

import shlex
from typing import Any

from collector.model.units import gib, gib_figure

__all__ = ["MARGIN", "offer"]

MARGIN = 0.02  # the estimate's default margin: a peak this close to the card is at the edge


def offer(run: Any) -> list[str]:
    """The lines that offer plans for ``run`` (a :class:`collector.analysis.runs.Run`), none
    when it ran with room, is not a ``finetune`` run (``--like`` reads only those), or names no
    card."""
    summary = run.meta.get("workload_summary")
    if not isinstance(summary, dict) or summary.get("workload") != "finetune":
        return []
    for s in run.samplers:
        records = run.by_gpu.get(s.gpu_uuid) or []
        if not records or not s.total_bytes:
            continue
        ooms = max(r.ooms for r in records)
        peak = max((r.nvml_peak_bytes or 0) for r in records)
        if not (ooms or peak >= s.total_bytes * (1 - MARGIN)):
            continue
        why = (
            f"It ran out of memory ({ooms} time{'s' if ooms > 1 else ''} torch counted)"
            if ooms
            else f"Its peak ({gib(peak)}) sat within {MARGIN:.0%} of the card's "
            f"{gib(s.total_bytes)}"
        )
        card = _card(s.name, s.total_bytes)
        cmd = ["stepmem", "estimate", "--like", run.source, "--gpu", card, "--plan"]
        return [
            f"{why}. Plans that make it fit, each traced from this run's model, optimizer and "
            "batch, ranked (the same training first):",
            "  " + " ".join(shlex.quote(a) for a in cmd),
        ]
    return []


def _card(name: str, total: int) -> str:
    """``--gpu``'s value for the card the run sampled: its name where stepmem knows it, else
    its size."""
    from collector.estimate.gpus import card
    from collector.model.errors import EstimateError

    try:
        card(name)
        return name
    except EstimateError:
        return f"{gib_figure(total)}GiB"
