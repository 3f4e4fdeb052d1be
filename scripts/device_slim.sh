#!/usr/bin/env bash
# Makes the working tree small enough for a device call, then puts it back.
#
#   bash scripts/device_slim.sh aside [RUN_DIR ...]   # before the call: results/ moves out of the tree
#   bash scripts/device_slim.sh restore               # after it: results/ comes back whole
#
# The device takes at most 64 MiB of working tree (on-disk sizes) with the carried paths, and the
# committed results (their report.html files above all) come near that alone. `aside` moves
# results/ to a folder beside the checkout and keeps in the tree only results/calibration (the
# reports' predicted-vs-measured section reads it) and the run folders named, which a command such as
# `parabench fidelity RUN_DIR` reads there. `restore` puts results/ back; anything written under
# results/ in between is kept (moved into the restored tree where no file of that name exists).
# PARABENCH_ROOT names another checkout (the tests use it).
set -euo pipefail
root=${PARABENCH_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
aside="$root/../.parabench-results-aside"
cd "$root"
case "${1:-}" in
  aside)
    shift
    [ -e "$aside" ] && { echo "device_slim: $aside exists: restore first" >&2; exit 1; }
    [ -d results ] || { echo "device_slim: no results/ in $root" >&2; exit 1; }
    keep=()
    for run in "$@"; do
      [ -d "$run" ] || { echo "device_slim: no run folder $run" >&2; exit 1; }
      abs=$(cd "$run" && pwd)
      case "$abs" in "$root"/results/?*) keep+=("${abs#"$root"/results/}") ;;
        *) echo "device_slim: $run is not under results/" >&2; exit 1 ;; esac
    done
    mv results "$aside"
    mkdir -p results
    if [ -d "$aside/calibration" ]; then cp -a "$aside/calibration" results/; fi
    for rel in "${keep[@]+"${keep[@]}"}"; do
      mkdir -p "results/$(dirname "$rel")"
      cp -a "$aside/$rel" "results/$rel"
    done
    echo "device_slim: results/ is aside in $aside; run scripts/device_slim.sh restore after the call"
    ;;
  restore)
    [ -d "$aside" ] || { echo "device_slim: nothing aside ($aside)" >&2; exit 1; }
    # what the call wrote under results/ in between joins the tree; the committed files win
    (cd results && find . -type f -print0) | while IFS= read -r -d '' f; do
      [ -e "$aside/$f" ] || { mkdir -p "$aside/$(dirname "$f")" && mv "results/$f" "$aside/$f"; }
    done
    rm -rf results
    mv "$aside" results
    echo "device_slim: results/ restored"
    ;;
  *)
    echo "usage: scripts/device_slim.sh aside [RUN_DIR ...] | restore" >&2
    exit 2
    ;;
esac
