#!/usr/bin/env bash
# Benchmark gate: run tests/benchmarks (pytest-benchmark) and fail when a benchmark got slower than
# the committed baseline (results/benchmarks/baseline.json) by more than the threshold. Each
# benchmark's min time is divided by the min of a yardstick timed before every round, so the
# machine's speed of the moment cancels; gate_check.py computes the verdict and says why
# (threshold 40 % on the baseline's kind of machine, 200 % elsewhere). A benchmark that fails is
# timed once more and judged on its better run. Refresh the baseline on the machine that runs the
# gate with `tests/benchmarks/gate.sh --update`.
#
# Usage: tests/benchmarks/gate.sh [--update] [pytest args]   (PYTHON=... to pick the interpreter,
#        PARABENCH_BENCH_THRESHOLD=N to change the threshold)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
BASELINE=results/benchmarks/baseline.json
RUN=(-m pytest -q -p no:cacheprovider tests/benchmarks --benchmark-only --benchmark-columns=min,median,rounds
     --benchmark-sort=name)
if [ "${1:-}" = "--update" ]; then
    shift
    exec "$PY" "${RUN[@]}" --benchmark-json="$BASELINE" "$@"
fi
NOW="$(mktemp -d)"
trap 'rm -rf "$NOW"' EXIT
"$PY" "${RUN[@]}" --benchmark-json="$NOW/run1.json" "$@"
"$PY" tests/benchmarks/gate_check.py "$BASELINE" "$NOW/run1.json" && exit 0
# Failed: time the failed benchmarks once more after a pause and judge each on its better run
# (gate_check.py says why). A missing benchmark has nothing to time again and still fails.
FAILED="$("$PY" tests/benchmarks/gate_check.py --failed "$BASELINE" "$NOW/run1.json" || true)"
[ -n "$FAILED" ] || exit 1
echo "benchmark gate: timing again in 10 s: $FAILED"
sleep 10
"$PY" "${RUN[@]}" --benchmark-json="$NOW/run2.json" -k "${FAILED// / or }" "$@"
exec "$PY" tests/benchmarks/gate_check.py "$BASELINE" "$NOW/run1.json" "$NOW/run2.json"
