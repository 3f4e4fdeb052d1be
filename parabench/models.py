"""The one model every strategy trains and the synthetic data it learns (its shapes: ``parabench.shapes``).

The model is a GPT-2/3 style decoder: learned token and position embeddings, pre-LayerNorm
blocks with causal scaled-dot-product attention and a GELU MLP (4x), a final LayerNorm and an
untied output head. Every strategy builds it through :func:`build_model` with the same seed,
so all of them start from bit-identical weights on the same device type.

The data is a first-order Markov chain over the vocabulary: token[t+1] = token[t] + offset, where
the offset is drawn from a small fixed set with skewed probabilities. A model can learn the
transition table, so loss curves fall; the entropy floor is that of the offset distribution.
Batches are a pure function of (seed, step), so any world size sees the same global batch.
"""

from __future__ import annotations

import contextlib
import math
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

# The shapes are the model's vocabulary: its callers find them here beside the modules.
from parabench.shapes import (  # noqa: F401
    CUSTOM_MODEL,
    CUSTOM_MODEL_FORM,
    FLOPS_CONVENTION,
    HFU_CONVENTION,
    LAYOUTS,
    MARKOV_OFFSETS,
    MARKOV_PROBS,
    MODEL_LADDER,
    MOE_FLOPS_CONVENTION,
    GPTConfig,
    custom_model_name,
    hardware_flops_per_token,
    is_model_name,
    markov_entropy_nats,
    model_config,
    model_flops_per_token,
    parameter_count,
    unknown_model_message,
)


class FusedCausalSelfAttention(nn.Module):
    """Causal self-attention with one ``qkv`` linear (d -> 3d, bias), GPT-2 / nanoGPT / Megatron-LM
    style: the same computation as :class:`CausalSelfAttention` (its q, k, v weights are the row
    blocks ``qkv.weight[:d]``, ``[d:2d]``, ``[2d:]``), in 2 linears and 4 parameter tensors instead of
    4 linears and 7 tensors.

    Biases everywhere (nanoGPT's default ``bias=True``), not none: every other tensor of the block
    (LayerNorms, the output projection and MLP biases) stays as in the separate layout, so the only
    difference between the layouts is the granularity of the attention's input projection, plus the
    key bias a fused qkv bias carries (d parameters per block; softmax cancels it, so its true
    gradient is zero, as in GPT-2). Dropping every bias (nanoGPT ``bias=False``) would change
    the LayerNorms and the MLP too and measure two things at once.

    A column split of ``qkv.weight`` is not a split by heads, so tensor and context parallelism
    refuse this layout (``StrategySpec.layouts``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        # Separate q/k/v projections (not one fused qkv) so that a column split of each weight
        # is a split by heads: tensor parallelism then needs no re-layout.
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        # No key bias: it adds q.b to every score of a row, which softmax cancels, so its true
        # gradient is zero and Adam would only amplify rounding noise into it.
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # The head count comes from the local width, so a tensor-parallel shard (fewer heads) works unchanged.
        q, k, v = (lin(x).view(b, s, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


BALANCED_ROUTING_BIAS = 20.0


def balanced_routing_bias(n_rows: int, seq_len: int, n_experts: int, top_k: int, device) -> torch.Tensor:
    """``[n_rows, E]`` router-logit bias of the balanced benchmark mode (``balanced_routing``).

    Rows are tokens, sample-major (row r is position ``t = r mod seq_len``). Position t gets
    +20 on experts ``(t + j*E/k) mod E`` for j < k, so its top-k are those experts, spread over
    the expert-parallel ranks, and every expert serves exactly ``s*k/E`` tokens of each sequence.
    Megatron-Core's ``moe_router_force_load_balancing`` does this with random logits for
    benchmarking; a fixed pattern of positions gives every strategy the same routing (one
    process, ref.ep, DeepSpeed-MoE), so they stay comparable and testable. The gates remain the
    router's softmax over the biased logits, so the router still learns through them.

    Why a benchmark needs it: at GPT-2 initialisation on synthetic tokens the residual stream
    shares one direction across tokens and top-k routing collapses onto a few experts (measured
    on gpt-350m-moe: every token of a layer on the same 2 of 8 experts), so an expert-parallel
    measurement would time that collapse rather than a trained, balanced MoE.
    """
    if n_experts % top_k:
        raise ValueError(f"balanced routing needs top_k ({top_k}) to divide n_experts ({n_experts})")
    pos = torch.arange(n_rows, device=device) % seq_len
    chosen = (pos.unsqueeze(1) + torch.arange(top_k, device=device) * (n_experts // top_k)) % n_experts
    bias = torch.zeros(n_rows, n_experts, device=device)
    return bias.scatter_(1, chosen, BALANCED_ROUTING_BIAS)


def router_logits(router: nn.Module, flat: torch.Tensor, cfg: GPTConfig, seq_len: int) -> torch.Tensor:
    """The router's logits for the token rows ``flat`` (sample-major, ``seq_len`` per sample),
    plus the balanced-routing bias when the model asks for it."""
    logits = router(flat)
    if cfg.balanced_routing:
        logits = logits + balanced_routing_bias(flat.shape[0], seq_len, cfg.n_experts, cfg.top_k, flat.device).to(
            logits.dtype
        )
    return logits


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None, n_samples: int):
    """Top-k token-choice routing (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch,
    Fedus et al. 2021) of ``T`` tokens (rows of ``logits`` [T, E], ``n_samples`` sequences of equal
    length, sample-major).

    Returns ``(experts [T, k], gates [T, k], keep [T, k] bool, aux)``: gates are the top-k softmax
    probabilities renormalised to sum to 1; ``keep`` is False for assignments dropped by the
    capacity ``ceil(capacity_factor * T * k / E)`` per expert (first come, first served in
    token-major order), all True when dropless. ``aux`` is the Switch load-balancing loss
    ``E * sum_e f_e * P_e`` (f_e: fraction of the k*T assignments that chose e, P_e: mean router
    probability of e) computed per *sequence* and averaged over sequences (DeepSeek-V3's
    sequence-wise form): it is then a mean over samples, so data-parallel splits of the batch
    average to exactly the loss of the whole batch.
    """
    T, E = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, experts = probs.topk(top_k, dim=-1)
    gates = (top_p / top_p.sum(dim=-1, keepdim=True)).to(logits.dtype)
    onehot = F.one_hot(experts, E)  # [T, k, E]
    keep = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * T * top_k / E)
        position = onehot.reshape(T * top_k, E).cumsum(0).reshape(T, top_k, E)  # 1-based rank within its expert
        keep = (position * onehot).sum(-1) <= capacity
    f = onehot.float().sum(1).view(n_samples, -1, E).mean(1) / top_k  # [n, E]
    p = probs.view(n_samples, -1, E).mean(1)
    aux = (E * (f * p).sum(-1)).mean()
    return experts, gates, keep, aux


class AuxLossInjector(torch.autograd.Function):
    """Identity on ``x``; in backward, gives ``aux`` the gradient ``scale`` as if ``scale * aux`` had
    been added to the loss (Megatron-core's MoEAuxLossAutoScaler). The auxiliary loss thus reaches
    the router through any trainer that calls ``lm_loss(model(x), y).backward()``."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class MoE(nn.Module):
    """``n_experts`` expert MLPs behind a top-k router; the output of a token is the gate-weighted
    sum of its (kept) experts' outputs, zero for a fully dropped token (the residual carries it).

    The load-balancing loss, times ``aux_loss_coef * aux_grad_scale``, enters the gradient through
    :class:`AuxLossInjector`; the reported LM loss does not include it (``last_aux`` keeps the
    value). Trainers that divide the loss by grad_accum set ``aux_grad_scale = 1 / grad_accum``.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))
        self.aux_grad_scale = 1.0
        self.last_aux: torch.Tensor | None = None
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.last_dropped = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        experts, gates, keep, aux = route(
            router_logits(self.router, flat, self.cfg, s), self.cfg.top_k, self.cfg.capacity_factor, b
        )
        out = torch.zeros_like(flat)
        tok = torch.arange(b * s, device=x.device).unsqueeze(1).expand_as(experts)
        for e, expert in enumerate(self.experts):
            sel = (experts == e) & keep
            t_idx, g = tok[sel], gates[sel]
            if t_idx.numel():
                # under autocast the expert's output and the gates are 16-bit: the weighted sum
                # accumulates in the residual stream's dtype, as expert parallelism's combine does
                out = out.index_add(0, t_idx, expert(flat[t_idx]).to(out.dtype) * g.unsqueeze(1).to(out.dtype))
        self.last_aux = aux.detach()
        self.last_tokens_per_expert = torch.bincount(experts[keep], minlength=self.cfg.n_experts).cpu()
        self.last_dropped = int((~keep).sum())
        if torch.is_grad_enabled() and self.cfg.aux_loss_coef:
            out = AuxLossInjector.apply(out, aux, self.cfg.aux_loss_coef * self.aux_grad_scale)
        return out.view(b, s, d)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = FusedCausalSelfAttention(cfg) if cfg.layout == "fused" else CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        # ``layer`` (its index) matters only for MoE configs: dense models build the same MLP as before.
        self.mlp = MoE(cfg) if layer is not None and cfg.is_moe_layer(layer) else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(tokens)`` returns logits; ``loss`` is the mean token CE."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok_emb(tokens) + self.pos_emb(pos)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _LossRoute:
    """Which form of :func:`token_cross_entropy` :func:`lm_loss` runs, and how often it ran compiled."""

    fn = staticmethod(token_cross_entropy)
    compiled_calls = 0


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss every strategy that holds whole logits calls: :func:`token_cross_entropy`,
    eager, or compiled inside :func:`compiled_loss` (option ``compile_loss``)."""
    return _LossRoute.fn(logits, targets)


def _counted(fn):
    def run(logits, targets):
        _LossRoute.compiled_calls += 1
        return fn(logits, targets)

    return run


@contextlib.contextmanager
def compiled_loss(on: bool):
    """Option ``compile_loss``: within, :func:`lm_loss` runs ``torch.compile(token_cross_entropy)``,
    torchtitan's compile component "loss" (``torchtitan/train.py``: ``self.loss_fn =
    torch.compile(self.loss_fn)``). Eager, the fp32 cross-entropy over a 50,304-way vocabulary
    writes the upcast logits, their log-softmax and two gradients of that size to memory (about
    20 bytes per logit); Inductor fuses the upcast, the log-sum-exp and the gradient into a read and
    a write of the 16-bit logits. Yields a function that returns how many calls ran compiled, so a
    strategy that never calls :func:`lm_loss` cannot carry the option's label unnoticed."""
    if not on:
        yield lambda: 0
        return
    start = _LossRoute.compiled_calls
    _LossRoute.fn = staticmethod(_counted(torch.compile(token_cross_entropy)))
    try:
        yield lambda: _LossRoute.compiled_calls - start
    finally:
        _LossRoute.fn = staticmethod(token_cross_entropy)


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """GPT-2 initialisation (N(0, 0.02), residual projections scaled by 1/sqrt(2L)), seeded.

    Parameters are drawn in a fixed order from one generator on the parameters' device, so every
    strategy and world size starts from the same numbers on the same kind of device (CPU runs
    are bit-identical to each other, GPU runs to each other). Drawing on the device keeps the
    initialisation of billion-parameter models to a fraction of a second.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    resid_std = 0.02 / math.sqrt(2 * model.cfg.n_layers)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif ".ln" in name or name.startswith("ln_"):
            p.fill_(1.0)
        else:
            std = resid_std if name.endswith("proj.weight") else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(std))


def build_model(cfg: GPTConfig, seed: int, device: torch.device | str = "cpu") -> GPT:
    """The model every strategy starts from: fp32 parameters on ``device``, deterministic in ``seed``.

    The module is built on the meta device and materialised once on ``device``, so no
    throw-away CPU copy of a billion-parameter model is ever made.
    """
    with torch.device("meta"):
        model = GPT(cfg)
    model = model.to_empty(device=device)
    init_weights(model, seed)
    return model


def global_batch(step: int, batch_size: int, cfg: GPTConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of the whole global batch for ``step`` (int64, CPU), shape [B, s].

    Sample j of step i is the same whatever the world size, so strategies that split the batch
    differently still train on identical data.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=gen)
    choice = torch.multinomial(torch.tensor(MARKOV_PROBS), batch_size * cfg.seq_len, replacement=True, generator=gen)
    offsets = torch.tensor(MARKOV_OFFSETS)[choice].view(batch_size, cfg.seq_len)
    stream = torch.cat([starts, starts + offsets.cumsum(dim=1)], dim=1) % cfg.vocab_size
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


# The pieces of the MoE layer an expert-parallel shard needs to route exactly as the full layer
# (``reference_impls.expert_parallel`` takes them from its caller; it imports nothing from parabench).
MOE_ROUTING = types.SimpleNamespace(
    moe_type=MoE, route=route, router_logits=router_logits, add_aux_loss=AuxLossInjector.apply
)
