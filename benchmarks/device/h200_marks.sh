#!/usr/bin/env bash
# Live H200 check of the step-mark readings: the end reading (lower of the last sample before
# the end mark and the first within 2 ms after), NVML at begin/phase marks, changes located
# between marks, per-process readings joined live (NVML read at join time), the within-step peak
# split, and the allocation history of the step after a jump of torch reserved.
#   1. outside: 4 GiB cuMemAlloc in the training process from step 3 until step 6 begins
#   1b. neighbour: a second process holding 2 GiB from step 3 until step 6
#   2. leak: 512 MiB of live tensors kept every step (torch reserved jumps each step), with the
#      allocation history (first 3 steps + the steps after jumps)
#   3. small Llama fine-tune, paged_adamw_8bit, watched (phases forward_backward / optimizer)
# Results under $OUT (one results.tgz + summary.txt).
#   device run (carry .bundle):  bash benchmarks/device/h200_marks.sh
source benchmarks/device/bundle.sh
mkdir -p "$OUT/r" "$OUT/history"
write_env "$OUT/env.txt"

run() {  # run NAME -- stepmem run arguments (live NVML, the run store under $OUT/runs)
  local name=$1; shift; shift
  STEPMEM_HISTORY_DIR="$OUT/history/$name" timeout 240 python -m collector.cli run --backend nvml \
    --store "$OUT/runs" --run-id "$name" --out "$OUT/r/$name.records.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/summary.txt"
  timeout 120 python -m collector.cli report "$OUT/runs/$name" > "$OUT/$name.report.txt" 2>&1
  ls -la "$OUT/history/$name" >> "$OUT/$name.log" 2>&1
}
run outside -- --workload patterns -- --pattern outside --steps 8 --extra-mib 4096
run neighbour -- --workload patterns -- --pattern neighbour --steps 8 --extra-mib 2048
run leak -- --workload patterns -- --pattern leak --steps 10 --leak-mib 512
run paged -- --workload finetune -- --size small --optim paged_adamw_8bit --steps 6 --seq-len 1024
find "$OUT/history" -name "*.pickle" -size +20M -delete  # keep what can come back

cd "$OUT" && tar czf /tmp/results.tgz . ; mv /tmp/results.tgz "$OUT/"
find "$OUT" -mindepth 1 -maxdepth 1 ! -name results.tgz ! -name summary.txt -exec rm -rf {} +
