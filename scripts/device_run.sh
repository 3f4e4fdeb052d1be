#!/usr/bin/env bash
# Runs parabench suites on an offline GPU machine and packs the results for the trip back.
#
#   bash scripts/device_run.sh OUT_DIR SUITE [SUITE ...]
#
# Installs the wheels that scripts/../.whl holds (DeepSpeed and its pure-Python needs, made by
# ../shared/tools/gpu-wheels.sh), keeps NVLink multicast off in NCCL, PyTorch and NVSHMEM (the
# shared host requires it; torchrun passes the environment to every rank), runs each suite and
# writes OUT_DIR/results.tgz (results without logs), OUT_DIR/logs.tgz and OUT_DIR/console.txt.
set -uo pipefail
out=$1; shift
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi -L
mkdir -p "$out/res"
for suite in "$@"; do
  python3 -m parabench.cli run suite "$suite" --out "$out/res" ${PARABENCH_ARGS:-} 2>&1 | tee -a "$out/console.txt"
done
tar czf "$out/results.tgz" --exclude='logs' --exclude='.scratch' -C "$out/res" .
tar czf "$out/logs.tgz" -C "$out/res" .
rm -rf "$out/res"
