"""Check the ``stepmem/*`` keys a Trainer reported to TensorBoard against the step records the
sampler joined in the same run (the GPU half of the tracker check: the torch keys need CUDA).

    python benchmarks/tracker_keys.py TB_DIR RECORDS.json [--out FILE.json]

For every training step logged to TensorBoard it compares, in GiB:

* ``stepmem/torch_reserved_gib`` and ``stepmem/torch_allocated_gib`` with the step record's torch
  figures at that step's end mark;
* ``stepmem/torch_reserved_peak_gib`` / ``torch_allocated_peak_gib`` (the allocator's peaks
  since the previous log; one log a step) with the record's peaks of that step;
* ``stepmem/nvml_peak_gib`` with the NVML peak of the step named by ``stepmem/nvml_step``.

Prints one JSON document: per key, the steps compared and the largest difference; exit 1 when a
key is missing or differs by more than 1 MiB.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GIB = 1 << 30
TOLERANCE_GIB = 1 / 1024  # 1 MiB: TensorBoard stores float32 values


def _scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for run in sorted({p.parent for p in tb_dir.rglob("events.out.tfevents.*")}):
        ea = EventAccumulator(str(run), size_guidance={"scalars": 0})
        ea.Reload()
        for tag in ea.Tags()["scalars"]:
            if "stepmem/" in tag:
                key = tag[tag.index("stepmem/") :]
                out.setdefault(key, {}).update({e.step: e.value for e in ea.Scalars(tag)})
    return out


def compare(tb: dict[str, dict[int, float]], records: list[dict]) -> dict:
    by_step = {r["step"]: r for r in records}

    def torch_end(key: str):
        return lambda r: (r.get("torch_end") or {}).get(key)

    expected = {
        "stepmem/torch_reserved_gib": torch_end("reserved_bytes.all.current"),
        "stepmem/torch_allocated_gib": torch_end("allocated_bytes.all.current"),
        "stepmem/torch_reserved_peak_gib": lambda r: r.get("torch_reserved_peak_bytes"),
        "stepmem/torch_allocated_peak_gib": lambda r: r.get("torch_allocated_peak_bytes"),
    }
    result: dict = {"keys": sorted(tb), "checks": {}, "ok": True}
    for key, of in expected.items():
        pairs = [
            (s, v, of(by_step[s]) / GIB)
            for s, v in sorted(tb.get(key, {}).items())
            if s in by_step and of(by_step[s]) is not None
        ]
        worst = max((abs(v - want) for _, v, want in pairs), default=None)
        ok = bool(pairs) and worst is not None and worst <= TOLERANCE_GIB
        result["checks"][key] = {
            "steps_compared": [s for s, _, _ in pairs],
            "max_diff_gib": worst,
            "first": [{"step": s, "logged": v, "record": want} for s, v, want in pairs[:3]],
            "ok": ok,
        }
        result["ok"] &= ok
    # the NVML keys name the step they belong to: compare with that step's record
    nvml, named = tb.get("stepmem/nvml_peak_gib", {}), tb.get("stepmem/nvml_step", {})
    pairs = [
        (s, int(named[s]), v, by_step[int(named[s])]["nvml_peak_bytes"] / GIB)
        for s, v in sorted(nvml.items())
        if s in named and int(named[s]) in by_step
    ]
    worst = max((abs(v - want) for *_, v, want in pairs), default=None)
    ok = bool(pairs) and worst is not None and worst <= TOLERANCE_GIB
    result["checks"]["stepmem/nvml_peak_gib"] = {
        "logged_at_step_for_step": [[s, n] for s, n, _, _ in pairs],
        "max_diff_gib": worst,
        "ok": ok,
    }
    result["ok"] &= ok
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tb_dir", type=Path)
    ap.add_argument("records", type=Path, help="stepmem run --out JSON (its 'records')")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    doc = json.loads(a.records.read_text())
    records = doc["records"] if isinstance(doc, dict) else doc
    result = compare(_scalars(a.tb_dir), records)
    text = json.dumps(result, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
