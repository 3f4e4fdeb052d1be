"""Context parallelism: ring attention and DeepSpeed-Ulysses (``reference_impls/context_parallel.py``)
and Llama 3's all-gather of K and V (``reference_impls/cp_allgather.py``) as references, DeepSpeed's DistributedAttention and torch's
experimental context_parallel as peers. For now the whole world is the cp group, alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from parabench.shapes import GPTConfig
from parabench.strategies import AMP_ONLY, CommonOptions, StrategySpec
from parabench.theory import BYTES, Expectation, psi, sum_ops, zero_paper_state_bytes


@dataclass(frozen=True)
class ContextOptions(CommonOptions):
    cp: int | None = None  # context-parallel degree; None: the world size (the only one supported)
    cp_split: Literal["zigzag", "contiguous"] = "zigzag"  # ring, all-gather: how a sequence is cut into chunks
    activation_checkpointing: bool = False  # recompute every transformer block in backward (peers that wire it)


def validate(case, o: ContextOptions, cfg: GPTConfig) -> None:
    cp = case.world_size if o.cp is None else o.cp
    if cp != case.world_size:
        raise ValueError(f"{case.strategy}: cp={cp} must equal world_size={case.world_size} (no cp x dp yet)")
    if cfg.n_experts:
        raise ValueError(f"{case.strategy}: context parallelism supports dense models only ({case.model} is MoE)")
    seq = case.seq_len or cfg.seq_len
    split = o.cp_split if case.strategy in ("ref.cp_ring", "ref.cp_allgather") else "contiguous"
    chunks = 2 * cp if split == "zigzag" else cp
    if seq % chunks:
        raise ValueError(
            f"{case.strategy}: seq_len={seq} does not split into {chunks} chunks ({split} split over cp={cp})"
        )
    if case.strategy in ("ref.cp_ulysses", "deepspeed.ulysses") and cfg.n_heads % cp:
        raise ValueError(f"{case.strategy}: cp={cp} does not divide the {cfg.n_heads} heads of {case.model}")


# --- context parallelism (ring attention, Ulysses, all-gather) ------------------------------------
# Conventions: c = cp (the whole world for now), B = micro_batch x grad_accum samples handed to a
# rank per step; the group all-gathers its token ids, so each of the grad_accum micro-batches has
# b = c x micro_batch samples of which a rank holds n = s/c positions; h = d_model.


def cp_ops(cfg: GPTConfig, case, mode: str) -> list[tuple[str, int]]:
    """Every communication op (kind, payload bytes) one rank issues in one training step.

    Data: one all-gather of the token ids and targets, payload c x 2·B·s int64.
    Ring attention, per layer per micro-batch: forward c-1 hops, each sending K and V blocks of
    b·n·h elements to the next rank and receiving as many from the previous one (send 2·b·n·h,
    recv 2·b·n·h per hop); backward (a second ring pass, nothing of the visited blocks kept from
    forward) sends K and V round the ring again, c-1 hops, and the dK, dV partial sums of each
    block c-1 hops on to its owner, in the same direction: per layer 6(c-1)·b·n·h elements sent
    and as many received, all in the compute dtype (bf16 under autocast).
    Ulysses, per layer per micro-batch: 4 all-to-alls forward (q, k, v to head shards; the output
    back to sequence shards) and 4 backward, each of b·n·h = b·s·h/c elements (input payload).
    All-gather (Llama 3), per layer per micro-batch: one all-gather of the stacked K and V, payload
    the gathered buffer of 2·b·s·h elements, and in backward one reduce-scatter of dK, dV, payload
    the buffer before scattering, 2·b·s·h elements; both in the compute dtype.
    Gradients: one all-reduce of all Ψ parameters' fp32 gradients per step.
    """
    c = case.world_size
    s, h, E = cfg.seq_len, cfg.d_model, BYTES[case.precision]
    B = case.micro_batch * case.grad_accum
    b = c * case.micro_batch
    n = s // c
    act = b * n * h * E
    ops: list[tuple[str, int]] = [("all_gather", c * 2 * B * s * 8)]
    for _ in range(case.grad_accum):
        for _layer in range(cfg.n_layers):
            if mode == "ring":
                # forward K, V; backward K, V again and the dK, dV partial sums
                ops += [("send", 2 * act), ("recv", 2 * act)] * (3 * (c - 1))
            elif mode == "allgather":
                ops += [("all_gather", 2 * c * act), ("reduce_scatter", 2 * c * act)]
            else:
                ops += [("all_to_all", act)] * 8
    ops.append(("all_reduce", 4 * psi(cfg)))
    return ops


_ATTENTION_NOTES = {
    "ring": "ring attention: per layer per micro-batch (c-1) hops of K and V (2·b·(s/c)·h elements sent and "
    "as many received per hop) forward; backward (a second ring pass) (c-1) hops of K and V again and "
    "(c-1) hops of the dK, dV partial sums, all in the compute dtype; ",
    "ulysses": "Ulysses: per layer per micro-batch 4 all-to-alls of b·s·h/c elements forward (q, k, v, out) and 4 "
    "backward; ",
    "allgather": "all-gather (Llama 3): per layer per micro-batch one all-gather of K and V (2·b·s·h elements "
    "gathered) forward and one reduce-scatter of dK, dV (2·b·s·h elements before scattering) backward, in the "
    "compute dtype; ",
}


def cp_expectation(mode: str):
    def fn(cfg, case, o, dp):
        p = psi(cfg)
        # The ring's blocks and Ulysses' q, k, v and output shards travel in the compute dtype:
        # measured equal in bf16 on 2 GPUs as well (ring, ref.cp_ulysses and deepspeed.ulysses);
        # the all-gather's K, V and their gradients too (bf16 checked on CPU).
        exact = case.precision in ("fp32", "bf16")
        return Expectation(
            state_bytes={"params": 4 * p, "grads": 4 * p, "optimizer": 8 * p},
            comm_payload_bytes=sum_ops(cp_ops(cfg, case, mode)) if exact else None,
            paper_state_bytes=zero_paper_state_bytes(0, p, dp),
            notes=_ATTENTION_NOTES[mode]
            + "b = cp x micro_batch samples (the group all-gathers its token ids: c·2·B·s int64 per step); one fp32 "
            "all-reduce of all gradients. Model state fully replicated: 16Ψ in fp32. Exact for fp32 and bf16.",
        )

    return fn


def _row(name, builder, kind, description, expect, **kw):
    if kind == "reference":
        kw.setdefault(
            "compile_unsupported",
            "its attention exchanges K and V (or heads) with send/recv or all-to-all inside each block, which a "
            "whole-block torch.compile (fullgraph) cannot trace, and its builder wires no hook",
        )
    return StrategySpec(
        name,
        "context",
        builder,
        kind,
        description,
        options=ContextOptions,
        validate=validate,
        expect=expect,
        min_world_size=2,
        **AMP_ONLY,
        **kw,
    )


ROWS = (
    _row(
        "ref.cp_ring",
        "parabench.builders.context:build_cp_ring",
        "reference",
        "ring attention context parallel: K/V round the ring over send/recv, fused block kernels, "
        "log-sum-exp merge, ring backward (option cp_split = zigzag | contiguous)",
        cp_expectation("ring"),
        version="3",
        peers=("torch.cp",),
        report_sections=("cp_balance",),
    ),
    _row(
        "ref.cp_ulysses",
        "parabench.builders.context:build_cp_ulysses",
        "reference",
        "DeepSpeed-Ulysses context parallel: all-to-all sequence shards <-> head shards around attention",
        cp_expectation("ulysses"),
        peers=("deepspeed.ulysses",),
    ),
    _row(
        "ref.cp_allgather",
        "parabench.builders.context:build_cp_allgather",
        "reference",
        "Llama 3 all-gather context parallel: K, V all-gathered before attention, local queries, dK, dV "
        "reduce-scattered; load-balanced split (option cp_split = zigzag | contiguous)",
        cp_expectation("allgather"),
        report_sections=("cp_balance",),
    ),
    # DeepSpeed's DistributedAttention issues the same 4 + 4 all-to-alls per layer; the rest of the
    # step is ref.cp_ulysses's (token all-gather, one gradient all-reduce).
    _row(
        "deepspeed.ulysses",
        "parabench.peers.cp_ep_peers:build_deepspeed_ulysses",
        "peer",
        "DeepSpeed-Ulysses DistributedAttention (deepspeed.sequence.layer) around SDPA; gradients "
        "all-reduced over the cp group",
        cp_expectation("ulysses"),
    ),
    _row(
        "torch.cp",
        "parabench.peers.cp_ep_peers:build_torch_cp",
        "peer",
        "torch.distributed.tensor.experimental.context_parallel (ring attention); CUDA only",
        None,
    ),
)
