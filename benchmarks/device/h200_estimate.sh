#!/usr/bin/env bash
# On the H200 (#25): the estimate against the measurement.
#  1. `stepmem estimate` of the seed's 7B runs (adamw_8bit, paged_adamw_8bit) on fake CUDA
#     tensors (CUDA autocast and attention kernels, no device memory used; the GPU's used memory
#     is read before and after to show it);
#  2. a measured 7B adamw_8bit run (4 steps) whose probe is given the estimate
#     (STEPMEM_ESTIMATE: the predicted peak rides with each end event), its store reported with
#     `report --estimate`; the paged capture committed in captures/ is reported the same way;
#  3. the 1B FSDP2 estimate (workloads/distributed.py's loop) against the committed H200 FSDP2 run.
# Results as $OUT/estimate.tar.gz.
#   device run (carry .bundle):  bash benchmarks/device/h200_estimate.sh
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT_ALL=$OUT; OUT=$OUT/e; mkdir -p "$OUT"
write_env "$OUT/env.txt"
used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; }
for o in adamw_8bit paged_adamw_8bit; do
  before=$(used); t0=$(date +%s)
  timeout 400 python -m collector.cli estimate --size 7b --optim $o --seq-len 4096 --batch 1 \
    --grad-accum 2 --out "$OUT/h200-7b-$o.estimate.json" > "$OUT/h200-7b-$o.estimate.txt" 2>&1
  echo "== estimate $o: exit $?, $(( $(date +%s) - t0 )) s, GPU used ${before} -> $(used) MiB" \
    | tee -a "$OUT/summary.txt"
done
before=$(used); t0=$(date +%s)
timeout 300 python -m collector.cli estimate --workload distributed --size 1b --seq-len 1024 \
  --batch 4 --out "$OUT/h200-1b-fsdp2.estimate.json" > "$OUT/h200-1b-fsdp2.estimate.txt" 2>&1
echo "== estimate 1b FSDP2: exit $?, $(( $(date +%s) - t0 )) s, GPU used ${before} -> $(used) MiB" \
  | tee -a "$OUT/summary.txt"
python -m collector.cli report benchmarks/results/h200-distributed/runs/h200-1b-fsdp2 \
  --estimate "$OUT/h200-1b-fsdp2.estimate.json" > "$OUT/fsdp2.report.txt" 2>&1
echo "== report --estimate (committed FSDP2 store): exit $?" | tee -a "$OUT/summary.txt"
t0=$(date +%s)
STEPMEM_ESTIMATE="$OUT/h200-7b-adamw_8bit.estimate.json" timeout 400 python -m collector.cli run \
  --backend nvml --store "$OUT/runs" --run-id h200-7b-estimated --out "$OUT/h200-7b-estimated.records.json" \
  --workload finetune -- --size 7b --optim adamw_8bit --steps 4 > "$OUT/h200-7b-estimated.log" 2>&1
echo "== measured 7B adamw_8bit with the estimate: exit $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
python -m collector.cli report "$OUT/runs/h200-7b-estimated" \
  --estimate "$OUT/h200-7b-adamw_8bit.estimate.json" > "$OUT/h200-7b-estimated.report.txt" 2>&1
echo "== report --estimate (run store): exit $?" | tee -a "$OUT/summary.txt"
python -m collector.cli report captures/paged_adamw_8bit.capture.parquet \
  --estimate "$OUT/h200-7b-paged_adamw_8bit.estimate.json" > "$OUT/paged.report.txt" 2>&1
echo "== report --estimate (paged capture): exit $?" | tee -a "$OUT/summary.txt"
tar czf "$OUT_ALL/estimate.tar.gz" -C "$OUT_ALL" e && cp "$OUT/summary.txt" "$OUT_ALL/" && rm -rf "$OUT"
