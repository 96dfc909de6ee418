"""Captures made in the tests: a small synthetic one with known steps, and hostile variants of
it (values a capture must never hold), written the way any editor of a Parquet file could."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from collector.replay import Capture

GIB = 1 << 30
MIB = 1 << 20
TOTAL = 80 * GIB


def stepped(
    steps: list[int],
    step_s: float = 0.25,
    grow: int = 256 * MIB,
    spike: int = 0,
    base: int = 10 * GIB,
    rate_hz: float = 1000.0,
) -> Capture:
    """A capture of ``len(steps)`` steps numbered as ``steps`` says (repeat numbers for
    epochs), each ``step_s`` long with 80 % of it inside the step: memory grows ``grow`` a step
    and holds an extra ``spike`` for the middle fifth of each step (a transient)."""
    period = int(1e9 / rate_hz)
    n = len(steps)
    span = int((n + 1) * step_s * 1e9)
    t = np.arange(0, span, period, dtype=np.int64)
    used = np.full(len(t), base, dtype=np.int64)
    events: list[dict[str, Any]] = []
    for k, step in enumerate(steps):
        b = int((k + 0.5) * step_s * 1e9)
        e = b + int(0.8 * step_s * 1e9)
        used[t >= b] += grow
        if spike:
            lo, hi = b + int(0.3 * step_s * 1e9), b + int(0.5 * step_s * 1e9)
            used[(t >= lo) & (t < hi)] += spike
        for kind, at in (("begin", b), ("end", e)):
            events.append({"kind": kind, "step": step, "t_ns": at, "gpu_uuid": "GPU-synthetic"})
    return Capture(
        t_ns=t,
        used=used,
        reserved=np.zeros(len(t), dtype=np.int64),
        device={"uuid": "GPU-synthetic", "index": 0, "name": "synthetic", "total_bytes": TOTAL},
        rate_hz=rate_hz,
        command="tests/caps.py stepped",
        events=events,
    )


def write_raw(path: Path, columns: dict[str, Any], meta: dict[str, Any] | bytes) -> Path:
    """A Parquet file with these columns and this stepmem metadata, checked by nothing."""
    raw = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    table = pa.table(columns).replace_schema_metadata({b"stepmem.capture": raw})
    pq.write_table(table, path)
    return path


def hostile(path: Path, case: str) -> Path:
    """A variant of a small good capture with one hostile thing in it (see ``CASES``)."""
    cap = stepped([1, 2, 3])
    t, used = cap.t_ns.tolist(), cap.used.tolist()
    cols: dict[str, Any] = {"t_ns": t, "used": used, "reserved": [0] * len(t)}
    meta: dict[str, Any] = {
        "format": 1,
        "device": dict(cap.device),
        "rate_hz": cap.rate_hz,
        "events": [dict(e) for e in cap.events],
    }
    ev = meta["events"][0]
    if case == "used negative":
        cols["used"][10] = -5 * GIB
    elif case == "used above the card":
        cols["used"][10] = 1 << 62
    elif case == "used NaN":
        cols["used"] = [float(u) for u in used]
        cols["used"][10] = float("nan")
    elif case == "used as text":
        cols["used"] = [str(u) for u in used]
    elif case == "time not from 0":
        cols["t_ns"] = [x - 1_000_000_000 for x in t]
    elif case == "total of 1 byte":
        meta["device"]["total_bytes"] = 1
    elif case == "total of 2^62 bytes":
        meta["device"]["total_bytes"] = 1 << 62
    elif case == "event at 10^18 ns":
        meta["events"][-1]["t_ns"] = 10**18
    elif case == "event at 2^70 ns":
        meta["events"][-1]["t_ns"] = 2**70
    elif case == "step 2^70":
        ev["step"] = 2**70
    elif case == "torch value as text":
        ev["torch"] = {"allocated_bytes.all.current": "lots"}
    elif case == "torch value infinite":
        ev["torch"] = {"allocated_bytes.all.current": float("inf")}
    elif case == "ledger beyond int64":
        meta["events"][1]["ledger"] = {"optimizer_state": 10**30}
    elif case == "memory_info_version as text":
        meta["device"]["memory_info_version"] = "abc"
    elif case == "phase with markup":
        ev["phase"] = "[red]opt[/red][/x]"
    elif case == "device name with escapes":
        meta["device"]["name"] = "\x1b]0;PWNED\x07\x1b[2JH200"
    elif case == "process list of junk":
        meta["processes"] = [{"t_ns": 0, "procs": [["x", "y"]]}]
    else:
        raise ValueError(case)
    raw = json.dumps(meta, allow_nan=True).encode()
    return write_raw(path, cols, raw)


CASES = {  # case: what the one line names
    "used negative": "outside 0..",
    "used above the card": "outside 0..",
    "used NaN": "not integers",
    "used as text": "not integers",
    "time not from 0": "start at 0",
    "total of 1 byte": "outside 0..1 bytes",
    "total of 2^62 bytes": "at most 2^53",
    "event at 10^18 ns": "far past the samples' end",
    "event at 2^70 ns": "t_ns",
    "step 2^70": "step",
    "torch value as text": "finite numbers",
    "torch value infinite": "finite numbers",
    "ledger beyond int64": "finite numbers that fit an int64",
    "memory_info_version as text": "memory_info_version",
    "process list of junk": "[pid, used bytes or null, name]",
}
