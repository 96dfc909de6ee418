"""Step records for tests, written as the JSON a records file holds and read as a file is:
checked and typed (:func:`collector.analysis.runs.check_records`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from collector.analysis.runs import check_records
from collector.model.step import StepRecord


def typed(records: list[dict[str, Any]], source: str = "records") -> list[StepRecord]:
    """``records`` (dicts) as the typed, checked records every reader takes."""
    return check_records(records, source)


GIB = 1 << 30


def step_record() -> StepRecord:
    """One step of the seed's 7B run as the sampler joins it (the golden exposition's)."""
    return StepRecord.from_dict(step_record_data())


def step_record_data() -> dict:
    """:func:`step_record` as the JSON a records file holds."""
    return {
        "gpu_uuid": "GPU-abc",
        "step": 7,
        "begin_ns": 1_000_000_000,
        "end_ns": 2_500_000_000,
        "samples": 1500,
        "nvml_peak_bytes": 82 * GIB,
        "nvml_peak_t_ns": 2_000_000_000,
        "nvml_min_bytes": 80 * GIB,
        "nvml_end_bytes": 81 * GIB,
        "nvml_reserved_bytes": 615 << 20,
        "gap": "",
        "torch_allocated_peak_bytes": 79 * GIB,
        "torch_reserved_peak_bytes": 80 * GIB,
        "torch_begin": {},
        "torch_end": {
            "allocated_bytes.all.current": 38 * GIB,
            "reserved_bytes.all.current": 80 * GIB,
            "context_baseline_bytes": 600 << 20,
            "num_alloc_retries": 2,
            "num_ooms": 0,
        },
        "phases": [],
        "ledger": {
            "parameters": 25 * GIB,
            "gradients": 0,
            "optimizer_state": 13 * GIB,
            "optimizer_state_managed": 0,
            "other_allocated": GIB,
        },
    }


ROOT = Path(__file__).resolve().parent.parent
H200 = ROOT / "benchmarks" / "results" / "h200-run2"
RECORDS = H200 / "adamw_8bit.records.json"  # the seed's 7B adamw_8bit run, from the H200


def seed_doc() -> dict:
    """The seed's 7B run as its records file holds it (``stepmem run --out``)."""
    return json.loads(RECORDS.read_text())


def unmeasured_run() -> tuple[list[dict], int]:
    """The H200 adamw_8bit records with steps 3-5 stripped of their NVML figures, as a sampler
    that read nothing inside them leaves them."""
    doc = json.loads(RECORDS.read_text())
    recs = copy.deepcopy(doc["records"])
    for r in recs:
        if r["step"] in (3, 4, 5):
            r.update(
                samples=0,
                gap="no_samples",
                nvml_peak_bytes=None,
                nvml_peak_t_ns=None,
                nvml_min_bytes=None,
                nvml_end_bytes=None,
                nvml_reserved_bytes=None,
            )
            for ph in r.get("phases") or []:
                ph["nvml_peak_bytes"] = None
    return recs, doc["samplers"][0]["total_bytes"]
