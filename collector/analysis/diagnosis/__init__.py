"""Rules that explain a run's memory, in plain words with numbers.

``diagnose(records)`` reads one stream (a training process on one GPU: its
StepRecord objects in the order they ran) and returns findings, one rule a
module (:mod:`.rules`), folded by :mod:`.consistency` so that one phenomenon
gives one finding; :func:`verdict` puts the one to three lines that matter first. Kinds, their
severity and every threshold are declared in :mod:`.kinds`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from collector.analysis.diagnosis.consistency import contradictions, reconcile
from collector.analysis.diagnosis.kinds import (
    THRESHOLDS,
    Finding,
    FindingKind,
    Severity,
    Thresholds,
)
from collector.analysis.diagnosis.steps import Steps
from collector.analysis.diagnosis.text import steps_text
from collector.analysis.diagnosis.verdict import verdict
from collector.model.step import StepRecord

__all__ = [
    "THRESHOLDS",
    "Finding",
    "FindingKind",
    "Severity",
    "Thresholds",
    "contradictions",
    "diagnose",
    "steps_text",
    "verdict",
]


def diagnose(
    recs: Sequence[StepRecord],
    total_bytes: int | None = None,
    sites: dict[int, dict[str, Any]] | None = None,
    verbose: bool = False,
    time_scale: float = 1.0,
) -> list[Finding]:
    """Findings for one stream's records, rule by rule, reconciled. A step without NVML samples
    has None NVML figures (never 0 bytes): it is named and left out of every rule that reads
    NVML. ``sites``: the allocation history's summary by step, to cite; ``verbose``: name
    figures under the noise floor too; ``time_scale``: a replay's speed (its times inside a
    step are given as the recorded run's)."""
    from collector.analysis.diagnosis.rules import RULES

    typed = sorted(recs, key=lambda r: r.step)
    if not typed:
        return [Finding(FindingKind.EMPTY, "No complete step was recorded.")]
    s = Steps(typed, total_bytes, dict(sites or {}), verbose, THRESHOLDS, time_scale)
    return reconcile([f for rule in RULES for f in rule(s)])
