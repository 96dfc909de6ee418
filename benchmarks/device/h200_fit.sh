#!/usr/bin/env bash
# On the H200 (#29): will it fit? Two parts, one device call each (a call runs at most 10 min).
#  PART=1 (measure): the benchmark rows trained for real under `stepmem run` on a loopback Ray
#     head (NVML within-step peaks, torch's allocated and reserved, and the allocation history
#     of steps 1-3 in each run store); allocation histories of three more loops without Ray
#     (sequence lengths changing every step, expandable segments, a small model without
#     checkpointing); `stepmem devices --calibrate`; CUDA's attention-kernel choices.
#  PART=2 (predict): `stepmem estimate` of every row on fake CUDA tensors (benchmarks/fit.py,
#     six processes side by side), and the largest micro-batch `stepmem estimate --max-batch`
#     finds for smaller cards checked by training it, and one more, with torch limited to what
#     that card leaves (fit_loop.py --card-gib: set_per_process_memory_fraction).
# Results as tarballs under $OUT (at most 8 files come back).
#   device run:  PART=1 bash benchmarks/device/h200_fit.sh   (carry .bundle)
source benchmarks/device/bundle.sh
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
PART=${PART:-1}
OUT_ALL=$OUT; OUT=$OUT/fit$PART; mkdir -p "$OUT"
S="$OUT_ALL/summary.txt"
write_env "$OUT/env.txt"
say() { echo "$*" | tee -a "$S"; }
BUDGET=${BUDGET:-500}  # seconds of work before the packing: the call's limit is 600
late() { [ "$SECONDS" -gt "$BUDGET" ] && say "== skipped $1: ${SECONDS} s spent" && return 0; return 1; }

row() {  # row NAME TIMEOUT ARGS...: one measured run on the Ray head
  local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  late "$name" && return
  timeout "$limit" python -m collector.cli run --backend nvml --address 127.0.0.1:6379 \
    --store "$OUT/runs" --run-id "$name" --out "$OUT/$name.records.json" "$@" \
    > "$OUT/$name.log" 2>&1
  say "== $name: exit $?, $(( $(date +%s) - t0 )) s"
}

hist() {  # hist NAME ARGS...: a loop without Ray whose probe records its history
  local name=$1; shift; local t0=$(date +%s)
  late "$name" && return
  STEPMEM_HISTORY_DIR="$OUT/hist/$name" timeout 60 "$@" > "$OUT/hist-$name.log" 2>&1
  say "== history $name: exit $?, $(( $(date +%s) - t0 )) s"
}

if [ "$PART" = 1 ]; then
  nvidia-smi -q -d MEMORY > "$OUT/nvidia-smi-memory.txt" 2>&1
  timeout 30 python benchmarks/device/sdpa_rules.py > "$OUT/sdpa-choices.json" 2> "$OUT/sdpa.err"
  say "== sdpa choices: exit $?"
  STEPMEM_CALIBRATION="$OUT/calibration.json" timeout 60 python -m collector.cli devices \
    --calibrate > "$OUT/calibrate.txt" 2>&1
  say "== calibrate: exit $?"; cat "$OUT/calibrate.txt" >> "$S"
  ray_head "$OUT/ray_start.log"
  row h200-fit-7b-adamw_8bit 110 --workload finetune -- --size 7b --optim adamw_8bit --steps 4
  row h200-fit-7b-paged 110 --workload finetune -- --size 7b --optim paged_adamw_8bit --steps 4
  row h200-fit-3b 80 --script benchmarks/fit_loop.py -- --size 3b --seq-len 2048 --batch 2 --steps 4
  row h200-fit-qwen2 70 --script benchmarks/fit_loop.py -- \
    --config benchmarks/configs/qwen2-1.5b.json --seq-len 2048 --batch 4 --steps 4
  row h200-fit-gpt2 60 --script benchmarks/fit_loop.py -- \
    --config benchmarks/configs/gpt2-medium.json --no-checkpointing --seq-len 1024 --batch 8 --steps 4
  row h200-fit-1b-fsdp2 70 --workload distributed -- --shard fsdp2 --size 1b --seq-len 1024 \
    --batch 4 --steps 4
  ray stop > /dev/null 2>&1
  hist shapes python -m workloads.cases --case shapes --size small --steps 4 --seq-len 2048 --batch 4
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True hist expandable \
    python benchmarks/fit_loop.py --size small --seq-len 2048 --batch 4 --steps 4
  hist small python benchmarks/fit_loop.py --size small --seq-len 1024 --batch 8 --no-checkpointing --steps 4
fi

largest() {  # largest NAME CARD ESTIMATE-FLAGS -- LOOP-FLAGS: the search, then b* and b*+1 for real
  local name=$1 gpu=$2; shift 2; local est=() loop=() t0=$(date +%s)
  while [ "$1" != "--" ]; do est+=("$1"); shift; done; shift; loop=("$@")
  late "largest $name" && return
  timeout 400 python -m collector.cli estimate "${est[@]}" --gpu "$gpu" --margin 0 --max-batch \
    --out "$OUT/largest-$name.json" > "$OUT/largest-$name.txt" 2>&1
  local b; b=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['largest']['largest'])" \
    "$OUT/largest-$name.json" 2>/dev/null) || { say "== largest $name: no answer"; return; }
  say "== largest $name on $gpu GiB: batch $b ($(( $(date +%s) - t0 )) s)"
  for n in "$b" "$((b + 1))"; do
    timeout 120 python benchmarks/fit_loop.py "${loop[@]}" --batch "$n" --card-gib "$gpu" --steps 3 \
      --no-probe > "$OUT/largest-$name-batch$n.log" 2>&1
    say "   batch $n: exit $? $(tail -1 "$OUT/largest-$name-batch$n.log" | cut -c1-160)"
  done
}

if [ "$PART" = 2 ]; then
  python -c "import torch; p=torch.cuda.get_device_properties(0); f,t=torch.cuda.mem_get_info(); \
print('cuda total_memory', p.total_memory, 'mem_get_info', f, t)" >> "$OUT/env.txt"
  [ -z "${NO_ESTIMATES:-}" ] && OMP_NUM_THREADS=2 timeout 560 python benchmarks/fit.py estimate \
    "$OUT/gpu" --parallel > "$OUT/estimates.log" 2>&1 &
  Q=benchmarks/configs/qwen2-1.5b.json G=benchmarks/configs/gpt2-medium.json
  largest qwen2 40 --config $Q --optim adamw_torch --seq-len 2048 -- --config $Q --seq-len 2048 &
  { largest gpt2 22.5 --config $G --optim adamw_torch --seq-len 1024 --no-checkpointing -- \
      --config $G --seq-len 1024 --no-checkpointing
    largest 3b 80 --size 3b --optim adamw_torch --seq-len 2048 -- --size 3b --seq-len 2048; } &
  wait
  [ -f "$OUT/estimates.log" ] && say "== estimates: $(tr '\n' ' ' < "$OUT/estimates.log")"
fi

cd "$OUT_ALL"
pack() {  # pack NAME RUN...: the runs' histories in one archive (the largest files)
  local name=$1; shift; local dirs=()
  for n in "$@"; do
    [ -d "fit$PART/runs/$n/history" ] && mv "fit$PART/runs/$n/history" "fit$PART/hist/$n" \
      && dirs+=("$n")
  done
  [ ${#dirs[@]} -gt 0 ] && tar cJf "$name.tar.xz" -C "fit$PART/hist" "${dirs[@]}" \
    && (cd "fit$PART/hist" && rm -rf "${dirs[@]}")
}
if [ "$PART" = 1 ]; then
  mkdir -p "fit$PART/hist"
  pack hist-7b h200-fit-7b-adamw_8bit h200-fit-7b-paged
  pack hist-runs h200-fit-3b h200-fit-qwen2 h200-fit-gpt2 h200-fit-1b-fsdp2
  tar cJf hist-loops.tar.xz -C "fit$PART" hist && rm -rf "fit$PART/hist"
fi
tar cJf "fit$PART.tar.xz" "fit$PART" && rm -rf "fit$PART"
ls -la "$OUT_ALL" >> "$S"
