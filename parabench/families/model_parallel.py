"""Model parallelism: Megatron tensor (+ sequence) parallelism and pipelines (GPipe, 1F1B,
interleaved 1F1B, zero-bubble ZB-H1), composed with data parallelism, as references (``reference_impls/compose.py``,
``tensor_parallel.py``, ``pipeline.py``) and as peers (PyTorch DTensor and pipelining, DeepSpeed's
pipeline engine).

``ref.tp`` on ``tp x dp`` ranks, ``ref.pp_1f1b`` on ``pp x dp`` and ``ref.pp_1f1b`` with ``tp`` set
on ``tp x pp x dp`` all go through the one composition function,
:func:`reference_impls.compose.parallelize`; the topology lays the grid out from ``tp`` and ``pp``.
``ref.pp_interleaved`` (``pipeline_interleaved.py``) runs Megatron's interleaved 1F1B with
``virtual_stages`` chunks per rank through the same function, and ``ref.pp_zb``
(``pipeline_zb.py``) ZB-H1 with the backward split into input and weight gradients (plain
pipeline x dp; its peer ``torch.pp_zb`` is torch's ScheduleInterleavedZeroBubble with one stage
per rank, the same order).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Literal

from parabench.shapes import GPTConfig
from parabench.strategies import MASTER_ONLY, TORCH_PEER_RECIPES, CommonOptions, PeerProfile, PlanFacts, StrategySpec
from parabench.theory import BYTES, Expectation, recipe_state_bytes, scalar_ops, sum_ops

TP_STRATEGIES = ("ref.tp", "ref.tp_sp", "torch.tp", "torch.tp_sp")
SP_STRATEGIES = ("ref.tp_sp", "torch.tp_sp")
INTERLEAVED_STRATEGIES = ("ref.pp_interleaved", "torch.pp_interleaved")
ZERO_BUBBLE_STRATEGIES = ("ref.pp_zb", "torch.pp_zb")


def virtual_stages_of(case, o: ModelParallelOptions) -> int:
    """Model chunks per pipeline rank: ``virtual_stages`` for the interleaved schedules, else 1."""
    return o.virtual_stages if case.strategy in INTERLEAVED_STRATEGIES else 1


@dataclass(frozen=True)
class ModelParallelOptions(CommonOptions):
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline stages
    microbatches: int | None = None  # pipeline micro-batches per micro_batch; None: 2 * pp
    schedule: Literal["1f1b", "gpipe"] = "1f1b"  # ref.tp / ref.tp_sp with pp > 1: the pipeline schedule
    sp: bool = False  # sequence parallel under a pipeline strategy (ref.pp_*)
    record_timeline: bool = False  # one more untimed step records the pipeline timeline (CUDA events on a GPU)
    virtual_stages: int = 2  # ref.pp_interleaved / torch.pp_interleaved: model chunks per rank
    # Blocks per pipeline stage, e.g. [7, 6, 6, 5] (one stage per rank; not the interleaved
    # schedules): fewer on the last stage, which also runs the head and loss. "balanced": the split
    # that evens the stages' FLOPs (reference_impls.pipeline_balance), resolved into the case when
    # it is made. None: an equal split (reference_impls.pipeline.partition_layers). Reference and
    # peers cut the same stages.
    stage_layers: list[int] | None = None

    @property
    def n_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else 2 * self.pp


@dataclass(frozen=True)
class DeepSpeedPipeOptions(ModelParallelOptions):
    profile: PeerProfile = "tuned"  # strategies.PEER_PROFILE_HELP

    RECORDED_DEFAULTS: ClassVar[tuple[str, ...]] = ("profile",)


def validate(case, o: ModelParallelOptions, cfg: GPTConfig) -> None:
    """Degrees that fit the model and the batch; the strategies' own limits."""
    pp, tp = o.pp, o.tp
    if cfg.n_heads % tp:
        raise ValueError(f"tp={tp} does not divide the {cfg.n_heads} heads of {case.model}")
    if pp > cfg.n_layers:
        raise ValueError(f"pp={pp} stages for a model of {cfg.n_layers} layers")
    if pp > 1:
        m = o.n_microbatches
        if m < 1:
            raise ValueError(f"microbatches must be a positive integer (got {m!r})")
        if case.micro_batch % m:
            raise ValueError(
                f"{m} pipeline micro-batches do not divide micro_batch={case.micro_batch} "
                f"(each pipeline micro-batch is micro_batch / microbatches samples; "
                f"the default is 2*pp = {2 * pp})"
            )
    if o.stage_layers is not None:
        if case.strategy in INTERLEAVED_STRATEGIES:
            raise ValueError(
                f"{case.strategy}: option stage_layers sets the blocks of each of the pp={pp} pipeline stages, "
                f"but interleaving cuts pp x virtual_stages = {pp * o.virtual_stages} chunks; "
                f"drop stage_layers (interleaved chunks are split equally)"
            )
        from reference_impls.pipeline_checks import check_stage_layers

        check_stage_layers(o.stage_layers, cfg.n_layers, pp)
    if case.strategy in INTERLEAVED_STRATEGIES:
        v = o.virtual_stages
        if pp * v > cfg.n_layers:
            raise ValueError(f"pp={pp} x virtual_stages={v} chunks for a model of {cfg.n_layers} layers")
    if case.strategy == "ref.pp_interleaved" and pp > 1:
        from reference_impls.pipeline_checks import check_interleaving

        check_interleaving(pp, o.virtual_stages, o.n_microbatches)
    if case.strategy in ZERO_BUBBLE_STRATEGIES and pp > 1:
        from reference_impls.pipeline_checks import check_zero_bubble

        check_zero_bubble(pp, o.n_microbatches)
        if tp != 1 or o.sp:
            raise ValueError(f"{case.strategy} runs a plain pipeline (x dp): tp must be 1 and sp off (got tp={tp})")
    if case.strategy == "ref.pp_2bw":
        if tp != 1 or o.sp:
            raise ValueError(f"ref.pp_2bw runs a plain pipeline (x dp): tp must be 1 and sp off (got tp={tp})")
        if o.n_microbatches * case.grad_accum < pp:
            raise ValueError(
                f"ref.pp_2bw keeps two weight versions only with micro-batches >= pp: "
                f"{o.n_microbatches * case.grad_accum} micro-batches for pp={pp}"
            )
    if case.strategy == "torch.pp_zb" and pp > 1:
        # ScheduleInterleavedZeroBubble takes the micro-batches in max(1, m // pp) equal rounds
        m = o.n_microbatches * case.grad_accum
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(f"torch.pp_zb: {m} micro-batches do not split into {rounds} equal rounds of ~pp={pp}")
    if tp > 1 and cfg.vocab_size % tp:
        raise ValueError(f"tp={tp} does not divide the vocabulary ({cfg.vocab_size}) of {case.model}")
    if case.strategy in SP_STRATEGIES or o.sp:
        seq = case.seq_len or cfg.seq_len
        if seq % tp:
            raise ValueError(f"sequence parallel: tp={tp} does not divide seq_len={seq}")
    if case.strategy in TP_STRATEGIES and tp < 2:
        raise ValueError(f"{case.strategy} needs options.tp >= 2 (got tp={tp})")
    if case.strategy not in TP_STRATEGIES and pp < 2:
        raise ValueError(f"{case.strategy} needs options.pp >= 2 (got pp={pp})")
    if case.strategy == "deepspeed.pp":
        if tp != 1 or case.world_size != pp:
            raise ValueError(
                f"deepspeed.pp runs one pipeline of pp stages, one per rank: world_size must equal pp "
                f"and tp must be 1 (got world_size={case.world_size}, pp={pp}, tp={tp}; data and "
                f"tensor parallelism around DeepSpeed's pipeline are not wired)"
            )


# --- expectations -------------------------------------------------------------------------------

# --- model parallelism: Megatron TP (+SP), GPipe / 1F1B pipelines, composed with DP -------------
# Conventions: b·s·h elements per activation; t = tp, p = pp, d = dp; B = micro_batch x grad_accum
# samples per data-parallel rank per step; a pipeline runs n = microbatches x grad_accum
# micro-batches of B/n samples (without a pipeline, grad_accum chunks of micro_batch samples).
# Every op's payload is computed one by one so that the meter's scalar cut-off (ops of at most
# SCALAR_BYTES are listed apart from volume) is applied exactly as on the measurement.


def _mp_local_params(cfg: GPTConfig, t: int, lo: int, hi: int, first: bool, last: bool) -> int:
    """Parameters one rank of a TP x PP grid holds (shapes of reference_impls.tensor_parallel)."""
    h, V, s, r = cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.mlp_ratio
    per_layer = (
        3 * h * h // t
        + 2 * h // t  # q, k, v column-parallel (k has no bias)
        + h * h // t
        + h  # attn proj row-parallel, bias replicated
        + r * h * h // t
        + r * h // t  # mlp fc column-parallel
        + r * h * h // t
        + h  # mlp proj row-parallel, bias replicated
        + 4 * h
    )  # ln1, ln2 replicated
    n = (hi - lo) * per_layer
    if first:
        n += V * h // t + s * h  # vocab-parallel token embedding, replicated positions
    if last:
        n += 2 * h + V * h // t  # ln_f, vocab-parallel head
    return n


def _mp_sp_params(cfg: GPTConfig, lo: int, hi: int, first: bool, last: bool) -> int:
    """Replicated parameters applied to sequence shards (their grads are all-reduced over tp)."""
    h = cfg.d_model
    return (hi - lo) * 6 * h + (cfg.seq_len * h if first else 0) + (2 * h if last else 0)


def rank_chunks(
    cfg: GPTConfig, p: int, v: int, pp_rank: int, stage_layers: list[int] | None = None
) -> list[tuple[int, int, bool, bool]]:
    """``(lo, hi, first, last)`` of each model chunk pipeline rank ``pp_rank`` holds: one stage
    (v = 1; ``stage_layers`` blocks per stage when given), or chunks ``pp_rank + k p`` of ``p v``
    (interleaved); ``first`` holds the embedding, ``last`` the final LayerNorm, head and loss."""
    from reference_impls.pipeline import partition_layers

    C = p * v
    bounds = partition_layers(cfg.n_layers, C, stage_layers)
    return [(*bounds[c], c == 0, c == C - 1) for c in range(pp_rank, C, p)]


def model_parallel_ops(
    cfg: GPTConfig,
    case,
    coords: tuple[int, int, int],
    sequence_parallel: bool,
    microbatches: int | None = None,
    step_ops: bool = True,
) -> list[tuple[str, int]]:
    """Every communication op (kind, payload bytes) one rank issues in one training step
    (fp32, or bf16/fp16 under autocast: what travels in the compute dtype is said below).

    Tensor parallel (Megatron, per layer per micro-batch): forward 2 all-reduces (``g`` after the
    attention and MLP row-parallel layers), backward 2 (``f`` before q/k/v and before the MLP fc),
    each b·s·h. Embedding: 1 all-reduce b·s·h forward (partial vocab lookups). Head: 1 all-reduce
    b·s·h backward (``f`` before the vocab-parallel head). Cross-entropy: 3 all-reduces of b·s fp32
    scalars forward (max, target logit, sum of exponentials). With sequence parallelism each of the
    b·s·h all-reduces becomes one all-gather or reduce-scatter (payload b·s·h, the full buffer)
    in forward and its conjugate in backward: per layer 4 all-gathers + 4 reduce-scatters; plus
    one all-reduce per step of the sequence-sharded replicated parameters' gradients
    (LayerNorms, row-parallel biases, positions). Pipeline: per micro-batch, a stage other than
    the first receives b·s·h (b·s/t·h under SP) activations and sends the same gradient back; a
    stage other than the last sends activations and receives gradients. Interleaved
    (``ref.pp_interleaved``, v chunks per rank): the same per chunk, so per micro-batch each of
    the p·v − 1 chunk boundaries (not p − 1) carries one activation forward and one gradient back;
    a rank sends and receives on both sides of each of its chunks except chunk 0's input and
    chunk p·v − 1's output: per micro-batch 2v boundary crossings (each a send and a recv) per
    rank, 2v − 1 on ranks 0 and p − 1, i.e. v times 1F1B's volume on the middle ranks and 2v − 1
    times on the end ranks. The TP ops follow the layers the rank holds over all its chunks. Data parallel: one all-reduce of all local
    gradients per step. ``step_ops=False``: the per-micro-batch ops only (not those once-per-step
    gradient all-reduces, which the torch peers issue per parameter).
    """
    dp_rank, pp_rank, tp_rank = coords
    o = ModelParallelOptions.read(case.options)
    t, p = o.tp, o.pp
    d = case.world_size // (t * p)
    # E: bytes of what lives in the parameter dtype (fp32 under "amp", bf16/fp16 under "master",
    # where every activation and gradient is in the compute dtype).
    h, s, E = cfg.d_model, cfg.seq_len, BYTES[case.param_precision]
    chunks = rank_chunks(cfg, p, virtual_stages_of(case, o), pp_rank, o.stage_layers)
    layers = sum(hi - lo for lo, hi, _, _ in chunks)
    first, last = chunks[0][2], chunks[-1][3]
    B = case.micro_batch * case.grad_accum
    n = (microbatches or o.n_microbatches) * case.grad_accum if p > 1 else case.grad_accum
    b = B // n
    act = b * s * h * E
    # Under autocast (bf16/fp16) the row-parallel outputs that ``g`` all-reduces in forward are in
    # the compute dtype; everything else (``f``'s backward on the fp32 LayerNorm output, the
    # embedding, the cross-entropy, pipeline activations on the fp32 residual stream) stays fp32.
    act_g = b * s * h * BYTES[case.precision]
    ops: list[tuple[str, int]] = []
    for _ in range(n):
        if t > 1 or sequence_parallel:
            if sequence_parallel:
                emb = ["reduce_scatter", "all_gather"]
                head = ["all_gather", "reduce_scatter"]
            else:
                emb, head = ["all_reduce"], ["all_reduce"]
            for _layer in range(layers):
                if sequence_parallel:
                    # forward: all-gather of the fp32 LayerNorm output, reduce-scatter of the
                    # row-parallel output (compute dtype); backward: their conjugates, in the
                    # dtypes of the gradients flowing back (fp32 through autocast's cast, compute
                    # dtype out of the row-parallel matmul)
                    ops += [("all_gather", act), ("reduce_scatter", act_g)] * 2
                    ops += [("reduce_scatter", act), ("all_gather", act_g)] * 2
                else:  # two g (forward, compute dtype), two f (backward, fp32)
                    ops += [("all_reduce", act_g)] * 2 + [("all_reduce", act)] * 2
            if first:
                ops += [(k, act) for k in emb]
            if last:
                ops += [(k, act) for k in head] + [("all_reduce", b * s * 4)] * 3
        if p > 1:
            s_local = s // t if sequence_parallel else s
            pact = b * s_local * h * E
            for _, _, chunk_first, chunk_last in chunks:
                if not chunk_first:
                    ops += [("recv", pact), ("send", pact)]
                if not chunk_last:
                    ops += [("send", pact), ("recv", pact)]
    if sequence_parallel and step_ops:
        ops.append(("all_reduce", sum(_mp_sp_params(cfg, *c) for c in chunks) * E))
    if d > 1 and step_ops:
        ops.append(("all_reduce", sum(_mp_local_params(cfg, t, *c) for c in chunks) * E))
    return ops


def zero_bubble_pipeline(p: int, n_micro: int) -> dict:
    """The expectation's pipeline entry for ZB-H1 (Qi et al. 2024, Sec. 3.1): bubble
    (p-1)(T_F+T_B-T_W) over the step, (p-1)/(3m+p-1) at equal F, B and W times, beside 1F1B's
    (p-1)/(m+p-1) at the same activation memory (p micro-batches alive at the peak). The engine's
    record adds the same formula at its measured mean T_F, T_B, T_W."""
    from reference_impls import pipeline_zb as zb
    from reference_impls.pipeline import bubble_fraction_theory

    return {
        "schedule": "zb_h1",
        "microbatches": n_micro,
        "bubble_fraction": zb.bubble_fraction_theory(p, n_micro),
        "bubble_fraction_1f1b": bubble_fraction_theory(p, n_micro),
        "peak_live_microbatches_per_stage": [zb.peak_live_theory(p, n_micro)] * p,
    }


def stage_imbalance_flops(cfg: GPTConfig, p: int, stage_layers: list[int] | None) -> float:
    """The split's largest stage over the mean stage by forward FLOPs (reference_impls.pipeline_balance)."""
    from reference_impls.pipeline import partition_layers
    from reference_impls.pipeline_balance import flop_stage_imbalance

    counts = [hi - lo for lo, hi in partition_layers(cfg.n_layers, p, stage_layers)]
    return flop_stage_imbalance(counts, cfg.d_model, cfg.seq_len, cfg.vocab_size, cfg.mlp_ratio)


def model_parallel_expectation(sequence_parallel: bool | None, schedule: str | None):
    def fn(cfg, case, o, dp):
        from reference_impls import pipeline_interleaved as interleaved
        from reference_impls.pipeline import bubble_fraction_theory

        sp = o.sp if sequence_parallel is None else sequence_parallel
        t, p = o.tp, o.pp
        v = virtual_stages_of(case, o)
        m = o.n_microbatches
        world = case.world_size
        grid = [(r // (t * p), (r // t) % p, r % t) for r in range(world)]
        per_rank = [sum_ops(model_parallel_ops(cfg, case, c, sp)) for c in grid]
        state = []
        for _, pp_rank, _ in grid:
            n = sum(_mp_local_params(cfg, t, *c) for c in rank_chunks(cfg, p, v, pp_rank, o.stage_layers))
            state.append(recipe_state_bytes(case, n))
        out = Expectation(
            state_bytes=state,
            comm_payload_bytes=per_rank[0],
            comm_payload_bytes_per_rank=per_rank,
            paper_state_bytes=None,
            notes="fp32 parameters, gradients and Adam moments of this rank's TP shard of its pipeline stage "
            "(bf16 autocasts compute only). Communication: see parabench.theory.model_parallel_ops; under "
            "bf16/fp16 the row-parallel outputs (g's forward all-reduce, or SP's forward reduce-scatter and "
            "its backward all-gather) travel in the compute dtype, everything else in fp32.",
        )
        if p > 1 and v > 1:
            n_micro = m * case.grad_accum
            out["pipeline"] = {
                "schedule": schedule,
                "microbatches": n_micro,
                "virtual_stages": v,
                "bubble_fraction": interleaved.bubble_fraction_theory(p, v, n_micro),
                # (chunk, micro-batch) activations, each 1/v of a plain stage's
                "peak_live_microbatches_per_stage": [interleaved.peak_live_theory(s, p, v, n_micro) for s in range(p)],
            }
        elif p > 1 and schedule == "zb_h1":
            out["pipeline"] = zero_bubble_pipeline(p, m * case.grad_accum)
        elif p > 1:
            n_micro = m * case.grad_accum
            out["pipeline"] = {
                "schedule": schedule or o.schedule,
                "microbatches": n_micro,
                "bubble_fraction": bubble_fraction_theory(p, n_micro),
                "peak_live_microbatches_per_stage": [
                    n_micro if (schedule or o.schedule) == "gpipe" else min(p - s, n_micro) for s in range(p)
                ],
            }
        if p > 1 and v == 1:  # beside the record's measured pipeline_stage_imbalance
            out["pipeline"]["stage_imbalance_flops"] = stage_imbalance_flops(cfg, p, o.stage_layers)
        return out

    return fn


def expect_pp_2bw(cfg, case, o, dp):
    """PipeDream-2BW: two fp32 weight versions per stage (Narayanan et al. 2021, Sec. 3.1), one gradient,
    Adam's two moments; PipeDream's weight stashing would hold ``p - stage`` versions."""
    p = o.pp
    state, pipedream = [], []
    for r in range(case.world_size):
        stage = r % p  # the rank grid is (dp, pp, tp) with tp = 1
        n = sum(_mp_local_params(cfg, 1, *c) for c in rank_chunks(cfg, p, 1, stage, o.stage_layers))
        state.append({"params": 2 * 4 * n, "grads": 4 * n, "optimizer": 8 * n})
        pipedream.append((p - stage) * 4 * n)
    return Expectation(
        state_bytes=state,
        comm_payload_bytes=None,
        paper_state_bytes=None,
        pipeline={
            "schedule": "2bw",
            "microbatches": o.n_microbatches * case.grad_accum,
            "weight_versions": 2,
            "pipedream_stashed_weight_bytes_per_rank": pipedream,
        },
        notes="fp32, per stage: 2 x 4Ψ_stage weights (W(b-1) for the batch in flight, W(b) the newest), 4Ψ_stage "
        "gradient, 8Ψ_stage Adam = 16Ψ_stage + 4Ψ_stage for the second version. No flush: a step's traffic "
        "depends on how many backwards of the previous batch fall into it (fewer in the first step), so it "
        "is not checked per step.",
    )


# --- PyTorch DTensor tensor parallel (parabench/peers/torch_tp.py) ------------------------------
# The same Megatron layout as ref.tp / ref.tp_sp, so the same per-micro-batch collectives, with
# three differences read from the plan and confirmed by the meter on gloo:
#   * torch.tp_sp shards the learned position table by position (RowwiseParallel, Shard(0)
#     output) where the reference replicates it: per micro-batch one reduce-scatter of its s·h
#     output in forward and one all-gather of its gradient in backward (fp32, no batch dimension);
#   * the replicated parameters applied to sequence shards (under SP the LayerNorms only: the
#     row-parallel biases are added before the reduce-scatter) get Partial gradients, all-reduced
#     once per step in one flat buffer (``_match_parameter_layouts``), as the reference
#     all-reduces one flat buffer of LayerNorms, biases and positions;
#   * data parallel all-reduces the local gradients in DDP's buckets (parameter order, a bucket
#     closed once it holds 25 MiB or more: ``torch_tp.average_over_dp``), where the reference
#     all-reduces one flat buffer of them all.
TORCH_TP_DP_BUCKET_BYTES = 25 * 2**20


def dp_bucket_payloads(numels: list[int], element_size: int, cap: int = TORCH_TP_DP_BUCKET_BYTES) -> list[int]:
    """Bytes of each bucket DDP's rule makes of these tensors: fill in order, close at >= cap."""
    out, size = [], 0
    for n in numels:
        size += n * element_size
        if size >= cap:
            out.append(size)
            size = 0
    return out + [size] if size else out


def _torch_tp_numels(cfg: GPTConfig, t: int, sequence_parallel: bool) -> tuple[list[int], list[int]]:
    """(every parameter's local numel, the numels of those whose gradients are Partial over tp)."""
    h, V, s, r = cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.mlp_ratio
    per_layer = [h, h]  # ln1
    per_layer += [h * h // t, h // t, h * h // t, h * h // t, h // t]  # q (+bias), k, v (+bias): colwise
    per_layer += [h * h // t, h]  # attn proj rowwise, bias replicated
    per_layer += [h, h]  # ln2
    per_layer += [r * h * h // t, r * h // t, r * h * h // t, h]  # mlp fc colwise, proj rowwise
    numels = [V * h // t, s * h // t if sequence_parallel else s * h]
    numels += per_layer * cfg.n_layers + [h, h, V * h // t]  # ln_f, vocab-parallel head
    partial = [h] * (4 * cfg.n_layers + 2) if sequence_parallel else []
    return numels, partial


def torch_tp_ops(cfg: GPTConfig, case, coords: tuple[int, int, int], sequence_parallel: bool) -> list[tuple[str, int]]:
    """Every communication op (kind, payload bytes) one rank of torch.tp / torch.tp_sp issues in a step."""
    o = ModelParallelOptions.read(case.options)
    t = o.tp
    d = case.world_size // t
    ops = model_parallel_ops(cfg, case, coords, sequence_parallel, step_ops=False)
    numels, partial = _torch_tp_numels(cfg, t, sequence_parallel)
    e = BYTES[case.param_precision]
    if sequence_parallel:
        ops += [("reduce_scatter", cfg.seq_len * cfg.d_model * e), ("all_gather", cfg.seq_len * cfg.d_model * e)] * (
            case.grad_accum
        )
        ops += [("all_reduce", e * sum(partial))]  # one flat buffer (``_match_parameter_layouts``)
    if d > 1:
        ops += [("all_reduce", b) for b in dp_bucket_payloads(numels, e)]
    return ops


def torch_tp_expectation(sequence_parallel: bool):
    def fn(cfg, case, o, dp):
        t = o.tp
        grid = [(r // t, 0, r % t) for r in range(case.world_size)]
        ops = [torch_tp_ops(cfg, case, c, sequence_parallel) for c in grid]
        per_rank = [sum_ops(x) for x in ops]
        n = sum(_torch_tp_numels(cfg, t, sequence_parallel)[0])
        return Expectation(
            state_bytes=[recipe_state_bytes(case, n)] * len(grid),
            comm_payload_bytes=per_rank[0],
            comm_payload_bytes_per_rank=per_rank,
            comm_scalar_ops_per_rank=[scalar_ops(x) for x in ops],
            paper_state_bytes=None,
            notes="fp32 parameters, gradients (given their parameter's layout before the update) and AdamW "
            "moments of this rank's TP shard. Communication: Megatron's, as ref.tp"
            + (
                "_sp, plus a reduce-scatter (forward) and all-gather (backward) of the position table's s·h output "
                "per micro-batch (torch shards it by position) and one all-reduce of the LayerNorm gradients per step"
                if sequence_parallel
                else ""
            )
            + "; see parabench.families.model_parallel.torch_tp_ops.",
        )

    return fn


# --- DeepSpeed's pipeline engine (parabench/peers/deepspeed_pipe.py) ----------------------------
# Read from deepspeed/runtime/pipe/engine.py (0.19.8) and confirmed by the meter on gloo. Per
# optimizer step (not the first: the first activation send is preceded by one 256 x int32 = 1 KiB
# tensor-meta message, ``_send_tensor_meta``, never repeated with dynamic_shape=False):
#   * per micro-batch, a blocking send/recv of the activation [b, s, h] forward and its gradient
#     backward, in the module's dtype (fp32, or bf16 under DeepSpeed's bf16 config);
#   * ReduceGrads: ``buffered_allreduce_fallback`` all-reduces every local gradient over the
#     data-parallel group even when it holds one rank (pp == world_size), in the communication
#     dtype (the parameter dtype), in buckets closed once they pass 500M elements
#     (``allreduce_no_retain``, MEMORY_OPT_ALLREDUCE_SIZE);
#   * scalar ops: the last stage broadcasts [loss, dp-averaged loss] (2 x fp32) over the pipe group
#     (``_aggregate_total_loss``), every stage takes part; under bf16 the BF16_Optimizer all-reduces
#     its gradient norm (one fp32) whether or not clipping is on.

DS_ALLREDUCE_BUCKET = 500_000_000


def deepspeed_pp_stage_numels(cfg: GPTConfig, pp: int, stage: int, stage_layers: list[int] | None = None) -> list[int]:
    """Parameter sizes of one stage in PipelineModule order (embeddings, blocks, LayerNorm + head)."""
    from reference_impls.pipeline import partition_layers

    lo, hi = partition_layers(cfg.n_layers, pp, stage_layers)[stage]
    return _chunk_param_numels(cfg, lo, hi, stage == 0, stage == pp - 1)


def deepspeed_pp_ops(cfg: GPTConfig, case, stage: int) -> list[tuple[str, int]]:
    """Every communication op (kind, payload bytes) one stage of deepspeed.pp issues in a step."""
    o = ModelParallelOptions.read(case.options)
    p = o.pp
    n = o.n_microbatches * case.grad_accum
    b = case.micro_batch * case.grad_accum // n
    e = BYTES[case.precision]
    act = b * cfg.seq_len * cfg.d_model * e
    ops: list[tuple[str, int]] = []
    for _ in range(n):
        if stage > 0:
            ops += [("recv", act), ("send", act)]
        if stage < p - 1:
            ops += [("send", act), ("recv", act)]
    bucket = 0
    for numel in deepspeed_pp_stage_numels(cfg, p, stage, o.stage_layers):
        bucket += numel
        if bucket > DS_ALLREDUCE_BUCKET:
            ops.append(("all_reduce", bucket * e))
            bucket = 0
    if bucket:
        ops.append(("all_reduce", bucket * e))
    ops.append(("broadcast", 2 * 4))
    if case.precision == "bf16":
        ops.append(("all_reduce", 4))
    return ops


def expect_deepspeed_pp(cfg, case, o, dp):
    from reference_impls.pipeline import bubble_fraction_theory

    p = o.pp
    n_micro = o.n_microbatches * case.grad_accum
    ops = [deepspeed_pp_ops(cfg, case, s) for s in range(p)]
    per_rank = [sum_ops(x) for x in ops]
    e = BYTES[case.precision]
    state = []
    for s in range(p):
        n = sum(deepspeed_pp_stage_numels(cfg, p, s, o.stage_layers))
        if case.precision == "bf16":  # bf16 module; BF16_Optimizer: fp32 gradient accumulators, fp32 master
            state.append({"params": e * n, "grads": 4 * n, "optimizer": 12 * n})
        else:
            state.append({"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n})
    return Expectation(
        state_bytes=state,
        comm_payload_bytes=per_rank[0],
        comm_payload_bytes_per_rank=per_rank,
        comm_scalar_ops_per_rank=[scalar_ops(x) for x in ops],
        paper_state_bytes=None,
        notes="DeepSpeed PipelineEngine, ZeRO-0, one stage per rank: activations forward and gradients "
        "backward per micro-batch (send/recv in the module dtype), one all-reduce of the stage's "
        "gradients over its one-rank data-parallel group, the loss broadcast from the last stage "
        "(scalar); see parabench.theory.deepspeed_pp_ops. The first step also sends a 1 KiB tensor-meta "
        "message ahead of the first activation.",
        pipeline={
            "schedule": "1f1b",
            "microbatches": n_micro,
            "bubble_fraction": bubble_fraction_theory(p, n_micro),
            "stage_imbalance_flops": stage_imbalance_flops(cfg, p, o.stage_layers),
        },
    )


# --- torch.distributed.pipelining (parabench/peers/torch_pipeline.py) ---------------------------
# The model is cut into C = pp x v chunks (v = virtual_stages for ScheduleInterleaved1F1B, else 1)
# by the same partition as the references; rank r holds chunks r, r + pp, ..., r + (v-1)·pp. Per
# micro-batch, every chunk boundary carries the activation [b, s, h] forward and its gradient
# backward, as one send/recv pair each (PipelineStage's batch_isend_irecv), in fp32: the residual
# stream stays fp32 under autocast. So interleaving moves the same bytes per boundary crossing but
# crosses v times as many boundaries (C - 1 instead of pp - 1), and every rank but the ends of the
# chain sends and receives on both sides of each of its chunks. Shapes are inferred on the first
# step only (the metered step is a later one). Data parallel: each chunk's DDP all-reduces its
# gradients (in the parameter dtype) over the dp group in buckets during the last micro-batch's
# backward; torch.pp_zb, whose split backward DDP cannot see, the same 25 MiB buckets in parameter
# order after the schedule (peers/common.average_over_dp).

# DDP's reducer rebuilds its buckets after the first synced backward, in the order the gradients
# became ready (about the reverse of registration; the order changes how many buckets, never the
# bytes): the first closes at 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``), the rest at
# ``bucket_cap_mb``, 25 MiB by default. The rebuild broadcasts the bucket layout once, in the
# forward of the second step, ahead of any metered step.
DDP_FIRST_BUCKET_BYTES = 2**20


def ddp_bucket_payloads(numels: list[int], element_size: int, cap: int = TORCH_TP_DP_BUCKET_BYTES) -> list[int]:
    """Bytes of each bucket DDP's rebuilt reducer makes of one module's parameters (registration order)."""
    out, size, limit = [], 0, DDP_FIRST_BUCKET_BYTES
    for n in reversed(numels):
        size += n * element_size
        if size >= limit:
            out.append(size)
            size, limit = 0, cap
    return out + [size] if size else out


def torch_pipeline_ops(cfg: GPTConfig, case, pp_rank: int, dp: int) -> list[tuple[str, int]]:
    """Every communication op (kind, payload bytes) one rank of a torch pipeline issues in a step."""
    from reference_impls.pipeline import partition_layers

    o = ModelParallelOptions.read(case.options)
    p, v = o.pp, virtual_stages_of(case, o)
    chunks = p * v
    n = o.n_microbatches * case.grad_accum
    b = case.micro_batch * case.grad_accum // n
    e = BYTES[case.param_precision]
    act = b * cfg.seq_len * cfg.d_model * e
    ops: list[tuple[str, int]] = []
    for _ in range(n):
        for k in range(v):
            c = pp_rank + k * p
            if c > 0:
                ops += [("recv", act), ("send", act)]
            if c < chunks - 1:
                ops += [("send", act), ("recv", act)]
    if dp > 1:
        bounds = partition_layers(cfg.n_layers, chunks, o.stage_layers)
        for k in range(v):
            c = pp_rank + k * p
            numels = _chunk_param_numels(cfg, *bounds[c], c == 0, c == chunks - 1)
            if case.strategy == "torch.pp_zb":  # common.average_over_dp, parameter order
                ops += [("all_reduce", b) for b in dp_bucket_payloads(numels, e)]
            else:
                ops += [("all_reduce", b) for b in ddp_bucket_payloads(numels, e)]
    return ops


@functools.lru_cache(maxsize=8)
def _meta_param_numels(cfg: GPTConfig) -> tuple:
    """(embeddings, each block, final LayerNorm + head) parameter sizes of ``cfg``'s model, built
    once on the meta device: a build takes about 0.08 s at gpt-13b, and the planner asks for every
    chunk of every rank of every pipeline candidate."""
    import torch

    from parabench.models import GPT

    with torch.device("meta"):
        model = GPT(cfg)

    def sizes(*mods):
        return tuple(q.numel() for m in mods for q in m.parameters())

    return sizes(model.tok_emb, model.pos_emb), tuple(sizes(b) for b in model.blocks), sizes(model.ln_f, model.head)


def _chunk_param_numels(cfg: GPTConfig, lo: int, hi: int, first: bool, last: bool) -> list[int]:
    """Parameter sizes of one chunk (embeddings on the first, LayerNorm + head on the last)."""
    emb, blocks, head = _meta_param_numels(cfg)
    return [*(emb if first else ()), *(n for i in range(lo, hi) for n in blocks[i]), *(head if last else ())]


def torch_pipeline_schedule(schedule: str, p: int, v: int, n_micro: int) -> dict:
    """The expectation's pipeline entry for torch.distributed.pipelining's ``schedule`` (the
    adapters' names: gpipe, 1f1b, interleaved, zb) over ``p`` ranks of ``v`` chunks each, named as
    the reference engines name theirs."""
    if schedule == "zb":  # ScheduleInterleavedZeroBubble with one stage per rank runs ZB-H1's order (its ZB1P)
        return zero_bubble_pipeline(p, n_micro)
    return {
        "schedule": "interleaved_1f1b" if v > 1 else ("gpipe" if schedule == "gpipe" else "1f1b"),
        "microbatches": n_micro,
        "virtual_stages": v,
        # Narayanan et al. 2021, Sec. 2.2: v chunks per rank divide the bubble by v.
        "bubble_fraction": (p - 1) / (v * n_micro + p - 1),
    }


def expect_torch_pipeline(cfg, case, o, dp):
    from reference_impls.pipeline import partition_layers

    p = o.pp
    v = virtual_stages_of(case, o)
    chunks = p * v
    bounds = partition_layers(cfg.n_layers, chunks, o.stage_layers)
    grid = [(r // p, r % p) for r in range(case.world_size)]  # (dp rank, pp rank); no tp
    per_rank = [sum_ops(torch_pipeline_ops(cfg, case, pp_rank, dp)) for _, pp_rank in grid]
    state = []
    for _, pp_rank in grid:
        n = sum(sum(_chunk_param_numels(cfg, *bounds[c], c == 0, c == chunks - 1)) for c in range(pp_rank, chunks, p))
        state.append(recipe_state_bytes(case, n))
    pipeline = torch_pipeline_schedule(
        case.strategy.removeprefix("torch.pp_"), p, v, o.n_microbatches * case.grad_accum
    )
    if v == 1:  # beside the record's measured pipeline_stage_imbalance
        pipeline["stage_imbalance_flops"] = stage_imbalance_flops(cfg, p, o.stage_layers)
    return Expectation(
        state_bytes=state,
        comm_payload_bytes=per_rank[0],
        comm_payload_bytes_per_rank=per_rank,
        paper_state_bytes=None,
        notes=f"torch.distributed.pipelining over {chunks} chunks ({v} per rank): per micro-batch each chunk "
        "boundary sends the fp32 activation b·s·h forward and its gradient back; fp32 parameters, gradients "
        "and AdamW moments of the rank's chunks; with dp > 1 each chunk's DDP all-reduces its gradients in "
        "buckets (torch.pp_zb: in 25 MiB buckets after the schedule); see "
        "parabench.families.model_parallel.torch_pipeline_ops.",
        pipeline=pipeline,
    )


MODEL_PARALLEL_LOSS = (
    "its loss is computed per stage (the last pipeline stage's head and loss) or over vocabulary-parallel "
    "logits (tensor parallelism), not by parabench.models.lm_loss over whole logits"
)


def _row(name, builder, kind, description, expect, **kw):
    # Rows whose builders compile the blocks (peers.common.compile_blocks, after tensor parallelism and
    # the pipeline split) say compile_unsupported=None; the others name why they refuse it.
    if name in ZERO_BUBBLE_STRATEGIES:
        kw.setdefault(
            "compile_unsupported",
            "the split backward asks autograd for per-module gradients (hooks on module outputs, "
            "B and W as separate graph walks); torch's own zero-bubble schedules refuse torch.compile too",
        )
    elif name == "deepspeed.pp":
        kw.setdefault(
            "compile_unsupported", "DeepSpeed's PipelineModule runs its layers itself; no compile hook is wired"
        )
    kw.setdefault("own_loss", MODEL_PARALLEL_LOSS)
    return StrategySpec(
        name,
        "model_parallel",
        builder,
        kind,
        description,
        options=kw.pop("options", ModelParallelOptions),
        validate=validate,
        expect=expect,
        **(
            MASTER_ONLY
            if name.startswith("deepspeed.")
            else TORCH_PEER_RECIPES
            if name.startswith("torch.")
            else {"legacy_recipe": "amp"}
        ),
        **kw,
    )


_REF = "parabench.builders.model_parallel"
_TORCH_PP = "parabench.peers.torch_pipeline"
ROWS = (
    _row(
        "ref.tp",
        f"{_REF}:build_tp",
        "reference",
        "Megatron tensor parallel: f/g operators, column/row-parallel layers, vocab-parallel "
        "embedding and cross-entropy (options tp, pp; x dp)",
        model_parallel_expectation(False, None),
        compile_unsupported=None,
        plan=PlanFacts(
            family="model_parallel",
            search=("tensor", "tensor_pipeline"),
            master_grad_buffer=True,
        ),
        peers=("torch.tp",),
    ),
    _row(
        "ref.tp_sp",
        f"{_REF}:build_tp_sp",
        "reference",
        "Megatron tensor + sequence parallel: all-gather/reduce-scatter along the sequence",
        model_parallel_expectation(True, None),
        compile_unsupported=None,
        plan=PlanFacts(
            family="model_parallel",
            search=("tensor",),
            search_order=1,
            sequence_parallel=True,
            master_grad_buffer=True,
        ),
        peers=("torch.tp_sp",),
    ),
    _row(
        "ref.pp_gpipe",
        f"{_REF}:build_pp_gpipe",
        "reference",
        "GPipe pipeline over send/recv (options pp, microbatches, tp, sp; x dp)",
        model_parallel_expectation(None, "gpipe"),
        compile_unsupported=None,
        plan=PlanFacts(
            family="model_parallel",
            search=("pipeline",),
            search_order=1,
            pipeline_schedule="gpipe",
            pipeline_engine="ref",
            master_grad_buffer=True,
        ),
        peers=("torch.pp_gpipe",),
    ),
    _row(
        "ref.pp_1f1b",
        f"{_REF}:build_pp_1f1b",
        "reference",
        "1F1B (PipeDream-Flush) pipeline over send/recv (options pp, microbatches, tp, sp; x dp)",
        model_parallel_expectation(None, "1f1b"),
        compile_unsupported=None,
        plan=PlanFacts(
            family="model_parallel",
            search=("pipeline",),
            pipeline_schedule="1f1b",
            pipeline_engine="ref",
            master_grad_buffer=True,
        ),
        peers=("torch.pp_1f1b", "deepspeed.pp"),
    ),
    _row(
        "ref.pp_interleaved",
        f"{_REF}:build_pp_interleaved",
        "reference",
        "Megatron interleaved 1F1B over send/recv: virtual_stages (default 2) chunks per rank, "
        "micro-batches a multiple of pp (options pp, virtual_stages, microbatches, tp, sp; x dp)",
        model_parallel_expectation(None, "interleaved_1f1b"),
        compile_unsupported=None,
        version="1",
        plan=PlanFacts(
            family="model_parallel",
            search=("pipeline",),
            search_order=2,
            pipeline_schedule="interleaved",
            pipeline_engine="ref",
            master_grad_buffer=True,
        ),
        peers=("torch.pp_interleaved",),
    ),
    _row(
        "ref.pp_zb",
        f"{_REF}:build_pp_zb",
        "reference",
        "Zero-bubble ZB-H1 pipeline over send/recv (Qi et al. 2024): backward split into input (B) and "
        "weight (W) gradients, W's deferred into the bubble; micro-batches >= pp (options pp, microbatches; x dp)",
        model_parallel_expectation(None, "zb_h1"),
        version="2",  # 2: W of nn.Linear as explicit dy^T x, a micro-batch's graph freed at its W (1: one autograd.grad per module, graphs kept to the step's end)
        plan=PlanFacts(
            family="model_parallel",
            pipeline_schedule="zb_h1",
            pipeline_engine="ref",
            host_bound=True,
            host_bound_versions=("1",),
            host_analogue="torch.pp_zb",
            master_grad_buffer=True,
            done_graphs_kept_versions=("1",),
        ),
        peers=("torch.pp_zb",),
    ),
    _row(
        "ref.pp_2bw",
        "parabench.builders.pipeline_2bw:build_pp_2bw",
        "reference",
        "PipeDream-2BW over send/recv (Narayanan et al. 2021): no flush, two weight versions per stage, "
        "the update delayed one step; micro-batches >= pp (options pp, microbatches; x dp)",
        expect_pp_2bw,
        compile_unsupported=None,
        precisions=("fp32",),  # the two flat weight versions are fp32; no master-weight or autocast variant yet
    ),
    _row(
        "torch.tp",
        "parabench.peers.torch_tp:build_tp",
        "peer",
        "PyTorch DTensor parallelize_module, ColwiseParallel/RowwiseParallel over the tp mesh",
        torch_tp_expectation(False),
        compile_unsupported=None,
        version="4",  # 4: dp gradients in 25 MiB buckets (3: no DeviceMesh slicing per step)
        plan=PlanFacts(
            family="model_parallel",
            search=("tensor",),
            search_order=2,
            host_bound=True,
            host_bound_eager_only=True,
            master_grad_buffer=True,
        ),
    ),
    _row(
        "torch.tp_sp",
        "parabench.peers.torch_tp:build_tp_sp",
        "peer",
        "PyTorch DTensor tensor parallel + SequenceParallel LayerNorms",
        torch_tp_expectation(True),
        compile_unsupported=None,
        version="4",  # 4: dp gradients in 25 MiB buckets (3: LayerNorm gradients in one flat buffer)
        plan=PlanFacts(
            family="model_parallel",
            search=("tensor",),
            search_order=3,
            sequence_parallel=True,
            host_bound=True,
            host_bound_eager_only=True,
            master_grad_buffer=True,
        ),
    ),
    _row(
        "torch.pp_gpipe",
        f"{_TORCH_PP}:build_gpipe",
        "peer",
        "torch.distributed.pipelining PipelineStage + ScheduleGPipe",
        expect_torch_pipeline,
        compile_unsupported=None,
        version="3",  # 3: dp > 1 through DDP-wrapped stages (2: one all-reduce per gradient after the schedule)
        plan=PlanFacts(
            family="model_parallel",
            pipeline_schedule="gpipe",
            pipeline_engine="torch",
            ddp_stages_from_version=3,
            master_grad_buffer=True,
            device_copies="torch_pipeline",
        ),
    ),
    _row(
        "torch.pp_1f1b",
        f"{_TORCH_PP}:build_1f1b",
        "peer",
        "torch.distributed.pipelining PipelineStage + Schedule1F1B",
        expect_torch_pipeline,
        compile_unsupported=None,
        version="3",  # 3: dp > 1 through DDP-wrapped stages (2: one all-reduce per gradient after the schedule)
        plan=PlanFacts(
            family="model_parallel",
            search=("pipeline",),
            search_order=3,
            pipeline_schedule="1f1b",
            pipeline_engine="torch",
            ddp_stages_from_version=3,
            master_grad_buffer=True,
            device_copies="torch_pipeline",
        ),
    ),
    _row(
        "torch.pp_interleaved",
        f"{_TORCH_PP}:build_interleaved",
        "peer",
        "torch.distributed.pipelining ScheduleInterleaved1F1B, virtual_stages (default 2) chunks per rank",
        expect_torch_pipeline,
        version="3",  # 3: dp > 1 through DDP-wrapped stages (2: one all-reduce per gradient after the schedule)
        plan=PlanFacts(
            family="model_parallel",
            pipeline_schedule="interleaved",
            pipeline_engine="torch",
            ddp_stages_from_version=3,
            master_grad_buffer=True,
            device_copies="torch_pipeline",
        ),
    ),
    _row(
        "torch.pp_zb",
        f"{_TORCH_PP}:build_zb",
        "peer",
        "torch.distributed.pipelining ScheduleInterleavedZeroBubble with one stage per rank (ZB-H1's order; "
        "stage_backward_input / stage_backward_weight split the backward)",
        expect_torch_pipeline,
        version="2",  # 2: dp > 1 averages in 25 MiB buckets after the schedule (1: one all-reduce per gradient)
        plan=PlanFacts(
            family="model_parallel",
            pipeline_schedule="zb_h1",
            pipeline_engine="torch",
            host_bound=True,
            host_analogue="ref.pp_zb",
            master_grad_buffer=True,
            device_copies="torch_pipeline",
        ),
    ),
    _row(
        "deepspeed.pp",
        "parabench.peers.deepspeed_pipe:build",
        "peer",
        "DeepSpeed pipeline engine: PipelineModule (parabench's stage split) + engine.train_batch, "
        "TrainSchedule (1F1B), blocking send/recv, ZeRO-0 (options pp = world_size, microbatches, profile; "
        "no dp/tp)",
        expect_deepspeed_pp,
        min_world_size=2,
        options=DeepSpeedPipeOptions,
        version="2",  # 2: the tuned profile by default (1 ran what is now "matched")
        plan=PlanFacts(
            family="model_parallel",
            pipeline_schedule="1f1b",
        ),
    ),
)
