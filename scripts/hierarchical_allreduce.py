"""Flat against hierarchical all-reduce across nodes: time per call, bus bandwidth, and each
form's intra- and inter-node bytes per rank (the communication meter's ``by_link``) against theory.

Forms, each on the same tensor:
- ``flat``: one all-reduce over the world (NCCL's or gloo's own);
- ``hier``: reduce-scatter inside the node, all-reduce of the shard across nodes (ranks with the
  same local rank), all-gather inside the node, with the backend's collectives;
- ``ref-flat`` / ``ref-hier``: the same two algorithms written on send/recv
  (``reference_impls.collectives.ring_allreduce`` / ``hierarchical_allreduce``), whose every
  message the meter attributes exactly.

Run it on every node through torchrun, e.g. 4 GPUs of one host as 2 emulated nodes whose link is
forced through sockets (``parabench.multinode.emulation_env``)::

    for r in 0 1; do
      env $(python -c "from parabench.multinode import emulation_env as e; \\
print(' '.join(f'{k}={v}' for k, v in e($r, 2).items()))") \\
      torchrun --nnodes 2 --node-rank $r --rdzv-backend static --rdzv-endpoint 127.0.0.1:29500 \\
        --nproc-per-node 2 scripts/hierarchical_allreduce.py --mib 256 --out hier.json &
    done; wait

On CPU (gloo), one torchrun of 4 processes laid out as 2 nodes: ``PARABENCH_NODE_SIZE=2 torchrun
--standalone --nproc-per-node 4 scripts/hierarchical_allreduce.py --mib 4``. Rank 0 prints a table
and writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parabench.distributed import init_process_group, pick_device, synchronize  # noqa: E402
from parabench.meters.comm import CommMeter  # noqa: E402
from parabench.multinode import NodeLayout  # noqa: E402
from parabench.results import recorded_env  # noqa: E402
from reference_impls._compat import all_gather_into, reduce_scatter_into  # noqa: E402
from reference_impls.collectives import hierarchical_allreduce, node_groups, ring_allreduce  # noqa: E402


def library_hierarchical(t: torch.Tensor, intra, inter, m: int) -> torch.Tensor:
    flat = t.view(-1)
    size = -(-flat.numel() // m)
    padded = flat.new_zeros(size * m)
    padded[: flat.numel()].copy_(flat)
    shard = flat.new_empty(size)
    reduce_scatter_into(shard, padded, group=intra)
    dist.all_reduce(shard, group=inter)
    all_gather_into(padded, shard, group=intra)
    flat.copy_(padded[: flat.numel()])
    return t


def theory(form: str, nbytes: int, layout: NodeLayout) -> dict:
    """Wire bytes per rank under the meter's convention (what it counts: sends, and for the
    send/recv forms receives too)."""
    n, m, k = layout.world_size, layout.local_world_size, layout.nnodes
    if form == "flat":  # one world ring over k nodes: k/n of 2(n-1)/n N crosses
        wire = 2 * (n - 1) / n * nbytes
        return {"intra_node": wire * (1 - k / n), "inter_node": wire * k / n}
    if form == "hier":
        shard = nbytes / m
        return {"intra_node": 2 * (m - 1) / m * nbytes, "inter_node": 2 * (k - 1) / k * shard}
    if form == "ref-hier":  # sends and receives
        return {"intra_node": 2 * 2 * (m - 1) / m * nbytes, "inter_node": 2 * 2 * (k - 1) / k * nbytes / m}
    return {}  # ref-flat: a rank's share depends on its place in the ring; the meter reports it


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=64.0, help="tensor size (MiB, fp32 on CPU, bf16 on GPU)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = pick_device("auto")
    init_process_group(device, timeout_s=600)
    layout = NodeLayout.from_env()
    intra, inter = node_groups(layout.nnodes, layout.local_world_size)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    numel = int(args.mib * 2**20) // torch.tensor([], dtype=dtype).element_size()
    x = torch.ones(numel, dtype=dtype, device=device)
    m = layout.local_world_size
    forms = {
        "flat": lambda t: dist.all_reduce(t),
        "hier": lambda t: library_hierarchical(t, intra, inter, m),
        "ref-flat": lambda t: ring_allreduce(t),
        "ref-hier": lambda t: hierarchical_allreduce(t, intra, inter),
    }
    rows = {}
    for name, fn in forms.items():
        t = x.clone()
        fn(t)  # warm-up: communicators, buffers
        with CommMeter() as meter:
            fn(t)
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn(t)
        synchronize(device)
        seconds = (time.perf_counter() - start) / args.iters
        nbytes = x.numel() * x.element_size()
        by_link = meter.summary()["by_link"]
        rows[name] = {
            "seconds": seconds,
            "busbw_gbps": 2 * (layout.world_size - 1) / layout.world_size * nbytes / seconds / 1e9,
            "intra_node_bytes": by_link["intra_node"]["wire_bytes"],
            "inter_node_bytes": by_link["inter_node"]["wire_bytes"],
            "theory": theory(name, nbytes, layout),
        }
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:
        print(f"{layout.nnodes} nodes x {layout.local_world_size} ranks, {args.mib:g} MiB {dtype}, {device.type}")
        print(f"{'form':10s} {'ms':>9} {'busbw GB/s':>11} {'intra MB (rank 0)':>18} {'inter MB (rank 0)':>18}  theory")
        for name, r in rows.items():
            th = r["theory"]
            print(
                f"{name:10s} {r['seconds'] * 1e3:9.2f} {r['busbw_gbps']:11.2f} {r['intra_node_bytes'] / 1e6:18.3f} "
                f"{r['inter_node_bytes'] / 1e6:18.3f}  "
                + (f"{th['intra_node'] / 1e6:.3f} / {th['inter_node'] / 1e6:.3f}" if th else "-")
            )
        if args.out:
            Path(args.out).write_text(
                json.dumps({"layout": vars(layout), "per_rank": everyone, "env": recorded_env()}, default=str)
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
