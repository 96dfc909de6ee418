#!/usr/bin/env bash
# The GPU parts of the benchmark runner on the H200 (rate, floor, smi, peak, cost); the CPU parts
# (scale, export) need Prometheus and run on the development machine. Results in $OUT/bench.tar.gz.
#   device run (carry .bundle):  bash benchmarks/device/h200_bench.sh
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
python benchmarks/run.py --out "$OUT/bench" --parts rate,floor,smi,peak,cost --cost-reps 5 \
  --cost-block 4 --part-timeout 300
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/bench/gpu.csv"
tar czf "$OUT/bench.tar.gz" -C "$OUT" bench && rm -rf "$OUT/bench"
