#!/usr/bin/env bash
# On the H200: `stepmem run --script` wrapping a user's HF Trainer script (workloads/finetune.py
# run as a plain script: its own StepProbe + StepMemCallback), submitted with `ray job submit`;
# then the GPU-marked tests. Results as $OUT/script.tar.gz.
#   device run (carry .bundle):  bash benchmarks/device/h200_script.sh
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT_ALL=$OUT; OUT=$OUT/r; mkdir -p "$OUT"
ray_head "$OUT/ray_start.log"
t0=$(date +%s)
timeout 400 ray job submit --address http://127.0.0.1:8265 --working-dir . \
  --runtime-env-json '{"excludes": [".bundle", ".git"]}' -- \
  python -m collector.job --store "$OUT/runs" --run-id h200-7b-script \
    --out "$OUT/h200-7b-script.records.json" --script workloads/finetune.py \
    -- --size 7b --optim paged_adamw_8bit --steps 5 > "$OUT/h200-7b-script.log" 2>&1
echo "== script job: exit $?, $(( $(date +%s) - t0 )) s"
grep -E "script .* done|succeeded|failed|managed \(paged\)" "$OUT/h200-7b-script.log" | tail -4
ray stop > /dev/null 2>&1
python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
tar czf "$OUT_ALL/script.tar.gz" -C "$OUT_ALL" r && rm -rf "$OUT"
