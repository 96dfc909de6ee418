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

from collector.errors import InputError

__all__ = ["baseline_rules", "peak_of"]

RECORD = "stepmem_baseline_step_nvml_peak_bytes"


def peak_of(doc: dict[str, Any]) -> int:
    """The largest within-step NVML peak over the steps of a records document (gapped steps,
    whose windows may have missed samples, are left out)."""
    peaks = [
        r["nvml_peak_bytes"]
        for r in doc.get("records", [])
        if not r.get("gap") and r.get("nvml_peak_bytes") is not None
    ]
    if not peaks:
        raise InputError("the records hold no complete step to take a baseline from")
    return max(peaks)


def workload_of(doc: dict[str, Any]) -> str:
    samplers = doc.get("samplers", [])
    if not isinstance(samplers, list) or not all(isinstance(s, dict) for s in samplers):
        raise InputError("the records' samplers are not a list of objects")
    names = {s.get("workload", "") for s in samplers} - {""}
    if len(names) != 1:
        raise InputError("cannot tell the workload from the records; pass --workload NAME")
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
    """The baselines in a rule file written by :func:`baseline_rules`. :class:`InputError` for
    a file that is not one (invalid YAML, or rules of another kind): it is never overwritten."""
    not_ours = f"{path} is not a stepmem baseline file"
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{not_ours} ({first}); it is left as it is") from None
    try:
        groups = doc["groups"]
        if [g["name"] for g in groups] != ["stepmem-baselines"]:
            raise ValueError
        out = {}
        for rule in groups[0]["rules"]:
            if rule["record"] != RECORD:
                raise ValueError
            out[str(rule["labels"]["workload"])] = int(
                rule["expr"].removeprefix("vector(").removesuffix(")")
            )
        return out
    except (KeyError, TypeError, ValueError, IndexError):
        raise InputError(
            f"{not_ours} (it holds other rules); choose another --out: it is left as it is"
        ) from None


def write_baseline(records: Path, out: Path, workload: str | None, merge: bool) -> tuple[str, int]:
    """Write ``out`` with ``records``' peak as the baseline of its workload. ``out`` may be new
    or a baseline file; with ``merge`` its other workloads are kept, without it a file holding
    other workloads is refused (nothing is dropped silently)."""
    from collector.report import check_meta, check_records

    try:
        doc = json.loads(records.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{records} is not a readable records file: {exc}") from None
    if not isinstance(doc, dict):
        raise InputError(f"{records} is not a stepmem records file")
    check_meta(doc, str(records))
    check_records(doc.get("records", []), str(records))
    name = workload or workload_of(doc)
    peak = peak_of(doc)
    baselines = read_rules(out) if out.exists() else {}
    others = sorted(set(baselines) - {name})
    if others and not merge:
        raise InputError(
            f"{out} holds the baselines of {', '.join(others)} too; --merge keeps them, or "
            "choose another --out"
        )
    baselines[name] = peak
    out.write_text(baseline_rules(baselines))
    return name, peak
