"""Per-workload baselines for the StepMemPeakRegression alert.

A baseline gets into Prometheus as a recording rule: a constant ``vector(<bytes>)`` recorded as
``stepmem_baseline_step_nvml_peak_bytes{workload="<name>"}``. ``stepmem baseline RECORDS.json``
writes that rule file from the step records of a run you accept (``stepmem run --out``); load it
with the other rule files. Several workloads can share one file (``--merge``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

__all__ = ["baseline_rules", "peak_of"]

RECORD = "stepmem_baseline_step_nvml_peak_bytes"


def peak_of(doc: dict[str, Any]) -> int:
    """The largest within-step NVML peak over the steps of a records document (gapped steps,
    whose windows may have missed samples, are left out)."""
    peaks = [r["nvml_peak_bytes"] for r in doc.get("records", []) if not r.get("gap")]
    if not peaks:
        raise ValueError("the records hold no complete step to take a baseline from")
    return max(peaks)


def workload_of(doc: dict[str, Any]) -> str:
    names = {s.get("workload", "") for s in doc.get("samplers", [])} - {""}
    if len(names) != 1:
        raise ValueError("cannot tell the workload from the records; pass --workload NAME")
    return names.pop()


def baseline_rules(baselines: dict[str, int]) -> str:
    rules = [
        {"record": RECORD, "expr": f"vector({peak})", "labels": {"workload": name}}
        for name, peak in sorted(baselines.items())
    ]
    header = (
        "# Per-workload baselines for StepMemPeakRegression (recording rules).\n"
        "# Written by `stepmem baseline`; regenerate rather than edit.\n"
    )
    return header + yaml.safe_dump(
        {"groups": [{"name": "stepmem-baselines", "rules": rules}]}, sort_keys=False
    )


def read_rules(path: Path) -> dict[str, int]:
    """The baselines already in a rule file written by :func:`baseline_rules`."""
    doc = yaml.safe_load(path.read_text()) or {}
    out = {}
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            if rule.get("record") == RECORD:
                out[rule["labels"]["workload"]] = int(rule["expr"].removeprefix("vector(")[:-1])
    return out


def write_baseline(records: Path, out: Path, workload: str | None, merge: bool) -> tuple[str, int]:
    try:
        doc = json.loads(records.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{records} is not a readable records file: {exc}") from None
    name = workload or workload_of(doc)
    peak = peak_of(doc)
    baselines = read_rules(out) if merge and out.exists() else {}
    baselines[name] = peak
    out.write_text(baseline_rules(baselines))
    return name, peak
