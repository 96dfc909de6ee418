#!/usr/bin/env bash
# The user's path on the H200: a Ray head started with `ray start --head --num-gpus=1`, then
# `ray job submit --working-dir . -- python -m collector.job ...` for the real 7B finetune and for
# the three memory patterns the report must name (leak, allocator jump, CUDA OOM). Each job
# writes its run store and records under $OUT; while a job runs, its samplers' /metrics are read
# through the job's Prometheus file_sd targets file (the last reading is kept per job). Everything
# comes back as $OUT/jobs.tar.gz (the device tool returns few files).
#   device run (carry .bundle):  bash benchmarks/device/h200_jobs.sh
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled
# A single-machine cluster on loopback: Ray otherwise swaps 127.0.0.1 for the outward address.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT_ALL=$OUT; OUT=$OUT/r
mkdir -p "$OUT/metrics" "$OUT/targets"
{ nvidia-smi; python -c 'import torch, transformers, ray, bitsandbytes; print("torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__, "bitsandbytes", bitsandbytes.__version__)'; } > "$OUT/env.txt" 2>&1
ray_head "$OUT/ray_start.log"
scrape() {  # read the job's targets file and its samplers' /metrics until the job ends
  python - "$1" "$2" <<'PY'
import json, os, sys, time, urllib.request
targets, out = sys.argv[1], sys.argv[2]
for _ in range(600):  # at most ~20 minutes, every 2 s
    if os.path.exists(out + ".done"):
        break
    time.sleep(2)
    try:
        groups = json.load(open(targets))
    except (OSError, ValueError):
        continue
    for g in groups:
        for t in g["targets"]:
            if not t.startswith("127.0.0.1:"):
                print("skipping non-loopback target", t, file=sys.stderr)
                continue
            try:
                body = urllib.request.urlopen(f"http://{t}/metrics", timeout=2).read()
            except OSError:
                continue
            if b"stepmem_step_nvml_peak_bytes{" in body:
                open(out, "wb").write(body)
PY
}
job() {
  local name=$1; shift
  scrape "$OUT/targets/$name.json" "$OUT/metrics/$name.prom" & local sp=$!
  local t0=$(date +%s)
  timeout 480 ray job submit --address http://127.0.0.1:8265 --working-dir . \
    --runtime-env-json '{"excludes": [".bundle", ".git"]}' -- \
    python -m collector.job --store "$OUT/runs" --run-id "$name" --out "$OUT/$name.records.json" \
      --targets "$OUT/targets/$name.json" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  touch "$OUT/metrics/$name.prom.done"; wait $sp; rm -f "$OUT/metrics/$name.prom.done"
  echo "== $name: ray job submit exit $rc, $(( $(date +%s) - t0 )) s"
  grep -E "Job '.*' (succeeded|failed)|stepmem: the workload failed" "$OUT/$name.log" | tail -2
}
job h200-7b-adamw --workload finetune -- --size 7b --optim adamw_8bit --steps 6
job h200-leak --workload patterns -- --pattern leak --steps 20
job h200-allocator --workload patterns -- --pattern allocator --steps 10
job h200-oom --workload patterns -- --pattern oom
ray job list --address http://127.0.0.1:8265 > "$OUT/ray_job_list.txt" 2>&1
ray stop > /dev/null 2>&1
du -sh "$OUT"/runs/* 2>/dev/null
tar czf "$OUT_ALL/jobs.tar.gz" -C "$OUT_ALL" r && rm -rf "$OUT"
