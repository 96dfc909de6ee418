#!/usr/bin/env bash
# On the H200 (#30): users' own scripts, estimated and measured side by side. Model folders of
# zeros (benchmarks/scripts/make_model.py: a 1.1B and a 7B Llama, written sparse), then
#  1. `stepmem estimate --script` of each script on fake CUDA tensors (six processes side by
#     side: an estimate holds no GPU memory beyond its CUDA context);
#  2. the same scripts with the same arguments run for real under `stepmem run --script` on a
#     loopback Ray head, one after another (NVML within-step peaks, torch's counters, the
#     ledger), each in its run store.
# `stepmem report RUN --estimate EST` between them is run here, off the GPU (benchmarks/results/
# scripts/README.md has the commands). Results as $OUT/scripts.tar.gz.
#   device run (carry .bundle):  bash benchmarks/device/h200_scripts.sh
#   (ONLY=estimates: part 1 alone; RUNS="qlora-1b qlora-7b": of part 2 those alone)
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT_ALL=$OUT; OUT=$OUT/scripts; mkdir -p "$OUT/est" "$OUT/logs"
S="$OUT/summary.txt"
say() { echo "$*" | tee -a "$S"; }
write_env "$OUT/env.txt"
M=/tmp/models
python benchmarks/scripts/make_model.py 1b $M/1b > /dev/null && python benchmarks/scripts/make_model.py 7b $M/7b
say "== models: $(( SECONDS )) s"
B=benchmarks/scripts
# name script model args...
ROWS=(
  "readme-1b readme_train 1b --batch 4 --seq-len 1024"
  "plain-adamw-1b plain_adamw 1b --batch 4 --seq-len 2048"
  "hf-trainer-1b hf_trainer 1b --batch 4 --seq-len 1024 --grad-accum 2"
  "lightning-1b lightning_fit 1b --batch 4 --seq-len 1024"
  "qlora-1b qlora 1b --batch 4 --seq-len 2048 --rank 64"
  "qlora-7b qlora 7b --batch 2 --seq-len 4096 --rank 64"
)
t0=$SECONDS
for row in "${ROWS[@]}"; do
  set -- $row; name=$1 script=$2 model=$3; shift 3
  ( s=$SECONDS; timeout 280 python -m collector.cli estimate --script $B/$script.py \
      --out "$OUT/est/$name.estimate.json" -- $M/$model "$@" > "$OUT/est/$name.txt" \
      2> "$OUT/logs/$name.estimate.log"
    echo "== estimate $name: exit $?, $(( SECONDS - s )) s" >> "$S" ) &
done
wait
say "== estimates (side by side): $(( SECONDS - t0 )) s"
if [ "${ONLY:-}" = estimates ]; then  # the runs measured already (a call of their own)
  tar czf "$OUT_ALL/scripts.tar.gz" -C "$OUT_ALL" scripts; exit 0
fi
ray_head "$OUT/logs/ray_start.log"
for row in "${ROWS[@]}"; do
  set -- $row; name=$1 script=$2 model=$3; shift 3
  [ "$SECONDS" -gt 520 ] && { say "== skipped $name: ${SECONDS} s spent"; continue; }
  [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]] && continue  # RUNS="a b": those alone
  s=$SECONDS
  timeout 150 python -m collector.cli run --backend nvml --address 127.0.0.1:6379 \
    --store "$OUT/runs" --run-id "h200-$name" --out "$OUT/logs/$name.records.json" \
    --script $B/$script.py -- $M/$model "$@" > "$OUT/logs/$name.run.log" 2>&1
  say "== run $name: exit $?, $(( SECONDS - s )) s"
done
ray stop > /dev/null 2>&1
tar czf "$OUT_ALL/scripts.tar.gz" -C "$OUT_ALL" scripts
