#!/usr/bin/env bash
# Peak capture at 100 Hz / 1 kHz / 10 kHz / max on `spiky` against the true peak, peers
# simulated on the same trace; and the 7B step time with and without stepmem. Results under $OUT.
#   device run (carry .bundle):  bash benchmarks/device/h200_perf.sh
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled
timeout 200 python benchmarks/peak_capture.py --steps 100 --out "$OUT/peak_capture.json" 2>"$OUT/peak_capture.err" | tee "$OUT/peak_capture.txt"
timeout 300 python benchmarks/training_cost.py --reps 3 --block 3 --out "$OUT/training_cost.json" 2>"$OUT/training_cost.err" | tee "$OUT/training_cost.txt"
tail -n 3 "$OUT"/*.err
