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
"""

from __future__ import annotations

import statistics
import time

import torch

from parabench.distributed import synchronize


def current_cpu() -> int | None:
    """The CPU this thread last ran on (Linux: field 39 of /proc/thread-self/stat), or None."""
    try:
        with open("/proc/thread-self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[36])  # field 39 of the whole line; fields here start at field 3
    except (OSError, IndexError, ValueError):
        return None


def probe(device: torch.device, ops: int = 200, repeats: int = 5) -> dict:
    """``dispatch_us``: the host's median time to issue one tiny op on ``device``, in µs;
    ``cpu``: the CPU the calling thread ran on."""
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
