"""Host-side cost of one tensor-parallel training step, per strategy, on 2 gloo ranks (CPU).

On an H100 the device time of ref.tp and torch.tp is the same work; what differs is how many ops the
host dispatches and how many of them go through DTensor's dispatch (sharding propagation,
redistribution checks, wrapping). This script counts, for one training step of each strategy:

* collectives and their payload bytes (``parabench.meters.comm.CommMeter``);
* aten ops dispatched: ``dtensor_ops`` = ops called with a DTensor argument (each one a pass through
  DTensor's dispatcher), ``plain_ops`` = ops on plain tensors (including those DTensor issues on its
  local shards);
* host time per step (min and median of ``--steps``): wall time, and the CPU time of the main thread
  (``time.thread_time``: no waiting for the other rank or for a shared machine's other processes),
  with the model made narrow so that compute is small beside dispatch.

It also runs the step of the peer-fidelity script ``parabench/fidelity/scripts/torch_tp.py`` (its plan,
model and optimizer, imported from the script's own module).

Run from the repository root: ``python suites/studies/scripts/tp_dispatch_audit.py --layers 24 --recipe master``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

STRATEGIES = ("ref.tp", "torch.tp", "ref.tp_sp", "torch.tp_sp", "fidelity.torch_tp")


class OpCounter(TorchDispatchMode):
    """Counts aten ops: those with a DTensor (wrapper subclass) argument, then, as DTensor decomposes
    them into ops on its local tensors, those on plain tensors."""

    def __init__(self):
        super().__init__()
        self.dtensor = Counter()
        self.plain = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        if any(isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t) for t in flat):
            self.dtensor[str(func)] += 1
            return NotImplemented
        self.plain[str(func)] += 1
        return func(*args, **(kwargs or {}))


class _GcLog:
    """Python's cyclic collections while active: how many per generation, and their time."""

    def __init__(self):
        self.count, self.seconds, self._t0 = Counter(), 0.0, 0.0

    def _cb(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.count[info["generation"]] += 1

    def __enter__(self):
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._cb)


def _fidelity_step(cfg, recipe: str):
    """The step of parabench/fidelity/scripts/torch_tp.py, built by the script's own functions."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    import parabench.fidelity

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(parabench.fidelity.__file__)), "scripts"))
    import _gpt
    import torch_tp as script

    args = argparse.Namespace(
        n_layer=cfg.n_layers, n_head=cfg.n_heads, d_model=cfg.d_model, vocab=cfg.vocab_size, seq_len=cfg.seq_len,
        seed=1234, lr=3e-4,
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _gpt.build_gpt(args, torch.device("cpu"))
    master = recipe == "master"
    if master:
        model = model.to(torch.bfloat16)
    parallelize_module(model, mesh, script.plan(args.n_layer))
    params = list(model.parameters())
    if master:
        opt = _gpt.MasterWeightAdamW(params, fused=False, **_gpt.adamw_hyper(args))
    else:
        groups = [
            {"params": [p for p in params if hasattr(p, "placements")]},
            {"params": [p for p in params if not hasattr(p, "placements")]},
        ]
        opt = torch.optim.AdamW(groups, **_gpt.adamw_hyper(args), foreach=True)
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if not master else contextlib.nullcontext

    def step(x, y):
        with amp(), loss_parallel():
            loss = _gpt.lm_loss(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _rank(opts: dict) -> dict:
    from parabench import models
    from parabench.case import Case
    from parabench.meters.comm import CommMeter
    from parabench.registry import get_strategy
    from parabench.worker import local_batches, make_spec

    cfg = models.GPTConfig(
        n_layers=opts["layers"], d_model=opts["d_model"], n_heads=opts["heads"], vocab_size=256, seq_len=opts["seq"]
    )
    models.MODEL_LADDER["audit"] = cfg
    torch.set_num_threads(1)
    out = {}
    for name in opts["strategies"]:
        strategy = name if name in ("ref.tp", "ref.tp_sp", "torch.tp", "torch.tp_sp") else "torch.tp"
        case = Case(
            model="audit", strategy=strategy, world_size=2, precision="bf16", recipe=opts["recipe"],
            micro_batch=opts["micro_batch"], options={"tp": 2, **opts["options"]},
        )  # fmt: skip
        spec = make_spec(case, torch.device("cpu"))
        n = opts["steps"] + 3
        batches = local_batches(case, spec, n)
        if name == "fidelity.torch_tp":
            step = _fidelity_step(cfg, opts["recipe"])
        else:
            trainer = get_strategy(strategy).build(spec)
            step = trainer.train_step
        step(*batches[0])  # warm-up: optimizer states, caches
        with CommMeter() as comm:
            step(*batches[1])
        with OpCounter() as ops:
            step(*batches[2])
        gc_log = _GcLog()
        times, cpu = [], []
        with gc_log:
            for x, y in batches[3:]:
                t0, c0 = time.perf_counter(), time.thread_time()
                step(x, y)
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
        gc.disable()
        try:
            times_nogc = []
            for x, y in batches[3:]:
                t0 = time.perf_counter()
                step(x, y)
                times_nogc.append(time.perf_counter() - t0)
        finally:
            gc.enable()
        summary = comm.summary()
        out[name] = {
            "collectives": {k: v["calls"] for k, v in summary["by_kind"].items()},
            "scalar_collectives": {k: v["calls"] for k, v in summary["scalar_ops"].items()},
            "comm_payload_bytes": summary["payload_bytes"],
            "dtensor_ops": sum(ops.dtensor.values()),
            "plain_ops": sum(ops.plain.values()),
            "top_dtensor_ops": ops.dtensor.most_common(opts["top"]),
            "plain_op_counts": dict(ops.plain),
            "host_cpu_ms_min": 1e3 * min(cpu),
            "host_cpu_ms_median": 1e3 * statistics.median(cpu),
            "host_ms_min": 1e3 * min(times),
            "host_ms_median": 1e3 * statistics.median(times),
            "host_ms_min_gc_off": 1e3 * min(times_nogc),
            "host_ms_median_gc_off": 1e3 * statistics.median(times_nogc),
            "gc_per_step": {g: c / len(times) for g, c in gc_log.count.items()},
            "gc_ms_per_step": 1e3 * gc_log.seconds / len(times),
            "gc_tracked_objects": len(gc.get_objects()),
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--recipe", choices=("master", "amp"), default="master")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=0, help="list the N most frequent DTensor ops")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--json", help="write every number (and the per-op counts) here")
    ap.add_argument("--options", default="{}", help="JSON case options for the parabench strategies")
    a = ap.parse_args()
    from parabench.distributed import run_on_gloo

    opts = {
        "layers": a.layers, "d_model": a.d_model, "heads": a.heads, "seq": a.seq, "micro_batch": a.micro_batch,
        "recipe": a.recipe, "steps": a.steps, "top": a.top, "strategies": a.strategies.split(","),
        "options": json.loads(a.options),
    }  # fmt: skip
    res = run_on_gloo(_rank, 2, opts)[0]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(
        f"{'strategy':20} {'collectives':34} {'MiB':>8} {'DTensor ops':>11} {'plain ops':>9} {'ms min':>7} {'ms med':>7}"
    )
    for name, r in res.items():
        coll = " ".join(f"{k}:{v}" for k, v in r["collectives"].items())
        print(
            f"{name:20} {coll:34} {r['comm_payload_bytes'] / 2**20:8.2f} {r['dtensor_ops']:11d} {r['plain_ops']:9d} "
            f"{r['host_ms_min']:7.1f} {r['host_ms_median']:7.1f} {r['host_cpu_ms_min']:7.1f} {r['host_cpu_ms_median']:7.1f}"
        )
        print(
            f"    gc on/off: min {r['host_ms_min']:.1f}/{r['host_ms_min_gc_off']:.1f} ms, median "
            f"{r['host_ms_median']:.1f}/{r['host_ms_median_gc_off']:.1f} ms; collections/step "
            f"{dict(sorted(r['gc_per_step'].items()))}, {r['gc_ms_per_step']:.2f} ms/step in gc, "
            f"{r['gc_tracked_objects']} tracked objects"
        )
        for op, c in r["top_dtensor_ops"]:
            print(f"    {c:6d}  {op}")


if __name__ == "__main__":
    main()
