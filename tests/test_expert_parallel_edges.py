"""Expert parallelism at its edges, over gloo on CPU (fp32):

* dispatch -> combine with identity experts gives every row back bitwise, for uneven splits, a
  rank that sends nothing to a peer, experts that get no rows and a rank that receives nothing;
* routing forced so that experts get no tokens, down to a whole rank whose experts get none in a
  layer (the case that deadlocked ref.ep on 2 GPUs: that rank's graph dropped both backward
  all-to-alls of the layer), matches one process: loss, every gradient, and which experts were
  left without a gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from parabench.distributed import run_on_gloo
from parabench.models import MOE_ROUTING, GPTConfig, MoE, build_model, lm_loss
from reference_impls.expert_parallel import ExpertParallel, ExpertParallelMoE

CFG = GPTConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=128, seq_len=16, n_experts=4, top_k=2)
MICRO_BATCH = 2

# send_counts[src][dst][local expert], world 2, 2 local experts per rank
ROUND_TRIP_COUNTS = {
    "uneven": [[[3, 0], [1, 5]], [[0, 2], [7, 1]]],
    "nothing_to_a_peer": [[[4, 2], [0, 0]], [[1, 1], [3, 0]]],
    "rank1_receives_nothing": [[[4, 2], [0, 0]], [[1, 3], [0, 0]]],
    "nothing_at_all_from_rank0": [[[0, 0], [0, 0]], [[2, 0], [0, 3]]],
}


def _round_trip(counts):
    rank = dist.get_rank()
    moe = ExpertParallelMoE(MoE(CFG), dist.group.WORLD, MOE_ROUTING)
    send_counts = torch.tensor(counts[rank])
    g = torch.Generator().manual_seed(rank)
    rows = torch.randn(int(send_counts.sum()), CFG.d_model, generator=g)
    recv, recv_counts, splits = moe.dispatch(rows, send_counts)
    expected_recv_counts = torch.stack([torch.tensor(counts[src][rank]) for src in range(dist.get_world_size())])
    back = moe.combine(recv.clone(), splits)  # identity experts
    return {
        "bitwise": torch.equal(back, rows),
        "recv_counts": torch.equal(recv_counts, expected_recv_counts),
        "recv_rows": recv.shape[0],
        "expected_rows": int(expected_recv_counts.sum()),
    }


@pytest.mark.parametrize("name", sorted(ROUND_TRIP_COUNTS))
def test_dispatch_combine_round_trip_is_bitwise(group, name):
    for rank, res in enumerate(r["round_trip"][name] for r in group):
        assert res["bitwise"], f"rank {rank}: combine(dispatch(rows)) != rows"
        assert res["recv_counts"] and res["recv_rows"] == res["expected_rows"], (rank, res)


def _force_routing(model: nn.Module, banned: dict[int, list[int]]) -> None:
    """Give the router of MoE layer i a bias of -1e4 on the experts in ``banned[i]``: no token can
    choose them (top-2 of the rest), whatever the input."""
    for i, experts in banned.items():
        moe = model.blocks[i].mlp
        biased = nn.Linear(CFG.d_model, CFG.n_experts, bias=True)
        with torch.no_grad():
            biased.weight.copy_(moe.router.weight)
            biased.bias.zero_()
            biased.bias[experts] = -1e4
        moe.router = biased


def _batch(world: int):
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, CFG.vocab_size, (world * MICRO_BATCH, CFG.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _ep_grads_vs_one_process(banned):
    rank, world = dist.get_rank(), dist.get_world_size()
    full = build_model(CFG, seed=3)
    _force_routing(full, banned)
    single = copy.deepcopy(full)
    inputs, targets = _batch(world)

    ep = ExpertParallel(full, dist.group.WORLD, MOE_ROUTING, lm_loss)
    mine = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
    loss = ep.forward_backward(inputs[mine], targets[mine], grad_accum=1)
    grads = {ep.global_name(n): (None if p.grad is None else p.grad.clone()) for n, p in full.named_parameters()}
    received = {i: m.stats["received_rows"] for i, m in ep.moe_layers.items()}
    losses = [None] * world
    dist.all_gather_object(losses, float(loss))
    parts = [None] * world
    dist.all_gather_object(parts, grads)
    if rank != 0:
        return None

    ref_loss = lm_loss(single(inputs), targets)
    ref_loss.backward()
    merged: dict = {}
    for part in parts:  # dense gradients agree across ranks (all-reduced); an expert's is on its owner only
        for n, g in part.items():
            if g is not None or n not in merged:
                merged[n] = g
    out = {"loss": sum(losses) / world, "ref_loss": float(ref_loss), "received": received, "mismatch": [], "none": []}
    for n, p in single.named_parameters():
        g = merged[n]
        if (g is None) != (p.grad is None):
            out["mismatch"].append(f"{n}: grad None in {'ep' if g is None else 'one process'} only")
        elif g is None:
            out["none"].append(n)
        elif not torch.allclose(g, p.grad, rtol=1e-5, atol=1e-6):
            out["mismatch"].append(f"{n}: max |diff| {float((g - p.grad).abs().max()):.3g}")
    return out


BANNED = {
    "one-expert-starved": {1: [1]},
    "rank0-experts-all-starved-in-a-layer": {1: [0, 1]},
    "each-rank-starved-in-one-layer": {1: [0, 1], 3: [2, 3]},
}


def _every_case():
    """Every round trip and every starved routing, one after another on this rank."""
    return {
        "round_trip": {name: _round_trip(counts) for name, counts in ROUND_TRIP_COUNTS.items()},
        "starved": {name: _ep_grads_vs_one_process(banned) for name, banned in BANNED.items()},
    }


@pytest.fixture(scope="module")
def group():
    """Each rank's results: one spawned 2-rank group serves every test of the module."""
    return run_on_gloo(_every_case, 2)


@pytest.mark.parametrize("name", list(BANNED))
def test_starved_experts_match_one_process(group, name):
    banned = BANNED[name]
    res = group[0]["starved"][name]
    assert abs(res["loss"] - res["ref_loss"]) <= 1e-5 * abs(res["ref_loss"])
    assert not res["mismatch"], res["mismatch"]
    starved = {f"blocks.{i}.mlp.experts.{e}." for i, es in banned.items() for e in es}
    assert {n.rsplit(".", 2)[0] + "." for n in res["none"]} == starved  # exactly the banned experts got no gradient
    if banned.get(1) == [0, 1]:
        assert res["received"][1] == 0  # rank 0 received no row in layer 1: the deadlock case
