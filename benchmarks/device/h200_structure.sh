#!/usr/bin/env bash
# The restructured code on the H200: the probe split into core/outbox/ledger/recording and the
# job's parts (session, runners, replay driver, settings) run live, with nothing else changed.
#   1. the GPU-marked tests (tests/test_gpu.py)
#   2. the tracker keys on CUDA: a small Llama fine-tune (paged_adamw_8bit, 12 steps) under
#      `stepmem run --backend nvml`, the Trainer reporting to TensorBoard; the logged stepmem/*
#      keys are checked against the step records the sampler joined (benchmarks/tracker_keys.py)
#   3. the leak and outside patterns as in benchmarks/results/h200-marks (run 2), to compare
# Results under $OUT (results.tgz + summary.txt).
#   device run (carry .bundle):  bash benchmarks/device/h200_structure.sh
source benchmarks/device/bundle.sh
mkdir -p "$OUT/r" "$OUT/history"
write_env "$OUT/env.txt"

timeout 240 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > "$OUT/gpu-tests.txt" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu-tests.txt")" | tee -a "$OUT/summary.txt"

run() {  # run NAME -- stepmem run arguments (live NVML, the run store under $OUT/runs)
  local name=$1; shift; shift
  STEPMEM_HISTORY_DIR="$OUT/history/$name" timeout 300 python -m collector.cli run --backend nvml \
    --store "$OUT/runs" --run-id "$name" --out "$OUT/r/$name.records.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/summary.txt"
  timeout 120 python -m collector.cli report "$OUT/runs/$name" > "$OUT/$name.report.txt" 2>&1
}
TENSORBOARD_LOGGING_DIR="$OUT/tb" run tracker -- --workload finetune -- --size small \
  --optim paged_adamw_8bit --steps 12 --seq-len 1024 --report-to tensorboard
python benchmarks/tracker_keys.py "$OUT/tb" "$OUT/r/tracker.records.json" --out "$OUT/tracker_keys.json" > /dev/null
echo "tracker keys rc=$?" | tee -a "$OUT/summary.txt"
run outside -- --workload patterns -- --pattern outside --steps 8 --extra-mib 4096
run leak -- --workload patterns -- --pattern leak --steps 10 --leak-mib 512
find "$OUT/history" -name "*.pickle" -size +20M -delete  # keep what can come back

cd "$OUT" && tar czf /tmp/results.tgz . ; mv /tmp/results.tgz "$OUT/"
find "$OUT" -mindepth 1 -maxdepth 1 ! -name results.tgz ! -name summary.txt -exec rm -rf {} +
