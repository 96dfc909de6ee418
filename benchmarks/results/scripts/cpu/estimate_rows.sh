#!/usr/bin/env bash
#   bash benchmarks/results/scripts/cpu/estimate_rows.sh MODEL_1B_DIR MODEL_7B_DIR  (make_model.py 1b/7b)
# the six rows of benchmarks/device/h200_scripts.sh, estimated on this machine (no GPU: the CPU
# stands in for CUDA), into benchmarks/results/scripts/cpu/
cd "$(dirname "$0")/../../../.."  # the repository root
M1=$1; M7=$2; O=benchmarks/results/scripts/cpu; B=benchmarks/scripts
ROWS=(
  "readme-1b readme_train $M1 --batch 4 --seq-len 1024"
  "plain-adamw-1b plain_adamw $M1 --batch 4 --seq-len 2048"
  "hf-trainer-1b hf_trainer $M1 --batch 4 --seq-len 1024 --grad-accum 2"
  "lightning-1b lightning_fit $M1 --batch 4 --seq-len 1024"
  "qlora-1b qlora $M1 --batch 4 --seq-len 2048 --rank 64"
  "qlora-7b qlora $M7 --batch 2 --seq-len 4096 --rank 64"
)
for row in "${ROWS[@]}"; do
  set -- $row; name=$1 script=$2 model=$3; shift 3
  s=$SECONDS
  .venv/bin/stepmem estimate --script $B/$script.py --gpu H200 --margin 0 --out $O/$name.estimate.json -- $model "$@" > $O/$name.txt 2> $O/$name.log
  echo "== cpu estimate $name: exit $?, $(( SECONDS - s )) s" | tee -a $O/summary.txt
done
