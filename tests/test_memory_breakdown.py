"""The memory-breakdown meter (parabench/meters/memory_breakdown.py) and the reference ZeRO memory bounds.

Two gloo ranks, the ``small`` model in bf16 with buckets of 0.125 MiB (about three per block, as 25 MiB
buckets are for gpt-1.3b), one warm-up step, then one step under the meter:

* the meter's categories add up to its peak;
* ref.zero2 never holds more gradient bytes than its fp32 main-gradient shard plus a bounded number of
  gradient buckets (``in_flight`` reduce-scatters outstanding, each with its receive shard, and at most
  two buckets being filled), both at the meter's peak and at every gradient hook of the step;
* ref.zero2 peaks no higher than ref.zero1 on the same case.
"""

from __future__ import annotations

import torch

from parabench.distributed import run_on_gloo
from parabench.suite import Case

BUCKET_MB = 0.125


def _case(strategy):
    return Case(model="small", strategy=strategy, world_size=2, precision="bf16", micro_batch=4, seq_len=64,
                device="cpu", options={"bucket_mb": BUCKET_MB})


def _measure(case_dicts):
    from parabench.meters.memory_breakdown import measure_step
    from parabench.strategies import get_strategy
    from parabench.worker import local_batches, make_spec

    out = {}
    for cd in case_dicts:
        case = Case.from_dict(cd)
        spec = make_spec(case, torch.device("cpu"))
        trainer = get_strategy(case.strategy).build(spec)
        (x0, y0), (x1, y1) = local_batches(case, spec, 2)
        trainer.train_step(x0, y0)
        # High-water mark of the gradient buckets alive, sampled at every gradient hook.
        live = {"buckets": 0, "bytes": 0}
        ready = trainer._grad_ready

        def sample(p, b, s):
            ready(p, b, s)
            bufs = [g for g in trainer._gbuf if g is not None] + [o for _, o, _ in trainer._pending]
            live["buckets"] = max(live["buckets"], sum(g is not None for g in trainer._gbuf))
            live["bytes"] = max(live["bytes"], sum(t.numel() * t.element_size() for t in bufs))

        trainer._grad_ready = sample
        for h in trainer._hooks:
            h.remove()
        trainer._hooks = [p.register_post_accumulate_grad_hook(lambda p, b=b, s=s: trainer._grad_ready(p, b, s))
                          for b in trainer.buckets for p, s in zip(b.params, b.starts)]
        _, res = measure_step(trainer, x1, y1)
        elem = trainer.flat_param.element_size()
        res["bucket_bytes_max"] = max(b.numel for b in trainer.buckets) * elem
        res["main_shard_bytes"] = 4 * sum(b.numel for b in trainer.buckets) // trainer.world
        res["in_flight"], res["world"], res["live"] = trainer.in_flight, trainer.world, live
        trainer.close()
        out[case.strategy] = res
    return out


def test_memory_breakdown_zero():
    res = run_on_gloo(_measure, 2, [_case("ref.zero1").to_dict(), _case("ref.zero2").to_dict()])
    for rank in res:
        for strategy, r in rank.items():
            cats = r["by_category"]
            assert sum(cats.values()) == r["peak_total_bytes"] == r["peak_bytes"], (strategy, r)
            assert r["peak_bytes"] > r["baseline_bytes"] > 0
            assert cats["parameters"] > 0 and cats["optimizer"] > 0 and cats["activations"] > 0
        z2 = rank["ref.zero2"]
        # in_flight outstanding buckets (+ their receive shard) and at most two being filled.
        bound_buckets = z2["in_flight"] + 2
        bound = (z2["main_shard_bytes"] + bound_buckets * z2["bucket_bytes_max"]
                 + z2["in_flight"] * z2["bucket_bytes_max"] // z2["world"])
        assert z2["by_category"]["gradients"] <= bound, (z2["by_category"], bound)
        assert z2["live"]["buckets"] <= bound_buckets, z2["live"]
        assert z2["live"]["bytes"] <= bound - z2["main_shard_bytes"], (z2["live"], bound)
        assert z2["peak_bytes"] <= rank["ref.zero1"]["peak_bytes"], (z2["peak_bytes"], rank["ref.zero1"]["peak_bytes"])
