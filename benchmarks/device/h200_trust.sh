#!/usr/bin/env bash
# The trust issue's live-GPU half on the H200: the GPU-marked tests; a live spiky run to the end
# (report command printed, no Ray process left); the same run SIGKILLed mid-way and interrupted
# by three Ctrl-C (the reaper and the one-stop handler with the real NVML backend). Results
# under $OUT.
#   device run (carry .bundle):  bash benchmarks/device/h200_trust.sh
source benchmarks/device/bundle.sh
write_env "$OUT/env.txt"
python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
# Ray's default for a local cluster: token authentication on (no RAY_AUTH_MODE set)
timeout 240 python -m collector.cli run --backend nvml --workload spiky --store "$OUT/runs" \
  --run-id spiky-complete --out "$OUT/spiky.records.json" -- --steps 40 > "$OUT/spiky-complete.log" 2>&1
echo "complete: rc=$?" | tee "$OUT/summary.txt"
python - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import os, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, os.getcwd())
from collector.reaper import marked

out = Path(sys.argv[1])
def any_marked():
    n = 0
    for p in Path("/proc").glob("[0-9]*/environ"):
        try:
            n += b"STEPMEM_RAY_OWNER=" in p.read_bytes()
        except OSError:  # not ours to read, or gone
            pass
    return n

print("after the complete run, processes still marked by any stepmem run:", any_marked())

def start(run_id):
    p = subprocess.Popen(
        [sys.executable, "-m", "collector.cli", "run", "--backend", "nvml", "--workload", "spiky",
         "--store", str(out / "runs"), "--run-id", run_id, "--", "--steps", "2000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("run store:"):
            break
    time.sleep(8)  # well inside the workload
    token = None
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == p.pid:
                env = (stat.parent / "environ").read_bytes().split(b"\0")
                token = next((v.split(b"=", 1)[1].decode() for v in env
                              if v.startswith(b"STEPMEM_RAY_OWNER=")), token)
        except OSError:
            pass
    return p, token, lines

def gone_after(token, limit=60):
    t0 = time.monotonic()
    while marked(token) and time.monotonic() - t0 < limit:
        time.sleep(0.2)
    return time.monotonic() - t0, len(marked(token))

p, token, lines = start("spiky-sigkill")
n = len(marked(token))
os.kill(p.pid, signal.SIGKILL)
p.wait()
s, left = gone_after(token)
(out / "spiky-sigkill.log").write_text("".join(lines))
print(f"SIGKILL: {n} Ray processes marked before; {left} left {s:.1f} s after the kill")

p, token, lines = start("spiky-3xint")
for _ in range(3):
    os.killpg(p.pid, signal.SIGINT)
    time.sleep(0.3)
rest, _ = p.communicate(timeout=180)
s, left = gone_after(token)
(out / "spiky-3xint.log").write_text("".join(lines) + rest)
print(f"3x Ctrl-C: exit {p.returncode}; traceback in output: {'Traceback' in rest}; "
      f"'already stopping' lines: {rest.count('already stopping')}; {left} Ray processes left "
      f"{s:.1f} s after exit")
PY
for r in spiky-sigkill spiky-3xint; do
  python -m collector.cli report "$OUT/runs/$r" > "$OUT/$r.report.txt" 2>&1
  echo "$r report: rc=$? $(grep -m1 -o 'Run [A-Z][A-Z]*' "$OUT/$r.report.txt")" | tee -a "$OUT/summary.txt"
done
