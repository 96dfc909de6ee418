#!/usr/bin/env bash
# On the H200, through `ray job submit` on a `ray start --head --num-gpus=1` cluster:
#  1. the 7B finetune inside a Ray Train TorchTrainer (`--train-workers 1`);
#  2. a 7B finetune of 30 steps stopped with `ray job stop` once steps reach the run store;
#  3. the GPU-marked tests.
# Everything comes back as $OUT/train.tar.gz.
#   device run (carry .bundle):  bash benchmarks/device/h200_train.sh
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_JOB_STOP_WAIT_TIME_S=30
OUT_ALL=$OUT; OUT=$OUT/r; mkdir -p "$OUT"
A=http://127.0.0.1:8265
ray_head "$OUT/ray_start.log"
SUBMIT=(ray job submit --address $A --working-dir . --runtime-env-json '{"excludes": [".bundle", ".git"]}')
t0=$(date +%s)
timeout 400 "${SUBMIT[@]}" -- python -m collector.job --store "$OUT/runs" --run-id h200-7b-train \
  --out "$OUT/h200-7b-train.records.json" --workload finetune --train-workers 1 \
  -- --size 7b --optim adamw_8bit --steps 6 > "$OUT/h200-7b-train.log" 2>&1
echo "== ray train job: exit $?, $(( $(date +%s) - t0 )) s"; grep -E "Ray Train|done in|succeeded|failed" "$OUT/h200-7b-train.log" | tail -4
t0=$(date +%s)
"${SUBMIT[@]}" --no-wait -- python -m collector.job --store "$OUT/runs" --run-id h200-7b-stop \
  --workload finetune -- --size 7b --optim adamw_8bit --steps 30 > "$OUT/h200-7b-stop.submit.log" 2>&1
JOB=$(grep -o "raysubmit_[A-Za-z0-9]*" "$OUT/h200-7b-stop.submit.log" | head -1)
for i in $(seq 240); do
  n=$(python -c "import sys; from collector.store import RunStore; s=RunStore('$OUT/runs/h200-7b-stop').steps(); print(0 if s is None else len(s))" 2>/dev/null || echo 0)
  [ "$n" -ge 4 ] && break; sleep 1
done
echo "== $n steps stored after $(( $(date +%s) - t0 )) s; ray job stop $JOB"
ray job stop --address $A "$JOB" > "$OUT/h200-7b-stop.stop.log" 2>&1; echo "stop exit $?"
ray job logs --address $A "$JOB" > "$OUT/h200-7b-stop.log" 2>&1
ray job status --address $A "$JOB" 2>&1 | tail -1
python -m collector.cli report "$OUT/runs/h200-7b-stop" > "$OUT/h200-7b-stop.report.txt" 2>&1; echo "report exit $?"
python -c "import json; m=json.load(open('$OUT/runs/h200-7b-stop/meta.json')); print('store status:', m['status'], '| samples lost:', m.get('samples_lost'))"
ray stop > /dev/null 2>&1
python -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
tar czf "$OUT_ALL/train.tar.gz" -C "$OUT_ALL" r && rm -rf "$OUT"
