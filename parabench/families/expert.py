"""Expert parallelism for the MoE models: the reference (``reference_impls/expert_parallel.py``:
experts sharded, tokens dispatched and combined with all-to-all) and DeepSpeed-MoE. For now the
whole world is the ep group, alone."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from parabench.shapes import GPTConfig, parameter_count
from parabench.strategies import AMP_ONLY, MASTER_ONLY, CommonOptions, PeerProfile, StrategySpec
from parabench.theory import BYTES, Expectation, sum_ops


@dataclass(frozen=True)
class ExpertOptions(CommonOptions):
    ep: int | None = None  # expert-parallel degree; None: the world size (the only one supported)
    min_capacity: int = 0  # deepspeed.moe capacity mode: the gate's minimum slots per expert
    activation_checkpointing: bool = False  # not supported by either strategy: refused when set


@dataclass(frozen=True)
class DeepSpeedMoEOptions(ExpertOptions):
    profile: PeerProfile = "tuned"  # strategies.PEER_PROFILE_HELP

    RECORDED_DEFAULTS: ClassVar[tuple[str, ...]] = ("profile",)


def validate(case, o: ExpertOptions, cfg: GPTConfig) -> None:
    ep = case.world_size if o.ep is None else o.ep
    if not cfg.n_experts:
        raise ValueError(f"{case.strategy} needs an MoE model (n_experts > 0), got {case.model}")
    if ep != case.world_size:
        raise ValueError(f"{case.strategy}: ep={ep} must equal world_size={case.world_size} (no ep x dp yet)")
    if cfg.n_experts % ep:
        raise ValueError(f"{case.strategy}: ep={ep} does not divide the {cfg.n_experts} experts of {case.model}")
    if case.strategy == "deepspeed.moe" and cfg.top_k != 2:
        raise ValueError(f"deepspeed.moe wires DeepSpeed's top-2 gate only ({case.model} has top_k={cfg.top_k})")


def ep_ops(cfg: GPTConfig, case, routing: list[tuple[int, int]] | None = None) -> list[tuple[str, int]]:
    """Every communication op (kind, payload bytes) one rank issues in one training step.

    Per MoE layer per micro-batch: forward one all-to-all of the per-expert counts (E int64) and two
    of token rows, dispatch (input: the A_r assignments this rank routes) and combine (input: the
    R_r rows it received); backward the same two row exchanges reversed (combine's backward sends
    A_r rows, dispatch's R_r): 2(A_r + R_r)·h elements per MoE layer. ``routing`` lists the measured
    (A_r, R_r) per MoE layer per micro-batch; without it, dropless top-k with balanced routing:
    A_r = R_r = b·s·k (b = micro_batch), capped at E·capacity when a capacity factor is set.
    Rows travel in the compute dtype (under autocast the dispatch casts them, as the experts'
    first matmul would). Gradients: one fp32 all-reduce of the dense (replicated) parameters; with ep = world, none for
    experts.
    """
    h, E, k, b, s = cfg.d_model, cfg.n_experts, cfg.top_k, case.micro_batch, cfg.seq_len
    nb = BYTES[case.precision]
    if routing is None:
        a = b * s * k
        if cfg.capacity_factor is not None:
            a = min(a, E * math.ceil(cfg.capacity_factor * b * s * k / E))
        routing = [(a, a)] * (cfg.n_moe_layers * case.grad_accum)
    ops: list[tuple[str, int]] = []
    for sent, received in routing:
        ops += [
            ("all_to_all", E * 8),
            ("all_to_all", sent * h * nb),
            ("all_to_all", received * h * nb),
            ("all_to_all", sent * h * nb),
            ("all_to_all", received * h * nb),
        ]
    ops.append(("all_reduce", 4 * parameter_count(cfg)["dense"]))
    return ops


def expect_ref_ep(cfg, case, o, dp):
    c = parameter_count(cfg)
    if "experts" not in c:
        return Expectation(
            state_bytes=None, comm_payload_bytes=None, paper_state_bytes=None, notes="ref.ep needs an MoE model"
        )
    ep = case.world_size
    local = c["dense"] + c["experts"] // ep
    balanced = sum_ops(ep_ops(cfg, case))
    # What one rank moves depends on the routing: rows it routes A_r <= b·s·k (= when dropless),
    # rows it receives 0 <= R_r <= ep·b·s·min(k, E/ep). The record's check uses that range.
    h, nb, k, E = cfg.d_model, BYTES[case.precision], cfg.top_k, cfg.n_experts
    a_max = case.micro_batch * cfg.seq_len * k
    r_max = ep * case.micro_batch * cfg.seq_len * min(k, E // ep)
    a_min = a_max if cfg.capacity_factor is None else 0
    n = cfg.n_moe_layers * case.grad_accum
    counts = n * E * 8 if E * 8 > 64 else 0
    comm = {**balanced, "all_to_all": [counts + n * 2 * a_min * h * nb, counts + n * 2 * (a_max + r_max) * h * nb]}
    return Expectation(
        state_bytes={"params": 4 * local, "grads": 4 * local, "optimizer": 8 * local},
        comm_payload_bytes=comm,
        comm_payload_bytes_balanced=balanced,
        paper_state_bytes=None,
        notes="dense parameters replicated + E/ep experts per MoE layer: 16 bytes each in fp32 (an expert no token "
        "chose has no gradient that step). The all-to-all volume of one rank depends on the routing: the "
        "expectation is the range [2·A_min, 2·(A_max + R_max)]·h per MoE layer (A: rows routed, b·s·k when "
        "dropless; R: rows received, at most ep·b·s·min(k, E/ep)); comm_payload_bytes_balanced gives dropless "
        "balanced routing (A = R = b·s·k), which is the mean over ranks; parabench.theory.ep_ops with the "
        "measured routing (trainer.strategy_stats) is exact.",
    )


# deepspeed.ulysses: DeepSpeed's DistributedAttention issues the same 4 + 4 all-to-alls per layer;


def deepspeed_moe_capacity(
    tokens: int, n_experts: int, top_k: int, capacity_factor: float, min_capacity: int = 0
) -> int:
    """Slots per expert in DeepSpeed 0.19's ``top2gating`` for ``tokens`` tokens of one rank and
    micro-batch: ``ceil(tokens / E * (capacity_factor * 2))`` evaluated as DeepSpeed does (the
    factor is a float32 tensor), at least ``min_capacity``. With ``min_capacity = 0`` it equals
    parabench's ``ceil(capacity_factor * tokens * k / E)`` for k = 2."""
    import torch

    if top_k != 2:
        raise ValueError("deepspeed_moe_capacity models DeepSpeed's top-2 gate only")
    capacity = int(torch.ceil((tokens / n_experts) * torch.tensor(capacity_factor * 2)).item())
    return max(capacity, min_capacity)


def deepspeed_moe_ops(cfg: GPTConfig, case, capacities: list[int] | None = None) -> list[tuple[str, int]]:
    """Every communication op (kind, payload bytes) one rank issues in one step of ``deepspeed.moe``
    (DeepSpeed-MoE ``MOELayer`` under the ZeRO-0 engine, ep = world).

    Per MoE layer per micro-batch: the gate dispatches into a dense [E, C, h] buffer (empty slots
    zero) and all-to-alls it; the experts' [E, C, h] output goes back by a second all-to-all;
    backward repeats both: 4 all-to-alls of E·C·h elements in the compute dtype. Capacity mode:
    C = :func:`deepspeed_moe_capacity` of the rank's b·s tokens, whatever the routing, and the gate
    needs no collective. Dropless: C = the largest expert demand over the ep group, found by an
    all-reduce (MAX) of one int64 in forward; ``capacities`` lists the measured C per MoE layer per
    micro-batch (``strategy_stats``), which dropless needs.
    Gradients (engine, at the accumulation boundary, parameter dtype): non-expert parameters
    (attention, embeddings, norms, head and the gates) in one all-reduce over the data-parallel
    group (the world); the local experts' E/ep per MoE layer in one all-reduce over the
    expert-data-parallel group, which has world/ep = 1 rank here (a call the meter sees, no wire
    traffic). DeepSpeed flushes a bucket only past 5e8 elements: one call each for these models.
    """
    c = parameter_count(cfg)
    h, E = cfg.d_model, cfg.n_experts
    dropless = cfg.capacity_factor is None
    if capacities is None:
        if dropless:
            raise ValueError("dropless deepspeed.moe: the capacity depends on the routing; pass the measured ones")
        capacities = [
            deepspeed_moe_capacity(
                case.micro_batch * cfg.seq_len,
                E,
                cfg.top_k,
                cfg.capacity_factor,
                ExpertOptions.read(case.options).min_capacity,
            )
        ] * (cfg.n_moe_layers * case.grad_accum)
    nb = BYTES[case.precision]
    ops: list[tuple[str, int]] = []
    for capacity in capacities:
        if dropless:
            ops.append(("all_reduce", 8))
        ops += [("all_to_all", E * capacity * h * nb)] * 4
    ep = case.world_size
    ops += [("all_reduce", nb * c["dense"]), ("all_reduce", nb * c["experts"] // ep)]
    return ops


def deepspeed_moe_scalar_ops(cfg: GPTConfig, case) -> dict:
    """Collectives of at most 64 bytes (the meter lists them apart), measured on CPU: per MoE layer
    per micro-batch the dropless capacity all-reduce (8 bytes); in bf16 once per step the engine's
    overflow check, a 1-byte flag all-reduced (MAX) over the largest expert-parallel group."""
    calls = cfg.n_moe_layers * case.grad_accum if cfg.capacity_factor is None else 0
    nbytes = 8 * calls
    if case.precision != "fp32":
        calls, nbytes = calls + 1, nbytes + 1
    return {"all_reduce": {"calls": calls, "payload_bytes": nbytes}} if calls else {}


def expect_deepspeed_moe(cfg, case, o, dp):
    c = parameter_count(cfg)
    if "experts" not in c:
        return Expectation(
            state_bytes=None, comm_payload_bytes=None, paper_state_bytes=None, notes="deepspeed.moe needs an MoE model"
        )
    local = c["dense"] + c["experts"] // case.world_size
    nb = BYTES[case.precision]
    state = {"params": 4 * local, "grads": None, "optimizer": 8 * local} if case.precision == "fp32" else None
    n = cfg.n_moe_layers * case.grad_accum
    tokens, E = case.micro_batch * cfg.seq_len, cfg.n_experts
    balanced = math.ceil(tokens * cfg.top_k / E)  # every expert equally loaded
    if cfg.capacity_factor is not None:
        comm = sum_ops(deepspeed_moe_ops(cfg, case))
        balanced_comm = None
    else:
        # C lies between the balanced load and b·s (every token chose the same expert)
        balanced_comm = sum_ops(deepspeed_moe_ops(cfg, case, [balanced] * n))
        lo, hi = (sum_ops(deepspeed_moe_ops(cfg, case, [cap] * n))["all_to_all"] for cap in (balanced, tokens))
        comm = {**balanced_comm, "all_to_all": [lo, hi]}
    return Expectation(
        state_bytes=state,
        comm_payload_bytes=comm,
        comm_payload_bytes_balanced=balanced_comm,
        comm_payload_bytes_dense_grads=nb * c["dense"],
        comm_payload_bytes_expert_grads=nb * c["experts"] // case.world_size,
        comm_scalar_ops=deepspeed_moe_scalar_ops(cfg, case),
        paper_state_bytes=None,
        notes="DeepSpeed-MoE: per MoE layer per micro-batch 4 all-to-alls (dispatch, combine, and their backward) of "
        "the dense [E, C, h] buffer, padding included. Capacity mode: C = ceil(b·s/E · 2·capacity_factor), "
        "so the volume does not depend on the routing; dropless: C = the largest expert demand over the ep "
        "group (one int64 all-reduce per layer), the range [ceil(b·s·k/E), b·s] and the balanced value are "
        "given, parabench.theory.deepspeed_moe_ops with the measured capacities is exact. ref.ep sends only "
        "the kept rows: summed over ranks its volume is DeepSpeed's minus 4·h per padding slot. Gradients in "
        "the parameter dtype: non-expert all-reduced over the world, the E/ep local experts over the "
        "expert-data-parallel group of one rank (payload counted, nothing on the wire). State: dense + local "
        "experts, 16 bytes each in fp32 (gradients sit in DeepSpeed's buffers, not counted).",
    )


def routed_comm(case, cfg: GPTConfig, per_rank: list[dict]) -> list[dict] | None:
    """Expert parallelism moves what the router decided: with the routing each rank measured on
    the instrumented step (``strategy_stats``: rows sent and received per MoE layer for ref.ep,
    the gate's capacity for deepspeed.moe), the per-rank volume is exact. None when that does not
    apply: another strategy, no stats, or gradient accumulation (the stats keep only the last
    micro-batch, so the earlier ones' routing is unknown)."""
    if case.strategy not in ("ref.ep", "deepspeed.moe") or case.grad_accum != 1:
        return None
    out = []
    for r in per_rank:
        moe = ((r or {}).get("strategy_stats") or {}).get("moe_layers")
        if not moe or len(moe) != cfg.n_moe_layers:
            return None
        layers = [moe[k] for k in sorted(moe, key=int)]
        try:
            if case.strategy == "ref.ep":
                ops = ep_ops(cfg, case, [(int(x["sent_rows"]), int(x["received_rows"])) for x in layers])
            else:
                ops = deepspeed_moe_ops(cfg, case, [int(x["capacity"]) for x in layers])
        except (KeyError, TypeError, ValueError):
            return None
        out.append(sum_ops(ops))
    return out


def _row(name, builder, kind, description, expect, **kw):
    return StrategySpec(
        name,
        "expert",
        builder,
        kind,
        description,
        options=kw.pop("options", ExpertOptions),
        validate=validate,
        expect=expect,
        routed_comm=routed_comm,
        min_world_size=2,
        **(MASTER_ONLY if kind == "peer" else AMP_ONLY),
        **kw,
    )


ROWS = (
    _row(
        "ref.ep",
        "parabench.builders.expert:build_ep",
        "reference",
        "expert parallel MoE: experts sharded, tokens dispatched/combined with all-to-all (counts first), "
        "dense parameters all-reduced",
        expect_ref_ep,
        version="2",
        peers=("deepspeed.moe",),
        report_sections=("moe_routing",),
        compile_unsupported=(
            "its MoE layers route tokens by data-dependent counts and all-to-all inside the block, and its builder "
            "wires no torch.compile hook; deepspeed.moe, its peer, refuses compile too"
        ),
    ),
    _row(
        "deepspeed.moe",
        "parabench.peers.cp_ep_peers:build_deepspeed_moe",
        "peer",
        "DeepSpeed-MoE (deepspeed.moe.layer.MoE, top-2, deterministic gate; capacity mode for models with a "
        "capacity factor, else dropless) in the MoE blocks; ZeRO-0 engine reduces expert / non-expert gradients",
        expect_deepspeed_moe,
        options=DeepSpeedMoEOptions,
        version="2",  # 2: the tuned profile by default (1 ran what is now "matched")
        report_sections=("moe_routing",),
    ),
)
