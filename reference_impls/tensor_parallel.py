"""Megatron-LM tensor parallelism, with and without sequence parallelism (torch only).

Shoeybi et al. 2019, "Megatron-LM", Sec. 3 (Fig. 3 and 4): an MLP ``Y = GeLU(X A)``, ``Z = Y B``
is split by *columns* of A and *rows* of B, so every rank computes a slice of the hidden layer
with no communication and one all-reduce recombines ``Z``. Attention is split by heads the same
way (q, k, v by columns, the output projection by rows). Two conjugate operators mark where the
communication goes:

* ``f``: identity in forward, all-reduce in backward (before a column-parallel layer: its input
  is replicated, the gradient w.r.t. it is a sum of every rank's partial contribution);
* ``g``: all-reduce in forward, identity in backward (after a row-parallel layer: every rank
  holds a partial sum of the output).

Per transformer layer and micro-batch: 2 ``g`` (forward) + 2 ``f`` (backward) = 4 all-reduces of
``b*s*h`` elements. The embedding is split by vocabulary (Sec. 3, "input embedding"): each rank
looks up the tokens of its vocabulary range and a ``g`` sums the partial embeddings; the output
head is split by vocabulary too, and the cross-entropy is computed from the vocab-parallel logits
with three all-reduces of ``b*s`` scalars (max, sum of exponentials, target logit) instead of
gathering ``b*s*V`` logits (Sec. 3, last paragraph: "fuse the output of the parallel GEMM with
the cross entropy loss").

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4.2.2, Fig. 5, eq. 4-5): outside the tensor-parallel regions (the
LayerNorms, residual adds, dropout) the activations are split along the *sequence* so that no
rank stores them whole. ``g`` becomes ``ḡ`` = reduce-scatter along the sequence in forward
(all-gather in backward), and ``f`` becomes ``f̄`` = all-gather along the sequence in forward
(reduce-scatter in backward). An all-reduce *is* a reduce-scatter followed by an all-gather, so
the communicated volume is unchanged. Parameters applied to a sequence shard (LayerNorm weights
and biases, the bias of a row-parallel layer, the position embedding) only see that shard's
tokens, so their gradients are all-reduced over the tensor-parallel group after backward.

Layout: activations are ``[b, s, h]``; sequence shards are contiguous ranges of ``s``.
Shards are sliced from a full model built with the same seed, so they start bit-identical to
single-device training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from reference_impls._compat import all_gather_into, reduce_scatter_into

# --- the communication operators ---------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce of the partial sums forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``[b, s/t, h]`` shards into ``[b, s, h]`` (shards concatenated along s)."""
    t = dist.get_world_size(group)
    b, s_local, h = x.shape
    out = torch.empty((t * b, s_local, h), dtype=x.dtype, device=x.device)  # rank-major
    all_gather_into(out, x.contiguous(), group=group)
    return out.view(t, b, s_local, h).permute(1, 0, 2, 3).reshape(b, t * s_local, h)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``[b, s, h]`` over the group and keep this rank's ``[b, s/t, h]`` sequence range."""
    t = dist.get_world_size(group)
    b, s, h = x.shape
    chunks = x.reshape(b, t, s // t, h).permute(1, 0, 2, 3).reshape(t * b, s // t, h)  # rank-major
    out = torch.empty((b, s // t, h), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, chunks, group=group)
    return out


class _GatherFromSP(torch.autograd.Function):
    """Korthikanti's ``f̄``: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    """Korthikanti's ``ḡ``: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


def f_op(x, group, sequence_parallel=False):
    """Enter a tensor-parallel region (before column-parallel layers)."""
    return _GatherFromSP.apply(x, group) if sequence_parallel else _CopyToTP.apply(x, group)


def g_op(x, group, sequence_parallel=False):
    """Leave a tensor-parallel region (after row-parallel layers)."""
    return _ReduceScatterToSP.apply(x, group) if sequence_parallel else _ReduceFromTP.apply(x, group)


# --- parallel layers, sliced from full nn.Linear / nn.Embedding ---------------------------------


def _slice(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    if t.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split over {world} ranks")
    return t.detach().chunk(world, dim=dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """``Y_i = X A_i + b_i``: the rows of ``nn.Linear.weight`` (its output features) split.

    The input must already be replicated (or gathered); the output stays split (no gather):
    Megatron's ``gather_output=False``, which is how consecutive layers avoid communication.
    """

    shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(_slice(full.weight, 0, rank, world))
        self.bias = nn.Parameter(_slice(full.bias, 0, rank, world)) if full.bias is not None else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``Z = sum_i Y_i B_i + b``: the columns of ``weight`` (its input features) split.

    Returns the rank's *partial* product; the caller applies ``g`` (or ``ḡ``) and then adds
    ``bias``, which is replicated: adding it before the reduction would add it ``t`` times.
    """

    shard_dims = {"weight": 1, "bias": None}

    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(_slice(full.weight, 1, rank, world))
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank*V/t, (rank+1)*V/t)`` of the token embedding; other tokens look up zeros.

    Forward returns the *partial* embedding; the caller reduces it with ``g`` (or ``ḡ``).
    """

    shard_dims = {"weight": 0}

    def __init__(self, full: nn.Embedding, rank: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(_slice(full.weight, 0, rank, world))
        self.vocab_start = rank * self.weight.shape[0]

    def forward(self, tokens):
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        emb = F.embedding(local.masked_fill(outside, 0), self.weight)
        return emb.masked_fill(outside.unsqueeze(-1), 0.0)


class VocabParallelHead(nn.Module):
    """The untied output head split by vocabulary: a column-parallel linear without bias whose
    ``[b, s, V/t]`` logits go straight into :func:`vocab_parallel_cross_entropy`."""

    shard_dims = {"weight": 0}

    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(_slice(full.weight, 0, rank, world))
        self.vocab_start = rank * self.weight.shape[0]

    def forward(self, x):
        return F.linear(x, self.weight)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy from logits split by vocabulary, never gathering them (Megatron Sec. 3).

    loss_n = log(sum_v exp(z_nv)) - z_n,target, with z = logits - max (for stability). Three
    all-reduces of ``N = b*s`` fp32 scalars: the max (MAX), the target logit (SUM: only the rank
    owning the target contributes) and the sum of exponentials (SUM). Backward needs no
    communication: d loss_n / d z_nv = softmax_nv - [v == target], computed locally.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.float()
        n, v_local = logits.shape
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        z = logits - logits_max.unsqueeze(-1)

        local_t = targets - vocab_start
        mine = (local_t >= 0) & (local_t < v_local)
        local_t = local_t.masked_fill(~mine, 0)
        target_logit = z.gather(1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        dist.all_reduce(target_logit, group=group)

        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, mine = ctx.saved_tensors
        g = softmax  # reuse the buffer: this Function is differentiated once
        g[torch.arange(g.shape[0], device=g.device), local_t] -= mine.to(g.dtype)
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits, targets, vocab_start, group):
    """Mean token cross-entropy of ``[b, s, V/t]`` vocab-parallel logits against ``[b, s]``."""
    per_token = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), vocab_start, group
    )
    return per_token.mean()


# --- the transformer, split ------------------------------------------------------------------


class ParallelAttention(nn.Module):
    """q, k, v column-parallel (whole heads per rank), proj row-parallel."""

    def __init__(self, full, rank, world, group, sequence_parallel):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.head_dim = full.head_dim
        self.q = ColumnParallelLinear(full.q, rank, world)
        self.k = ColumnParallelLinear(full.k, rank, world)
        self.v = ColumnParallelLinear(full.v, rank, world)
        self.proj = RowParallelLinear(full.proj, rank, world)

    def forward(self, x):
        x = f_op(x, self.group, self.sp)  # one f for q, k and v: they share the input
        b, s, _ = x.shape
        q, k, v = (lin(x).view(b, s, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.proj(y.transpose(1, 2).reshape(b, s, -1))
        return g_op(y, self.group, self.sp) + self.proj.bias


class ParallelMLP(nn.Module):
    """fc column-parallel, GeLU local (the point of splitting A by columns), proj row-parallel."""

    def __init__(self, full, rank, world, group, sequence_parallel):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.fc = ColumnParallelLinear(full.fc, rank, world)
        self.proj = RowParallelLinear(full.proj, rank, world)

    def forward(self, x):
        x = f_op(x, self.group, self.sp)
        y = self.proj(F.gelu(self.fc(x), approximate="tanh"))
        return g_op(y, self.group, self.sp) + self.proj.bias


class ParallelBlock(nn.Module):
    def __init__(self, full, rank, world, group, sequence_parallel):
        super().__init__()
        self.ln1 = full.ln1  # replicated (and, with SP, applied to the rank's sequence shard)
        self.attn = ParallelAttention(full.attn, rank, world, group, sequence_parallel)
        self.ln2 = full.ln2
        self.mlp = ParallelMLP(full.mlp, rank, world, group, sequence_parallel)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TensorParallelGPT(nn.Module):
    """This rank's shard of a GPT (``tok_emb, pos_emb, blocks, ln_f, head``, same names).

    ``forward(tokens, targets)`` returns the mean loss (identical on every tensor-parallel rank).
    ``embed`` and ``head_loss`` are exposed separately so a pipeline can place them on its first
    and last stage. With ``sequence_parallel`` the residual stream between them is ``[b, s/t, h]``.
    """

    def __init__(self, full, group, sequence_parallel: bool = False):
        super().__init__()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        cfg = full.cfg
        if cfg.n_heads % world:
            raise ValueError(f"tp={world} does not divide n_heads={cfg.n_heads}")
        if cfg.vocab_size % world:
            raise ValueError(f"tp={world} does not divide vocab_size={cfg.vocab_size}")
        self.cfg, self.group, self.sp = cfg, group, sequence_parallel
        self.tp_rank, self.tp_world = rank, world
        self.tok_emb = VocabParallelEmbedding(full.tok_emb, rank, world)
        self.pos_emb = full.pos_emb  # replicated: s*h is small next to V*h
        self.blocks = nn.ModuleList(ParallelBlock(b, rank, world, group, sequence_parallel) for b in full.blocks)
        self.ln_f = full.ln_f
        self.head = VocabParallelHead(full.head, rank, world)

    def embed(self, tokens):
        s = tokens.shape[1]
        if self.sp:
            if s % self.tp_world:
                raise ValueError(f"sequence parallel: tp={self.tp_world} does not divide seq_len={s}")
            x = g_op(self.tok_emb(tokens), self.group, True)  # reduce-scatter: [b, s/t, h]
            lo = self.tp_rank * (s // self.tp_world)
            return x + self.pos_emb(torch.arange(lo, lo + s // self.tp_world, device=tokens.device))
        x = g_op(self.tok_emb(tokens), self.group, False)  # all-reduce of the partial lookups
        return x + self.pos_emb(torch.arange(s, device=tokens.device))

    def head_loss(self, x, targets):
        # f (or f̄) before the vocab-parallel head: its input gradient is a sum over vocab shards.
        x = f_op(self.ln_f(x), self.group, self.sp)
        logits = self.head(x)  # [b, s, V/t], never gathered
        return vocab_parallel_cross_entropy(logits, targets, self.head.vocab_start, self.group)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head_loss(x, targets)

    # -- bookkeeping for gradients and for gathering the full model --------------------------

    def shard_dims(self) -> dict[str, int | None]:
        """GPT parameter name -> dimension it is split along (None: replicated)."""
        out = {}
        for name, _ in self.named_parameters():
            mod_name, _, leaf = name.rpartition(".")
            mod = self.get_submodule(mod_name) if mod_name else self
            out[name] = getattr(mod, "shard_dims", {}).get(leaf)
        return out

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        """Replicated parameters applied to sequence shards: their grads need a tp all-reduce."""
        if not self.sp:
            return []
        dims = self.shard_dims()
        return [p for n, p in self.named_parameters() if dims[n] is None]


def allreduce_sequence_parallel_grads(params, group) -> None:
    """Sum the gradients of LayerNorms, row-parallel biases and the position embedding over the
    tensor-parallel group (each rank saw only its sequence shard). One flat all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def apply_tensor_parallel(model, group, sequence_parallel: bool = False) -> TensorParallelGPT:
    """Picotron-style entry point: the full model in, this rank's shard out."""
    return TensorParallelGPT(model, group, sequence_parallel)
