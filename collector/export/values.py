"""Step record → metric values, shared by the pull collector and remote write."""

from __future__ import annotations

from typing import Any

from collector.accounting import account
from collector.records import ESTIMATE_KEY, Stat, StepRecord

__all__ = ["step_values"]

_TORCH_END = {
    "stepmem_step_torch_allocated_end_bytes": Stat.ALLOCATED,
    "stepmem_step_torch_reserved_end_bytes": Stat.RESERVED,
}


_COMPONENT = {  # the accounting's names → the `component` label (a fixed set)
    "baseline": "baseline",
    "torch reserved": "torch_reserved",
    "outside torch, this process": "outside_torch",
    "other processes": "other_processes",
    "no process (managed/UVM)": "no_process",
    "outside torch (unsplit)": "outside_torch_unsplit",
    "remainder": "remainder",
}


def _account(rec: StepRecord) -> Any:
    """The step's account with the baseline the sampler has seen so far (the report uses the
    whole run's)."""
    return account(rec, rec.process_pid or None, rec.processes.get("baseline"))


def step_values(rec: StepRecord | dict[str, Any]) -> list[tuple[str, dict[str, str], float]]:
    """``(metric, extra labels, value)`` for every per-step series a step record has data for
    (a record, or its ``to_dict`` form as it crosses a Ray call); every one carries the step's
    ``rank``."""
    if isinstance(rec, dict):
        rec = StepRecord.from_dict(rec)
    rank = {"rank": str(rec.rank)}
    return [(name, {**rank, **extra}, value) for name, extra, value in _step_values(rec)]


def _step_values(rec: StepRecord) -> list[tuple[str, dict[str, str], float]]:
    out: list[tuple[str, dict[str, str], float]] = [
        ("stepmem_step", {}, rec.step),
        ("stepmem_step_duration_seconds", {}, (rec.end_ns - rec.begin_ns) / 1e9),
    ]
    for name, key in (  # a step without NVML samples has no NVML figures: no series, not 0
        ("stepmem_step_nvml_peak_bytes", "nvml_peak_bytes"),
        ("stepmem_step_nvml_end_bytes", "nvml_end_bytes"),
        ("stepmem_step_torch_allocated_peak_bytes", "torch_allocated_peak_bytes"),
        ("stepmem_step_torch_reserved_peak_bytes", "torch_reserved_peak_bytes"),
    ):
        v = getattr(rec, key)
        if v is not None:
            out.append((name, {}, v))
    for name, key in _TORCH_END.items():
        v = rec.end_stat(key)
        if v is not None:
            out.append((name, {}, v))
    nt = rec.nontorch_end
    if nt is not None:
        out.append(("stepmem_step_nontorch_bytes", {}, nt))
    acc = _account(rec)
    if acc is not None:
        for name, value in acc.components().items():
            out.append(("stepmem_step_account_bytes", {"component": _COMPONENT[name]}, value))
    for kind, value in rec.ledger.items():
        if kind == ESTIMATE_KEY:  # the prediction rides with the ledger; its own series
            out.append(("stepmem_step_estimate_peak_bytes", {}, value))
        else:
            out.append(("stepmem_step_ledger_bytes", {"kind": kind}, value))
    return out
