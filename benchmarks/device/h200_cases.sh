#!/usr/bin/env bash
# On the H200:
#  1. two DDP ranks from torch.multiprocessing.spawn sharing the GPU (gloo) under
#     `stepmem run --script`, rank 1 keeping 2 GiB more from step 3 on (#22; the first run of
#     h200_distributed.sh met a probe bug there, fixed since);
#  2. four captures of memory cases the diagnosis must explain (#24), each a plain training
#     loop of a 0.2B Llama under the probe (workloads/cases.py): keep_logits (every micro-step's
#     logits kept), shapes (a new sequence length every step), eval (an eval pass inside every
#     third step), graphs (torch.compile with CUDA graphs);
#  3. the GPU-marked tests.
# Results as $OUT/cases.tar.gz (the captures go to captures/ of the project).
#   device run (carry .bundle):  bash benchmarks/device/h200_cases.sh
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT_ALL=$OUT; OUT=$OUT/c; mkdir -p "$OUT/captures"
write_env "$OUT/env.txt"
t0=$(date +%s)
timeout 200 python -m collector.cli run --store "$OUT/runs" --run-id h200-spawn-ddp \
  --out "$OUT/h200-spawn-ddp.records.json" --script benchmarks/device/spawn_ranks.py \
  -- --shard ddp --backend gloo --size small --steps 6 --seq-len 1024 --batch 2 \
  --imbalance 1:2048:3 > "$OUT/h200-spawn-ddp.log" 2>&1
echo "== spawned ranks under --script: exit $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
capture() {  # capture NAME ARGS...: one case, trimmed to 1 s around its steps
  local name=$1; shift
  t0=$(date +%s)
  timeout 240 python -m collector.cli capture --out "$OUT/captures/$name.capture.parquet" \
    --trim 1 --note "case=$name" -- python -m workloads.cases "$@" > "$OUT/$name.capture.log" 2>&1
  echo "== capture $name: exit $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
}
capture keep_logits --case keep_logits --size small --steps 10 --seq-len 512 --batch 2
capture shapes --case shapes --size small --steps 12 --seq-len 4096 --batch 2 --grad-accum 1
capture eval --case eval --size small --steps 9 --seq-len 1024 --batch 2 --eval-every 3 --eval-batch 32
capture graphs --case graphs --size small --steps 10 --seq-len 512 --batch 2 --grad-accum 1
# the keep_logits case as a run with its allocation history (the lines that allocate)
t0=$(date +%s)
timeout 200 python -m collector.cli run --store "$OUT/runs" --run-id h200-keep-logits \
  --out "$OUT/h200-keep-logits.records.json" --script workloads/cases.py \
  -- --case keep_logits --size small --steps 8 --seq-len 512 --batch 2 > "$OUT/h200-keep-logits.log" 2>&1
echo "== keep_logits run with history: exit $?, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py > "$OUT/gpu_tests.txt" 2>&1
echo "== gpu tests: exit $?" | tee -a "$OUT/summary.txt"
tar czf "$OUT_ALL/cases.tar.gz" -C "$OUT_ALL" c && cp "$OUT/summary.txt" "$OUT_ALL/" && rm -rf "$OUT"
