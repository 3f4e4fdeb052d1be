"""Context parallelism: the sequence split over a group of ``cp`` ranks (torch only).

Every rank holds all parameters and a *part of every sequence*; only attention mixes positions,
so only attention communicates. Two ways to do it:

**Ring attention** (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers").
Each rank keeps its queries; the key/value blocks travel round the ring with point-to-point
``batch_isend_irecv`` (send to rank+1, receive from rank-1), ``cp - 1`` hops per layer. Every
(query block, key block) pair gives a partial softmax ``(out_i, lse_i)`` normalised over that key
block only; partials are merged *exactly* through their log-sum-exp (Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax"; FlashAttention's online softmax)::

    lse = logaddexp(lse_a, lse_b);   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

Causal masking makes a query block skip every later key block. With the *contiguous* split
(rank r holds chunk r of cp) rank cp-1 computes cp blocks and rank 0 one: the last rank sets the
pace. The *zig-zag* (head-tail) split cuts the sequence into 2cp chunks and gives rank r chunks
r and 2cp-1-r, so every rank computes exactly the same number of chunk pairs (2 per foreign
block + 3 on its own; Brandon et al. 2023 "Striped Attention" and Llama 3's CP use the same idea).
``split`` = "zigzag" | "contiguous"; :class:`RingStats` records per-rank executed attention
FLOPs and compute time (CUDA events on GPUs) so the imbalance can be measured.

Backward: *autograd through the blockwise computation*. The partials and merges are plain
differentiable torch ops, and the rotation is an autograd function whose backward sends the
gradient of a received block back to the rank it came from (receive from rank+1, send to
rank-1). So backward moves exactly what forward moved: ``cp - 1`` hops of dK and dV. It keeps
every visited K/V block and block softmax alive until backward (memory of full attention over the
local queries), which a hand-written ring backward (FlashAttention-2 style, recomputing the
blocks while dK/dV travel with K/V) avoids; this reference chooses plain correctness. There is
no compute/communication overlap either: each hop is waited for before the block is computed.

**DeepSpeed-Ulysses** (Jacobs et al. 2023). An all-to-all turns q, k, v from sequence-sharded
``[b, a, s/cp, d]`` into head-sharded ``[b, a/cp, s, d]``; each rank runs ordinary causal attention
over the whole sequence for its heads; a second all-to-all brings the output back to sequence
shards. Forward: 4 all-to-alls per layer of ``b*s*h/cp`` elements each (q, k, v, out); the
backward of an all-to-all is the reverse all-to-all, so backward moves the same. Needs
``cp | n_heads``; the split is contiguous (every rank does the same work anyway).

Both: every rank's parameter gradients cover only its tokens' contributions, so gradients are
all-reduced over the cp group (one flat fp32 buffer) and divided by cp (each rank's loss is the
mean over its own tokens, equally many on every rank).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from reference_impls._compat import all_gather_into

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


def _ring_exchange(tensors: list[torch.Tensor], send_to: int, recv_from: int, group) -> list[torch.Tensor]:
    """Send every tensor to global rank ``send_to`` and receive as many from ``recv_from``."""
    out = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, o, recv_from, group) for o in out]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


class _RingPass(torch.autograd.Function):
    """Forward: pass (k, v) one hop round the ring (to next, from prev). Backward: the gradients of
    the received blocks go back where they came from (to prev, from next)."""

    @staticmethod
    def forward(ctx, k, v, nxt, prv, group):
        ctx.nxt, ctx.prv, ctx.group = nxt, prv, group
        k2, v2 = _ring_exchange([k, v], nxt, prv, group)
        return k2, v2

    @staticmethod
    def backward(ctx, dk, dv):
        dk2, dv2 = _ring_exchange([dk, dv], ctx.prv, ctx.nxt, ctx.group)
        return dk2, dv2, None, None, None


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
    counted whole: its masked half is computed too), compute seconds.

    Compute time is taken around each hop's block computations. On CUDA those calls only queue
    kernels, so a host clock would measure launches: there a pair of CUDA events goes round each
    hop's compute instead, and their elapsed times are read (``as_dict``) only once the step is
    over, so timing adds no synchronisation inside the step. On CPU the work is synchronous and
    ``time.perf_counter`` is exact. ``clock`` says which ("cuda_event" | "host") in the record.
    """

    pairs_full: int = 0
    pairs_diagonal: int = 0
    flops: int = 0
    hops: int = 0
    clock: str | None = None  # None: nothing timed (Ulysses)
    host_compute_s: float = 0.0
    event_pairs: list = field(default_factory=list)  # (start, end) torch.cuda.Event per timed hop

    def reset(self):
        self.pairs_full = self.pairs_diagonal = self.flops = self.hops = 0
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
        return {"attn_pairs_full": self.pairs_full, "attn_pairs_diagonal": self.pairs_diagonal,
                "attn_flops_fwd": self.flops, "attn_compute_s_fwd": self.compute_s,
                "attn_compute_clock": self.clock, "ring_hops": self.hops}


def block_attention(q, k, v, diagonal: bool, scale: float):
    """Softmax attention of one query chunk over one key chunk: ``(out, lse)``, out normalised over
    this key chunk only. ``diagonal``: the chunks are the same positions (causal mask inside)."""
    s = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.exp(s - lse) @ v, lse


def merge_partials(out, lse, out_i, lse_i, correct: bool = True):
    """Exact merge of two partial softmax results through their log-sum-exp."""
    if out is None:
        return out_i, lse_i
    new = torch.logaddexp(lse, lse_i)
    if not correct:  # deliberately broken (tests): partials added without rescaling
        return out + out_i, new
    return out * torch.exp(lse - new) + out_i * torch.exp(lse_i - new), new


def ring_attention(q, k, v, group, split: str, stats: RingStats | None = None, lse_correction: bool = True):
    """Causal ring attention. q, k, v: ``[b, a, n, d]`` with this rank's chunks (``chunks_of``)
    concatenated along n. Returns ``[b, a, n, d]``."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    nxt, prv = ranks[(r + 1) % cp], ranks[(r - 1) % cp]
    my_chunks = chunks_of(r, cp, split)
    c = q.shape[-2] // len(my_chunks)
    scale = q.shape[-1] ** -0.5
    qs = q.split(c, dim=-2)
    acc = [(None, None) for _ in my_chunks]
    unused = []
    for step in range(cp):
        src = (r - step) % cp
        ks, vs = k.split(c, dim=-2), v.split(c, dim=-2)
        used = False
        started = stats.compute_started(q.device) if stats is not None else None
        for qi, qc in enumerate(my_chunks):
            for ki, kc in enumerate(chunks_of(src, cp, split)):
                if kc > qc:
                    continue  # entirely in the future of this query chunk
                out_i, lse_i = block_attention(qs[qi], ks[ki], vs[ki], kc == qc, scale)
                acc[qi] = merge_partials(*acc[qi], out_i, lse_i, correct=lse_correction)
                used = True
                if stats is not None:
                    b, a, _, d = q.shape
                    stats.flops += 4 * b * a * c * c * d
                    if kc == qc:
                        stats.pairs_diagonal += 1
                    else:
                        stats.pairs_full += 1
        if stats is not None:
            stats.compute_ended(started)
        if not used:
            unused.append((k, v))
        if step < cp - 1:
            k, v = _RingPass.apply(k, v, nxt, prv, group)
            if stats is not None:
                stats.hops += 1
    out = torch.cat([o for o, _ in acc], dim=-2)
    # A block this rank never attends to (contiguous split: the later ranks' blocks) must still be
    # part of the graph, so that every rank runs the same ring hops in backward (else a deadlock).
    for k_, v_ in unused:
        out = out + 0.0 * (k_.sum() + v_.sum())
    return out


def ulysses_attention(q, k, v, group, reverse: bool = True):
    """Causal attention by DeepSpeed-Ulysses. q, k, v: ``[b, a, s/cp, d]`` contiguous sequence shards."""
    qh, kh, vh = (_SeqToHead.apply(t, group) for t in (q, k, v))
    y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    if not reverse:  # deliberately broken (tests): reinterpret the head shard as a sequence shard
        return y.reshape(q.shape)
    return _HeadToSeq.apply(y, group)


# --- the model under context parallelism -------------------------------------------------------


class ContextParallel:
    """Train a replicated GPT with its sequence split over ``group``.

    ``mode``: "ring" or "ulysses"; ``split``: "zigzag" | "contiguous" (ring only; Ulysses is always
    contiguous). ``broken``: tests only ("no_lse" for the ring, "no_reverse" for Ulysses).

    Data: the trainer is handed this rank's data-parallel slice of the global batch. The cp group
    must see the *same* samples, so the token ids of the group's slices are all-gathered (one
    all-gather of ``[2, B, s]`` int64 per step: inputs and targets) and every rank keeps its part of
    the sequence of every sample. The global batch is unchanged (micro_batch x world samples) and
    each rank processes micro_batch x s tokens, as under data parallelism.
    """

    def __init__(self, model: nn.Module, group, mode: str, split: str = "zigzag", broken: str | None = None):
        if mode not in ("ring", "ulysses"):
            raise ValueError(f"unknown context-parallel mode {mode!r}")
        self.model, self.group, self.mode = model, group, mode
        self.split = split if mode == "ring" else "contiguous"
        self.broken = broken
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        cfg = model.cfg
        if mode == "ulysses" and cfg.n_heads % self.cp:
            raise ValueError(f"Ulysses: cp={self.cp} does not divide the {cfg.n_heads} heads")
        self.stats = RingStats()

    def attention(self, q, k, v):
        if self.mode == "ring":
            return ring_attention(q, k, v, self.group, self.split, self.stats,
                                  lse_correction=self.broken != "no_lse")
        return ulysses_attention(q, k, v, self.group, reverse=self.broken != "no_reverse")

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's tokens (``tokens``: [B, n] at global positions ``pos``)."""
        m = self.model
        b, n = tokens.shape
        x = m.tok_emb(tokens) + m.pos_emb(pos)
        for blk in m.blocks:
            att = blk.attn
            h = blk.ln1(x)
            q, k, v = (lin(h).view(b, n, -1, att.head_dim).transpose(1, 2) for lin in (att.q, att.k, att.v))
            y = self.attention(q, k, v)
            x = x + att.proj(y.transpose(1, 2).reshape(b, n, -1))
            x = x + blk.mlp(blk.ln2(x))
        return m.head(m.ln_f(x))

    def gather_batch(self, inputs: torch.Tensor, targets: torch.Tensor):
        both = torch.stack([inputs, targets])  # [2, B, s]
        out = torch.empty((self.cp * 2,) + tuple(both.shape[1:]), dtype=both.dtype, device=both.device)
        all_gather_into(out, both.contiguous(), group=self.group)
        out = out.view((self.cp,) + tuple(both.shape)).transpose(0, 1).reshape(2, self.cp * inputs.shape[0], inputs.shape[1])  # rank-major samples
        return out[0], out[1]

    def forward_backward(self, inputs, targets, grad_accum: int, autocast=None) -> torch.Tensor:
        """Gradients of the mean loss over the group's batch, all-reduced; returns this rank's mean loss."""
        from parabench.models import lm_loss

        self.stats.reset()
        x_all, y_all = self.gather_batch(inputs, targets)
        pos = positions_of(self.rank, self.cp, x_all.shape[1], self.split).to(x_all.device)
        x_loc, y_loc = x_all[:, pos], y_all[:, pos]
        total = torch.zeros((), device=inputs.device)
        for x, y in zip(x_loc.chunk(grad_accum), y_loc.chunk(grad_accum)):
            with autocast() if autocast else contextlib.nullcontext():
                loss = lm_loss(self.forward(x, pos), y) / grad_accum
            loss.backward()
            total += loss.detach()
        self.all_reduce_grads()
        return total

    def all_reduce_grads(self):
        """One flat all-reduce of every gradient over the cp group, then / cp."""
        params = list(self.model.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.cp)
        off = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
