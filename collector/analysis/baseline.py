"""Per-workload baselines for the StepMemPeakRegression alert.

A baseline gets into Prometheus as a recording rule: a constant ``vector(<bytes>)`` recorded as
``stepmem_baseline_step_nvml_peak_bytes{workload="<name>"}``. ``stepmem baseline RECORDS.json``
writes that rule file from the step records of a run you accept (``stepmem run --out``); load it
with the other rule files. Several workloads can share one file (``--merge``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from collector.model.errors import InputError
from collector.model.files import atomic_write
from collector.model.step import StepRecord

__all__ = ["baseline_rules", "peak_of"]

RECORD = "stepmem_baseline_step_nvml_peak_bytes"


def peak_of(records: list[StepRecord]) -> int:
    """The largest within-step NVML peak over the steps of a run (gapped steps, whose windows
    may have missed samples, are left out)."""
    peaks = [r.nvml_peak_bytes for r in records if not r.gap and r.nvml_peak_bytes is not None]
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


HEADER = (
    "# Per-workload baselines for StepMemPeakRegression (recording rules).\n"
    "# Written by `stepmem baseline`; regenerate rather than edit.\n"
)
MAX_FILE_BYTES = 1 << 20  # a baseline file holds a few rules


def baseline_rules(baselines: dict[str, int], notes: str = "") -> str:
    """The rule file: the header, ``notes`` (comment lines kept from the file merged into),
    one recording rule per workload."""
    rules = [
        {"record": RECORD, "expr": f"vector({peak})", "labels": {"workload": name}}
        for name, peak in sorted(baselines.items())
    ]
    return (
        HEADER
        + notes
        + yaml.safe_dump(
            {"groups": [{"name": "stepmem-baselines", "rules": rules}]}, sort_keys=False
        )
    )


class _NoAliases(yaml.SafeLoader):
    """Safe YAML without anchors and aliases: a baseline file never needs them, and nested
    aliases expand exponentially (a "billion laughs" file would hang the command)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise yaml.YAMLError(
                "it uses YAML anchors or aliases (&name, *name), which a baseline file never holds"
            )
        return super().compose_node(parent, index)


def notes_of(text: str) -> str:
    """The comment lines at the top of a baseline file that are not stepmem's own header (a
    note saying where a baseline comes from): kept when the file is merged into."""
    lines = []
    for line in text.splitlines(keepends=True):
        if not line.startswith("#"):
            break
        if line not in HEADER.splitlines(keepends=True):
            lines.append(line)
    return "".join(lines)


def read_rules(path: Path) -> dict[str, int]:
    """The baselines in a rule file written by :func:`baseline_rules`. :class:`InputError` for
    a file that is not one (invalid YAML, aliases, rules of another kind, larger than any
    baseline file): it is never overwritten."""
    not_ours = f"{path} is not a stepmem baseline file"
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise InputError(
                f"{not_ours} (larger than {MAX_FILE_BYTES >> 20} MiB); it is left as it is"
            )
        doc = yaml.load(path.read_text(), Loader=_NoAliases)  # a SafeLoader, aliases refused
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
    from collector.analysis.runs import load_run

    run = load_run(records)  # a run directory or a records file, checked as report reads it
    doc: dict[str, Any] = dict(run.meta)
    recs = [r for s in run.streams for r in s.records]
    name = workload or workload_of(doc)
    peak = peak_of(recs)
    baselines = read_rules(out) if out.exists() else {}
    others = sorted(set(baselines) - {name})
    if others and not merge:
        raise InputError(
            f"{out} holds the baselines of {', '.join(others)} too; --merge keeps them, or "
            "choose another --out"
        )
    baselines[name] = peak
    notes = notes_of(out.read_text()) if out.exists() else ""
    try:  # whole or not at all: a full disk leaves the old file as it was
        atomic_write(out, baseline_rules(baselines, notes))
    except OSError as exc:
        raise InputError(
            f"{out} could not be written ({exc.strerror or exc}); it is left as it was"
        ) from None
    return name, peak
