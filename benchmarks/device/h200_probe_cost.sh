#!/usr/bin/env bash
# The probe's cost on the H200: its parts, and per step on the 7B finetune (adamw_8bit, 8 steps)
# under `stepmem run` with a live sampler. Results under $OUT.
#   device run (carry .bundle):  bash benchmarks/device/h200_probe_cost.sh
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled
python benchmarks/probe_parts.py --out "$OUT/probe_parts.json" 2>&1 | tail -8
timeout 300 python -m collector.cli run --backend nvml --workload finetune --out "$OUT/probe_cost_7b.records.json" \
  -- --size 7b --optim adamw_8bit --steps 8 > "$OUT/probe_cost_7b.log" 2>&1
tail -n 14 "$OUT/probe_cost_7b.log"
python - "$OUT/probe_cost_7b.records.json" <<'PY'
import json, statistics, sys
d = json.load(open(sys.argv[1]))
c = [x / 1e6 for x in d["workload"]["probe_cost_ns"]]
print("probe cost per step (ms):", [round(x, 3) for x in c])
print("median of steps 2..:", round(statistics.median(c[1:]), 3), "max of steps 2..:", round(max(c[1:]), 3))
PY
