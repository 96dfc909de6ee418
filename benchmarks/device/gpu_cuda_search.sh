#!/usr/bin/env bash
# On a GPU (no bundle needed): (1) benchmarks/scripts/cuda_calls.py estimated under
# `stepmem estimate --script` (torch.cuda's memory queries answered from the allocator model)
# and run for real, torch's counters printed by both; (2) benchmarks/scripts/searched.py's
# largest --batch-size under a memory fraction, found by `--max-batch --batch-arg`, then
# trained for real at that batch and at one more with torch capped by the same fraction.
# Results as $OUT/cuda_search.tar.gz.
#   device run:  bash benchmarks/device/gpu_cuda_search.sh
source benchmarks/device/bundle.sh
R=$OUT/r; mkdir -p "$R"; write_env "$R/env.txt"
est() { python -m collector.cli estimate "$@"; }

echo "== cuda_calls: estimate" | tee -a "$R/summary.txt"
est --script benchmarks/scripts/cuda_calls.py --json -- "$R/est_snap.pickle" --json \
  > "$R/cuda_calls.estimate.json" 2> "$R/cuda_calls.estimate.log"
echo "exit $?" | tee -a "$R/summary.txt"; grep '^counters' "$R/cuda_calls.estimate.log" | tail -1 | tee -a "$R/summary.txt"
grep 'stepmem estimate' "$R/cuda_calls.estimate.log" | tail -2 | tee -a "$R/summary.txt"
echo "== cuda_calls: real" | tee -a "$R/summary.txt"
timeout 300 python benchmarks/scripts/cuda_calls.py "$R/real_snap.pickle" --json > "$R/cuda_calls.real.log" 2>&1
echo "exit $?" | tee -a "$R/summary.txt"; grep '^counters' "$R/cuda_calls.real.log" | tail -1 | tee -a "$R/summary.txt"
tail -3 "$R/cuda_calls.real.log" >> "$R/summary.txt"

F=${FRACTION:-0.04}   # of the GPU: about 3.2 GiB of an H100 80GB, 5.6 of an H200
echo "== searched: --max-batch under --memory-fraction $F" | tee -a "$R/summary.txt"
t0=$(date +%s)
est --script benchmarks/scripts/searched.py --margin 0 --memory-fraction "$F" --max-batch \
  --batch-arg batch-size --json -- --batch-size 100 > "$R/search.json" 2> "$R/search.log"
echo "exit $?, $(( $(date +%s) - t0 )) s" | tee -a "$R/summary.txt"
best=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['largest']['largest'])" "$R/search.json")
echo "largest batch: $best" | tee -a "$R/summary.txt"
for b in "$best" $(( best + 1 )) $(( best + 2 )); do
  timeout 300 python benchmarks/scripts/searched.py --batch-size "$b" --fraction "$F" --json \
    > "$R/real_b$b.log" 2>&1
  rc=$?; oom=$(grep -c OutOfMemoryError "$R/real_b$b.log")
  echo "real batch $b: exit $rc, OutOfMemoryError lines $oom, $(grep '^{' "$R/real_b$b.log" | tail -1)" | tee -a "$R/summary.txt"
  est --script benchmarks/scripts/searched.py --margin 0 --memory-fraction "$F" --json -- --batch-size "$b" \
    > "$R/est_b$b.json" 2>/dev/null
  python - "$R/est_b$b.json" "$b" <<'PY' | tee -a "$R/summary.txt"
import json, sys
e = json.load(open(sys.argv[1]))
s = e["steps"][-1]
print(f"estimate batch {sys.argv[2]}: fits {e['fit']['fits']}, need {e['fit']['need']}, usable {e['fit']['usable']}, "
      f"allocated peak {s['allocated_peak']}, reserved peak {s['reserved_peak']}")
PY
done
rm -f "$R"/*.pickle
tar czf "$OUT/cuda_search.tar.gz" -C "$OUT" r && cp "$R/summary.txt" "$OUT/summary.txt" && rm -rf "$R"
