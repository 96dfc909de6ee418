#!/usr/bin/env bash
# On the H200, the restructured job's two other runners, as benchmarks/device/h200_train.sh and
# h200_script.sh ran them before the refactor (same commands, same workloads), through
# `ray job submit` on a `ray start --head --num-gpus=1` cluster:
#  1. the 7B finetune in a Ray Train TorchTrainer (`--train-workers 1`, adamw_8bit, 6 steps);
#  2. a user's script (`--script workloads/finetune.py`, 7B, paged_adamw_8bit, 5 steps).
# Results as $OUT/runners.tar.gz.
#   device run (carry .bundle):  bash benchmarks/device/h200_runners.sh
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT_ALL=$OUT; OUT=$OUT/r; mkdir -p "$OUT"
A=http://127.0.0.1:8265
ray_head "$OUT/ray_start.log"
SUBMIT=(ray job submit --address $A --working-dir . --runtime-env-json '{"excludes": [".bundle", ".git"]}')
t0=$(date +%s)
timeout 400 "${SUBMIT[@]}" -- python -m collector.job --store "$OUT/runs" --run-id h200-7b-train \
  --out "$OUT/h200-7b-train.records.json" --workload finetune --train-workers 1 \
  -- --size 7b --optim adamw_8bit --steps 6 > "$OUT/h200-7b-train.log" 2>&1
echo "== ray train job: exit $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
t0=$(date +%s)
timeout 400 "${SUBMIT[@]}" -- python -m collector.job --store "$OUT/runs" --run-id h200-7b-script \
  --out "$OUT/h200-7b-script.records.json" --script workloads/finetune.py \
  -- --size 7b --optim paged_adamw_8bit --steps 5 > "$OUT/h200-7b-script.log" 2>&1
echo "== script job: exit $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
ray stop > /dev/null 2>&1
tar czf "$OUT_ALL/runners.tar.gz" -C "$OUT_ALL" r && cp "$OUT/summary.txt" "$OUT_ALL/" && rm -rf "$OUT"
