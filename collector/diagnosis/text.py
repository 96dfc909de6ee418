"""How figures are written in findings."""

from __future__ import annotations

from collector.diagnosis.kinds import GIB, MIB

__all__ = ["g", "size", "steps_text"]


def g(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def size(n: float) -> str:
    """GiB from 1 GiB up, MiB below."""
    return g(n) if abs(n) >= GIB else f"{n / MIB:.0f} MiB"


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
