"""The GPT trained under context parallelism (``reference_impls/context_parallel.py`` for ring
attention and Ulysses, ``reference_impls/cp_allgather.py`` for the all-gather of K and V): every
rank holds the whole model and its part of every sequence, attention is the chosen scheme's, and
the parameter gradients are all-reduced over the group.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from reference_impls._compat import all_gather_into
from reference_impls.context_parallel import RingStats, positions_of, ring_attention, ulysses_attention
from reference_impls.cp_allgather import allgather_attention


class ContextParallel:
    """Train a replicated GPT with its sequence split over ``group``.

    ``mode``: "ring", "ulysses" or "allgather"; ``split``: "zigzag" | "contiguous" (ring and
    all-gather; Ulysses is always contiguous). ``broken``: tests only ("no_lse" for the ring,
    "no_reverse" for Ulysses, "no_reduce_scatter" for the all-gather).

    Data: the trainer is handed this rank's data-parallel slice of the global batch. The cp group
    must see the *same* samples, so the token ids of the group's slices are all-gathered (one
    all-gather of ``[2, B, s]`` int64 per step: inputs and targets) and every rank keeps its part of
    the sequence of every sample. The global batch is unchanged (micro_batch x world samples) and
    each rank processes micro_batch x s tokens, as under data parallelism.
    """

    def __init__(
        self, model: nn.Module, group, mode: str, split: str = "zigzag", broken: str | None = None, *, loss_fn
    ):
        if mode not in ("ring", "ulysses", "allgather"):
            raise ValueError(f"unknown context-parallel mode {mode!r}")
        self.model, self.group, self.mode = model, group, mode
        self.loss_fn = loss_fn  # (logits, targets) -> mean loss
        self.split = "contiguous" if mode == "ulysses" else split
        self.broken = broken
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        cfg = model.cfg
        if mode == "ulysses" and cfg.n_heads % self.cp:
            raise ValueError(f"Ulysses: cp={self.cp} does not divide the {cfg.n_heads} heads")
        self.stats = RingStats()

    def attention(self, q, k, v):
        if self.mode == "ring":
            return ring_attention(q, k, v, self.group, self.split, self.stats, lse_correction=self.broken != "no_lse")
        if self.mode == "allgather":
            reduce_grads = self.broken != "no_reduce_scatter"
            return allgather_attention(q, k, v, self.group, self.split, self.stats, reduce_grads=reduce_grads)
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
        out = (
            out.view((self.cp,) + tuple(both.shape))
            .transpose(0, 1)
            .reshape(2, self.cp * inputs.shape[0], inputs.shape[1])
        )  # rank-major samples
        return out[0], out[1]

    def forward_backward(self, inputs, targets, grad_accum: int, autocast=None) -> torch.Tensor:
        """Gradients of the mean loss over the group's batch, all-reduced; returns this rank's mean loss."""
        self.stats.reset()
        x_all, y_all = self.gather_batch(inputs, targets)
        pos = positions_of(self.rank, self.cp, x_all.shape[1], self.split).to(x_all.device)
        x_loc, y_loc = x_all[:, pos], y_all[:, pos]
        total = torch.zeros((), device=inputs.device)
        for x, y in zip(x_loc.chunk(grad_accum), y_loc.chunk(grad_accum)):
            with autocast() if autocast else contextlib.nullcontext():
                loss = self.loss_fn(self.forward(x, pos), y) / grad_accum
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
            p.grad.copy_(flat[off : off + n].view_as(p))
            off += n
