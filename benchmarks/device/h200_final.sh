#!/usr/bin/env bash
# Final check on the H200 with the code as committed: the GPU-marked tests, and the 7B
# paged_adamw_8bit and spiky runs under `stepmem run` with the final probe. Results under $OUT.
#   device run (carry .bundle):  bash benchmarks/device/h200_final.sh
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled
python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
timeout 300 python -m collector.cli run --backend nvml --workload finetune --out "$OUT/paged_adamw_8bit.records.json" \
  -- --size 7b --optim paged_adamw_8bit --steps 5 > "$OUT/paged_adamw_8bit.log" 2>&1
timeout 120 python -m collector.cli run --backend nvml --workload spiky --out "$OUT/spiky.records.json" \
  -- --steps 40 > "$OUT/spiky.log" 2>&1
python - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
d = json.load(open(f"{out}/paged_adamw_8bit.records.json"))
c = [x / 1e6 for x in d["workload"]["probe_cost_ns"]]
print("paged probe cost ms, median/max of steps 2..:", round(statistics.median(c[1:]), 3), round(max(c[1:]), 3))
for r in d["records"]:
    te, led = r["torch_end"], r["ledger"]
    nt = r["nvml_end_bytes"] - te["reserved_bytes.all.current"] - te["context_baseline_bytes"]
    print(r["step"], "nvml_end %.2f resv_end %.2f alloc_end %.2f managed %.2f nontorch %.2f GiB" % (
        r["nvml_end_bytes"] / 2**30, te["reserved_bytes.all.current"] / 2**30,
        te["allocated_bytes.all.current"] / 2**30, led["optimizer_state_managed"] / 2**30, nt / 2**30))
s = json.load(open(f"{out}/spiky.records.json"))
plan = {p["step"]: p["spike_bytes"] for p in s["workload"]["plan"]}
ok = sum(abs((r["nvml_peak_bytes"] - r["nvml_end_bytes"]) / plan[r["step"]] - 1) <= 0.02 for r in s["records"])
c = [x / 1e6 for x in s["workload"]["probe_cost_ns"]]
print(f"spiky: peak-end within 2% of the transient on {ok}/{len(s['records'])} steps; probe cost median {statistics.median(c[1:]):.3f} ms")
PY
