#!/usr/bin/env bash
# The gate's GPU test (issue 19): repeatability-gpu twice with the same code (runs a, b), then once
# with every timed step 5 % longer (run slow5, PARABENCH_DEBUG_SLOWDOWN=0.05), each its own run
# folder; the three runs come back as one archive, $OUT/repeatability.tgz. Compare them here:
#   parabench compare results/repeatability/a results/repeatability/b          # must exit 0
#   parabench compare results/repeatability/a results/repeatability/slow5      # must exit 1
set -uo pipefail
cd "$(dirname "$0")/.."
for run in a b slow5; do
  slow=0; [ "$run" = slow5 ] && slow=0.05
  PARABENCH_DEBUG_SLOWDOWN=$slow DEVICE_WORK=/tmp/rep-$run DEADLINE_S=${DEADLINE_S:-190} \
    bash scripts/device_run.sh /tmp/rep-out/$run repeatability-gpu
done
mkdir -p /tmp/rep-pack
for run in a b slow5; do
  src=$(ls -d /tmp/rep-$run/res/repeatability-gpu/*/ | head -1)
  cp -r "$src" /tmp/rep-pack/$run
  cp /tmp/rep-out/$run/console.txt /tmp/rep-pack/$run/console.txt
done
tar czf "${OUT:-/tmp}/repeatability.tgz" --exclude=.scratch -C /tmp/rep-pack .
