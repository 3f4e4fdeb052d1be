"""Context parallelism: the sequence split over a group of ``cp`` ranks (torch only).

Every rank holds all parameters and a *part of every sequence*; only attention mixes positions,
so only attention communicates. Three ways to do it:

**Ring attention** (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"). Each rank keeps its queries; the key/value blocks travel round the ring
with point-to-point ``batch_isend_irecv`` (send to rank+1, receive from rank-1), ``cp - 1`` hops
per layer, each hop's transfer posted before the block computation and waited for after it, so
the two overlap. Every (query chunk, key chunk) pair is one call of a *fused* attention kernel
(FlashAttention: the scores exist only tile by tile, on chip; on a CPU torch's flash kernel for
CPUs) that returns the pair's output normalised over that key chunk only, and its log-sum-exp.
Partials are merged *exactly* through the log-sum-exp (Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax"; FlashAttention's online softmax)::

    lse = logaddexp(lse_a, lse_b);   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

Causal masking makes a query chunk skip every later key chunk. With the *contiguous* split
(rank r holds chunk r of cp) rank cp-1 computes cp blocks and rank 0 one: the last rank sets the
pace. The *zig-zag* (head-tail) split cuts the sequence into 2cp chunks and gives rank r chunks
r and 2cp-1-r, so every rank computes exactly the same number of chunk pairs (2 per foreign
block + 3 on its own; Brandon et al. 2023 "Striped Attention" and Llama 3's CP use the same idea).
``split`` = "zigzag" | "contiguous"; :class:`RingStats` records per-rank executed attention
FLOPs and compute time (CUDA events on GPUs) so the imbalance can be measured.

Backward: *a second ring pass*, hand-written (Liu et al. 2023, section 3; the same scheme as
ring-flash-attention and torch's ``context_parallel``). With P = exp(S - lse) the attention
probabilities, softmax attention's backward is ``dV = Pᵀ·dO``, ``dS = P ∘ (dO·Vᵀ - D)`` with
``D = rowsum(dO ∘ O)``, ``dQ = dS·K·scale``, ``dK = dSᵀ·Q·scale``. Given the *final* output O and
the *final* lse, one (query chunk, key chunk) pair's P is exactly its slice of the global
probabilities and D is the global row term, so the fused backward kernel of that single pair
returns its exact share of dQ, dK, dV. Forward therefore saves only the local q, k, v, the output
and its lse (nothing quadratic in the sequence: the score matrix of a pair is never stored), and
backward sends K, V round the ring again (``cp - 1`` hops) while the partial sums of dK, dV
travel one hop behind them, each rank adding its share of the block it holds, until after
``cp - 1`` hops they reach the block's owner, which adds the share of its own queries. Per layer:
forward 2(cp-1) block transfers of K, V; backward 2(cp-1) of K, V and 2(cp-1) of dK, dV, all in
the compute dtype (partial sums are added in fp32 on each rank, rounded for the wire).

**DeepSpeed-Ulysses** (Jacobs et al. 2023). An all-to-all turns q, k, v from sequence-sharded
``[b, a, s/cp, d]`` into head-sharded ``[b, a/cp, s, d]``; each rank runs ordinary causal attention
over the whole sequence for its heads; a second all-to-all brings the output back to sequence
shards. Forward: 4 all-to-alls per layer of ``b*s*h/cp`` elements each (q, k, v, out); the
backward of an all-to-all is the reverse all-to-all, so backward moves the same. Needs
``cp | n_heads``; the split is contiguous (every rank does the same work anyway).

**All-gather** (Llama 3, section 3.3.2): K and V all-gathered over the group before attention,
their gradients reduce-scattered in backward; in ``reference_impls/cp_allgather.py``.

All (``reference_impls/cp_model.py``, the model under context parallelism): every rank's parameter
gradients cover only its tokens' contributions, so gradients are all-reduced over the cp group (one
flat fp32 buffer) and divided by cp (each rank's loss is the mean over its own tokens, equally many
on every rank).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

SPLITS = ("zigzag", "contiguous")


# --- how the sequence is split ------------------------------------------------------------------


def chunks_of(rank: int, cp: int, split: str) -> list[int]:
    """Indices of the sequence chunks rank ``rank`` holds (chunks of s/cp, or of s/2cp for zigzag)."""
    if split == "contiguous":
        return [rank]
    if split == "zigzag":
        return [rank, 2 * cp - 1 - rank]
    raise ValueError(f"unknown cp split {split!r}; valid: {', '.join(SPLITS)}")


def positions_of(rank: int, cp: int, seq_len: int, split: str) -> torch.Tensor:
    """Global positions of this rank's tokens, in the order the rank stores them."""
    chunks = chunks_of(rank, cp, split)
    n = cp * len(chunks)
    if seq_len % n:
        raise ValueError(f"seq_len={seq_len} does not split into {n} chunks ({split} split over cp={cp})")
    c = seq_len // n
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks])


# --- communication operators -------------------------------------------------------------------


class _Hop:
    """One ring hop in flight: every tensor of ``tensors`` goes to global rank ``send_to`` and as
    many (same shapes and dtypes) come from ``recv_from``. Posted before a hop's computation and
    waited for after it, so the transfer overlaps the computation."""

    def __init__(self, tensors: list[torch.Tensor], send_to: int, recv_from: int, group):
        self.sent = [t.contiguous() for t in tensors]  # referenced until the sends complete
        self.received = [torch.empty_like(t) for t in self.sent]
        ops = [dist.P2POp(dist.isend, t, send_to, group) for t in self.sent]
        ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in self.received]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for req in self.requests:
            req.wait()
        self.sent = None
        return self.received


def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single along dim 0 (which must have size = group size)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _SeqToHead(torch.autograd.Function):
    """Ulysses' first all-to-all: [b, a, s/cp, d] (sequence shard) -> [b, a/cp, s, d] (head shard)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    """Ulysses' second all-to-all: [b, a/cp, s, d] -> [b, a, s/cp, d]."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group), None


def _seq_to_head(x, group):
    cp = dist.get_world_size(group)
    b, a, sl, d = x.shape
    send = x.reshape(b, cp, a // cp, sl, d).transpose(0, 1)  # [dest head group, b, a/cp, s/cp, d]
    recv = _a2a(send, group)  # [source rank = sequence chunk, b, a/cp, s/cp, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, a // cp, cp * sl, d)


def _head_to_seq(x, group):
    cp = dist.get_world_size(group)
    b, ah, s, d = x.shape
    send = x.reshape(b, ah, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # [dest sequence chunk, b, a/cp, s/cp, d]
    recv = _a2a(send, group)  # [source rank = head group, b, a/cp, s/cp, d]
    return recv.transpose(0, 1).reshape(b, cp * ah, s // cp, d)


# --- attention ---------------------------------------------------------------------------------


@dataclass
class RingStats:
    """Per-rank attention work of the last step (forward, summed over layers and micro-batches):
    executed chunk pairs, FLOPs (4·b·a·c²·d per pair of chunks of c positions, a diagonal pair
    counted whole by convention, although the fused causal kernel skips most of its masked half),
    compute seconds.

    Compute time is taken around each hop's block computations. On CUDA those calls only queue
    kernels, so a host clock would measure launches: there a pair of CUDA events goes round each
    hop's compute instead, and their elapsed times are read (``as_dict``) only once the step is
    over, so timing adds no synchronisation inside the step. On CPU the work is synchronous and
    ``time.perf_counter`` is exact. ``clock`` says which ("cuda_event" | "host") in the record.
    """

    pairs_full: int = 0
    pairs_diagonal: int = 0
    calls: int = 0  # kernel calls in forward (fused_pairs: fewer than pairs)
    flops: int = 0
    hops: int = 0
    clock: str | None = None  # None: nothing timed (Ulysses)
    host_compute_s: float = 0.0
    event_pairs: list = field(default_factory=list)  # (start, end) torch.cuda.Event per timed hop

    def reset(self):
        self.pairs_full = self.pairs_diagonal = self.calls = self.flops = self.hops = 0
        self.host_compute_s = 0.0
        self.event_pairs = []

    def compute_started(self, device: torch.device):
        """Mark the start of one hop's compute; pass what it returns to :meth:`compute_ended`."""
        if device.type == "cuda":
            self.clock = "cuda_event"
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        self.clock = "host"
        return time.perf_counter()

    def add_call(self, q_shape, chunk: int, n_pairs: int, diagonal: bool) -> None:
        """One kernel call over ``n_pairs`` (query chunk, key chunk) pairs of ``chunk`` positions
        each: 4·b·a·c²·d forward FLOPs per pair (QKᵀ and PV), a diagonal pair counted whole."""
        b, a, _, d = q_shape
        self.flops += 4 * b * a * chunk * chunk * d * n_pairs
        self.calls += 1
        if diagonal:
            self.pairs_diagonal += n_pairs
        else:
            self.pairs_full += n_pairs

    def compute_ended(self, start) -> None:
        if self.clock == "cuda_event":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.event_pairs.append((start, end))
        else:
            self.host_compute_s += time.perf_counter() - start

    @property
    def compute_s(self) -> float:
        """Summed compute seconds. With CUDA events: device time between each start and end event
        (the kernels, plus any gap in which the GPU waited for the host to launch them)."""
        if not self.event_pairs:
            return self.host_compute_s
        self.event_pairs[-1][1].synchronize()  # a no-op once the step has synchronised (the worker does)
        return sum(start.elapsed_time(end) for start, end in self.event_pairs) / 1e3

    def as_dict(self) -> dict:
        return {
            "attn_pairs_full": self.pairs_full,
            "attn_pairs_diagonal": self.pairs_diagonal,
            "attn_calls_fwd": self.calls,
            "attn_flops_fwd": self.flops,
            "attn_compute_s_fwd": self.compute_s,
            "attn_compute_clock": self.clock,
            "ring_hops": self.hops,
        }


# --- one (query chunk, key chunk) pair: a fused kernel that also returns its log-sum-exp ---------
# The fused kernels never materialise the [n, n] scores, and their backward recomputes them tile by
# tile from (q, k, v, out, lse). Which kernel: torch's flash kernel for CPUs; on CUDA FlashAttention-2
# for 16-bit inputs, and the memory-efficient kernel (xFormers') for fp32, which flash does not take.
# Dropout is off everywhere, so the random-state arguments of the CUDA backward kernels are unread.

_CUDA_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # FlashAttention-2 takes 16-bit inputs only
_EFFICIENT_LSE_ROWS = 32  # the memory-efficient kernel pads its lse rows to a multiple of 32


def block_forward(q, k, v, diagonal: bool, scale: float):
    """Attention of one query chunk over one key chunk: ``(out, lse)``, out ``[b, a, n, d]``
    normalised over this key chunk only, lse ``[b, a, n]`` fp32. ``diagonal``: the chunks are the
    same positions (causal mask inside; equal lengths, so torch's top-left causal mask is right)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p=0.0, is_causal=diagonal, scale=scale
        )
    if q.dtype in _CUDA_FLASH_DTYPES:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, diagonal, False, scale=scale)
        return out, lse
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, diagonal, scale=scale
    )
    return out, lse[..., : q.shape[-2]]


def block_backward(dout, q, k, v, out, lse, diagonal: bool, scale: float):
    """``(dq, dk, dv)`` of one chunk pair, given the *final* ``out`` and ``lse`` of these queries
    (merged over every key chunk): then this pair's probabilities and the softmax-backward row term
    rowsum(dout * out) are the global ones, and the pair's gradients are its exact share."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, diagonal, scale=scale
        )
    no_rng = torch.empty((), dtype=torch.long)  # what the forward kernels return without dropout
    if q.dtype in _CUDA_FLASH_DTYPES:
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, diagonal, no_rng, no_rng, scale=scale
        )
    padded_lse = F.pad(lse, (0, -lse.shape[-1] % _EFFICIENT_LSE_ROWS))
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, padded_lse, no_rng, no_rng, 0.0, [True, True, True, False], diagonal, scale=scale
    )
    return dq, dk, dv


def block_attention_reference(q, k, v, diagonal: bool, scale: float):
    """What :func:`block_forward` computes, written out: the whole score matrix of the pair is
    materialised (``[b, a, n, n]``), so this is for reading and tests only."""
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if diagonal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def merge_partials(out, lse, out_i, lse_i, correct: bool = True):
    """Exact merge of two partial softmax results through their log-sum-exp (out ``[..., n, d]``,
    lse ``[..., n]``). ``out=None``: the first partial. A row that saw no key in a partial (fully
    masked: out 0, lse -inf) takes the other's values unchanged; one that saw none in either stays
    out 0, lse -inf, where exp(-inf - -inf) would put NaN in it."""
    if out is None:
        return out_i, lse_i
    new = torch.logaddexp(lse, lse_i)
    if not correct:  # deliberately broken (tests): partials added without rescaling
        return out + out_i, new
    ref = torch.where(new == float("-inf"), 0.0, new)
    return out * torch.exp(lse - ref).unsqueeze(-1) + out_i * torch.exp(lse_i - ref).unsqueeze(-1), new


# --- the ring ------------------------------------------------------------------------------------


def chunk_pairs(my_chunks: list[int], their_chunks: list[int]) -> list[tuple[int, int, bool]]:
    """``(query chunk index, key chunk index, diagonal)`` of every pair a rank holding ``my_chunks``
    computes against a K/V block holding ``their_chunks``: causal, so a key chunk after the query
    chunk is skipped, and the query chunk's own positions are masked inside (diagonal)."""
    return [(qi, ki, kc == qc) for qi, qc in enumerate(my_chunks) for ki, kc in enumerate(their_chunks) if kc <= qc]


def fused_pairs(my_chunks: list[int], their_chunks: list[int]) -> list[tuple[int, int, int, int, bool, int]]:
    """:func:`chunk_pairs` as kernel calls ``(q_lo, q_hi, k_lo, k_hi, diagonal, n_pairs)`` over
    contiguous ranges of chunk indices: a diagonal pair alone (its causal mask needs equal
    lengths); the off-diagonal pairs of consecutive query chunks over the same run of key chunks in
    one call. Zig-zag then needs one call per visiting block instead of two (the block of an
    earlier rank: both query chunks over its first chunk; of a later rank: the second query chunk
    over both of its chunks), so each call is longer and there are fewer of them."""
    pairs = chunk_pairs(my_chunks, their_chunks)
    calls = [(qi, qi + 1, ki, ki + 1, True, 1) for qi, ki, diagonal in pairs if diagonal]
    runs: dict[int, list[int]] = {}
    for qi, ki, diagonal in pairs:
        if not diagonal:
            runs.setdefault(qi, []).append(ki)
    merged: list[list[int]] = []  # [q_lo, q_hi, k_lo, k_hi]
    for qi in sorted(runs):
        ks = sorted(runs[qi])
        if ks != list(range(ks[0], ks[-1] + 1)):  # not one run: a call per pair
            calls += [(qi, qi + 1, ki, ki + 1, False, 1) for ki in ks]
            continue
        if merged and merged[-1][1] == qi and merged[-1][2:] == [ks[0], ks[-1] + 1]:
            merged[-1][1] = qi + 1
        else:
            merged.append([qi, qi + 1, ks[0], ks[-1] + 1])
    calls += [(a, b, ka, kb, False, (b - a) * (kb - ka)) for a, b, ka, kb in merged]
    return calls


def _span(chunks: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Chunks ``lo..hi-1`` as one tensor along the sequence (dim -2; lse chunks: dim -1)."""
    if hi == lo + 1:
        return chunks[lo]
    return torch.cat(chunks[lo:hi], dim=-2 if chunks[lo].dim() == 4 else -1)


def _chunks(x: torch.Tensor, c: int) -> list[torch.Tensor]:
    """``x`` cut into its chunks of c positions along the sequence, each contiguous: the kernels
    and the wire get dense memory (q, k, v arrive as transposed views of the projections)."""
    return [t.contiguous() for t in x.split(c, dim=-2)]


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over ``group`` with a hand-written ring backward (see the module
    docstring). Saved for backward: q, k, v, out, lse; nothing of the visited blocks."""

    @staticmethod
    def forward(ctx, q, k, v, group, split: str, stats: RingStats | None, lse_correction: bool):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        nxt, prv = ranks[(rank + 1) % cp], ranks[(rank - 1) % cp]
        my_chunks = chunks_of(rank, cp, split)
        n_chunks, c = len(my_chunks), q.shape[-2] // len(my_chunks)
        scale = q.shape[-1] ** -0.5
        qs = _chunks(q, c)
        kv = _chunks(k, c) + _chunks(v, c)  # the block that travels: its K chunks, then its V chunks
        partial = [(None, None)] * n_chunks  # per query chunk: (out in fp32, lse) merged so far
        for step in range(cp):
            src = (rank - step) % cp  # the rank whose block this is
            hop = _Hop(kv, nxt, prv, group) if step < cp - 1 else None
            started = stats.compute_started(q.device) if stats is not None else None
            for q_lo, q_hi, k_lo, k_hi, diagonal, n_pairs in fused_pairs(my_chunks, chunks_of(src, cp, split)):
                out_i, lse_i = block_forward(
                    _span(qs, q_lo, q_hi),
                    _span(kv, k_lo, k_hi),
                    _span(kv, n_chunks + k_lo, n_chunks + k_hi),
                    diagonal,
                    scale,
                )
                for j, qi in enumerate(range(q_lo, q_hi)):
                    partial[qi] = merge_partials(
                        *partial[qi],
                        out_i[..., j * c : (j + 1) * c, :].float(),
                        lse_i[..., j * c : (j + 1) * c],
                        correct=lse_correction,
                    )
                if stats is not None:
                    stats.add_call(q.shape, c, n_pairs, diagonal)
            if stats is not None:
                stats.compute_ended(started)
            if hop is not None:
                kv = hop.wait()
                if stats is not None:
                    stats.hops += 1
        out = torch.cat([o for o, _ in partial], dim=-2).to(q.dtype)
        lse = torch.cat([s for _, s in partial], dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.split, ctx.neighbours = group, split, (nxt, prv)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, (nxt, prv) = ctx.group, ctx.neighbours
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        my_chunks = chunks_of(rank, cp, ctx.split)
        n_chunks, c = len(my_chunks), q.shape[-2] // len(my_chunks)
        scale = q.shape[-1] ** -0.5
        qs, outs, douts = _chunks(q, c), _chunks(out, c), _chunks(dout, c)
        lses = [s.contiguous() for s in lse.split(c, dim=-1)]
        dqs = [torch.zeros_like(t, dtype=torch.float32) for t in qs]
        kv = _chunks(k, c) + _chunks(v, c)
        own_dkv = None  # this rank's own block: dK, dV chunks from its own queries (fp32)
        dkv_hop = None  # the dK, dV partial sums of a block, in flight to the next rank on its path
        for step in range(cp):
            src = (rank - step) % cp
            kv_hop = _Hop(kv, nxt, prv, group) if step < cp - 1 else None
            dkv = [torch.zeros_like(t, dtype=torch.float32) for t in kv]  # this rank's share, block src
            for q_lo, q_hi, k_lo, k_hi, diagonal, _ in fused_pairs(my_chunks, chunks_of(src, cp, ctx.split)):
                dq, dk, dv = block_backward(
                    _span(douts, q_lo, q_hi),
                    _span(qs, q_lo, q_hi),
                    _span(kv, k_lo, k_hi),
                    _span(kv, n_chunks + k_lo, n_chunks + k_hi),
                    _span(outs, q_lo, q_hi),
                    _span(lses, q_lo, q_hi),
                    diagonal,
                    scale,
                )
                for j, qi in enumerate(range(q_lo, q_hi)):
                    dqs[qi] += dq[..., j * c : (j + 1) * c, :]
                for j, ki in enumerate(range(k_lo, k_hi)):
                    dkv[ki] += dk[..., j * c : (j + 1) * c, :]
                    dkv[n_chunks + ki] += dv[..., j * c : (j + 1) * c, :]
            if step == 0:
                own_dkv = dkv  # kept here: the partial sums from the other ranks come home at the end
            else:
                # The previous rank's hop brought the sums over the ranks before it on block src's path
                # (none at step 1: the path starts here, one rank after the owner).
                if dkv_hop is not None:
                    for mine, before in zip(dkv, dkv_hop.wait()):
                        mine += before
                dkv_hop = _Hop([t.to(k.dtype) for t in dkv], nxt, prv, group)  # compute dtype on the wire
            if kv_hop is not None:
                kv = kv_hop.wait()
        if dkv_hop is not None:  # the sums over every other rank for this rank's block, after cp-1 hops
            for mine, others in zip(own_dkv, dkv_hop.wait()):
                mine += others
        dq = torch.cat(dqs, dim=-2).to(q.dtype)
        dk = torch.cat(own_dkv[:n_chunks], dim=-2).to(k.dtype)
        dv = torch.cat(own_dkv[n_chunks:], dim=-2).to(v.dtype)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, group, split: str, stats: RingStats | None = None, lse_correction: bool = True):
    """Causal ring attention. q, k, v: ``[b, a, n, d]`` with this rank's chunks (``chunks_of``)
    concatenated along n. Returns ``[b, a, n, d]`` in q's dtype. ``lse_correction=False``: the
    deliberately broken variant (tests), partials summed without rescaling."""
    return _RingAttention.apply(q, k, v, group, split, stats, lse_correction)


def ulysses_attention(q, k, v, group, reverse: bool = True):
    """Causal attention by DeepSpeed-Ulysses. q, k, v: ``[b, a, s/cp, d]`` contiguous sequence shards."""
    qh, kh, vh = (_SeqToHead.apply(t, group) for t in (q, k, v))
    y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    if not reverse:  # deliberately broken (tests): reinterpret the head shard as a sequence shard
        return y.reshape(q.shape)
    return _HeadToSeq.apply(y, group)
