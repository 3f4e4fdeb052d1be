#!/usr/bin/env bash
# Prepares the wheels that the offline GPU machine (Python 3.12, x86-64, torch preinstalled) lacks:
# DeepSpeed and its pure-Python needs, into .whl/ at the repository root (ignored by git).
#
#   bash scripts/gpu_wheels.sh            # from anywhere; scripts/device_wheels.sh runs it
#
# Source: the team's gpu-wheels.sh (its shared tools folder, outside this repository), copied so that
# a clone prepares its wheels alone. Changed from it: the root is found from this file, not from git
# (a source tarball works too), and .whl/ is left to the repository's .gitignore rather than written
# into .git/info/exclude (a worktree's .git is a file). DS_VERSION picks another DeepSpeed.
#
# On the GPU machine, scripts/device_run.sh installs them before running anything that imports
# DeepSpeed (by hand: pip install --no-index --no-deps --target /tmp/site .whl/*.whl, then
# PYTHONPATH=/tmp/site and TORCH_CUDA_ARCH_LIST=9.0, docs/facts.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
DS_VERSION=${DS_VERSION:-0.19.8}
# DeepSpeed ships only a source distribution; build a pure-Python wheel with no prebuilt ops.
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w .whl "deepspeed==${DS_VERSION}"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
ls -la .whl
