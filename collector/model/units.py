"""Units, named once, and the one way a byte figure is written.

Every figure stepmem keeps is in bytes; these are the binary multiples its text uses (nvitop's
``utils.py`` is the pattern: the units and their formatter in one place every module imports).
"""

from __future__ import annotations

__all__ = ["GIB", "KIB", "MIB", "gib", "gib_figure", "have", "size"]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


def gib_figure(n: float) -> str:
    """``n`` bytes in GiB, two decimals, no unit (a table cell): ``"1.50"``."""
    return f"{n / GIB:.2f}"


def gib(n: float) -> str:
    """``n`` bytes in GiB with the unit: ``"1.50 GiB"``."""
    return f"{gib_figure(n)} GiB"


def size(n: float) -> str:
    """GiB from 1 GiB up, whole MiB below: ``"1.50 GiB"``, ``"300 MiB"``."""
    return gib(n) if abs(n) >= GIB else f"{n / MIB:.0f} MiB"


def have(n: int) -> str:
    """The verb a count of things takes: ``f"{n} of 5 steps {have(n)}"`` ("1 of 5 steps has")."""
    return "has" if n == 1 else "have"
