"""How fast a rank's host issues work, probed off the clock: a slow host and a slow strategy look
alike in a step time, and this tells them apart.

Micro-batches of one row make a pipeline host-bound: a stage's forward then lasts as long as
Python, the dispatcher and the kernel launches take to issue it. On the virtual machines the
committed GPU results come from, a gpt-350m one-row GPipe stage issued its forwards at 0.49-0.63 ms
per block in one launch and 0.32-0.42 ms in the next, on the same GPUs at the same clocks, where the
device needs 0.19 ms (docs/results.md, "2026-11-27, late evening"). The probe times ``ops`` tiny in-place adds on the rank's device with no
synchronisation between them (on CUDA: dispatch plus kernel launch, the queue never fills), takes
the median of ``repeats`` rounds, and notes the CPU the rank's main thread was on. The worker
probes before the warm-up and after the timed steps, so the record carries the host's speed over
the very launch whose steps it times.

The probe reads the host's speed, not what the host did during the timed steps. ``cpu_times`` is
read just before the first and just after the last timed step (two getrusage calls, off the
clock), and ``cpu_use`` turns the difference into what the rank's main thread did meanwhile: its
CPU time as a share of the wall time, and its context switches per step. Involuntary switches are
other threads or processes taking the thread's CPU: contention, whatever the thread was doing. The
CPU share reads 1 both for a thread that issues work all along and for one that spin-waits on the
device (CUDA's default wait spins while the process has a CPU to itself), so it tells a host that
blocked (well below 1) from one that did not, and no more.

``cpu_times`` also reads the whole host's busy CPU time (/proc/stat) and load average, so
``cpu_use`` gives ``other_cpu_share``, the CPUs kept busy by anything but this process, which
``parabench.metrics.foreign_load`` turns into what processes outside the launch took.
``run_clock`` and ``run_host_load`` read the same figures over a whole suite run, for its manifest's
``host_load``: the load average at its start and end, and the CPU time that processes outside the run
took meanwhile (the host's busy time less the runner's and every launch's, torchrun and its ranks
included). On a shared CPU the gloo timings move with that figure (two smoke runs on one laptop, one
busy and one quiet, moved per case by 0.58-4.4x), and the report warns when it was high.
``thread_cpu_s`` and ``busiest_threads`` split the process's CPU by thread. On one H200, every
launch of DeepSpeed ZeRO-3 and FSDP2 at gpt-350m kept exactly one CPU busy, its main thread and the
autograd engine's device thread taking turns: such a step lasts as long as one core takes to run
the library's Python, and moves with that core's speed
(results/studies/launch-spread-h200x1/NOTES.md). ``process_facts`` names the CPUs a rank may use
and its thread pools.

``GcPauses`` counts Python's garbage collections over the timed steps, by generation, with the time
each took (a ``gc.callbacks`` hook: two clock reads per collection, none otherwise). A full
collection walks every live Python object, compiled graphs' included, and the other ranks wait for
it in their next collective: a rank's pause becomes everyone's slow step.
"""

from __future__ import annotations

import gc
import os
import statistics
import time

try:
    import resource
except ImportError:  # not on Windows: no CPU accounting there
    resource = None


def current_cpu() -> int | None:
    """The CPU this thread last ran on (Linux: field 39 of /proc/thread-self/stat), or None."""
    try:
        with open("/proc/thread-self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[36])  # field 39 of the whole line; fields here start at field 3
    except (OSError, IndexError, ValueError):
        return None


def probe(device, ops: int = 200, repeats: int = 5) -> dict:
    """``dispatch_us``: the host's median time to issue one tiny op on ``device`` (a torch.device), in µs;
    ``cpu``: the CPU the calling thread ran on."""
    import torch  # here, not above: the runner reads the run's host load without loading torch

    from parabench.distributed import synchronize

    x = torch.zeros(1, device=device)
    x.add_(1.0)  # the first call's one-off costs (kernel load, dispatcher caches) stay out
    synchronize(device)
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(ops):
            x.add_(1.0)
        rounds.append((time.perf_counter() - t0) / ops)
        synchronize(device)
    return {"dispatch_us": statistics.median(rounds) * 1e6, "cpu": current_cpu()}


def _host_busy_s(ticks: list[int] | None) -> float | None:
    """Every CPU's non-idle time since boot, in seconds, from ``_proc_stat_cpu`` (user, nice, system,
    irq, softirq and steal; idle and iowait left out), or None where there is no /proc/stat."""
    if ticks is None:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, *rest = ticks
    steal = rest[0] if rest else 0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _host_steal_s(ticks: list[int] | None) -> float | None:
    """Every CPU's stolen time since boot, in seconds (/proc/stat's eighth field): the time a virtual
    machine's CPUs were ready to run and the hypervisor ran something else. A host-bound step on a
    VM whose neighbours are busy slows by it, and nothing inside the VM shows it otherwise."""
    if ticks is None or len(ticks) < 8:
        return None
    return ticks[7] / os.sysconf("SC_CLK_TCK")


def _proc_stat_cpu() -> list[int] | None:
    """The whole host's CPU times since boot, in clock ticks (the first line of /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 8 or fields[0] != "cpu":
        return None
    return [int(x) for x in fields[1:]]


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_times() -> dict | None:
    """The calling thread's and its process's CPU use so far (getrusage), with the wall clock, the
    CPU the thread is on, the whole host's busy CPU time and its load average; None where the
    platform has no per-thread accounting."""
    if resource is None or not hasattr(resource, "RUSAGE_THREAD"):
        return None
    wall = time.perf_counter()
    thread = resource.getrusage(resource.RUSAGE_THREAD)
    process = resource.getrusage(resource.RUSAGE_SELF)
    ticks = _proc_stat_cpu()
    return {
        "wall_s": wall,
        "thread_cpu_s": thread.ru_utime + thread.ru_stime,
        "process_cpu_s": process.ru_utime + process.ru_stime,
        "host_busy_s": _host_busy_s(ticks),
        "host_steal_s": _host_steal_s(ticks),
        "load_average": _load_average(),
        "involuntary_switches": thread.ru_nivcsw,
        "voluntary_switches": thread.ru_nvcsw,
        "cpu": current_cpu(),
    }


def run_clock() -> dict:
    """A reading for ``run_host_load``: the wall clock, the host's busy CPU time, the CPU time of this
    process and of every child process it has waited for (torchrun, which waits for its ranks: a
    launch's whole tree once it has ended), the load average and the host's CPU count."""
    own = None
    if resource is not None:
        me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        own = me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime
    return {
        "wall_s": time.monotonic(),
        "host_busy_s": _host_busy_s(_proc_stat_cpu()),
        "run_cpu_s": own,
        "load_average": _load_average(),
        "host_cpus": os.cpu_count(),
    }


def run_host_load(start: dict, end: dict) -> dict:
    """What the host did over a run, between two ``run_clock`` readings taken after the last launch
    ended: ``other_cpu_s``, the host's busy CPU seconds less the run's own (its runner and launches),
    and ``other_cpu_pct``, that over every CPU of the host for the run's wall time; the 1-, 5- and
    15-minute load averages at both ends (the start's before any rank ran, the end's with the run's
    last minute in it). CPU figures are None where there is no /proc/stat or no getrusage. A rank
    that outlived its torchrun and was killed is never waited for: its CPU time counts as another
    process's, so the figure errs towards busy."""
    wall = end["wall_s"] - start["wall_s"]
    cpus = end["host_cpus"]
    readings = (start["host_busy_s"], end["host_busy_s"], start["run_cpu_s"], end["run_cpu_s"])
    busy = own = other = pct = None
    if None not in readings:
        busy = end["host_busy_s"] - start["host_busy_s"]
        own = end["run_cpu_s"] - start["run_cpu_s"]
        other = max(0.0, busy - own)
        pct = 100 * other / (wall * cpus) if wall > 0 and cpus else None

    def rounded(x: float | None, digits: int = 2) -> float | None:
        return None if x is None else round(x, digits)

    return {
        "wall_s": rounded(wall),
        "host_cpus": cpus,
        "load_average_start": start["load_average"],
        "load_average_end": end["load_average"],
        "host_busy_cpu_s": rounded(busy),
        "run_cpu_s": rounded(own),
        "other_cpu_s": rounded(other),
        "other_cpu_pct": rounded(pct, 1),
    }


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """Every thread of this process: native id -> (name, CPU seconds so far), from
    /proc/self/task/<tid>/stat; Python threads are named by ``threading``, the others by the OS
    (NCCL's, CUDA's and torch's threads name themselves). Empty where there is no /proc."""
    import threading

    python_names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
        except OSError:
            continue  # the thread ended meanwhile
        fields = tail.split()
        name = python_names.get(int(tid)) or head.split("(", 1)[1]
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def busiest_threads(before: dict, after: dict, wall_s: float, top: int = 6) -> list[dict]:
    """The threads that took the most CPU between two ``thread_cpu_s`` snapshots, as shares of
    the wall time: where a host-bound step's CPU goes besides its own thread."""
    rows = []
    for tid, (name, cpu) in after.items():
        share = (cpu - before.get(tid, (name, 0.0))[1]) / wall_s if wall_s > 0 else 0.0
        rows.append({"thread": name, "tid": tid, "cpu_share": round(share, 4)})
    rows.sort(key=lambda r: -r["cpu_share"])
    return [r for r in rows[:top] if r["cpu_share"] > 0]


def process_facts() -> dict:
    """What decides how fast this process's host side can run, read once per case: the CPUs it may
    use (its affinity mask), the host's CPU count, and the thread pools torch and OpenMP will use. A
    rank pinned to one core beside busy neighbours, or torch's intra-op pool set to the whole
    machine in every rank, shows here before it shows as a slow or scattered launch."""
    import torch

    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpus_allowed": len(affinity) if affinity is not None else None,
        "cpus_allowed_list": _ranges(affinity) if affinity is not None else None,
        "host_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "boot_id": boot_id(),
    }


def boot_id() -> str | None:
    """The running kernel's boot id (Linux): the same on every process of one machine, new at every
    boot, so two launches with the same id ran on the same machine. Containers on one host share
    it, which is the sense wanted here: the same CPUs. None where the kernel does not expose it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"``, the form of taskset and /proc/<pid>/status."""
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def _other_cpu_share(before: dict, after: dict, wall: float) -> float | None:
    """The host's busy CPU seconds that were not this process's, over the wall seconds: 1.0 is one
    CPU kept busy by something else all along (/proc/stat counts in clock ticks, 10 ms)."""
    if before.get("host_busy_s") is None or after.get("host_busy_s") is None:
        return None
    host = after["host_busy_s"] - before["host_busy_s"]
    mine = after["process_cpu_s"] - before["process_cpu_s"]
    return max(0.0, host - mine) / wall


def _steal_share(before: dict, after: dict, wall: float) -> float | None:
    if before.get("host_steal_s") is None or after.get("host_steal_s") is None:
        return None
    return max(0.0, after["host_steal_s"] - before["host_steal_s"]) / wall


def cpu_use(before: dict | None, after: dict | None, steps: int) -> dict | None:
    """What the thread did between two ``cpu_times``: ``thread_cpu_share`` (its CPU seconds over the
    wall seconds), ``process_cpu_share`` (every thread of the process: compile workers, NCCL's
    proxy, the telemetry sampler; above 1 when several ran at once), context switches per step, and
    the CPUs the thread was on at both ends."""
    if before is None or after is None or steps <= 0:
        return None
    wall = after["wall_s"] - before["wall_s"]
    if wall <= 0:
        return None
    return {
        "wall_s": wall,
        "thread_cpu_share": (after["thread_cpu_s"] - before["thread_cpu_s"]) / wall,
        "process_cpu_share": (after["process_cpu_s"] - before["process_cpu_s"]) / wall,
        # the host's other work meanwhile, in CPUs kept busy: other processes and other ranks
        "other_cpu_share": _other_cpu_share(before, after, wall),
        # the CPUs' worth of time the hypervisor took from the whole VM meanwhile
        "steal_cpu_share": _steal_share(before, after, wall),
        "load_average": [before.get("load_average"), after.get("load_average")],
        "involuntary_switches_per_step": (after["involuntary_switches"] - before["involuntary_switches"]) / steps,
        "voluntary_switches_per_step": (after["voluntary_switches"] - before["voluntary_switches"]) / steps,
        "cpus": [before["cpu"], after["cpu"]],
    }


class GcPauses:
    """Python's garbage collections between ``start`` and ``stop``: how many of each generation, and their pauses."""

    def __init__(self):
        self.collections = [0, 0, 0]
        self.pause_s = 0.0
        self.max_pause_s = 0.0
        self._started: float | None = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause = time.perf_counter() - self._started
        self._started = None
        self.collections[min(info.get("generation", 0), 2)] += 1
        self.pause_s += pause
        self.max_pause_s = max(self.max_pause_s, pause)

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def summary(self, steps: int) -> dict:
        return {
            "collections_by_generation": list(self.collections),
            "pause_s": self.pause_s,
            "pause_s_per_step": self.pause_s / steps if steps > 0 else None,
            "max_pause_s": self.max_pause_s,
            "automatic": gc.isenabled(),
        }
