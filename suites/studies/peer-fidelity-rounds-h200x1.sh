#!/usr/bin/env bash
# Rounds of suites/studies/peer-fidelity-rounds-h200x1.toml on one GPU machine: round r adds the
# r-th launch of every adapter case (`parabench run suite --repeats r`) and the r-th launch of its
# library script (`parabench fidelity RUN --launches r`). Odd rounds start with the adapters, even
# rounds with the scripts, so neither side always runs on the machine's freshest or most tired
# minutes. Rounds go on until ROUNDS are done or DEADLINE_S would be passed; a later call on the
# same warm machine resumes (everything lives in DEVICE_WORK), and OUT_DIR/results.tgz is rewritten
# after every round.
#
# SUITE names another peer-fidelity study to run in rounds (default: the one beside this file).
#
#   ROUNDS=5 DEADLINE_S=560 bash suites/studies/peer-fidelity-rounds-h200x1.sh OUT_DIR
set -uo pipefail
out=$1
rounds=${ROUNDS:-5}
deadline=${DEADLINE_S:-560}
start=$(date +%s)
cd "$(dirname "$0")/../.."
suite=${SUITE:-suites/studies/peer-fidelity-rounds-h200x1.toml}
work=${DEVICE_WORK:-/tmp/parabench-device}
mkdir -p "$out" "$work"
left() { echo $(( deadline - ($(date +%s) - start) )); }
adapters_and_scripts() {  # device_run.sh: wheels, NCCL's multicast off, the suite, then `fidelity`
  PARABENCH_ARGS="--repeats $1" PARABENCH_FIDELITY_ARGS="--launches $1" DEADLINE_S=$(left) \
    bash scripts/device_run.sh "$work/dr" "$suite" > /dev/null 2>&1
}
scripts_only() {
  local run
  run=$work/res/studies/$(basename "$suite" .toml)/$(cat "$work/run_id")
  [ -d "$run" ] || return 0
  PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 timeout -s INT "$(left)" python3 -m parabench.cli fidelity "$run" \
    --launches "$1" --no-report >> "$out/console.txt" 2>&1
}
r=$(( $(cat "$work/rounds_done" 2>/dev/null || echo 0) + 1 ))
while (( r <= rounds )); do
  t0=$(date +%s)
  if (( r % 2 )); then adapters_and_scripts $r; else scripts_only $r; adapters_and_scripts $r; fi
  tail -n 6 "$work/dr/console.txt" >> "$out/console.txt"
  cp "$work/dr/results.tgz" "$out/results.tgz" 2>/dev/null
  took=$(( $(date +%s) - t0 ))
  echo "round $r took ${took}s, $(left)s left" | tee -a "$out/console.txt"
  echo $r > "$work/rounds_done"
  (( $(left) > took + 10 )) || break
  r=$((r + 1))
done
