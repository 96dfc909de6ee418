"""One command for the performance table: runs every benchmark this machine can run, side by
side, and writes their JSON results plus ``table.md`` (the README's "Performance" table) into
``--out``.

Parts (``--parts``, default all; a part whose needs are missing is skipped and says why):

=========  ==================================================================  ==============
part       what                                                                needs
=========  ==================================================================  ==============
rate       sampler at ``max`` in a Ray actor vs a bare pynvml loop; 1 kHz       GPU
floor      C loop over ``nvmlDeviceGetMemoryInfo`` (the floor); paced 1 kHz    GPU, gcc, nvml.h
smi        ``nvidia-smi --query-gpu=memory.used -lms 1`` for 5 s               GPU
peak       peak capture on ``spiky`` at 100 Hz/1 kHz/10 kHz/max, peers          GPU
cost       7B ``finetune`` step time off / 1 kHz / max, interleaved             GPU, bitsandbytes
scale      N replayed GPUs on the local Ray cluster, real Prometheus            prometheus
export     scrape cost, remote-write throughput into a real Prometheus          prometheus
=========  ==================================================================  ==============

    python benchmarks/run.py --out benchmarks/results/bench-NAME
    python benchmarks/run.py --out DIR --parts scale,export       # the CPU parts only
    python benchmarks/run.py --table DIR [DIR ...]                # re-render table.md from results

``--table`` merges result directories (e.g. the GPU parts from the H200 and the CPU parts from a
development machine) into one table, written to the first directory.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
PARTS = ("rate", "floor", "smi", "peak", "cost", "scale", "export")
GPU_PARTS = {"rate", "floor", "smi", "peak", "cost"}


@functools.cache
def have_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return n > 0
    except Exception:
        return False


def nvml_header() -> Path | None:
    for d in ("/usr/local/cuda/include", "/usr/include", "/usr/local/include"):
        if (Path(d) / "nvml.h").exists():
            return Path(d)
    return None


def run_cmd(cmd: list[str], out: Path, name: str, timeout: int) -> dict[str, Any]:
    """Run one benchmark: stdout to NAME.txt (and echoed), stderr to NAME.err."""
    t0 = time.monotonic()
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    with open(out / f"{name}.txt", "w") as so, open(out / f"{name}.err", "w") as se:
        try:
            p = subprocess.run(cmd, stdout=so, stderr=se, timeout=timeout, cwd=ROOT)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = (out / f"{name}.txt").read_text()
    print(text.rstrip(), flush=True)
    status = "ok" if rc == 0 else "failed"
    if status != "ok":
        tail = (out / f"{name}.err").read_text().strip().splitlines()[-3:]
        print(f"   {name} failed ({rc}): {' / '.join(tail)}", flush=True)
    return {"status": status, "rc": rc, "seconds": round(time.monotonic() - t0, 1)}


def part_smi(out: Path) -> dict[str, Any]:
    seconds = 5.0
    cmd = ["nvidia-smi", "--query-gpu=timestamp,memory.used", "--format=csv,noheader", "-lms", "1"]
    t0 = time.monotonic()
    with open(out / "smi.csv", "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.DEVNULL)
        time.sleep(seconds)
        p.terminate()
        p.wait(10)
    wall = time.monotonic() - t0
    lines = [x for x in (out / "smi.csv").read_text().splitlines() if x.strip()]
    stamps = {x.split(",")[0] for x in lines}
    res = {
        "seconds": round(wall, 3),
        "readings": len(lines),
        "rate_hz": len(lines) / wall,
        "distinct_timestamps": len(stamps),
    }
    (out / "smi.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "smi.csv").unlink()
    print(f"== smi: {res['rate_hz']:.0f} readings/s over {wall:.1f} s", flush=True)
    return {"status": "ok", "seconds": round(wall, 1)}


def part_floor(out: Path) -> dict[str, Any]:
    inc = nvml_header()
    if inc is None or shutil.which("gcc") is None:
        return {"status": "skipped", "reason": "needs gcc and nvml.h"}
    exe = Path(tempfile.mkdtemp(prefix="stepmem-floor-")) / "nvml_floor"
    src = ROOT / "benchmarks" / "nvml_floor.c"
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(src), f"-I{inc}", "-lnvidia-ml"], check=True)
    res: dict[str, Any] = {}
    for args in (["3"], ["10", "paced"]):
        p = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)
        for line in p.stdout.splitlines():
            res.update(json.loads(line))
    (out / "floor.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"== floor: {res}", flush=True)
    return {"status": "ok"}


def run_part(name: str, out: Path, a: argparse.Namespace) -> dict[str, Any]:
    if name in GPU_PARTS and not have_gpu():
        return {"status": "skipped", "reason": "no GPU"}
    if name in ("scale", "export") and shutil.which("prometheus") is None:
        return {"status": "skipped", "reason": "no prometheus binary"}
    if name == "smi":
        if shutil.which("nvidia-smi") is None:
            return {"status": "skipped", "reason": "no nvidia-smi"}
        return part_smi(out)
    if name == "floor":
        return part_floor(out)
    b = str(ROOT / "benchmarks")
    args = {
        "rate": ["sampler_rate.py"],
        "peak": ["peak_capture.py", "--steps", str(a.peak_steps)],
        "cost": ["training_cost.py", "--reps", str(a.cost_reps), "--block", str(a.cost_block)],
        "scale": ["scale.py", "--gpus", *map(str, a.scale_gpus), "--seconds", str(a.scale_seconds)],
        "export": ["export_cost.py"],
    }[name]
    cmd = [PY, f"{b}/{args[0]}", *args[1:], "--out", str(out / f"{name}.json")]
    return run_cmd(cmd, out, name, timeout=a.part_timeout)


# -- the table --------------------------------------------------------------------------------


def _load(dirs: list[Path], name: str) -> dict[str, Any] | None:
    for d in dirs:
        p = d / f"{name}.json"
        if p.exists():
            return json.loads(p.read_text())
    return None


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def table(dirs: list[Path]) -> str:
    rows: list[str] = []
    rate, floor, smi = _load(dirs, "rate"), _load(dirs, "floor"), _load(dirs, "smi")
    rows.append("| measure | stepmem | reference | ratio / target |")
    rows.append("| --- | --- | --- | --- |")
    if rate:
        import statistics

        actor = statistics.median(r["actor_max"]["rate_hz"] for r in rate["rounds"])
        bare = statistics.median(r["bare_pynvml_hz"] for r in rate["rounds"])
        c = f"; C loop {floor['c_loop_hz'] / 1e3:,.0f} kHz" if floor else ""
        s = f"; nvidia-smi -lms 1 {smi['rate_hz']:,.0f} Hz" if smi else ""
        rows.append(
            f"| max sampling rate (H200) | {actor / 1e3:,.0f} kHz in a Ray actor | "
            f"pynvml loop {bare / 1e3:,.0f} kHz{c}{s} | **{rate['median_ratio']:.2f}×** pynvml "
            "(target ≥ 0.9×) |"
        )
        k = rate["actor_1khz"]
        paced = f"; C paced {100 * floor['c_paced_1khz_cpu_frac']:.1f} %" if floor else ""
        rows.append(
            f"| 1 kHz: rate, p99 gap, CPU of the sampling thread | {k['rate_hz']:.1f} Hz, "
            f"{k['gap_ms_p99']:.2f} ms, {100 * k['thread_cpu_frac']:.1f} % | pynvml paced "
            f"{100 * rate['bare_pynvml_1khz']['thread_cpu_frac']:.1f} %{paced} | "
            f"{k['thread_cpu_frac'] / rate['bare_pynvml_1khz']['thread_cpu_frac']:.2f}× pynvml |"
        )
    peak = _load(dirs, "peak")
    if peak:
        r = peak["rates"]
        got = ", ".join(f"{k} {_pct(v['caught_99'])}" for k, v in r.items())
        peers = ", ".join(f"{k} {_pct(v)}" for k, v in peak["peers"].items())
        rows.append(
            f"| steps whose NVML peak reaches ≥ 99 % of the true peak ({peak['steps']} `spiky` "
            f"steps) | {got} | peers on the same trace: {peers} | 1 kHz: "
            f"**{_pct(r['1 kHz']['caught_99'])}** (target ≥ 99 %) |"
        )
    cost = _load(dirs, "cost")
    if cost:
        m = cost["median_s"]
        n = len(cost["step_times_s"]["off"])
        ci = cost.get("slowdown_1khz_ci95")
        ci_txt = f" (95 % interval {100 * ci[0]:+.2f}..{100 * ci[1]:+.2f} %)" if ci else ""
        rows.append(
            f"| 7B step time, median of {n} steps a mode | 1 kHz {m['1 kHz']:.4f} s, max "
            f"{m['max']:.4f} s | off {m['off']:.4f} s | 1 kHz "
            f"**{100 * cost['slowdown_1khz']:+.2f} %**{ci_txt}, max "
            f"{100 * cost['slowdown_max']:+.2f} % (target ≤ +0.5 %) |"
        )
    scale = _load(dirs, "scale")
    if scale:
        for row in scale["rows"]:
            rows.append(
                f"| {row['gpus']} replayed GPUs at 1 kHz ({scale['cpus']} cores) | CPU "
                f"{100 * row['cpu_per_sampler_frac_median']:.1f} % a sampler, "
                f"{row['series_per_gpu']} series/GPU | scrape {row['scrape_ms_median']:.1f} ms,"
                f" remote write {row['remote_write_samples_per_s']:,.0f} samples/s | |"
            )
    export = _load(dirs, "export")
    if export:
        s = {x["gpus"]: x for x in export["scrape"]}
        rw = max(export["remote_write"], key=lambda x: x["steps_per_s"])
        rows.append(
            f"| scrape of /metrics, 1 and 8 GPUs | {s[1]['median_ms']:.2f} / "
            f"{s[8]['median_ms']:.2f} ms | remote write into Prometheus: "
            f"{rw['steps_per_s']:,.0f} steps/s ({rw['samples_per_s']:,.0f} samples/s) | |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="result directory (created)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {PARTS}")
    ap.add_argument("--table", type=Path, nargs="+", help="only render table.md from these")
    ap.add_argument("--peak-steps", type=int, default=100)
    ap.add_argument("--cost-reps", type=int, default=6)
    ap.add_argument("--cost-block", type=int, default=4)
    ap.add_argument("--scale-gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--scale-seconds", type=float, default=10.0)
    ap.add_argument("--part-timeout", type=int, default=900)
    a = ap.parse_args(argv)
    if a.table:
        missing = [d for d in a.table if not d.is_dir()]
        if missing:
            ap.error(f"not a directory: {missing[0]}")
        (a.table[0] / "table.md").write_text(table(a.table))
        print(table(a.table), end="")
        return 0
    if a.out is None:
        ap.error("--out is required (or --table DIR)")
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part {unknown[0]!r} (one of {', '.join(PARTS)})")
    # Loopback only: a single-machine Ray cluster stays on 127.0.0.1.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    a.out.mkdir(parents=True, exist_ok=True)
    # Parts already in --out (e.g. the GPU parts from another machine) stay; this run's are added.
    old = a.out / "runner.json"
    status: dict[str, Any] = json.loads(old.read_text()) if old.exists() else {}
    command = ["python", "benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])]
    status["commands"] = [*status.get("commands", []), command]
    status.pop("command", None)
    for i, name in enumerate(parts, 1):
        print(f"[{i}/{len(parts)}] {name}", flush=True)
        status[name] = run_part(name, a.out, a)
        if status[name]["status"] == "skipped":
            print(f"   skipped: {status[name]['reason']}", flush=True)
        (a.out / "runner.json").write_text(json.dumps(status, indent=1) + "\n")
    text = table([a.out])
    (a.out / "table.md").write_text(text)
    print(text, end="")
    failed = [k for k in parts if status[k].get("status") == "failed"]
    if failed:
        print(f"failed parts: {', '.join(failed)} (see their .err files in {a.out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
