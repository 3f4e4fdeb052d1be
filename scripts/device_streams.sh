#!/usr/bin/env bash
# Suite streams on disjoint GPUs of one host that outlive a single device call.
#
#   bash scripts/device_streams.sh start NAME GPUS 'SUITE [ARGS...]' ['SUITE [ARGS...]' ...]
#   bash scripts/device_streams.sh wait SECONDS   # until every stream ended, or SECONDS passed
#   bash scripts/device_streams.sh stop NAME
#   bash scripts/device_streams.sh pack OUT_DIR   # OUT_DIR/streams.tgz: every stream's runs and logs
#
# A device call may last 10 minutes, and a suite cut off by device_run.sh's deadline loses the case
# in flight. A stream runs detached (setsid), so it goes on between calls while the machine stays
# warm (its processes survive the call's end, in another PID namespace than the next call's, so
# streams are watched through files and stopped by command line); a later call waits on it and
# packs what it recorded. Each stream runs its items in order,
# each item one `device_run.sh` of one suite with the item's ARGS as PARABENCH_ARGS (e.g.
# '--filter w1'), on CUDA_VISIBLE_DEVICES=GPUS with a DEVICE_WORK of its own, so every item of a
# stream resumes the same run ids. An item '@after OTHER' waits until stream OTHER has ended (two
# cases that would not fit the host's memory together, say). The streams run from a private copy of the tree, made once per
# machine, because each call re-syncs the repository copy underneath running processes.
# PARABENCH_HOST_SHARED, if set at `start`, reaches every record's manifest: say there what else
# ran on the host. STREAM_CPUS, if set at `start` (a taskset list, e.g. 0-15), pins the stream and
# every process it starts to those CPUs, so a host-heavy stream (NVMe or CPU offload) leaves the
# other streams' CPUs alone; the manifests' cpus_usable then says how many each had.
set -uo pipefail
root=/tmp/pb-streams
tree=$root/tree
cmd=${1:?start|wait|stop|pack}; shift
mkdir -p "$root"
case $cmd in
  start)
    name=$1 gpus=$2; shift 2
    [ -d "$tree" ] || { mkdir -p "$tree.new" && cp -a "$(dirname "$0")/../." "$tree.new/" && mv "$tree.new" "$tree"; }
    dir=$root/$name
    mkdir -p "$dir/out" "$dir/work"
    printf '%s\n' "$@" > "$dir/items"
    pin=(); [ -n "${STREAM_CPUS:-}" ] && pin=(taskset -c "$STREAM_CPUS")
    cd "$tree" && CUDA_VISIBLE_DEVICES=$gpus DEVICE_WORK=$dir/work setsid nohup "${pin[@]}" bash -c '
      while IFS= read -r item; do
        [ -f "$0/stop" ] && break
        read -r suite args <<< "$item"
        if [ "$suite" = @after ]; then
          while [ ! -f "$0/../$args/done" ]; do sleep 5; done; continue
        fi
        PARABENCH_ARGS="$args" DEADLINE_S=${STREAM_DEADLINE_S:-100000} bash scripts/device_run.sh "$0/out" "$suite"
      done < "$0/items"
      date +%s > "$0/done"' "$dir" > "$dir/stream.log" 2>&1 < /dev/null &
    echo "stream $name on GPUs $gpus${STREAM_CPUS:+, CPUs $STREAM_CPUS}: $# items"
    ;;
  wait)
    end=$(( $(date +%s) + ${1:?seconds} ))
    while [ "$(date +%s)" -lt "$end" ]; do
      running=0
      for d in "$root"/*/; do [ -f "$d/items" ] && [ ! -f "$d/done" ] && running=1; done
      [ $running = 0 ] && break
      sleep 5
    done
    for d in "$root"/*/; do
      [ -f "$d/items" ] || continue
      n=$(basename "$d"); state=running
      [ -f "$d/done" ] && state=done
      echo "stream $n: $state; last: $(grep -E 'ok |oom|failed|timeout|crash' "$d/out/console.txt" 2>/dev/null | tail -1)"
    done
    ;;
  stop)
    d=$root/${1:?name}
    touch "$d/stop"
    # by command line, not PID: a later device call runs in another PID namespace than the stream
    pkill -INT -f "$d/work" 2>/dev/null
    for _ in $(seq 12); do [ -f "$d/done" ] && break; sleep 5; done
    pkill -KILL -f "$d/" 2>/dev/null; [ -f "$d/done" ] || date +%s > "$d/done"
    ;;
  pack)
    out=${1:?out dir}; mkdir -p "$out"
    tar czf "$out/streams.tgz" --exclude='.scratch' --exclude='./tree' -C "$root" .
    ;;
  *) echo "usage: $0 start|wait|stop|pack ..." >&2; exit 2 ;;
esac
