#!/usr/bin/env bash
# One device call on the H200: sampler rate/cost, the NVML floor, and the four captures
# (idle, 7B adamw_8bit, 7B paged_adamw_8bit, spiky), each 7B/spiky run under `stepmem run`
# with live samplers so its step records come back too. Results under $OUT.
#   device run (carry .bundle):  bash benchmarks/device/h200_foundation.sh
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled
R=$OUT/r; mkdir -p "$R"
SM="python -m collector.cli"
{ nvidia-smi; python -c 'import torch, transformers, ray, bitsandbytes, pynvml; print("torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__, "bitsandbytes", bitsandbytes.__version__)'; } > "$R/env.txt" 2>&1
echo "== sampler rate"; timeout 150 python benchmarks/sampler_rate.py --out "$R/sampler_rate.json" 2>"$R/sampler_rate.err" | tee "$R/sampler_rate.log"
echo "== nvml floor"; (gcc -O2 -o /tmp/nvml_floor benchmarks/nvml_floor.c -I/usr/local/cuda/include -lnvidia-ml && /tmp/nvml_floor 3 && /tmp/nvml_floor 10 paced) > "$R/nvml_floor.json" 2>&1; cat "$R/nvml_floor.json"
echo "== wake floor"; (gcc -O2 -o /tmp/wake_floor benchmarks/wake_floor.c && /tmp/wake_floor) > "$R/wake_floor.txt" 2>&1; cat "$R/wake_floor.txt"
echo "== nvidia-smi -lms 1"; timeout 5 nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 1 > "$R/smi_lms1.csv" 2>&1; wc -l < "$R/smi_lms1.csv"
[ -n "${SKIP_IDLE:-}" ] || echo "== idle"; [ -n "${SKIP_IDLE:-}" ] || timeout 60 $SM capture --duration 10 --rate 1000 --out "$OUT/idle.capture.parquet" --note workload=idle 2>&1 | tail -2
for opt in adamw_8bit paged_adamw_8bit; do
  echo "== $opt"
  timeout 300 $SM capture --rate 1000 --out "$OUT/$opt.capture.parquet" --note workload=finetune-7b-$opt -- \
    $SM run --backend nvml --workload finetune --out "$R/$opt.records.json" -- --size 7b --optim $opt --steps 5 \
    > "$R/$opt.log" 2>&1; tail -n 25 "$R/$opt.log"
done
echo "== spiky"
timeout 120 $SM capture --rate max --trim 0.5 --max-seconds 90 --out "$OUT/spiky.capture.parquet" --note workload=spiky -- \
  $SM run --backend nvml --workload spiky --rate 1000 --out "$R/spiky.records.json" -- --steps 40 \
  > "$R/spiky.log" 2>&1; tail -n 12 "$R/spiky.log"
tar czf "$OUT/results.tar.gz" -C "$OUT" r && rm -rf "$R"
ls -la "$OUT"
