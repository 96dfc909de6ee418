"""A step in which the allocator counted an out-of-memory error or that failed with one (its
NVML peak, the step before's, what torch held); a step that failed otherwise; a run stopped
(SIGTERM, Ctrl-C, ``ray job stop``)."""

from __future__ import annotations

from collector.analysis.diagnosis.kinds import Finding, FindingKind
from collector.analysis.diagnosis.steps import Steps
from collector.model.units import gib


def rule(s: Steps) -> list[Finding]:
    out: list[Finding] = []
    prev_ooms, prev = 0, None
    for r in s.all_steps:
        if r.ooms > prev_ooms or r.out_of_memory:
            text = f"Step {r.step} hit a CUDA out-of-memory error" + (
                " and failed" if r.failed else ""
            )
            if r.nvml_peak_bytes is None:
                text += "; NVML has no sample inside it"
            else:
                text += f"; NVML peaked at {gib(r.nvml_peak_bytes)} inside it"
                if s.total_bytes:
                    text += f" of the card's {gib(s.total_bytes)}"
            nums = {"step": r.step, "peak": r.nvml_peak_bytes, "failed": r.failed}
            if prev is not None and prev.nvml_peak_bytes is not None:
                text += f"; step {prev.step} before it peaked at {gib(prev.nvml_peak_bytes)}"
                if prev.nvml_end is not None:
                    text += f" and ended at {gib(prev.nvml_end)}"
                nums["previous_peak"] = prev.nvml_peak_bytes
            if r.allocated_end is not None:
                text += (
                    f"; torch held {gib(r.allocated_end)} allocated (within-step peak "
                    f"{gib(r.torch_allocated_peak_bytes or 0)}) when it failed"
                )
                nums["allocated_at_failure"] = r.allocated_end
            out.append(Finding(FindingKind.OOM, text + ".", nums, steps=(r.step, r.step)))
        elif r.interrupted:
            out.append(
                Finding(
                    FindingKind.INTERRUPTED,
                    f"The run was stopped during step {r.step} (SIGTERM, Ctrl-C or `ray job "
                    "stop`); the steps before it are complete.",
                    {"step": r.step},
                    steps=(r.step, r.step),
                )
            )
        elif r.failed:
            out.append(
                Finding(
                    FindingKind.FAILED,
                    f"Step {r.step} failed with {r.error}; "
                    + (
                        "NVML has no sample inside it."
                        if r.nvml_peak_bytes is None
                        else f"its NVML peak was {gib(r.nvml_peak_bytes)}."
                    ),
                    {"step": r.step, "error": r.error, "peak": r.nvml_peak_bytes},
                    steps=(r.step, r.step),
                )
            )
        prev_ooms, prev = r.ooms, r
    return out
