"""Memory and time of ring attention alone (``reference_impls.context_parallel.ring_attention``):
one forward + backward of the attention of one layer, on gloo ranks (CPU).

Per rank it reports:

* ``saved_bytes``: what autograd keeps between forward and backward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (each storage once; the inputs q, k, v included);
* ``peak_bytes``: the high-water mark of live tensor storages during forward + backward above
  what was live before (q, k, v and the output gradient), from ``parabench.meters.memory_breakdown``
  (every storage an aten op creates, receive buffers included; not what gloo holds inside);
* ``step_s``: median wall time of forward + backward over ``--reps`` after one warm-up.

``--impl FILE`` loads ``ring_attention`` from another copy of the module, e.g. the version before
the fused ring (``git show 13bb0d7^:reference_impls/context_parallel.py > /tmp/ring_old.py``), to
compare before/after on the same shapes (numbers in results/cp-ep-gpu/20261126-063819/NOTES.md):

    PYTHONPATH=. python3 suites/studies/scripts/ring_attention_bench.py --seq-len 4096 --heads 4 --split zigzag
    PYTHONPATH=. python3 suites/studies/scripts/ring_attention_bench.py --seq-len 4096 --heads 4 --impl /tmp/ring_old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import torch

from parabench.distributed import run_on_gloo

MiB = 1 << 20


def _load_ring_attention(path: str | None):
    if path is None:
        from reference_impls.context_parallel import ring_attention

        return ring_attention
    spec = importlib.util.spec_from_file_location("ring_impl_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module.ring_attention


def _measure(args: dict) -> dict:
    import torch.distributed as dist

    from parabench.meters.memory_breakdown import MemoryBreakdown
    from reference_impls.context_parallel import positions_of

    torch.set_num_threads(args["threads"])
    ring_attention = _load_ring_attention(args["impl"])
    group = dist.new_group(list(range(dist.get_world_size())))
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    b, a, s, d = args["batch"], args["heads"], args["seq_len"], args["head_dim"]
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(b, a, s, d, generator=gen) for _ in range(3)]
    mine = positions_of(rank, cp, s, args["split"])
    dtype = getattr(torch, args["dtype"])
    q, k, v = (t[:, :, mine].to(dtype).requires_grad_() for t in full)
    grad_out = torch.randn(b, a, len(mine), d, generator=gen).to(dtype)

    def step():
        out = ring_attention(q, k, v, group, args["split"])
        out.backward(grad_out)
        q.grad = k.grad = v.grad = None

    step()  # warm-up (allocator, gloo connections)

    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ring_attention(q, k, v, group, args["split"])
    out.backward(grad_out)
    q.grad = k.grad = v.grad = None
    del out

    dist.barrier(group)
    with MemoryBreakdown(None, device=torch.device("cpu"), inputs=(q, k, v, grad_out)) as meter:
        step()
    breakdown = meter.result()

    times = []
    for _ in range(args["reps"]):
        dist.barrier(group)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {
        "rank": rank,
        "saved_bytes": sum(saved.values()),
        "peak_bytes": breakdown["peak_bytes"] - breakdown["baseline_bytes"],
        "step_s": statistics.median(times),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default=None, help="file to load ring_attention from (default: the package's)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--split", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    per_rank = run_on_gloo(_measure, a.world, {k: getattr(a, k) for k in vars(a)})
    for r in per_rank:
        print(
            f"rank {r['rank']}: saved {r['saved_bytes'] / MiB:8.1f} MiB   peak +{r['peak_bytes'] / MiB:8.1f} "
            f"MiB   fwd+bwd {r['step_s'] * 1e3:8.1f} ms"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "per_rank": per_rank}, f, indent=1)


if __name__ == "__main__":
    main()
