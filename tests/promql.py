"""The project's Prometheus rules and the metric names a PromQL expression selects (rules and
dashboards are both checked against the metric table with it)."""

from __future__ import annotations

import re
from pathlib import Path

RULES_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "rules"


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers followed by ``{`` or ``[``, or standing
    alone, that are not PromQL functions, keywords or label names inside braces."""
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # drop matchers (label names and values)
    expr = re.sub(r"\$\w+", "", expr)  # Grafana variables ($__interval, $run)
    expr = re.sub(r"(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    functions = set(re.findall(r"([a-zA-Z_]+)\s*\(", expr))
    keywords = {
        "and",
        "or",
        "unless",
        "offset",
        "bool",
        "by",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "without",
        "m",
        "s",
        "h",
        "d",
        "w",
        "e",
    }
    return {w for w in words - functions - keywords if not re.fullmatch(r"\d+[smhdw]", w)}
