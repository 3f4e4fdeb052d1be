#!/usr/bin/env bash
# Everything the offline GPU machine lacks, into .whl/ (ignored by git), in one step before a
# device session:
#
#   bash scripts/device_wheels.sh
#
# DeepSpeed and its pure-Python needs (scripts/gpu_wheels.sh), torchao for the fp8 recipe
# (the version pyproject's `fp8` extra pins), and libaio for DeepSpeed's NVMe offload
# (scripts/libaio_bundle.sh). scripts/device_run.sh installs the wheels there and runs every suite
# with --no-skips, so a suite whose cases would be skipped for something missing stops within
# seconds instead of recording them as skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bash scripts/gpu_wheels.sh >/dev/null
torchao=$(grep -o 'torchao==[0-9.]*' pyproject.toml | head -1)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "$torchao"
bash scripts/libaio_bundle.sh "$root/.whl/libaio" >/dev/null
# The same wheels installed for the device's Python and packed with xz: 3.2 MB for DeepSpeed and its
# needs against 5.1 MB of wheels, which with the committed results no longer fit the device's 64 MiB
# limit on what travels. device_run.sh unpacks whichever of these it is given (carry one of them).
pack_site() {
  local name=$1 t
  shift
  t=$(mktemp -d)
  python3 -m pip install -q --no-deps --no-index --no-compile --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --target "$t" "$@"
  tar cJf ".whl/$name.tar.xz" -C "$t" .
  rm -rf "$t"
}
pack_site site-deepspeed $(ls .whl/*.whl | grep -v torchao)
pack_site site-torchao .whl/torchao-*.whl
ls -l .whl
