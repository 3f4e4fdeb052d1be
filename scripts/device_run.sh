#!/usr/bin/env bash
# Runs parabench suites on an offline GPU machine and packs the results for the trip back.
#
#   DEADLINE_S=560 bash scripts/device_run.sh OUT_DIR SUITE [SUITE ...]
#
# Installs the wheels in .whl/ (DeepSpeed and its pure-Python needs, torchao and libaio, made by
# scripts/device_wheels.sh; or the xz-packed installs .whl/site-*.tar.xz it also makes, the form
# that fits the device's limit), refuses a suite with a case that would be skipped there (--no-skips;
# DEVICE_ALLOW_SKIPS=1 lets such cases be recorded as skipped), keeps NVLink multicast off in
# NCCL, PyTorch and NVSHMEM (the shared host requires it; torchrun passes the environment to every
# rank), runs the suites in order within DEADLINE_S seconds in all, and after each one rewrites
# OUT_DIR/results.tgz (records, manifests, reports; no logs) and OUT_DIR/logs.tgz, so a suite cut
# off by the deadline still leaves everything finished before it. Console output goes to OUT_DIR/console.txt.
# PARABENCH_ARGS pass to every `parabench run suite` (e.g. --repeats 3, or --filter 'ref.ddp gpt-1.3b':
# shell quoting holds a filter with spaces together), PARABENCH_FIDELITY_ARGS to
# the `parabench fidelity` that follows a peer-fidelity suite (e.g. --launches 3).
#
# The device takes at most 64 MiB of working tree (on-disk sizes), carried paths included; the
# committed results come near that alone. When a call is refused for size, `scripts/device_slim.sh
# aside [RUN_DIR ...]` before it and `scripts/device_slim.sh restore` after it.
#
# One device call may run 10 minutes, so a suite may need several calls. The runs live in
# DEVICE_WORK (default /tmp/parabench-device, outside the repository copy, which is re-synced at
# every call) under one run id per machine, and every call resumes them: the next call on the
# same warm machine runs only the cases not yet recorded, and packs everything recorded so far.
# Suites on disjoint GPU sets may run at once (each with CUDA_VISIBLE_DEVICES and DEVICE_WORK of
# its own); the records then share the host, which the results document says where it applies.
set -uo pipefail
out=$1; shift
start=$(date +%s)
deadline=${DEADLINE_S:-560}
cd "$(dirname "$0")/.."
if ls .whl/site-*.tar.xz >/dev/null 2>&1; then
  # installed trees packed by scripts/device_wheels.sh (the form that fits the 64 MiB carry): unpacked
  # once per machine, under the same lock as the wheels
  (flock 9 && { [ -f /tmp/site/.installed ] || { mkdir -p /tmp/site && for t in .whl/site-*.tar.xz; do
    tar xJf "$t" -C /tmp/site || exit 1; done && touch /tmp/site/.installed; }; }) 9>/tmp/site.lock || exit 1
  export PYTHONPATH=/tmp/site:$PWD
elif ls .whl/*.whl >/dev/null 2>&1; then
  # once per machine, and under a lock: two streams on disjoint GPUs (CUDA_VISIBLE_DEVICES, their
  # own DEVICE_WORK) may start together
  (flock 9 && { [ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }; }) 9>/tmp/site.lock || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
# libaio for DeepSpeed's async I/O op (ZeRO-Infinity), packed by scripts/libaio_bundle.sh
if [ -d .whl/libaio ]; then
  a=$PWD/.whl/libaio
  export CPATH=$a/include${CPATH:+:$CPATH} LIBRARY_PATH=$a/lib${LIBRARY_PATH:+:$LIBRARY_PATH} LD_LIBRARY_PATH=$a/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
export TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-20000}
# The copy's .git (if any) is the session's first commit, not this tree's: the commit comes along
# in a file written before the call (git rev-parse HEAD > .parabench-commit) and wins in every manifest.
[ -f .parabench-commit ] && export PARABENCH_GIT_COMMIT=$(cat .parabench-commit)
nvidia-smi -L
work=${DEVICE_WORK:-/tmp/parabench-device}
mkdir -p "$work/res" "$out"
[ -f "$work/run_id" ] || date -u +%Y%m%d-%H%M%S > "$work/run_id"
run_args="--run-id $(cat "$work/run_id") --resume"
# a case skipped for something this machine lacks (torchao, GPUs) wastes the lease: stop at once
[ "${DEVICE_ALLOW_SKIPS:-0}" = 1 ] || run_args="$run_args --no-skips"
eval "suite_args=(${PARABENCH_ARGS:-})"
pack() {
  tar czf "$out/results.tgz" --exclude='logs' --exclude='.scratch' -C "$work/res" .
  tar czf "$out/logs.tgz" --exclude='.scratch' -C "$work/res" .
}
for suite in "$@"; do
  left=$(( deadline - ($(date +%s) - start) ))
  if [ "$left" -lt 20 ]; then echo "device_run: no time left for $suite" | tee -a "$out/console.txt"; continue; fi
  timeout -s INT "$left" python3 -m parabench.cli run suite "$suite" --out "$work/res" $run_args "${suite_args[@]}" 2>&1 | tee -a "$out/console.txt"
  pack
  name=$(basename "$suite" .toml)  # a study by name (studies/NAME) or by path
  if [[ $name == peer-fidelity* ]]; then  # each peer case beside its library's minimal script (resumes too)
    folder=$work/res/$name  # a study's runs are under studies/ (parabench.suite.Suite.results_folder)
    [ -d "$folder" ] || folder=$work/res/studies/$name
    left=$(( deadline - ($(date +%s) - start) ))
    [ "$left" -ge 30 ] && timeout -s INT "$left" python3 -m parabench.cli fidelity "$folder/$(cat "$work/run_id")" ${PARABENCH_FIDELITY_ARGS:-} 2>&1 | tee -a "$out/console.txt"
    pack
  fi
done
pack
