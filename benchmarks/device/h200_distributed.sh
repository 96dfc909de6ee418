#!/usr/bin/env bash
# On the H200, for distributed training (#22), through the real job entry points:
#  1. FSDP2 and DDP at world size 1 in a Ray Train TorchTrainer with NCCL on a ~1.1B Llama
#     (TinyLlama's shape, seq 1024, batch 4, 6 steps), step 2 of each under PyTorch's own tracker
#     (FSDPMemTracker / MemTracker) beside the probe's ledger (`--track`);
#  2. two DDP ranks from torch.multiprocessing.spawn sharing the one GPU (gloo) under
#     `stepmem run --script`, rank 1 keeping 2 GiB more from step 3 on (the case whose events
#     were all lost before);
#  3. the GPU-marked tests; the report of every run.
# Results as $OUT/distributed.tar.gz.
#   device run (carry .bundle):  bash benchmarks/device/h200_distributed.sh
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT_ALL=$OUT; OUT=$OUT/d; mkdir -p "$OUT"
write_env "$OUT/env.txt"
A=http://127.0.0.1:8265
ray_head "$OUT/ray_start.log"
SUBMIT=(ray job submit --address $A --working-dir . --runtime-env-json '{"excludes": [".bundle", ".git"]}')
for shard in fsdp2 ddp; do
  t0=$(date +%s)
  timeout 240 "${SUBMIT[@]}" -- python -m collector.job --store "$OUT/runs" \
    --run-id "h200-1b-$shard" --out "$OUT/h200-1b-$shard.records.json" \
    --workload distributed --train-workers 1 \
    -- --shard "$shard" --size 1b --steps 6 --seq-len 1024 --batch 4 --track "$OUT/track-$shard" \
    > "$OUT/h200-1b-$shard.log" 2>&1
  echo "== $shard in Ray Train: exit $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
done
ray stop > /dev/null 2>&1
t0=$(date +%s)
timeout 240 python -m collector.cli run --store "$OUT/runs" --run-id h200-spawn-ddp \
  --out "$OUT/h200-spawn-ddp.records.json" --script benchmarks/device/spawn_ranks.py \
  -- --shard ddp --backend gloo --size small --steps 6 --seq-len 1024 --batch 2 \
  --imbalance 1:2048:3 > "$OUT/h200-spawn-ddp.log" 2>&1
echo "== spawned ranks under --script: exit $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py > "$OUT/gpu_tests.txt" 2>&1
echo "== gpu tests: exit $?" | tee -a "$OUT/summary.txt"
for r in h200-1b-fsdp2 h200-1b-ddp h200-spawn-ddp; do
  python -m collector.cli report "$OUT/runs/$r" > "$OUT/$r.report.txt" 2>&1
done
tar czf "$OUT_ALL/distributed.tar.gz" -C "$OUT_ALL" d && cp "$OUT/summary.txt" "$OUT_ALL/" && rm -rf "$OUT"
