#!/usr/bin/env bash
# The accounting issue on the H200. Part 1: captures with per-process snapshots at every step
# mark (process names) and the probe's allocation history for the first 3 steps: a paged
# optimizer recorded without watch(), 4 GiB allocated outside torch from step 3 to 6, a second
# process on the same GPU, the caching allocator switched off. Part 2: the cost of the allocation
# history on the 7B adamw_8bit run (step times with and without it, A B A B), its snapshot time.
# Results under $OUT.
#   device run (carry .bundle):  bash benchmarks/device/h200_accounting.sh
source benchmarks/device/bundle.sh
mkdir -p "$OUT/r" "$OUT/history" "$OUT/cost"
write_env "$OUT/env.txt"

cap() {  # cap NAME [ENV=VALUE ...] -- stepmem run arguments
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" STEPMEM_HISTORY_DIR="$OUT/history/$name" timeout 300 \
    python -m collector.cli capture --rate 1000 --out "$OUT/$name.capture.parquet" \
    --note "workload=$name" -- python -m collector.cli run --backend nvml --store "$OUT/runs" \
    --run-id "$name" --out "$OUT/r/$name.records.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/summary.txt"
  python -m collector.history "$OUT/history/$name" > "$OUT/history/$name.sites.json" 2>>"$OUT/$name.log"
}
cap paged_nowatch X=1 -- --workload finetune -- --size small --optim paged_adamw_8bit --no-watch --steps 5 --seq-len 1024
cap outside X=1 -- --workload patterns -- --pattern outside --steps 8 --extra-mib 4096
cap neighbour X=1 -- --workload patterns -- --pattern neighbour --steps 8 --extra-mib 2048
cap nocache PYTORCH_NO_CUDA_MEMORY_CACHING=1 -- --workload patterns -- --pattern leak --steps 8 --leak-mib 256
find "$OUT/history" -name "*.pickle" -size +20M -delete  # keep what can come back

[ "${PART:-all}" = 1 ] && set -- skip
# Part 2: 7B adamw_8bit, 6 steps, the probe with and without the allocation history (3 steps)
for i in 1 2; do
  [ "${1:-}" = skip ] && break
  for mode in off history; do
    d="$OUT/cost/$mode-$i"; mkdir -p "$d"
    if [ $mode = history ]; then export STEPMEM_HISTORY_DIR="$d/history"; else unset STEPMEM_HISTORY_DIR; fi
    timeout 200 python - "$d" <<'PY' > "$d/log.txt" 2>&1
import json, sys, time
from pathlib import Path
from collector.probe.core import StepProbe
from workloads import finetune
out = Path(sys.argv[1])
args = finetune.defaults(finetune.parser().parse_args(["--size", "7b", "--optim", "adamw_8bit", "--steps", "6"]))
probe = StepProbe()
summary = finetune.run(args, probe)
probe.close()
h = probe.history
res = {"step_times_s": summary["step_times_s"], "probe_cost_ns": probe.cost_ns,
       "history": None if h is None else {"saved": h.saved, "errors": dict(h.errors), "cost_ns": h.cost_ns}}
(out / "result.json").write_text(json.dumps(res))
print(json.dumps(res))
PY
    echo "cost $mode-$i rc=$?" | tee -a "$OUT/summary.txt"
    if [ -d "$d/history" ]; then
      ls -la "$d/history" >> "$d/log.txt"
      timeout 120 python -m collector.history "$d/history" > "$d/sites.json" 2>>"$d/log.txt"
      rm -f "$d"/history/*.pickle
    fi
  done
done
unset STEPMEM_HISTORY_DIR

# what comes back (8 files at most): the captures, the summary, everything else in one archive
cd "$OUT" && tar czf /tmp/results.tgz --exclude='*.capture.parquet' . ; mv /tmp/results.tgz "$OUT/"
find "$OUT" -mindepth 1 -maxdepth 1 ! -name '*.capture.parquet' ! -name results.tgz ! -name summary.txt -exec rm -rf {} +
