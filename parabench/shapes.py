"""The GPT's shapes: its configuration, the size ladder, custom shape names, parameter counts
and FLOPs per token, and the entropy of its synthetic data. Plain arithmetic, no torch: suites,
cases, the theory and the planner read them without building a model (``parabench.models``
builds it).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace

from parabench.names import UnknownName, unknown_name, unknown_name_message


@dataclass(frozen=True)
class GPTConfig:
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int = 50304
    seq_len: int = 2048
    mlp_ratio: int = 4
    # Mixture of experts (all defaults = the dense model). A block whose index i has
    # (i + 1) % moe_every == 0 replaces its MLP with ``n_experts`` expert MLPs behind a top-k
    # token-choice router (see :class:`MoE`); capacity_factor None = dropless.
    n_experts: int = 0
    top_k: int = 2
    moe_every: int = 2
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    # Benchmark mode (see :func:`balanced_routing_bias`): every expert gets exactly s*k/E tokens of
    # each sequence, whatever the router has learnt.
    balanced_routing: bool = False
    # The attention block's parameter layout (``LAYOUTS``): "separate" q, k, v linears (k without a
    # bias), or one "fused" qkv linear as GPT-2, nanoGPT and Megatron-LM build it. Same math and
    # FLOPs; different parameter-tensor and module counts, which per-tensor and per-module hooks pay.
    layout: str = "separate"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise unknown_name("model layout", self.layout, LAYOUTS, plural="layouts")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and (i + 1) % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["layout"] == "separate":  # records of the default layout read as they did before the field
            del d["layout"]
        return d


# "separate": q, k, v as three linears (biases on q and v only), so that a column split of each is a
# split by heads (tensor and context parallelism rely on it). "fused": one qkv linear d -> 3d with a
# bias, the layout of GPT-2's checkpoints (``c_attn``), nanoGPT (``bias=True``, its default) and
# Megatron-LM (``linear_qkv``, ``add_bias_linear`` on by default).
LAYOUTS = ("separate", "fused")


# GPT-3 paper Table 2.1 with consistent shapes (see docs/facts.md), plus CPU-sized models for tests.
MODEL_LADDER: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=64),
    # CPU stand-in for GPU suites (`--proxy-model`): deep and wide enough in heads for 8 stages or tp=8.
    "tiny-deep": GPTConfig(n_layers=8, d_model=64, n_heads=8, vocab_size=256, seq_len=64),
    "small": GPTConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=512, seq_len=128),
    "gpt-125m": GPTConfig(n_layers=12, d_model=768, n_heads=12),
    "gpt-350m": GPTConfig(n_layers=24, d_model=1024, n_heads=16),
    "gpt-760m": GPTConfig(n_layers=24, d_model=1536, n_heads=16),
    "gpt-1.3b": GPTConfig(n_layers=24, d_model=2048, n_heads=16),
    "gpt-2.7b": GPTConfig(n_layers=32, d_model=2560, n_heads=32),
    "gpt-6.7b": GPTConfig(n_layers=32, d_model=4096, n_heads=32),
    "gpt-13b": GPTConfig(n_layers=40, d_model=5120, n_heads=40),
    # Mixture-of-experts variants (every second block an MoE of 4 / 8 experts, top-2, dropless).
    "tiny-moe": GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=64, n_experts=4, top_k=2),
    "tiny-moe-cap1": GPTConfig(
        n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=64, n_experts=4, top_k=2, capacity_factor=1.0
    ),
    "gpt-350m-moe": GPTConfig(n_layers=24, d_model=1024, n_heads=16, n_experts=8, top_k=2),
    # Capacity variants (ref.ep and deepspeed.moe compared in capacity mode; the models above are dropless).
    # capacity_factor 2.0 = E/k with 4 experts: capacity = all of a rank's tokens, so nothing is ever dropped.
    "tiny-moe-cap2": GPTConfig(
        n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=64, n_experts=4, top_k=2, capacity_factor=2.0
    ),
    "gpt-350m-moe-cap1": GPTConfig(n_layers=24, d_model=1024, n_heads=16, n_experts=8, top_k=2, capacity_factor=1.0),
    # Balanced-routing benchmark variants (see balanced_routing_bias): routing at initialisation
    # collapses onto few experts on synthetic data; these give every expert s*k/E tokens per sequence.
    "tiny-moe-bal": GPTConfig(
        n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=64, n_experts=4, top_k=2, balanced_routing=True
    ),
    "gpt-350m-moe-bal": GPTConfig(n_layers=24, d_model=1024, n_heads=16, n_experts=8, top_k=2, balanced_routing=True),
    "gpt-350m-moe-bal-cap1": GPTConfig(
        n_layers=24, d_model=1024, n_heads=16, n_experts=8, top_k=2, capacity_factor=1.0, balanced_routing=True
    ),
    # Long sequence for context parallelism.
    "gpt-125m-8k": GPTConfig(n_layers=12, d_model=768, n_heads=12, seq_len=8192),
}


# A dense shape off the ladder, named by its shape so that every process that reads a case (the
# workers torchrun starts, recheck, the report, the planner) rebuilds it from the name alone:
# "custom-L20-d2304-h18" is 20 layers of width 2304 with 18 heads; "-v32000" sets the vocabulary.
# The sequence length stays the case's own (seq_len).
CUSTOM_MODEL = re.compile(r"custom-L(\d+)-d(\d+)-h(\d+)(?:-v(\d+))?")
CUSTOM_MODEL_FORM = "custom-L<layers>-d<width>-h<heads>[-v<vocab>]"


def custom_model_name(cfg: GPTConfig) -> str | None:
    """The name :data:`CUSTOM_MODEL` gives ``cfg``'s shape, or None for a shape a name cannot carry
    (mixture of experts, another MLP ratio, the fused layout: those stay on the ladder)."""
    plain = GPTConfig(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, vocab_size=cfg.vocab_size)
    if replace(cfg, seq_len=plain.seq_len) != plain:
        return None
    return f"custom-L{cfg.n_layers}-d{cfg.d_model}-h{cfg.n_heads}" + (
        "" if cfg.vocab_size == GPTConfig.vocab_size else f"-v{cfg.vocab_size}"
    )


def is_model_name(name) -> bool:
    """A ladder model, or a well-formed custom shape name."""
    try:
        model_config(name)
    except (KeyError, TypeError):
        return False
    return True


def unknown_model_message(name) -> str:
    return unknown_name_message("model", name, MODEL_LADDER, also=CUSTOM_MODEL_FORM)


def _custom_shape(name: str) -> GPTConfig:
    layers, width, heads, vocab = CUSTOM_MODEL.fullmatch(name).groups()
    n_layers, d_model, n_heads = int(layers), int(width), int(heads)
    if min(n_layers, d_model, n_heads) < 1 or d_model % n_heads:
        raise KeyError(f"model {name!r}: layers, width and heads must be positive, and heads must divide the width")
    return GPTConfig(n_layers=n_layers, d_model=d_model, n_heads=n_heads, vocab_size=int(vocab or GPTConfig.vocab_size))


def model_config(
    name: str, seq_len: int | None = None, vocab_size: int | None = None, layout: str | None = None
) -> GPTConfig:
    if isinstance(name, str) and CUSTOM_MODEL.fullmatch(name):
        cfg = _custom_shape(name)
    elif name in MODEL_LADDER:
        cfg = MODEL_LADDER[name]
    else:
        raise UnknownName(unknown_model_message(name))
    if seq_len is not None:
        cfg = replace(cfg, seq_len=seq_len)
    if vocab_size is not None:
        cfg = replace(cfg, vocab_size=vocab_size)
    if layout is not None:
        cfg = replace(cfg, layout=layout)
    return cfg


def parameter_count(cfg: GPTConfig) -> dict[str, int]:
    """Parameter counts by role, computed from the shapes (no model needed).

    MoE configs add ``experts`` (all expert parameters), ``dense`` (everything else, routers
    included: what expert parallelism replicates), ``active`` (parameters one token uses: top_k
    experts per MoE layer) and count only the *active* matmul parameters under ``matmul``
    (router + top_k expert MLPs per MoE layer), which is what FLOPs per token are made of.
    """
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    qkv_biases = 3 * d if cfg.layout == "fused" else 2 * d  # the separate layout's k has none
    per_block = (3 * d * d + qkv_biases) + (d * d + d) + 2 * (cfg.mlp_ratio * d * d) + cfg.mlp_ratio * d + d + 4 * d
    blocks = L * per_block
    embeddings = V * d + cfg.seq_len * d
    head = V * d
    final_ln = 2 * d
    if cfg.is_moe:
        r, E, k, M = cfg.mlp_ratio, cfg.n_experts, cfg.top_k, cfg.n_moe_layers
        mlp = 2 * r * d * d + r * d + d
        experts = M * E * mlp
        blocks = L * per_block + M * ((E - 1) * mlp + d * E)  # E MLPs + router instead of one MLP
        total = blocks + embeddings + head + final_ln
        return {
            "total": total,
            "blocks": blocks,
            "embeddings": embeddings,
            "head": head,
            "experts": experts,
            "dense": total - experts,
            "active": total - M * (E - k) * mlp,
            "matmul": L * (4 * d * d + 2 * r * d * d) + M * ((k - 1) * 2 * r * d * d + d * E) + head,
        }
    return {
        "total": blocks + embeddings + head + final_ln,
        "blocks": blocks,
        "embeddings": embeddings,
        "head": head,
        # Parameters that take part in matrix multiplies: block weights and the output head.
        "matmul": L * (4 * d * d + 2 * cfg.mlp_ratio * d * d) + head,
    }


FLOPS_CONVENTION = (
    "6*N + 12*L*s*d per token (PaLM appendix B); N = matmul parameters "
    "(block weights + untied output head, embeddings excluded); no causal-mask discount"
)


MOE_FLOPS_CONVENTION = (
    FLOPS_CONVENTION + "; for MoE models N counts the active matmul parameters (router + top_k expert "
    "MLPs per MoE layer, not all experts), the dropless top-k cost of one token"
)


def model_flops_per_token(cfg: GPTConfig) -> int:
    n = parameter_count(cfg)["matmul"]
    return 6 * n + 12 * cfg.n_layers * cfg.seq_len * cfg.d_model


HFU_CONVENTION = (
    "hardware FLOPs per token = model FLOPs (FLOPS_CONVENTION) + the recomputation actually run: with "
    "activation checkpointing of every transformer block, one extra forward of the blocks, "
    "2*N_blocks + 4*L*s*d (N_blocks = matmul parameters inside the blocks, active ones for MoE; the "
    "head is not recomputed); HFU = achieved hardware FLOP/s per device / peak (Korthikanti et al. 2022)"
)


def hardware_flops_per_token(cfg: GPTConfig, activation_checkpointing: bool = False) -> int:
    """FLOPs a device actually executes per token (see HFU_CONVENTION); equals the model FLOPs
    without recomputation."""
    flops = model_flops_per_token(cfg)
    if activation_checkpointing:
        c = parameter_count(cfg)
        n_blocks = c["matmul"] - c["head"]
        flops += 2 * n_blocks + 4 * cfg.n_layers * cfg.seq_len * cfg.d_model
    return flops


# --- synthetic, learnable data ------------------------------------------------------------

MARKOV_OFFSETS = (1, 2, 3, 5, 8, 13)
MARKOV_PROBS = (0.5, 0.2, 0.12, 0.08, 0.06, 0.04)


def markov_entropy_nats() -> float:
    """Irreducible loss of the data: the entropy of the offset distribution."""
    return -sum(p * math.log(p) for p in MARKOV_PROBS)
