"""Is a GPU host's single-core speed a property of the core or of the minute? One process pins its
thread to each CPU in turn and times, on each: one tiny CUDA dispatch (the worker's host probe,
``parabench.meters.host.probe``) and a pure-Python loop (no driver), with the VM's steal time
(/proc/stat) over each sweep. Several sweeps, some seconds apart, separate a slow core (same core
slow in every sweep) from a slow minute (every core slow in one sweep).

    PYTHONPATH=. python suites/studies/host-speed-h200x1.py --sweeps 6 --pause-s 10 > host-speed.json
"""

import argparse
import json
import os
import sys
import time

import torch

from parabench.meters.host import probe


def stat_cpu() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def python_loop_us(n: int = 200_000) -> float:
    t0 = time.perf_counter()
    s = 0
    for i in range(n):
        s += i
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweeps", type=int, default=6)
    ap.add_argument("--pause-s", type=float, default=10.0)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    cuda = torch.device("cuda")
    tick = os.sysconf("SC_CLK_TCK")
    sweeps = []
    for sweep in range(args.sweeps):
        t0, s0 = time.time(), stat_cpu()
        rows = []
        for core in cores:
            os.sched_setaffinity(0, {core})
            time.sleep(0.01)
            rows.append(
                {
                    "core": core,
                    "dispatch_us": round(probe(cuda)["dispatch_us"], 3),
                    "python_loop_ns": round(python_loop_us() * 1e3, 2),
                }
            )
        s1, t1 = stat_cpu(), time.time()
        sweeps.append(
            {
                "t_s": round(t0, 1),
                "wall_s": round(t1 - t0, 2),
                "steal_cpu_share": round((s1[7] - s0[7]) / tick / (t1 - t0), 4),
                "cores": rows,
            }
        )
        os.sched_setaffinity(0, set(cores))
        print(
            json.dumps(
                {
                    "sweep": sweep,
                    "dispatch_us_min_max": [min(r["dispatch_us"] for r in rows), max(r["dispatch_us"] for r in rows)],
                    "steal": sweeps[-1]["steal_cpu_share"],
                }
            ),
            file=sys.stderr,
        )
        if sweep + 1 < args.sweeps:
            time.sleep(args.pause_s)
    with open("/proc/cpuinfo") as f:
        model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    print(json.dumps({"cpu_model": model, "cores": cores, "load_average": os.getloadavg(), "sweeps": sweeps}, indent=1))


if __name__ == "__main__":
    main()
