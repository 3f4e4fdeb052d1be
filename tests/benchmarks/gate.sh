#!/usr/bin/env bash
# Benchmark gate: run tests/benchmarks (pytest-benchmark) and fail when a benchmark got slower than
# the committed baseline (results/benchmarks/baseline.json) by more than the threshold. Each
# benchmark's min time is divided by the min of a yardstick timed before every round, so the
# machine's speed of the moment cancels; gate_check.py computes the verdict and says why
# (threshold 40 % on the baseline's kind of machine, 200 % elsewhere). Refresh the baseline on the
# machine that runs the gate with `tests/benchmarks/gate.sh --update`.
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
"$PY" "${RUN[@]}" --benchmark-json="$NOW/benchmarks.json" "$@"
"$PY" tests/benchmarks/gate_check.py "$BASELINE" "$NOW/benchmarks.json"
