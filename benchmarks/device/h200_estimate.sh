#!/usr/bin/env bash
# On the H200 (#25): the estimate against the measurement. Two parts (one device call each:
# a call runs at most 10 minutes).
#  PART=1: `stepmem estimate` of the seed's 7B runs (adamw_8bit, paged_adamw_8bit) and of the
#     1B FSDP2 run (workloads/distributed.py's loop), on fake CUDA tensors: CUDA's autocast and
#     attention kernels, torch's GPU allocation during each recorded in the estimate (0 B
#     expected); each reported against the committed H200 capture or run store.
#  PART=2: a measured 7B adamw_8bit run (4 steps) whose probe is given PART 1's estimate
#     (STEPMEM_ESTIMATE: the predicted peak rides with each end event), its store reported with
#     `report --estimate`.
# Results as $OUT/estimate-$PART.tar.gz.
#   device run:  PART=1 bash benchmarks/device/h200_estimate.sh   (PART=2: carry .bundle)
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
PART=${PART:-1}
OUT_ALL=$OUT; OUT=$OUT/e$PART; mkdir -p "$OUT"
write_env "$OUT/env.txt"
E=benchmarks/results/estimate
if [ "$PART" = 1 ]; then
  for o in adamw_8bit paged_adamw_8bit; do
    t0=$(date +%s)
    timeout 250 python -m collector.cli estimate --size 7b --optim $o --seq-len 4096 --batch 1 \
      --grad-accum 2 --out "$OUT/h200-7b-$o.estimate.json" > "$OUT/h200-7b-$o.estimate.txt" 2>&1
    echo "== estimate 7B $o: exit $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
    python -m collector.cli report captures/$o.capture.parquet \
      --estimate "$OUT/h200-7b-$o.estimate.json" > "$OUT/h200-7b-$o.report.txt" 2>&1
    echo "== report --estimate (capture $o): exit $?" | tee -a "$OUT/summary.txt"
  done
  t0=$(date +%s)
  timeout 120 python -m collector.cli estimate --workload distributed --size 1b --seq-len 1024 \
    --batch 4 --out "$OUT/h200-1b-fsdp2.estimate.json" > "$OUT/h200-1b-fsdp2.estimate.txt" 2>&1
  echo "== estimate 1B FSDP2: exit $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  python -m collector.cli report benchmarks/results/h200-distributed/runs/h200-1b-fsdp2 \
    --estimate "$OUT/h200-1b-fsdp2.estimate.json" > "$OUT/h200-1b-fsdp2.report.txt" 2>&1
  echo "== report --estimate (FSDP2 run store): exit $?" | tee -a "$OUT/summary.txt"
else
  t0=$(date +%s)
  STEPMEM_ESTIMATE="$E/h200-7b-adamw_8bit.estimate.json" timeout 400 python -m collector.cli run \
    --backend nvml --store "$OUT/runs" --run-id h200-7b-estimated \
    --out "$OUT/h200-7b-estimated.records.json" --workload finetune \
    -- --size 7b --optim adamw_8bit --steps 4 > "$OUT/h200-7b-estimated.log" 2>&1
  echo "== measured 7B adamw_8bit, probe given the estimate: exit $?, $(( $(date +%s) - t0 )) s" \
    | tee -a "$OUT/summary.txt"
  python -m collector.cli report "$OUT/runs/h200-7b-estimated" \
    --estimate "$E/h200-7b-adamw_8bit.estimate.json" > "$OUT/h200-7b-estimated.report.txt" 2>&1
  echo "== report --estimate (run store): exit $?" | tee -a "$OUT/summary.txt"
fi
tar czf "$OUT_ALL/estimate-$PART.tar.gz" -C "$OUT_ALL" "e$PART" && cp "$OUT/summary.txt" "$OUT_ALL/" \
  && rm -rf "$OUT"
