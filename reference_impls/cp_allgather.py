"""All-gather context parallelism with the load-balanced split, as Llama 3 trains long sequences.

Llama Team, "The Llama 3 Herd of Models" (2024), section 3.3.2, "Context parallelism": the
sequence is cut into 2×CP chunks and CP rank i holds chunks i and 2×CP−1−i, so that every rank
gets the same share of the causal mask. Instead of passing K and V round a ring while attention
runs (Liu et al. 2023; ``ref.cp_ring``), each layer first *all-gathers* K and V over the CP group,
then computes the attention of its local queries against them. Q never leaves its rank. The
paper accepts the exposed (not overlapped) all-gather for two reasons: it supports any attention
mask (document masks) without changing the communication, and with grouped-query attention K and
V are much smaller than Q, so the O(s) all-gather is small beside O(s²) attention. parabench's
GPT has as many K/V heads as query heads (no GQA), so here K and V are as large as Q and the
all-gather costs relatively more than in the paper.

Forward, per layer: one all-gather of this rank's K and V, stacked ``[2, b, a, n, d]`` (n = s/cp),
into ``[cp, 2, b, a, n, d]``, reordered from rank order to sequence order (rank r's two chunks go
back to chunk positions r and 2cp−1−r). Local query chunk qc (chunks of c = s/2cp positions)
attends without a mask to keys ``[0, qc·c)`` and with the causal mask to its own chunk: two calls
of the fused kernel the ring uses (``block_forward``), merged exactly through their log-sum-exp
(``merge_partials``). Rank i thus computes i + (2cp−1−i) = 2cp−1 full chunk pairs and 2 diagonal
pairs, the same on every rank; with ``split="contiguous"`` (the imbalanced baseline) rank r holds
chunk r of cp and computes r full pairs and one diagonal, so the last rank paces the step. The
work is the ring's, pair for pair (``RingStats`` counts it the same way), only the communication
differs.

Backward: the gradient of an all-gather is a reduce-scatter (the pair Megatron's sequence
parallelism uses, Korthikanti et al. 2022). A rank's queries touch K and V of every earlier
position; given the final output and log-sum-exp, the fused backward kernel of each call
(``block_backward``) returns that call's exact share of dK, dV. A rank sums its shares in fp32
over the whole gathered sequence, puts them back in rank order, rounds them to the compute dtype
and reduce-scatters them, so each rank receives the sum over every rank's queries for its own
chunks. The gathered K and V are kept from forward (2·b·s·h elements per layer, linear in s)
rather than gathered again, so backward's only collective per layer is that reduce-scatter.

Per layer per micro-batch: forward one all-gather of 2·b·s·h elements (the gathered buffer),
backward one reduce-scatter of 2·b·s·h elements (the buffer before scattering), both in the
compute dtype (bf16 under autocast). The rest of the step (token all-gather, one fp32 all-reduce of
the gradients over the group) is ``cp_model.ContextParallel``'s, shared with ring and Ulysses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference_impls._compat import all_gather_into, reduce_scatter_into
from reference_impls.context_parallel import RingStats, block_backward, block_forward, chunks_of, merge_partials


def _chunk_len(n_local: int, cp: int, split: str) -> int:
    return n_local // len(chunks_of(0, cp, split))


def to_sequence_order(gathered: torch.Tensor, cp: int, split: str) -> torch.Tensor:
    """``[cp, ..., n, d]`` (rank r's chunks, in the order it stores them) -> ``[..., s, d]`` in
    sequence order."""
    c = _chunk_len(gathered.shape[-2], cp, split)
    by_chunk = {}
    for r in range(cp):
        for j, chunk in enumerate(chunks_of(r, cp, split)):
            by_chunk[chunk] = gathered[r, ..., j * c : (j + 1) * c, :]
    return torch.cat([by_chunk[i] for i in range(len(by_chunk))], dim=-2)


def to_rank_order(full: torch.Tensor, cp: int, split: str) -> torch.Tensor:
    """The inverse of :func:`to_sequence_order`: ``[..., s, d]`` -> ``[cp, ..., n, d]``."""
    n_chunks = cp * len(chunks_of(0, cp, split))
    pieces = full.split(full.shape[-2] // n_chunks, dim=-2)
    return torch.stack([torch.cat([pieces[i] for i in chunks_of(r, cp, split)], dim=-2) for r in range(cp)])


class _GatherKV(torch.autograd.Function):
    """All-gather of the stacked K, V ``[2, b, a, n, d]`` over ``group`` into ``[2, b, a, s, d]``
    in sequence order; backward reduce-scatters the gradient back to this rank's chunks."""

    @staticmethod
    def forward(ctx, kv, group, split: str, reduce_grads: bool):
        cp = dist.get_world_size(group)
        ctx.group, ctx.split, ctx.reduce_grads = group, split, reduce_grads
        gathered = torch.empty((cp * kv.shape[0],) + tuple(kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        all_gather_into(gathered, kv.contiguous(), group=group)  # the all-gather of K and V
        return to_sequence_order(gathered.view((cp,) + tuple(kv.shape)), cp, split)

    @staticmethod
    def backward(ctx, grad_full):
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        by_rank = to_rank_order(grad_full, cp, ctx.split)  # [cp, 2, b, a, n, d]: each rank's share of my grads
        if not ctx.reduce_grads:  # deliberately broken (tests): keep only my own queries' share
            return by_rank[rank], None, None, None
        mine = torch.empty_like(by_rank[0])
        # the reduce-scatter of dK, dV: sum over every rank's queries, each rank keeps its chunks
        reduce_scatter_into(mine, by_rank.reshape((-1,) + tuple(by_rank.shape[2:])), group=group)
        return mine, None, None, None


def local_calls(my_chunks: list[int]) -> list[tuple[int, int, bool, int]]:
    """``(local query chunk, chunk index of the keys' end, diagonal, chunk pairs)`` of every
    kernel call: per local query chunk qc, keys [0, qc) unmasked (when qc > 0) and its own chunk
    with the causal mask."""
    calls = []
    for j, qc in enumerate(my_chunks):
        if qc > 0:
            calls.append((j, qc, False, qc))
        calls.append((j, qc + 1, True, 1))
    return calls


def _keys(kv_full: torch.Tensor, end: int, diagonal: bool, c: int):
    """K and V of one call: positions [0, end·c) or, diagonal, chunk end-1."""
    lo = (end - 1) * c if diagonal else 0
    return kv_full[0, ..., lo : end * c, :], kv_full[1, ..., lo : end * c, :]


class _LocalCausalAttention(torch.autograd.Function):
    """Causal attention of this rank's query chunks over the gathered K, V ``[2, b, a, s, d]``.
    Saved for backward: q, the gathered K and V, out, lse."""

    @staticmethod
    def forward(ctx, q, kv_full, my_chunks: list[int], stats: RingStats | None):
        c = q.shape[-2] // len(my_chunks)
        scale = q.shape[-1] ** -0.5
        qs = [t.contiguous() for t in q.split(c, dim=-2)]
        partial = [(None, None)] * len(my_chunks)
        started = stats.compute_started(q.device) if stats is not None else None
        for j, end, diagonal, n_pairs in local_calls(my_chunks):
            out_i, lse_i = block_forward(qs[j], *_keys(kv_full, end, diagonal, c), diagonal, scale)
            partial[j] = merge_partials(*partial[j], out_i.float(), lse_i)
            if stats is not None:
                stats.add_call(q.shape, c, n_pairs, diagonal)
        if stats is not None:
            stats.compute_ended(started)
        out = torch.cat([o for o, _ in partial], dim=-2).to(q.dtype)
        lse = torch.cat([s for _, s in partial], dim=-1)
        ctx.save_for_backward(q, kv_full, out, lse)
        ctx.my_chunks = my_chunks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv_full, out, lse = ctx.saved_tensors
        c = q.shape[-2] // len(ctx.my_chunks)
        scale = q.shape[-1] ** -0.5
        qs, outs, douts = ([t.contiguous() for t in x.split(c, dim=-2)] for x in (q, out, dout))
        lses = [t.contiguous() for t in lse.split(c, dim=-1)]
        dqs = [torch.zeros_like(t, dtype=torch.float32) for t in qs]
        dkv = torch.zeros_like(kv_full, dtype=torch.float32)  # this rank's share, summed in fp32
        for j, end, diagonal, _ in local_calls(ctx.my_chunks):
            k, v = _keys(kv_full, end, diagonal, c)
            dq, dk, dv = block_backward(douts[j], qs[j], k, v, outs[j], lses[j], diagonal, scale)
            dqs[j] += dq
            lo = (end - 1) * c if diagonal else 0
            dkv[0, ..., lo : end * c, :] += dk
            dkv[1, ..., lo : end * c, :] += dv
        return torch.cat(dqs, dim=-2).to(q.dtype), dkv.to(kv_full.dtype), None, None


def allgather_attention(q, k, v, group, split: str = "zigzag", stats: RingStats | None = None, reduce_grads=True):
    """Causal attention by all-gather context parallelism. q, k, v: ``[b, a, n, d]`` with this
    rank's chunks (``chunks_of``) concatenated along n. Returns ``[b, a, n, d]`` in q's dtype.
    ``reduce_grads=False``: the deliberately broken variant (tests), no reduce-scatter of dK, dV."""
    kv_full = _GatherKV.apply(torch.stack([k, v]), group, split, reduce_grads)
    my_chunks = chunks_of(dist.get_rank(group), dist.get_world_size(group), split)
    return _LocalCausalAttention.apply(q, kv_full, my_chunks, stats)
