"""The rules, one a module, each ``rule(steps) -> list[Finding]``; :data:`RULES` in the order
their findings are reported (the consistency pass and the verdict come after them)."""

from __future__ import annotations

from collector.analysis.diagnosis.rules import (
    accounting,
    cache,
    failures,
    growth,
    headroom,
    jumps,
    outside,
    transients,
    unmeasured,
)

RULES = (
    unmeasured.rule,
    growth.rule,
    jumps.rule,
    cache.rule,
    transients.rule,
    outside.rule,
    accounting.rule,
    headroom.rule,
    failures.rule,
)
