"""Step record → metric values, shared by the pull collector and remote write."""

from __future__ import annotations

from typing import Any

from collector.accounting import account, nontorch_bytes

__all__ = ["step_values"]

_TORCH_END = {
    "stepmem_step_torch_allocated_end_bytes": "allocated_bytes.all.current",
    "stepmem_step_torch_reserved_end_bytes": "reserved_bytes.all.current",
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


def _account(rec: dict[str, Any]) -> Any:
    """The step's account with the baseline the sampler has seen so far (the report uses the
    whole run's)."""
    pid = rec.get("pid") or (rec.get("torch_begin") or {}).get("process_pid")
    return account(rec, pid, (rec.get("processes") or {}).get("baseline"))


def step_values(rec: dict[str, Any]) -> list[tuple[str, dict[str, str], float]]:
    """``(metric, extra labels, value)`` for every per-step series a step record has data for;
    every one carries the step's ``rank``."""
    rank = {"rank": str(rec.get("rank") or 0)}
    return [(name, {**rank, **extra}, value) for name, extra, value in _step_values(rec)]


def _step_values(rec: dict[str, Any]) -> list[tuple[str, dict[str, str], float]]:
    out: list[tuple[str, dict[str, str], float]] = [
        ("stepmem_step", {}, rec["step"]),
        ("stepmem_step_duration_seconds", {}, (rec["end_ns"] - rec["begin_ns"]) / 1e9),
    ]
    for name, key in (  # a step without NVML samples has no NVML figures: no series, not 0
        ("stepmem_step_nvml_peak_bytes", "nvml_peak_bytes"),
        ("stepmem_step_nvml_end_bytes", "nvml_end_bytes"),
        ("stepmem_step_torch_allocated_peak_bytes", "torch_allocated_peak_bytes"),
        ("stepmem_step_torch_reserved_peak_bytes", "torch_reserved_peak_bytes"),
    ):
        if rec.get(key) is not None:
            out.append((name, {}, rec[key]))
    te = rec.get("torch_end") or {}
    for name, key in _TORCH_END.items():
        if key in te:
            out.append((name, {}, te[key]))
    nt = nontorch_bytes(rec)
    if nt is not None:
        out.append(("stepmem_step_nontorch_bytes", {}, nt))
    acc = _account(rec)
    if acc is not None:
        for name, value in acc.components().items():
            out.append(("stepmem_step_account_bytes", {"component": _COMPONENT[name]}, value))
    for kind, value in (rec.get("ledger") or {}).items():
        out.append(("stepmem_step_ledger_bytes", {"kind": kind}, value))
    return out
