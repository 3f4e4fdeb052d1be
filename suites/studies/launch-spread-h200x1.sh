#!/usr/bin/env bash
# Launches the adapter (suites/studies/launch-spread-h200x1.toml, both cases) and DeepSpeed's
# minimal script (defaults, then the tuned keys) in alternating rounds on one GPU machine, until
# DEADLINE_S would be passed, and packs everything into OUT_DIR/spread.tgz after every round.
#
#   DEADLINE_S=540 bash suites/studies/launch-spread-h200x1.sh OUT_DIR [SUITE]
#
# The scripts run as a user would start them, `torchrun --nproc-per-node 1 script.py ...`, with
# the environment the adapter's launches get from scripts/device_run.sh (wheels, NCCL's multicast
# off, TORCH_CUDA_ARCH_LIST=9.0). Odd rounds run the adapter first, even rounds the scripts first.
set -uo pipefail
out=$1
suite=${2:-suites/studies/launch-spread-h200x1.toml}
deadline=${DEADLINE_S:-540}
start=$(date +%s)
cd "$(dirname "$0")/../.."
mkdir -p "$out"
work=${DEVICE_WORK:-/tmp/parabench-device}
mkdir -p "$work/scripts"
# the environment device_run.sh sets up, for the script launches too
if ls .whl/site-*.tar.xz >/dev/null 2>&1; then
  [ -f /tmp/site/.installed ] || { mkdir -p /tmp/site && for t in .whl/site-*.tar.xz; do tar xJf "$t" -C /tmp/site; done && touch /tmp/site/.installed; }
elif ls .whl/*.whl >/dev/null 2>&1; then
  [ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }
fi
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
shape=(--n-layer 24 --d-model 1024 --n-head 16 --vocab 50304 --seq-len 2048 --micro-batch 8 --precision bf16
  --layout separate --warmup 5 --steps 30 --lr 3e-4 --device cuda)
scripts() {
  local r=$1 p
  for p in defaults tuned; do
    torchrun --nproc-per-node 1 parabench/fidelity/scripts/deepspeed_zero.py --stage 3 --profile $p "${shape[@]}" \
      --out "$work/scripts/zero3-$p.r$r.json" > "$work/scripts/zero3-$p.r$r.log" 2>&1
    echo "script zero3 $p round $r: rc $? $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(d['tokens_per_s_per_device']))" "$work/scripts/zero3-$p.r$r.json" 2>/dev/null)" | tee -a "$out/console.txt"
  done
}
adapter() {
  PARABENCH_ARGS="--repeats $1" DEADLINE_S=$(( deadline - ($(date +%s) - start) )) bash scripts/device_run.sh "$work/dr" "$suite" >/dev/null 2>&1
  tail -n 4 "$work/dr/console.txt" | tee -a "$out/console.txt"
}
r=1
while :; do
  t0=$(date +%s)
  if (( r % 2 )); then adapter $r; scripts $r; else scripts $r; adapter $r; fi
  tar czf "$out/spread.tgz" -C "$work" scripts dr/results.tgz 2>/dev/null
  took=$(( $(date +%s) - t0 ))
  left=$(( deadline - ($(date +%s) - start) ))
  echo "round $r took ${took}s, ${left}s left" | tee -a "$out/console.txt"
  (( left > took + 10 )) || break
  r=$((r + 1))
done
