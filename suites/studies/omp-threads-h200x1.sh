#!/usr/bin/env bash
# The OMP-threads A/B on one GPU machine, in rounds: the adapter (suites/studies/omp-threads-h200x1.toml)
# with OMP_NUM_THREADS=1 (parabench's default) and with OMP_NUM_THREADS=$(nproc), and DeepSpeed's
# minimal script (tuned keys) with OMP_NUM_THREADS unset (as `torchrun --nproc-per-node 1` leaves it)
# and =1. The order of the four rotates by one each round. Results: OUT_DIR/omp.tgz after every round.
#
#   DEADLINE_S=560 bash suites/studies/omp-threads-h200x1.sh OUT_DIR
set -uo pipefail
out=$1
deadline=${DEADLINE_S:-560}
start=$(date +%s)
cd "$(dirname "$0")/../.."
suite=suites/studies/omp-threads-h200x1.toml
work=${DEVICE_WORK:-/tmp/parabench-device}
mkdir -p "$out" "$work/scripts"
left() { echo $(( deadline - ($(date +%s) - start) )); }
adapter() {  # $1 round, $2 threads
  OMP_NUM_THREADS=$2 DEVICE_WORK=$work/omp$2 PARABENCH_ARGS="--repeats $1" DEADLINE_S=$(left) \
    bash scripts/device_run.sh "$work/omp$2/out" "$suite" > /dev/null 2>&1
  echo "adapter omp $2 round $1: $(grep -o '[0-9,]* tok/s/dev' "$work/omp$2/out/console.txt" | tail -1)" | tee -a "$out/console.txt"
}
script() {  # $1 round, $2 threads (unset: torch's default)
  local f=$work/scripts/zero3-omp$2.r$1
  ( [ "$2" = unset ] || export OMP_NUM_THREADS=$2
    PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 timeout "$(left)" torchrun --nproc-per-node 1 parabench/fidelity/scripts/deepspeed_zero.py \
      --stage 3 --profile tuned --n-layer 24 --d-model 2048 --n-head 16 --vocab 50304 --seq-len 2048 --micro-batch 8 \
      --precision bf16 --layout separate --warmup 5 --steps 20 --lr 3e-4 --device cuda --out "$f.json" > "$f.log" 2>&1 )
  echo "script omp $2 round $1: $(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['tokens_per_s_per_device']))" "$f.json" 2>/dev/null)" | tee -a "$out/console.txt"
}
variants=("adapter 1" "script unset" "adapter $(nproc)" "script 1")
r=1
while (( $(left) > 60 )); do
  for i in 0 1 2 3; do
    v=(${variants[$(( (i + r - 1) % 4 ))]})
    (( $(left) > 45 )) || break
    ${v[0]} $r ${v[1]}
  done
  tar czf "$out/omp.tgz" -C "$work" scripts omp1/res "omp$(nproc)/res" 2>/dev/null
  r=$((r + 1))
done
