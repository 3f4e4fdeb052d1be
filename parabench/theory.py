"""Analytic expectations every record carries beside its measurements.

For each strategy: the model-state bytes one rank holds (parameters, gradients, optimizer
states incl. master weights) *as the implementation lays them out*, next to the ZeRO paper's
figure, and the communication payload per optimizer step by kind (nccl-tests conventions,
see ``parabench.meters.comm``). Ψ is the parameter count, N the data-parallel degree.

ZeRO paper (Rajbhandari et al. 2020, Sec. 5, mixed precision + Adam, K = 12):
DP 16Ψ; stage 1: 4Ψ + 12Ψ/N; stage 2: 2Ψ + 14Ψ/N; stage 3: 16Ψ/N.

A strategy without an entry gets no expectation (``None``), never a guess.
"""

from __future__ import annotations

import math
from typing import Callable

from parabench.models import GPTConfig, parameter_count

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def zero_paper_state_bytes(stage: int, psi: int, n: int) -> float:
    """Model-state bytes per rank from the ZeRO paper (mixed precision, Adam, K=12)."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def _shard(numel: int, n: int) -> int:
    """Elements of the largest shard when ``numel`` is split over ``n`` ranks (padding up)."""
    return -(-numel // n)


class Expectation(dict):
    """{'state_bytes': {params, grads, optimizer} | None, 'comm_payload_bytes': {kind: bytes} | None,
    'paper_state_bytes': float | None, 'notes': str}"""


# name -> function(cfg, case, dp) -> Expectation
EXPECTATIONS: dict[str, Callable[..., Expectation]] = {}


def expectation(name: str):
    def deco(fn):
        EXPECTATIONS[name] = fn
        return fn
    return deco


def expected(case, cfg: GPTConfig, dp: int) -> Expectation | None:
    fn = EXPECTATIONS.get(case.strategy)
    return fn(cfg, case, dp) if fn else None


def _counts(cfg: GPTConfig) -> dict[str, int]:
    return parameter_count(cfg)


# --- peers --------------------------------------------------------------------------------

@expectation("single")
@expectation("torch.ddp")
def _torch_ddp(cfg, case, dp):
    psi = _counts(cfg)["total"]
    # DDP all-reduces even on a one-rank group (measured on 1 GPU: a copy, no wire traffic; the
    # wire estimate 2(n-1)/n x payload is then 0); only the plain single-process trainer sends nothing.
    comm = {"all_reduce": 4 * psi} if case.strategy == "torch.ddp" else {}
    return Expectation(
        state_bytes={"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi},
        comm_payload_bytes=comm,
        paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
        notes="fp32 parameters and gradients (autocast for bf16), Adam moments fp32; one fp32 all-reduce of "
              "all gradients per step (no_sync during accumulation).",
    )


@expectation("torch.fsdp2")
def _torch_fsdp2(cfg, case, dp):
    psi = _counts(cfg)["total"]
    pbytes = BYTES[case.precision]
    accum = case.grad_accum
    comm = {
        # forward gathers every parameter group (blocks and root), backward gathers each again
        # (reshard_after_forward=True, the root included); gradients are reduce-scattered in fp32
        # after every micro-batch.
        "all_gather": accum * 2 * psi * pbytes,
        "reduce_scatter": accum * psi * 4,
    } if dp > 1 else {}
    return Expectation(
        state_bytes=None,  # per-parameter dim-0 sharding: shard sizes vary by rank, see the measurement
        comm_payload_bytes=comm,
        paper_state_bytes=zero_paper_state_bytes(3, psi, dp),
        notes="fp32 sharded parameters are the master weights; gathered in the compute dtype.",
    )


@expectation("torch.hsdp")
def _torch_hsdp(cfg, case, dp):
    psi = _counts(cfg)["total"]
    shard = int(case.options.get("shard_size", 2))
    accum = case.grad_accum
    return Expectation(
        state_bytes=None,  # per-parameter dim-0 sharding within the shard group: see the measurement
        comm_payload_bytes={
            "all_gather": accum * 2 * psi * BYTES[case.precision],  # within the shard group
            "reduce_scatter": accum * psi * 4,                      # within the shard group, fp32
            "all_reduce": accum * psi * 4 // shard,                 # the shard, across replicas
        },
        paper_state_bytes=zero_paper_state_bytes(3, psi, shard),
        notes="FSDP2 on a (replicate, shard) mesh: forward and backward gathers inside the shard group, "
              "gradient reduce-scatter inside it, then an all-reduce of each shard across replicas.",
    )


def _deepspeed(stage: int):
    """DeepSpeed 0.19 as it behaves (read from its source, confirmed by the meter): gradients
    travel in the parameter dtype; stages 1 and 2 all-reduce each gradient bucket and then
    all-gather the updated parameters, so their payload is 2Ψ elements and their wire traffic 3Ψ
    (the paper's reduce-scatter + all-gather would be 2Ψ); stage 3 gathers every parameter in
    forward and reduce-scatters gradients, but re-gathers in backward only what its parameter
    cache has released (measured: nothing on the tiny model, the output head and a few blocks on
    gpt-125m, with stage3_max_reuse_distance=0), so its all-gather is the range [Ψ, 2Ψ] — the
    flight recorder confirms the meter here, the looseness is DeepSpeed's."""
    def fn(cfg, case, dp):
        psi = _counts(cfg)["total"]
        b = BYTES[case.precision]
        accum = case.grad_accum
        comm = None
        if dp > 1:
            comm = {0: {"all_reduce": b * psi},
                    1: {"all_reduce": b * psi, "all_gather": b * psi},
                    2: {"all_reduce": b * psi, "all_gather": b * psi},
                    3: {"all_gather": [accum * b * psi, accum * 2 * b * psi], "reduce_scatter": accum * b * psi}}[stage]
        return Expectation(
            state_bytes=None,
            comm_payload_bytes=comm,
            paper_state_bytes=zero_paper_state_bytes(stage, psi, dp),
            notes="DeepSpeed's internal layout is read from the engine; the paper's figure is given for reference.",
        )
    return fn


for _stage in range(4):
    EXPECTATIONS[f"deepspeed.zero{_stage}"] = _deepspeed(_stage)


# --- model parallelism: Megatron TP (+SP), GPipe / 1F1B pipelines, composed with DP -------------
# Conventions: b·s·h elements per activation; t = tp, p = pp, d = dp; B = micro_batch x grad_accum
# samples per data-parallel rank per step; a pipeline runs n = microbatches x grad_accum
# micro-batches of B/n samples (without a pipeline, grad_accum chunks of micro_batch samples).
# Every op's payload is computed one by one so that the meter's scalar cut-off (ops of at most
# SCALAR_BYTES are listed apart from volume) is applied exactly as on the measurement.

def _mp_local_params(cfg: GPTConfig, t: int, lo: int, hi: int, first: bool, last: bool) -> int:
    """Parameters one rank of a TP x PP grid holds (shapes of reference_impls.tensor_parallel)."""
    h, V, s, r = cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.mlp_ratio
    per_layer = (3 * h * h // t + 2 * h // t      # q, k, v column-parallel (k has no bias)
                 + h * h // t + h                  # attn proj row-parallel, bias replicated
                 + r * h * h // t + r * h // t     # mlp fc column-parallel
                 + r * h * h // t + h              # mlp proj row-parallel, bias replicated
                 + 4 * h)                          # ln1, ln2 replicated
    n = (hi - lo) * per_layer
    if first:
        n += V * h // t + s * h                    # vocab-parallel token embedding, replicated positions
    if last:
        n += 2 * h + V * h // t                    # ln_f, vocab-parallel head
    return n


def _mp_sp_params(cfg: GPTConfig, lo: int, hi: int, first: bool, last: bool) -> int:
    """Replicated parameters applied to sequence shards (their grads are all-reduced over tp)."""
    h = cfg.d_model
    return (hi - lo) * 6 * h + (cfg.seq_len * h if first else 0) + (2 * h if last else 0)


def model_parallel_ops(cfg: GPTConfig, case, coords: tuple[int, int, int], sequence_parallel: bool,
                       microbatches: int | None = None) -> list[tuple[str, int]]:
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
    stage other than the last sends activations and receives gradients. Data parallel: one
    all-reduce of all local gradients per step.
    """
    from reference_impls.pipeline import partition_layers

    dp_rank, pp_rank, tp_rank = coords
    o = case.options
    t, p = o.get("tp", 1), o.get("pp", 1)
    d = case.world_size // (t * p)
    h, s, E = cfg.d_model, cfg.seq_len, 4
    lo, hi = partition_layers(cfg.n_layers, p)[pp_rank]
    first, last = pp_rank == 0, pp_rank == p - 1
    B = case.micro_batch * case.grad_accum
    n = (microbatches or o.get("microbatches", 2 * p)) * case.grad_accum if p > 1 else case.grad_accum
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
            for _layer in range(hi - lo):
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
            if not first:
                ops += [("recv", pact), ("send", pact)]
            if not last:
                ops += [("send", pact), ("recv", pact)]
    if sequence_parallel:
        ops.append(("all_reduce", _mp_sp_params(cfg, lo, hi, first, last) * E))
    if d > 1:
        ops.append(("all_reduce", _mp_local_params(cfg, t, lo, hi, first, last) * E))
    return ops


def _sum_ops(ops, scalar_bytes: int = 64) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, nbytes in ops:
        if nbytes > scalar_bytes:
            out[kind] = out.get(kind, 0) + nbytes
    return out


def _model_parallel(sequence_parallel: bool | None, schedule: str | None):
    def fn(cfg, case, dp):
        from reference_impls.pipeline import bubble_fraction_theory, partition_layers

        o = case.options
        sp = bool(o.get("sp")) if sequence_parallel is None else sequence_parallel
        t, p = o.get("tp", 1), o.get("pp", 1)
        m = o.get("microbatches", 2 * p)
        world = case.world_size
        grid = [(r // (t * p), (r // t) % p, r % t) for r in range(world)]
        per_rank = [_sum_ops(model_parallel_ops(cfg, case, c, sp)) for c in grid]
        state = []
        for _, pp_rank, _ in grid:
            lo, hi = partition_layers(cfg.n_layers, p)[pp_rank]
            n = _mp_local_params(cfg, t, lo, hi, pp_rank == 0, pp_rank == p - 1)
            state.append({"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n})
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
        if p > 1:
            n_micro = m * case.grad_accum
            out["pipeline"] = {
                "schedule": schedule or o.get("schedule", "1f1b"),
                "microbatches": n_micro,
                "bubble_fraction": bubble_fraction_theory(p, n_micro),
                "peak_live_microbatches_per_stage": [n_micro if (schedule or o.get("schedule", "1f1b")) == "gpipe"
                                                     else min(p - s, n_micro) for s in range(p)],
            }
        return out
    return fn


EXPECTATIONS["ref.tp"] = _model_parallel(False, None)
EXPECTATIONS["ref.tp_sp"] = _model_parallel(True, None)
EXPECTATIONS["ref.pp_gpipe"] = _model_parallel(None, "gpipe")
EXPECTATIONS["ref.pp_1f1b"] = _model_parallel(None, "1f1b")


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


def deepspeed_pp_stage_numels(cfg: GPTConfig, pp: int, stage: int) -> list[int]:
    """Parameter sizes of one stage in PipelineModule order (embeddings, blocks, LayerNorm + head)."""
    import torch

    from parabench.models import GPT
    from reference_impls.pipeline import partition_layers

    lo, hi = partition_layers(cfg.n_layers, pp)[stage]
    with torch.device("meta"):
        model = GPT(cfg)
    mods = ([model.tok_emb, model.pos_emb] if stage == 0 else []) + [model.blocks[i] for i in range(lo, hi)]
    if stage == pp - 1:
        mods += [model.ln_f, model.head]
    return [p.numel() for m in mods for p in m.parameters()]


def deepspeed_pp_ops(cfg: GPTConfig, case, stage: int) -> list[tuple[str, int]]:
    """Every communication op (kind, payload bytes) one stage of deepspeed.pp issues in a step."""
    o = case.options
    p = o.get("pp", 1)
    n = o.get("microbatches", 2 * p) * case.grad_accum
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
    for numel in deepspeed_pp_stage_numels(cfg, p, stage):
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


def _scalar_ops(ops, scalar_bytes: int = 64) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for kind, nbytes in ops:
        if nbytes <= scalar_bytes:
            s = out.setdefault(kind, {"calls": 0, "payload_bytes": 0})
            s["calls"] += 1
            s["payload_bytes"] += nbytes
    return dict(sorted(out.items()))


@expectation("deepspeed.pp")
def _deepspeed_pp(cfg, case, dp):
    from reference_impls.pipeline import bubble_fraction_theory

    o = case.options
    p = o.get("pp", 1)
    n_micro = o.get("microbatches", 2 * p) * case.grad_accum
    ops = [deepspeed_pp_ops(cfg, case, s) for s in range(p)]
    per_rank = [_sum_ops(x) for x in ops]
    e = BYTES[case.precision]
    state = []
    for s in range(p):
        n = sum(deepspeed_pp_stage_numels(cfg, p, s))
        if case.precision == "bf16":  # bf16 module; BF16_Optimizer: fp32 gradient accumulators, fp32 master
            state.append({"params": e * n, "grads": 4 * n, "optimizer": 12 * n})
        else:
            state.append({"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n})
    return Expectation(
        state_bytes=state,
        comm_payload_bytes=per_rank[0],
        comm_payload_bytes_per_rank=per_rank,
        comm_scalar_ops_per_rank=[_scalar_ops(x) for x in ops],
        paper_state_bytes=None,
        notes="DeepSpeed PipelineEngine, ZeRO-0, one stage per rank: activations forward and gradients "
              "backward per micro-batch (send/recv in the module dtype), one all-reduce of the stage's "
              "gradients over its one-rank data-parallel group, the loss broadcast from the last stage "
              "(scalar); see parabench.theory.deepspeed_pp_ops. The first step also sends a 1 KiB tensor-meta "
              "message ahead of the first activation.",
        pipeline={"schedule": "1f1b", "microbatches": n_micro,
                  "bubble_fraction": bubble_fraction_theory(p, n_micro)},
    )


# --- reference data parallel: reference_impls/data_parallel.py, zero.py, fsdp.py -----------------
# The layout rules are restated here, not imported, so that a change in the code shows up as a
# mismatch with the measurement. b = bytes of the compute dtype (4 fp32, 2 bf16); Ψ the parameter
# count; N the data-parallel degree (the shard-group size S for hsdp); A = grad_accum.
# Padding: ZeRO-1/2 pad each gradient bucket, ZeRO-3/FSDP/HSDP each unit (a block, or the root:
# embeddings + final LayerNorm + head), to a multiple of N elements; Ψp is the padded total. The
# collectives run even at N = 1 (group of one), so the payloads below hold for any N.

def _ref_bucket_sizes(cfg: GPTConfig, elem: int, bucket_mb: float, pad_to: int) -> list[int]:
    """Padded bucket sizes (elements): parameters last-registered first, a bucket closes once it
    holds >= bucket_mb MiB of the compute dtype (reference_impls/dp_common.py:plan_buckets)."""
    import torch

    from parabench.models import GPT

    with torch.device("meta"):
        numels = [p.numel() for p in GPT(cfg).parameters()]
    sizes, used = [], 0
    for n in reversed(numels):
        used += n
        if used * elem >= bucket_mb * (1 << 20):
            sizes.append(-(-used // pad_to) * pad_to)
            used = 0
    if used:
        sizes.append(-(-used // pad_to) * pad_to)
    return sizes


def _ref_units(cfg: GPTConfig, n: int) -> tuple[int, int]:
    """(padded root unit, padded block unit) in elements, for shard groups of ``n`` ranks."""
    c = _counts(cfg)
    block = c["blocks"] // cfg.n_layers
    return _shard(c["total"] - c["blocks"], n) * n, _shard(block, n) * n


def _big(ops) -> int:
    """Sum of op payloads the comm meter counts as volume (ops above its scalar cut-off)."""
    return sum(x for x in ops if x > 64)


@expectation("ref.ddp")
def _ref_ddp(cfg, case, dp):
    psi, b, mixed = _counts(cfg)["total"], BYTES[case.precision], case.precision != "fp32"
    buckets = _ref_bucket_sizes(cfg, b, float(case.options.get("bucket_mb", 25)), 1)
    return Expectation(
        state_bytes={"params": b * psi, "grads": b * psi + (4 * psi if mixed else 0),
                     "optimizer": 8 * psi + (4 * psi if mixed else 0)},
        comm_payload_bytes={"all_reduce": _big(b * n for n in buckets)},
        paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
        notes="flat buffers, no padding. fp32: 4Ψ params (= the master) + 4Ψ grads + 8Ψ Adam = 16Ψ. bf16: 2Ψ "
              "params + 2Ψ grads + 4Ψ fp32 main gradient (made just before the update) + 4Ψ master + 8Ψ Adam = "
              "20Ψ (paper 16Ψ: it does not count the fp32 gradient). One all-reduce per bucket per step, in "
              "the compute dtype (bf16 on the wire for bf16); no_sync during accumulation.",
    )


@expectation("ref.ps")
def _ref_ps(cfg, case, dp):
    psi, b, mixed = _counts(cfg)["total"], BYTES[case.precision], case.precision != "fp32"
    server_state = {"params": b * psi, "grads": 2 * b * psi + (4 * psi if mixed else 0),
                    "optimizer": 8 * psi + (4 * psi if mixed else 0)}
    worker_state = {"params": b * psi, "grads": b * psi, "optimizer": 0}
    server_comm = {**({"recv": (dp - 1) * b * psi} if dp > 1 else {}), "broadcast": b * psi}
    worker_comm = {"send": b * psi, "broadcast": b * psi}
    return Expectation(
        state_bytes=[server_state] + [worker_state] * (dp - 1),
        comm_payload_bytes=server_comm,
        comm_payload_bytes_per_rank=[server_comm] + [worker_comm] * (dp - 1),
        paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
        notes="figures for the server (rank 0), the busiest rank: own gradient + one receive buffer (+ the fp32 "
              "main gradient in bf16), master and Adam moments; it receives (N-1) gradients per step. A worker "
              "holds bΨ params + bΨ grads, no optimizer state, and moves send bΨ + broadcast bΨ.",
    )


def _ref_zero(stage: int):
    def fn(cfg, case, dp):
        psi, b, mixed = _counts(cfg)["total"], BYTES[case.precision], case.precision != "fp32"
        buckets = _ref_bucket_sizes(cfg, b, float(case.options.get("bucket_mb", 25)), dp)
        psi_p, shard = sum(buckets), sum(buckets) // dp
        rs_rounds = 1 if stage == 1 else case.grad_accum
        return Expectation(
            state_bytes={"params": b * psi_p,
                         "grads": (b * psi_p if stage == 1 else 0) + 4 * shard,
                         "optimizer": 8 * shard + (4 * shard if mixed else 0)},
            comm_payload_bytes={"reduce_scatter": rs_rounds * _big(b * n for n in buckets),
                                "all_gather": _big(b * n for n in buckets)},
            paper_state_bytes=zero_paper_state_bytes(stage, psi, dp),
            notes=f"buckets padded to a multiple of N (Ψp = {psi_p} vs Ψ = {psi}); every bucket split into N shards. "
                  + ("ZeRO-1: full gradient buffer bΨp + fp32 main-gradient shard 4Ψp/N; " if stage == 1 else
                     "ZeRO-2: only the fp32 main-gradient shard 4Ψp/N at update time (buckets freed); ")
                  + "Adam 8Ψp/N, + fp32 master shard 4Ψp/N in bf16 (in fp32 the owned part of the parameter "
                  "buffer is the master). bf16: 2Ψ + 16Ψ/N (stage 2) vs the paper's 2Ψ + 14Ψ/N, the difference being "
                  "the fp32 gradient shard (as DeepSpeed holds). Reduce-scatter and all-gather in the compute dtype"
                  + (", reduce-scatter on every micro-batch." if stage == 2 else ", communication on the last micro-batch only."),
        )
    return fn


EXPECTATIONS["ref.zero1"] = _ref_zero(1)
EXPECTATIONS["ref.zero2"] = _ref_zero(2)


def _ref_sharded(variant: str):
    def fn(cfg, case, dp):
        psi, b, mixed = _counts(cfg)["total"], BYTES[case.precision], case.precision != "fp32"
        n = int(case.options.get("shard_size", 2)) if variant == "hsdp" else dp
        root, block = _ref_units(cfg, n)
        units = [root] + [block] * cfg.n_layers
        psi_p, shard = sum(units), sum(units) // n
        regathered = units[1:] + ([root] if variant == "zero3" else [])
        comm = {"all_gather": case.grad_accum * _big(b * u for u in units + regathered),
                "reduce_scatter": case.grad_accum * _big(b * u for u in units)}
        if variant == "hsdp":  # one all-reduce per unit's fp32 gradient shard
            comm["all_reduce"] = _big(4 * u // n for u in units)
        in_flight = int(case.options.get("in_flight", 2))
        return Expectation(
            state_bytes={"params": 4 * shard, "grads": 4 * shard, "optimizer": 8 * shard},
            comm_payload_bytes=comm,
            paper_state_bytes=zero_paper_state_bytes(3, psi, n),
            # Transient, on top of the model state, in the compute dtype: the gathered units alive at
            # once (the root and up to three blocks: in backward the block whose last gradients are
            # landing, the one computing, the one prefetched) and the gradients before their
            # reduce-scatter: the root's (autograd's own tensors, then for a moment also its flat
            # buffer) and the flat buffers of up to in_flight + 1 blocks; in 16-bit each of the
            # in_flight outstanding reduce-scatters has a receive shard too.
            working_set_bytes={"gathered_params": b * (root + 3 * block),
                               "grad_buffers": b * (2 * root + (in_flight + 1) * block)
                               + (b * in_flight * max(root, block) // n if mixed else 0)},
            notes=f"units (root + one per block) padded to a multiple of {'S' if variant == 'hsdp' else 'N'} "
                  f"(Ψp = {psi_p}); in every precision the fp32 shard 4Ψp/n is the only persistent copy of the "
                  "parameters (the master weights; cast into the all-gather buffer before each gather), fp32 "
                  "main-gradient shard 4Ψp/n (allocated unit by unit in backward, freed after the update), Adam "
                  "8Ψp/n: 16Ψp/n (paper 16Ψ/N). Per micro-batch: "
                  "all-gather of every unit for forward and of every block again for backward"
                  + (" and of the root too" if variant == "zero3" else " (the root stays gathered)")
                  + ", reduce-scatter of every unit, in the compute dtype"
                  + ("; once per step an fp32 all-reduce of each unit's gradient shard across the N/S replicas"
                     if variant == "hsdp" else "") + ".",
        )
    return fn


EXPECTATIONS["ref.zero3"] = _ref_sharded("zero3")
EXPECTATIONS["ref.fsdp"] = _ref_sharded("fsdp")
EXPECTATIONS["ref.hsdp"] = _ref_sharded("hsdp")


# --- context parallelism (ring attention, Ulysses) and expert parallelism ------------------------
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
            else:
                ops += [("all_to_all", act)] * 8
    ops.append(("all_reduce", 4 * _counts(cfg)["total"]))
    return ops


def _cp(mode: str):
    def fn(cfg, case, dp):
        psi = _counts(cfg)["total"]
        # The ring's blocks and Ulysses' q, k, v and output shards travel in the compute dtype:
        # measured equal in bf16 on 2 GPUs as well (ring, ref.cp_ulysses and deepspeed.ulysses).
        exact = case.precision in ("fp32", "bf16")
        return Expectation(
            state_bytes={"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi},
            comm_payload_bytes=_sum_ops(cp_ops(cfg, case, mode)) if exact else None,
            paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
            notes=("ring attention: per layer per micro-batch (c-1) hops of K and V (2·b·(s/c)·h elements sent and "
                   "as many received per hop) forward; backward (a second ring pass) (c-1) hops of K and V again and "
                   "(c-1) hops of the dK, dV partial sums, all in the compute dtype; "
                   if mode == "ring" else
                   "Ulysses: per layer per micro-batch 4 all-to-alls of b·s·h/c elements forward (q, k, v, out) and 4 "
                   "backward; ")
                  + "b = cp x micro_batch samples (the group all-gathers its token ids: c·2·B·s int64 per step); one fp32 "
                  "all-reduce of all gradients. Model state fully replicated: 16Ψ in fp32. Exact for fp32 and bf16.",
        )
    return fn


EXPECTATIONS["ref.cp_ring"] = _cp("ring")
EXPECTATIONS["ref.cp_ulysses"] = _cp("ulysses")


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
        ops += [("all_to_all", E * 8), ("all_to_all", sent * h * nb), ("all_to_all", received * h * nb),
                ("all_to_all", sent * h * nb), ("all_to_all", received * h * nb)]
    ops.append(("all_reduce", 4 * _counts(cfg)["dense"]))
    return ops


@expectation("ref.ep")
def _ref_ep(cfg, case, dp):
    c = _counts(cfg)
    if "experts" not in c:
        return Expectation(state_bytes=None, comm_payload_bytes=None, paper_state_bytes=None,
                           notes="ref.ep needs an MoE model")
    ep = case.world_size
    local = c["dense"] + c["experts"] // ep
    balanced = _sum_ops(ep_ops(cfg, case))
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
# the rest of the step is ref.cp_ulysses's (token all-gather, one gradient all-reduce).
EXPECTATIONS["deepspeed.ulysses"] = _cp("ulysses")


def deepspeed_moe_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float,
                           min_capacity: int = 0) -> int:
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
    c = _counts(cfg)
    h, E = cfg.d_model, cfg.n_experts
    dropless = cfg.capacity_factor is None
    if capacities is None:
        if dropless:
            raise ValueError("dropless deepspeed.moe: the capacity depends on the routing; pass the measured ones")
        capacities = [deepspeed_moe_capacity(case.micro_batch * cfg.seq_len, E, cfg.top_k, cfg.capacity_factor,
                                             int(case.options.get("min_capacity", 0)))
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


@expectation("deepspeed.moe")
def _deepspeed_moe(cfg, case, dp):
    c = _counts(cfg)
    if "experts" not in c:
        return Expectation(state_bytes=None, comm_payload_bytes=None, paper_state_bytes=None,
                           notes="deepspeed.moe needs an MoE model")
    local = c["dense"] + c["experts"] // case.world_size
    nb = BYTES[case.precision]
    state = {"params": 4 * local, "grads": None, "optimizer": 8 * local} if case.precision == "fp32" else None
    n = cfg.n_moe_layers * case.grad_accum
    tokens, E = case.micro_batch * cfg.seq_len, cfg.n_experts
    balanced = math.ceil(tokens * cfg.top_k / E)  # every expert equally loaded
    if cfg.capacity_factor is not None:
        comm = _sum_ops(deepspeed_moe_ops(cfg, case))
        balanced_comm = None
    else:
        # C lies between the balanced load and b·s (every token chose the same expert)
        balanced_comm = _sum_ops(deepspeed_moe_ops(cfg, case, [balanced] * n))
        lo, hi = (_sum_ops(deepspeed_moe_ops(cfg, case, [cap] * n))["all_to_all"] for cap in (balanced, tokens))
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


def routed_comm_per_rank(case, cfg: GPTConfig, per_rank: list[dict]) -> list[dict] | None:
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
        out.append(_sum_ops(ops))
    return out


# --- communication-reducing data parallelism: reference_impls/compression.py, torch DDP hooks ----
# Ψ parameters in buckets planned as ref.ddp plans them (25 MiB default: the small models fit in one);
# N = data-parallel degree. Per bucket b with numel_b elements and S_b tensors:
#   fp16:     all-reduce 2·numel_b                                  (2Ψ in all)
#   onebit:   all-gather N·(4·S_b + ⌈numel_b/8⌉)  [fp32 scale per tensor | signs 8 per byte]
#   topk:     all-gather N·4·k_b (fp32 values) + all-gather N·4·k_b (int32 indices), k_b = max(1, ⌈ratio·numel_b⌉)
#   powersgd: all-reduce 4·Σ n·r (P) + all-reduce 4·Σ m·r (Q) over the bucket's 2-D n×m tensors, r = min(rank, n, m),
#             + all-reduce 4·Σ numel of its 1-D tensors (uncompressed)
#   local SGD: nothing on a local step; at a sync step (every H-th) all-reduce 4Ψ (fp32 master) + 8Ψ (AdamW
#             moments) or 4Ψ (SGD momentum) when optimizer states are averaged: (4Ψ + 8Ψ)/H per step on average.
# Each op is checked against the meter's scalar cut-off (ops ≤ 64 bytes are listed apart) one by one.


def _ref_bucket_shapes(cfg: GPTConfig, elem: int, bucket_mb: float) -> list[list[tuple[int, ...]]]:
    """Parameter shapes per bucket, as reference_impls/dp_common.py:plan_buckets groups them (no padding)."""
    import torch

    from parabench.models import GPT

    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in GPT(cfg).parameters()]
    out, cur, used = [], [], 0
    for shape in reversed(shapes):
        cur.append(shape)
        used += math.prod(shape)
        if used * elem >= bucket_mb * (1 << 20):
            out.append(cur)
            cur, used = [], 0
    if cur:
        out.append(cur)
    return out


def compression_ops(cfg: GPTConfig, case, dp: int, method: str, buckets=None) -> list[tuple[str, int]]:
    """Every (kind, payload bytes) op of one compressed-DDP step (see the table above)."""
    o = case.options
    if buckets is None:
        b = BYTES[case.precision]
        buckets = _ref_bucket_shapes(cfg, b, float(o.get("bucket_mb", 25)))
    ops: list[tuple[str, int]] = []
    for shapes in buckets:
        numel = sum(math.prod(s) for s in shapes)
        if method == "fp16":
            ops.append(("all_reduce", 2 * numel))
        elif method == "onebit":
            ops.append(("all_gather", dp * (4 * len(shapes) + -(-numel // 8))))
        elif method == "topk":
            k = max(1, math.ceil(float(o.get("topk_ratio", 0.01)) * numel))
            ops += [("all_gather", dp * 4 * k), ("all_gather", dp * 4 * k)]
        elif method in ("powersgd", "torch_powersgd"):
            rank = int(o.get("powersgd_rank", 2))
            vec = ps = qs = 0
            for s in shapes:
                if len(s) == 2:
                    n, m = s
                    r = min(rank, n, m)
                    if method == "torch_powersgd" and not (n + m) * r * 1.0 < n * m:  # min_compression_rate = 1
                        vec += n * m
                        continue
                    ps, qs = ps + n * r, qs + m * r
                else:
                    vec += math.prod(s)
            ops += [("all_reduce", 4 * x) for x in (vec, ps, qs) if x]
        else:
            raise ValueError(method)
    return ops


def _compressed_state(cfg, case, dp, extra_grads: int):
    base = EXPECTATIONS["ref.ddp"](cfg, case, dp)["state_bytes"]
    return {**base, "grads": base["grads"] + extra_grads}


def _compressed(method: str):
    def fn(cfg, case, dp):
        psi = _counts(cfg)["total"]
        o = case.options
        ef = bool(o.get("error_feedback", True)) and method != "fp16"
        extra = 4 * psi if ef else 0
        if method == "powersgd":  # warm-start Q (m x r) per 2-D tensor
            rank = int(o.get("powersgd_rank", 2))
            for shapes in _ref_bucket_shapes(cfg, BYTES[case.precision], float(o.get("bucket_mb", 25))):
                extra += sum(4 * s[1] * min(rank, *s) for s in shapes if len(s) == 2)
        return Expectation(
            state_bytes=_compressed_state(cfg, case, dp, extra),
            comm_payload_bytes=_sum_ops(compression_ops(cfg, case, dp, method)),
            paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
            notes={"fp16": "ref.ddp with every bucket cast to fp16, all-reduced, cast back: 2Ψ bytes per step.",
                   "onebit": "per bucket an all-gather of N x (4 bytes per tensor scale + ⌈numel/8⌉ bytes of packed "
                             "signs) (≈ NΨ/8); + 4Ψ fp32 error-feedback residual under grads.",
                   "topk": "per bucket two all-gathers (fp32 values, int32 indices) of N·k elements, "
                           "k = ⌈topk_ratio·numel⌉ (≈ 8·N·ratio·Ψ bytes); + 4Ψ residual under grads.",
                   "powersgd": "per bucket all-reduces of P (4·Σ n·r), Q (4·Σ m·r) and the uncompressed 1-D tensors "
                               "(4·Σ numel); + 4Ψ residual and the warm-start Qs (4·Σ m·r) under grads.",
                   }[method] + (" Without error feedback, no residual." if method != "fp16" and not ef else ""),
        )
    return fn


for _m in ("fp16", "onebit", "topk", "powersgd"):
    EXPECTATIONS[f"ref.ddp_{_m}" if _m != "fp16" else "ref.ddp_fp16_compress"] = _compressed(_m)


def local_sgd_synced(case, step_index: int) -> bool:
    """Whether the step with 0-based index ``step_index`` ends with an average (every H-th step)."""
    return (step_index + 1) % int(case.options.get("sync_every", 4)) == 0


@expectation("ref.local_sgd")
def _ref_local_sgd(cfg, case, dp):
    psi = _counts(cfg)["total"]
    o = case.options
    H = int(o.get("sync_every", 4))
    sgd = o.get("local_optimizer", "adamw") == "sgd"
    states = (4 * psi if sgd else 8 * psi) if bool(o.get("average_optimizer_state", True)) else 0
    per_sync = [4 * psi] + ([4 * psi] if states and sgd else [4 * psi, 4 * psi] if states else [])
    instrumented = case.warmup + case.steps  # the worker's metered step (0-based)
    synced = local_sgd_synced(case, instrumented)
    state = EXPECTATIONS["ref.ddp"](cfg, case, dp)["state_bytes"]
    if sgd:
        state = {**state, "optimizer": state["optimizer"] - 4 * psi}
    return Expectation(
        state_bytes=state,
        comm_payload_bytes={"all_reduce": sum(per_sync)} if synced else {},
        comm_payload_bytes_avg_per_step={"all_reduce": sum(per_sync) / H},
        paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
        notes=f"no gradient communication; every {H} steps an all-reduce of the fp32 parameters (4Ψ)"
              + (f" and of the optimizer states ({'4Ψ SGD momentum' if sgd else '8Ψ AdamW moments'})" if states else "")
              + f". The metered step (index {instrumented}) {'is' if synced else 'is not'} a sync step; on average "
              f"{sum(per_sync) / H:.0f} bytes per step.",
    )


@expectation("torch.ddp_fp16_hook")
def _torch_fp16_hook(cfg, case, dp):
    psi = _counts(cfg)["total"]
    return Expectation(
        state_bytes={"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi},
        comm_payload_bytes={"all_reduce": 2 * psi},
        paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
        notes="torch DDP buckets cast to fp16 by fp16_compress_hook: 2Ψ bytes per step.",
    )


@expectation("torch.ddp_powersgd_hook")
def _torch_powersgd_hook(cfg, case, dp):
    psi = _counts(cfg)["total"]
    import torch

    from parabench.models import GPT

    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in GPT(cfg).parameters()]
    return Expectation(
        state_bytes=None,  # torch keeps its residual and P/Q memories inside the hook state
        comm_payload_bytes=_sum_ops(compression_ops(cfg, case, dp, "torch_powersgd", buckets=[shapes])),
        paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
        notes="powerSGD_hook after start_powerSGD_iter (2): per bucket all-reduces of the uncompressed tensors "
              "(1-D, and 2-D with (n+m)·r ≥ n·m), of P and of Q; computed as if all gradients were in one bucket "
              "(true for models under DDP's 1 MiB first bucket; otherwise exact unless an op falls under 64 bytes).",
    )


# --- CPU offload: device-resident model state -------------------------------------------------
# What stays on the device when the optimizer (and for FSDP2 the sharded parameters) live in CPU
# memory. On a CPU-only machine "device" and "CPU" are the same memory: the offload is then a copy
# within it, and these figures describe the layout, not a saving.

@expectation("ref.zero2_offload")
def _ref_zero2_offload(cfg, case, dp):
    base = EXPECTATIONS["ref.zero2"](cfg, case, dp)
    psi, b = _counts(cfg)["total"], BYTES[case.precision]
    buckets = _ref_bucket_sizes(cfg, b, float(case.options.get("bucket_mb", 25)), dp)
    psi_p, shard = sum(buckets), sum(buckets) // dp
    return Expectation(
        state_bytes={"params": b * psi_p, "grads": 4 * shard, "optimizer": 0},
        comm_payload_bytes=base["comm_payload_bytes"],
        paper_state_bytes=2 * psi,  # ZeRO-Offload, Sec. 4: only the 16-bit parameters stay (2Ψ)
        cpu_state_bytes={"master": 4 * shard, "grads": 4 * shard, "optimizer": 8 * shard},
        notes="ZeRO-2 on the device: bΨp compute parameters + the fp32 main-gradient shard 4Ψp/N (reduce-scattered "
              "there, then copied out); on the CPU: fp32 master 4Ψp/N, Adam 8Ψp/N and a 4Ψp/N gradient copy. The "
              "paper's 2Ψ counts 16-bit parameters only (its gradients stream to the CPU bucket by bucket). Same "
              "collectives as ref.zero2.",
    )


def _deepspeed_offload(stage: int):
    def fn(cfg, case, dp):
        base = _deepspeed(stage)(cfg, case, dp)
        psi, b = _counts(cfg)["total"], BYTES[case.precision]
        device_params = b * psi if stage == 2 else b * _shard(psi, dp)
        return Expectation(
            state_bytes=None,  # read from the engine (its "optimizer" figure includes the CPU-resident part)
            comm_payload_bytes=base["comm_payload_bytes"],
            paper_state_bytes=device_params,
            device_state_bytes={"params": device_params, "grads": None, "optimizer": 0},
            notes=f"DeepSpeed ZeRO-{stage} with offload_optimizer=cpu: fp32 master partitions, Adam moments and the "
                  "update on the CPU; the device keeps the "
                  + ("16-bit parameters (bΨ)" if stage == 2 else "16-bit parameter partition (bΨ/N)")
                  + " plus gradient buckets in flight. Client torch AdamW runs on the CPU.",
        )
    return fn


EXPECTATIONS["deepspeed.zero2_offload"] = _deepspeed_offload(2)
EXPECTATIONS["deepspeed.zero3_offload"] = _deepspeed_offload(3)


@expectation("torch.fsdp2_offload")
def _torch_fsdp2_offload(cfg, case, dp):
    base = _torch_fsdp2(cfg, case, dp)
    return Expectation(
        state_bytes=None,
        comm_payload_bytes=base["comm_payload_bytes"],
        paper_state_bytes=0,
        device_state_bytes={"params": 0, "grads": 0, "optimizer": 0},
        notes="FSDP2 CPUOffloadPolicy: sharded fp32 parameters, their gradients and the AdamW step stay in CPU memory; "
              "the device holds only the gathered block being computed (transient, not model state). Same "
              "collectives as torch.fsdp2.",
    )
