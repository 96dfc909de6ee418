"""How step lists are written in findings (figures: :mod:`collector.model.units`)."""

from __future__ import annotations

__all__ = ["steps_text"]


def steps_text(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1–3, 7``."""
    if not steps:
        return ""
    parts, run = [], [steps[0]]
    for s in steps[1:]:
        if s == run[-1] + 1:
            run.append(s)
            continue
        parts.append(f"{run[0]}–{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [s]
    parts.append(f"{run[0]}–{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(parts)
