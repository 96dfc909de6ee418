"""A big run end to end: does the job's driver stay flat while steps pile up, and how long do
``report`` and ``compare`` take on the store it leaves?

A synthetic capture of ``--steps`` steps of ``--step-ms`` each (10 GiB, a 2 GiB spike for 3 ms
mid-step: the adversarial trial's ``caps_long``) replayed on ``--gpus`` simulated GPUs by a real
``stepmem run`` (local Ray cluster on loopback, run store). Every 2 s the resident memory of the
driver (the ``stepmem run`` process), of Ray's GCS and of the samplers is read from /proc. The
driver should not grow with the records it has drained: the store holds them, the driver keeps a
cursor. Then ``stepmem report`` and ``stepmem compare`` run on that store and, side by side in
this same run, on a store of a tenth of its steps: their wall time and peak RSS, and the ratios.

    python benchmarks/big_run.py --out benchmarks/results/local-big-run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collector.replay import Capture  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20


def long_capture(steps: int, step_ms: float) -> Capture:
    """``steps`` steps back to back, ``step_ms`` each with 10 % of it between steps, 10 GiB used
    and a 2 GiB spike for 3 ms in the middle of every step, sampled at 1 kHz."""
    period = 1_000_000
    step_ns = int(step_ms * 1e6)
    t = np.arange(0, (steps + 2) * step_ns, period, dtype=np.int64)
    used = np.full(len(t), 10 * GIB, dtype=np.int64)
    events = []
    for k in range(steps):
        b = (k + 1) * step_ns
        e = b + int(0.9 * step_ns)
        mid = b + step_ns // 2
        used[(t >= mid) & (t < mid + 3_000_000)] += 2 * GIB
        events += [
            {"kind": "begin", "step": k + 1, "t_ns": b, "gpu_uuid": "GPU-long"},
            {"kind": "end", "step": k + 1, "t_ns": e, "gpu_uuid": "GPU-long"},
        ]
    return Capture(
        t_ns=t,
        used=used,
        reserved=np.zeros(len(t), dtype=np.int64),
        device={"uuid": "GPU-long", "index": 0, "name": "synthetic", "total_bytes": 80 * GIB},
        rate_hz=1000.0,
        command=f"benchmarks/big_run.py long_capture({steps}, {step_ms})",
        events=events,
    )


def rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def named_pids(*names: str) -> dict[str, list[int]]:
    """Processes whose command line holds one of ``names`` (this user's: /proc is enough)."""
    out: dict[str, list[int]] = {n: [] for n in names}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        for n in names:
            if n in cmd:
                out[n].append(int(d))
    return out


def timed(cmd: list[str]) -> dict[str, Any]:
    """Run ``cmd``; its wall time and the peak RSS of it and its children (wait4's rusage)."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, ru = os.wait4(p.pid, 0)
        log.seek(0)
        out = log.read()
    return {
        "cmd": " ".join(cmd[2:]),
        "rc": os.waitstatus_to_exitcode(status),
        "wall_s": round(time.monotonic() - t0, 2),
        "max_rss_mib": round(ru.ru_maxrss / 1024, 1),
        "lines": len(out.splitlines()),
    }


def run_store(stepmem: list[str], cap: Path, store: Path, run_id: str, gpus: int, watch: bool):
    cmd = [*stepmem, "run", "--capture", str(cap), "--gpus", str(gpus), "--store", str(store),
           "--run-id", run_id]  # fmt: skip
    series: list[dict[str, Any]] = []
    t0 = time.monotonic()
    log = open(store.parent / f"{run_id}.log", "w+b")  # noqa: SIM115 (read back below)
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    if watch:
        while p.poll() is None:
            time.sleep(2.0)
            procs = named_pids("gcs_server", "SamplerActor")
            row = {
                "t_s": round(time.monotonic() - t0, 1),
                "driver_mib": round((rss(p.pid) or 0) / MIB, 1),
                "gcs_mib": round(sum(rss(x) or 0 for x in procs["gcs_server"]) / MIB, 1),
                "samplers_mib": sorted(
                    round((rss(x) or 0) / MIB, 1) for x in procs["SamplerActor"]
                ),
                "store_records": _records(store / run_id),
            }
            series.append(row)
            print(f"  {row['t_s']:6.1f} s  driver {row['driver_mib']:7.1f} MiB  gcs "
                  f"{row['gcs_mib']:6.1f} MiB  records in store {row['store_records']}",
                  flush=True)  # fmt: skip
    rc = p.wait()
    log.seek(0)
    out = log.read().decode(errors="replace")
    log.close()
    if rc not in (0, 3):
        raise SystemExit(f"stepmem run exited {rc}:\n{out[-3000:]}")
    return rc, round(time.monotonic() - t0, 1), series


def _records(folder: Path) -> int:
    import pyarrow.parquet as pq

    n = 0
    for f in sorted((folder / "steps").glob("*.parquet")):
        with contextlib.suppress(Exception):  # a part being written
            n += pq.read_metadata(f).num_rows
    return n


def _c(cmd: str, name: str) -> str:
    """``report --all-steps`` + ``big`` → ``report big --all-steps``."""
    head, _, tail = cmd.partition(" ")
    return f"{head} {name}" + (f" {tail}" if tail else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    stepmem = [sys.executable, "-m", "collector.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_p = Path(tmp)
        big, small = tmp_p / "long.capture.parquet", tmp_p / "short.capture.parquet"
        long_capture(a.steps, a.step_ms).save(big)
        long_capture(a.steps // 10, a.step_ms).save(small)
        store = tmp_p / "runs"
        print(f"run: {a.gpus} GPUs x {a.steps} steps", flush=True)
        rc, wall, series = run_store(stepmem, big, store, "big", a.gpus, True)
        print(f"run: {a.gpus} GPUs x {a.steps // 10} steps", flush=True)
        rc_small, wall_small, _ = run_store(stepmem, small, store, "small", a.gpus, False)
        records = {"big": _records(store / "big"), "small": _records(store / "small")}
        cmds = {}
        for name in ("small", "big"):  # side by side, in this one run
            cmds[f"report {name}"] = timed([*stepmem, "report", str(store / name)])
            cmds[f"report {name} --all-steps"] = timed(
                [*stepmem, "report", "--all-steps", str(store / name)]
            )
            cmds[f"compare {name}"] = timed(
                [*stepmem, "compare", str(store / name), str(store / name)]
            )
            print(f"  report {name}: {cmds[f'report {name}']}", flush=True)
            print(f"  compare {name}: {cmds[f'compare {name}']}", flush=True)
    alive = [r for r in series if r["driver_mib"] > 0]
    quarter = next(r for r in alive if r["store_records"] >= records["big"] / 4)
    # the drain's end: the last reading before the store held every record (after it the job
    # reads the store back and renders its report, which is the report's memory, not the drain's)
    drained = [r for r in alive if r["store_records"] < records["big"]] or alive
    end = drained[-1]
    drv_growth = end["driver_mib"] - quarter["driver_mib"]
    recs_between = end["store_records"] - quarter["store_records"]
    result = {
        "gpus": a.gpus,
        "steps": a.steps,
        "step_ms": a.step_ms,
        "run": {"rc": rc, "wall_s": wall, "records": records["big"]},
        "run_small": {"rc": rc_small, "wall_s": wall_small, "records": records["small"]},
        "driver_mib_at_quarter": quarter["driver_mib"],
        "driver_mib_at_drain_end": end["driver_mib"],
        "driver_mib_max": max(r["driver_mib"] for r in alive),
        "driver_growth_mib": round(drv_growth, 1),
        "records_between": recs_between,
        "driver_bytes_per_record": round(drv_growth * MIB / max(recs_between, 1), 1),
        "gcs_mib_at_quarter": quarter["gcs_mib"],
        "gcs_mib_at_drain_end": end["gcs_mib"],
        "commands": cmds,
        "ratios_big_over_small": {
            k: round(cmds[_c(k, "big")]["wall_s"] / max(cmds[_c(k, "small")]["wall_s"], 1e-9), 2)
            for k in ("report", "report --all-steps", "compare")
        },
        "series": series,
        "python": sys.version.split()[0],
        "self_max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "big_run.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "series"}, indent=1))


if __name__ == "__main__":
    main()
