"""The physics of one training step, from parts a reader can check.

A ``Workload`` is one configuration: model shape x strategy and degrees (dp, tp, pp) x recipe x
micro-batch and accumulation x GPU count, together with the analytic expectation parabench's
theory gives for it (``parabench.registry.expected``: model-state bytes per rank, communication
payload by kind). Nothing here recomputes those: state and traffic come from the theory (or, in
the report, from the record's own ``theory`` section), so a ZeRO line predicted here is the
ZeRO line the theory checks measurements against.

Step time (per optimizer step, per rank), every term a rate times an amount:

- compute      FLOPs of the rank (model FLOPs + recomputation) / achieved matmul rate, where the
               rate saturates with the GEMM size x = tokens per micro-batch x width / tp:
               t = F * (1/R + (x0/R) / x)  (a roofline with a half-saturation size x0)
- bubble       pipeline: the per-micro-batch terms (compute, elementwise, logits, launches) of the
               average stage x pipeline_factor - 1: the schedule replayed (parabench.pipeline_sim)
               on unequal stages (blocks by partition_layers, embedding on the first, head and
               loss on the last); equal stages give (p-1)/(v*m), ZB-H1's (p-1)/(3m)
- memory       bytes the optimizer step and the casts move / memory bandwidth: optimizer
               reads and writes every state byte; autocast ("amp") casts fp32 weights per pass
- host         launch overhead per layer and micro-batch pass
- offload      bytes of the CPU optimizer states / host bandwidth
- comm         sum over collective kinds of exposure_class * (calls*alpha + bytes*bus/busbw),
               alpha-beta from the collectives suite (a serial collective's calls after the first
               at a queued call's alpha and bandwidth, from its bursts), exposure (the part not
               hidden behind compute) fitted per strategy family
- x impl       one factor per implementation with a named cause the terms miss (the row's
               ``PlanFacts.time_factor_cause``:
               DeepSpeed's engine passes, CPU Adam), fitted from the other configurations of the
               same implementation only, shrunk toward 1 by empirical Bayes (the spread between
               implementations against the spread within one), within IMPL_TIME_BOUNDS; 1 for
               every other one

Peak memory per rank: model states (theory) + activations after Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", Sec. 4, flash attention so no
5as/h term) per layer x layers held x micro-batches in flight, with or without checkpointing
+ logits (b*s*V elements, per recipe bytes per element fitted) + autocast's weight copies
+ the theory's working set (gathered parameters, gradient buckets) + a constant.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from parabench.plan import attention
from parabench.strategies import PlanFacts

GIB = 1 << 30


# Collective kinds and how many times the payload crosses a link per rank (nccl-tests bus factor).
def bus_factor(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # send, recv, broadcast, reduce


# Which collectives suite op stands in for a kind the suite does not time.
BENCH_OP = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "send": "all_gather",
    "recv": "all_gather",
    "broadcast": "all_gather",
    "all_to_all": "all_gather",
}

# The fitted step-time constants, in the order of the least-squares columns.
TIME_CONSTANTS = (
    "inv_rate",
    "inv_rate_x",
    "inv_mem_bw",
    "inv_act_bw",
    "inv_act_bw_compiled",
    "logit_s",
    "host_s",
    "ds_stage0_tensor_s",
    "inv_host_bw",
    "exp_dp",
    "exp_shard",
    "exp_deepspeed",
    "exp_tp",
    "exp_p2p",
    "comm_serial",
    "inv_rate_fp8",
    "fp8_cast_s",
    "attn_s",
)
# Constants in seconds per byte of HBM traffic, or per element of memory-bound work: on another part
# of one architecture they scale with its HBM bandwidth (``calibrate.derive``).
MEMORY_BOUND_TIME_CONSTANTS = ("inv_mem_bw", "inv_act_bw", "inv_act_bw_compiled", "logit_s", "fp8_cast_s")
# Constants the physics sets and no fit moves: exposed communication with nothing to hide behind, and
# attention's seconds at its own measured rate.
FIXED_TIME_CONSTANTS = ("comm_serial", "attn_s")
ACT_CONSTANTS = ("act_master", "act_amp", "act_amp_compiled", "act_fp8")
MEMORY_CONSTANTS = ACT_CONSTANTS + ("logit_bytes_master", "logit_bytes_amp", "cast", "const_bytes")
TIME_DOC = {
    "inv_rate": "s/FLOP at large GEMMs (1 / achieved matmul rate R)",
    "inv_rate_x": "x0/R: s/FLOP x GEMM size (M tokens x width / tp, in 1e6) of the small-GEMM penalty",
    "inv_mem_bw": "s/byte of optimizer-step and cast traffic (1 / achieved HBM bandwidth)",
    "inv_act_bw": "s per activation byte per layer pass (elementwise kernels: norms, GELU, residual, dropout; "
    "= accesses per element / HBM bandwidth)",
    "inv_act_bw_compiled": "inv_act_bw of a configuration with per-block torch.compile (option compile): Inductor "
    "fuses a block's elementwise chains, so fewer accesses per element (inv_act_bw where no compiled record "
    "calibrates it)",
    "logit_s": "s per logit element (b*s*V) per pass: softmax/cross-entropy, memory-bound",
    "host_s": "s of host/launch overhead per layer per micro-batch pass",
    "ds_stage0_tensor_s": "s per parameter tensor per step of DeepSpeed's 16-bit stage 0 (FP16_Optimizer, under "
    "bf16 too): its overflow check reduces each gradient and reads the result on the host, one tensor after "
    "another, with nothing beside it (``ds_stage0_tensors``)",
    "pp_host_block_s": "s of host time per block per pipeline action (one F, B or W of a chunk): the least an "
    "action lasts, so an action whose device work is shorter waits on its host (fitted over every pipeline "
    "record by a 1-D search, not by the least squares)",
    "inv_host_bw": "s/byte of CPU-offloaded optimizer state (1 / host bandwidth)",
    "exp_dp": "share of overlapped data-parallel gradient traffic (DDP family) that still costs step time "
    "(compute slowed beside it); the unhidden tail is in comm_serial",
    "exp_shard": "share of overlapped sharded (ZeRO/FSDP) traffic that still costs step time; the unhidden tail "
    "and the serial all-gathers are in comm_serial",
    "exp_deepspeed": "share of DeepSpeed ZeRO stage 0-2 traffic that costs step time: its engine's gradient reduce "
    "(beside backward with overlap_comm) and post-update all-gather, whose overlap the model does not read off "
    "its code (exp_shard where no DeepSpeed record calibrates it)",
    "exp_tp": "exposed fraction of tensor-parallel traffic",
    "exp_p2p": "exposed fraction of pipeline send/recv",
    "comm_serial": "multiplier (1, not fitted) on the communication the code leaves nothing to hide behind: "
    "collectives issued outside backward (ZeRO-1/2's post-update all-gather, DeepSpeed without overlap_comm) "
    "and the part of an overlapped collective its remaining compute cannot hide (``overlap_tail_s``)",
    "inv_rate_fp8": "s/FLOP of the transformer blocks' linears under the fp8 recipe (torch._scaled_mm, tensorwise "
    "scales; inv_rate where no fp8 record calibrates it)",
    "fp8_cast_s": "s per element of a float8 linear's input or output gradient per pass: the amax reduction, "
    "the scaled cast to float8 and the transposed copy torchao makes for the weight gradient",
    "attn_s": "multiplier (1, not fitted) on attention's seconds at its own measured rate (time key 'attention', "
    "parabench.plan.attention), which price the attention FLOPs in place of the matmul rate",
}
MEMORY_DOC = {
    "act_master": "multiplier on Korthikanti's activation bytes, bf16/fp16 parameters",
    "act_amp": "multiplier on Korthikanti's activation bytes under autocast (fp32 residual stream)",
    "act_amp_compiled": "act_amp with per-block torch.compile (option compile): AOTAutograd's partitioner picks "
    "what a compiled block saves for backward",
    "act_fp8": "multiplier on Korthikanti's activation bytes under the fp8 recipe (compiled): the partitioner "
    "saves a float8 linear's input as its float8 cast (1 byte) where recomputing the cast is cheaper",
    "logit_bytes_master": "bytes per logit element (b*s*V) alive at the peak, master recipe",
    "logit_bytes_amp": "bytes per logit element alive at the peak, amp recipe",
    "cast": "multiplier on autocast's 16-bit weight copies (2 bytes per parameter held)",
    "const_bytes": "fixed bytes (CUDA workspaces, allocator slack)",
}
# Used where the calibration has no record that exercises a constant (never silently zero).
TIME_DEFAULTS = {
    "inv_rate": 1 / 600e12,
    "inv_rate_x": 0.0,
    "inv_mem_bw": 1 / 2.0e12,
    "inv_act_bw": 0.0,
    "logit_s": 0.0,
    "host_s": 0.0,
    "ds_stage0_tensor_s": 0.0,
    "inv_host_bw": 1 / 20e9,
    "pp_host_block_s": 0.0,
    # overlapped traffic: the tail its compute cannot hide is charged in comm_serial; what the
    # overlapped part costs beside it (compute slowed by the collective's kernels) is not
    # identifiable without a multi-GPU record, and the first-principles default is none
    "exp_dp": 0.0,
    "exp_shard": 0.0,
    "exp_tp": 1.0,
    "exp_p2p": 1.0,
    "comm_serial": 1.0,
    "fp8_cast_s": 0.0,
    "attn_s": 1.0,
}


def time_constants(consts: dict | None) -> dict:
    """``consts`` over the defaults; the compiled elementwise constant is the eager one where no
    compiled record calibrated it (compile then changes nothing)."""
    c = {**TIME_DEFAULTS, **(consts or {})}
    c.setdefault("inv_act_bw_compiled", c["inv_act_bw"])
    c.setdefault("inv_rate_fp8", c["inv_rate"])
    c.setdefault("exp_deepspeed", c["exp_shard"])
    return c


# Recipes that train fp32 parameters under torch.autocast(bf16): the amp layout, casts and
# fp32 residual stream. fp8 (parabench/fp8.py) is amp with the blocks' linears in float8.
AUTOCAST_RECIPES = ("amp", "fp8")
# fp8 variants the float8 terms do not describe, with why (``Workload.unmodelled``).
FP8_EAGER = (
    "fp8 without compile: torchao documents float8 training with torch.compile, and eager float8 runs its "
    "amax, scale and cast as separate kernels (2.6-2.8x amp's step at gpt-1.3b on 2 H200s, fp8-gpu); the "
    "planner models compiled float8 only"
)
FP8_ALL_GATHER = (
    "torchao's float8 all-gather (option fp8_all_gather): no term for its per-step scale all-reduce and casts "
    "(measured 0.68x plain fp8 FSDP2 at gpt-1.3b, fp8-gpu and fp8-peers-gpu)"
)
FP8_FILTER_AUTO = (
    "fp8_filter auto converts the linears by shape (parabench/fp8.py); the float8 terms assume every block linear"
)
DS_ZERO_KEYS = (
    "DeepSpeed zero_optimization keys set by hand (option zero): the model prices DeepSpeed's defaults (buckets, "
    "prefetch, persistence), which the host and memory terms were fitted on"
)


MEMORY_DEFAULTS = {
    "act_master": 1.0,
    "act_amp": 1.3,
    "act_amp_compiled": 1.3,
    "act_fp8": 1.0,
    "logit_bytes_master": 10.0,
    "logit_bytes_amp": 12.0,
    "cast": 1.0,
    "const_bytes": 0.5 * GIB,
}
# Implementations whose step time keeps a fitted factor, each for a cause the terms above do not
# model (their rows' ``PlanFacts.time_factor_cause``); every other implementation runs at factor 1
# (the physics alone). Factors are bounded to IMPL_TIME_BOUNDS.
IMPL_TIME_BOUNDS = (0.67, 1.5)
# An implementation's memory beyond the physics (a fraction of its model states), kept in [0, this]:
# it cannot hold less than the states alive at its peak, and a larger remainder is a missing term.
IMPL_MEMORY_MAX = 0.5


def time_factor_cause(impl: str) -> str | None:
    return facts(impl.split(":", 1)[0]).time_factor_cause


# Memory factors are shrunk toward 0 as if this many configurations had shown no difference: one
# configuration of an implementation does not define it. Time factors are shrunk by what the records
# say instead (calibrate._shrinkage), with this as the fallback where no implementation has two.
SHRINK = 1.0


# Libraries whose Python runs once per parameter tensor (or per op) on the critical path of every
# pass: DeepSpeed ZeRO-3's fetch/release hooks, FSDP2's per-module hooks over DTensor parameters,
# DTensor's dispatch in torch.tp. Their step is max(device time, host time), host time = a per-library
# cost per parameter tensor x tensors x passes (docs/results.md: ZeRO-3 steps of ~450 ms at 2 GPUs for
# gpt-350m and gpt-1.3b alike, at 46-68 % GPU utilisation).
# The zero-bubble engines join them: their W runs one autograd call per parameter-owning module and
# micro-batch (reference_impls/pipeline_zb.backward_weight; torch's stage_backward_weight per
# parameter group), each a host round trip that a one-row micro-batch cannot hide.
# (Their rows: ``PlanFacts.host_bound``.)
# Strategies host-bound in some versions only (``PlanFacts.host_bound_versions``; a record
# made before versions were written ran version 1). ref.pp_zb version 1 ran W as one autograd.grad
# per parameter-owning module and micro-batch; version 2 computes every Linear's weight gradient as an
# explicit dy^T x matmul, all of them inside one no_grad context (pipeline_zb.backward_weight), and
# keeps autograd calls for the two LayerNorms per block and the embeddings only: a few host calls per
# block against the block's matmuls, so its step is the schedule's device time (pipeline_sim replay).
# Implementations with device work of their own (a fitted factor) that also wait on
# their host where the device work is short: step = max(device x factor, host cost per tensor x
# tensors x passes). DeepSpeed ZeRO-1/2 under the tuned profile (results/ds-host-gpu/20261127-043817,
# one host at 1, 2 and 4 GPUs): 108-136 ms a step at gpt-350m micro-batch 4 with the GPU 49-63 %
# busy, where ref.zero2 takes 67-74 ms; 120-123 ms at gpt-1.3b micro-batch 2 (24 blocks both: the
# same parameter tensors); GPU-bound at gpt-1.3b micro-batch 4 and up. (``PlanFacts.host_floor_profiles``.)
# Host-bound in eager mode only (``PlanFacts.host_bound_eager_only``): DTensor's per-op dispatch is
# traced into the graph by per-block torch.compile (option compile). tp-compile-gpu (gpt-1.3b mb 8,
# bf16-master): torch.tp compiled ran within 1 % of ref.tp compiled at tp 2 and 4, where eager it ran
# 0.61x and 0.40x ref.tp eager.
# torch pipelines whose dp reduction moved into the schedule, from the version their row names
# (``PlanFacts.ddp_stages_from_version``)
# (parabench/peers/torch_pipeline.py): from version 3 each stage module is DDP-wrapped and torch's
# runtime arms its reducer for the last micro-batch's backward only, which all-reduces the stage's
# gradients in buckets beside that backward; before (every record of versions 1-2), one all-reduce
# per gradient after the schedule. torch.pp_zb still reduces after the schedule: its split backward
# writes weight gradients by hand, where DDP's hooks never fire.
# Parameter tensors of a GPT block per model layout (parabench.models): "separate" q, k, v, proj, fc,
# fc2 weights, five biases (k has none) and two LayerNorms' weight and bias; "fused" one qkv weight and
# bias instead of q, k, v's five tensors. Outside the blocks: two embeddings, final LayerNorm weight and
# bias, head.
TENSORS_PER_LAYER = {"separate": 15, "fused": 12}
TENSORS_OUTSIDE = 5
# Autocast ("amp") bytes per parameter per pass: the fp32 weight read and its bf16 copy written in
# forward (4 + 2), the bf16 weight gradient read and accumulated into the fp32 .grad (2 + 4).
AMP_CAST_BYTES = 12
# fp8 (torchao Float8Linear, tensorwise) bytes per block-linear parameter per pass, in place of
# autocast's: the fp32 weight read for its amax and again for the scaled cast (4 + 4), the float8
# weight and its transpose written (1 + 1), the bf16 weight gradient read and accumulated into the
# fp32 .grad (2 + 4). The head, embeddings and LayerNorms stay under autocast (AMP_CAST_BYTES).
FP8_WEIGHT_BYTES = 16
# Elements a block's float8 linears cast per token, in units of d: (forward inputs, backward output
# gradients). Separate layout: q, k and v each cast the LayerNorm output (3d), the attention
# projection d, fc d, fc2 4d; their output gradients 3 x d, d, 4d, d. Fused: one qkv input (d).
FP8_CAST_ELEMS = {"separate": (9, 9), "fused": (7, 9)}
# Bytes per activation element of the elementwise kernels: bf16, or fp32 under autocast (norms and
# the residual stream stay fp32).
ACT_BYTES = {"amp": 4, "fp8": 4, None: 2}


def block_linear_params(w: "Workload") -> float:
    """Weights of a rank's block linears (q, k, v, proj, fc, fc2: 12 d^2 per block): the ones the
    fp8 recipe converts (parabench/fp8.py, filter "all")."""
    return 12 * w.d_model**2 * w.n_layers / (w.tp * w.pp)


def fp8_flops_share(w: "Workload") -> float:
    """Share of the model FLOPs in the block linears (6 x 12 d^2 L per token), which the fp8 recipe
    runs in float8; 0 under any other recipe."""
    if w.recipe != "fp8":
        return 0.0
    return min(1.0, 6 * 12 * w.d_model**2 * w.n_layers / w.flops_per_token)


def fp8_cast_elems(w: "Workload") -> float:
    """Elements a rank's float8 linears cast per step (forward inputs, recomputed ones again,
    backward output gradients)."""
    if w.recipe != "fp8":
        return 0.0
    fwd, bwd = FP8_CAST_ELEMS[w.layout]
    per_token = (fwd * (2 if w.checkpointing else 1) + bwd) * w.d_model * w.n_layers / (w.tp * w.pp)
    return per_token * w.rows * w.seq_len * w.passes


def _runs_ddp_stages(strategy: str, version: str | None) -> bool:
    first = facts(strategy).ddp_stages_from_version
    return first is not None and int(version or "1") >= first


def modelled_version(strategy: str, version: str | None) -> str | None:
    """The version of ``strategy`` as the model tells versions apart ("1" for a record made before
    versions were written), or None where the model treats every version alike."""
    f = facts(strategy)
    if f.host_bound_versions is not None:
        return version or "1"
    # the DDP-wrapped stages are one configuration from their first version on; the versions
    # before it (serial dp reduction) keep the keys they had
    return str(f.ddp_stages_from_version) if _runs_ddp_stages(strategy, version) else None


def ddp_stages(w: "Workload") -> bool:
    """Whether ``w`` runs a torch pipeline's DDP-wrapped stages (its dp all-reduce overlaps the
    last micro-batch's backward)."""
    return _runs_ddp_stages(w.strategy, w.strategy_version)


HOST_FLOOR_NOTE = (
    "pipeline actions at the host floor (the host time per block outlasts their device work): they follow "
    "the host's speed, which changed between launches on the GPU hosts measured (0.3-0.9 ms to issue a "
    "one-row block forward); one- and two-row micro-batches moved up to 29 % (docs/planner.md)"
)
# A derived part's steps above this MFU hold the 700 W power cap for most of the step: on 4x H200,
# gpt-6.7b at 50-60 % MFU ran at SM clocks of 1470-1620 MHz and 6-16 % slower than the derived
# calibration predicted, whose H100 constants hold the clocks of steps that did not (docs/planner.md).
POWER_CAP_MFU = 0.55
POWER_CAP_NOTE = (
    "predicted MFU {mfu:.0%} on a part calibrated from another's records: on H200, steps this dense held the "
    "700 W power cap (SM clocks 1470-1620 MHz) and ran 6-16 % slower than predicted (docs/planner.md)"
)
WIDTH_NOTE = (
    "width {width} outside the widths the calibration was fitted on ({lo}-{hi}): every term is extrapolated "
    "(at width 5120 on H200, DeepSpeed ZeRO-3 ran 24 % slower than predicted; docs/planner.md)"
)
# Pipelines from this width on ran slower than predicted on both parts, more so the wider (docs/planner.md,
# "2026-11-28, late": 8-15 % at widths 4096-5120, against a few percent at 2048). Part of it is the stages'
# in-place weight-gradient adds, measured and not charged: the model that charges them ranks worse.
WIDE_PIPELINE_WIDTH = 4096
WIDE_PIPELINE_NOTE = (
    "pipeline at width {width}: at widths 4096-5120 the pipelines measured ran 8-15 % slower than predicted; "
    "part of it is each stage's in-place weight-gradient adds (32 of the 87 ms missed at width 5120), which "
    "the model does not charge (docs/planner.md)"
)
SPLIT_GRAPHS_NOTE = (
    "peak may be low: Dynamo's DDPOptimizer cuts the compiled blocks at DDP's buckets, and nothing measured "
    "says what that saves with this recipe or checkpointing (ddp_optimizer = false compiles whole blocks)"
)


def unmodelled_reason(recipe: str | None, options: dict) -> str | None:
    """Why a configuration of ``recipe`` with ``options`` falls outside the model's terms, or None."""
    if options.get("zero"):
        return DS_ZERO_KEYS
    if recipe != "fp8":
        return None
    if not options.get("compile"):
        return FP8_EAGER
    if options.get("fp8_all_gather"):
        return FP8_ALL_GATHER
    if (options.get("fp8_filter") or "all") != "all":
        return FP8_FILTER_AUTO
    return None


def act_constant(w: "Workload") -> str:
    """The memory constant that scales ``w``'s activations: per recipe, and for amp per compile."""
    if w.recipe == "fp8":
        return "act_fp8"
    if w.recipe == "amp":
        return "act_amp_compiled" if w.compiled else "act_amp"
    return "act_master"


def act_column(w: "Workload") -> str:
    """The constant that prices ``w``'s elementwise traffic: compiled blocks fuse it."""
    return "inv_act_bw_compiled" if w.compiled else "inv_act_bw"


def is_host_bound(w: "Workload") -> bool:
    f = w.facts
    if not f.host_bound or w.offload:
        return False
    if w.compiled and f.host_bound_eager_only:
        return False
    return f.host_bound_versions is None or (w.strategy_version or "1") in f.host_bound_versions


def has_host_floor(w: "Workload") -> bool:
    return w.profile is not None and w.profile in w.facts.host_floor_profiles


def waits_on_host(w: "Workload") -> bool:
    """Whether ``w``'s step is max(device time, host time): host-bound, or with a host floor."""
    return is_host_bound(w) or has_host_floor(w)


def host_key(w: "Workload") -> str:
    return f"{w.impl}|{w.recipe}"


# Host-bound strategies whose host work is the same mechanism, for one without a calibrated record:
# the zero-bubble engines' W runs one autograd call per parameter-owning module (or parameter group)
# and micro-batch (ref.pp_zb version 1's backward_weight, torch's stage_backward_weight), and
# torch.pp_zb's timelines show its W waiting on the host (docs/results.md, "2026-11-27, last").
# (Their rows: ``PlanFacts.host_analogue``.)


def host_cost(w: "Workload", host_cal: dict) -> tuple[float | None, str | None]:
    """(seconds per parameter tensor, the key it was calibrated under): the implementation's own
    (per recipe, then any recipe); else the same library under another profile, whose hooks or
    dispatch run once per parameter tensor all the same (DeepSpeed ZeRO-3's fetch/release hooks,
    FSDP2's pre/post hooks: a profile changes buckets and prefetch, not the per-tensor Python);
    else its row's ``host_analogue``'s."""
    keys = [host_key(w), w.impl, f"{w.strategy}|{w.recipe}", w.strategy]
    keys += sorted(k for k in host_cal if k.startswith(w.strategy + ":") and k.endswith(f"|{w.recipe}"))
    keys += sorted(k for k in host_cal if k.startswith(w.strategy + ":") and "|" not in k)
    analogue = w.facts.host_analogue
    if analogue:
        keys += [f"{analogue}|{w.recipe}", analogue]
    for k in keys:
        if k in host_cal:
            return host_cal[k], k
    return None, None


def impl_factor(w: "Workload", impl_time: dict) -> tuple[float, str | None]:
    """(step-time factor, the implementation it was calibrated on): ``w``'s own; else the same
    library under another profile, whose engine runs the same per-step passes but for the ones a
    profile switches; else 1 (None)."""
    if w.impl in impl_time:
        return impl_time[w.impl], w.impl
    others = sorted(k for k in impl_time if k.split(":", 1)[0] == w.strategy)
    return (impl_time[others[0]], others[0]) if others else (1.0, None)


def host_units(w: "Workload") -> float:
    """Parameter tensors one rank's hooks visit per step: tensors of its stage x passes."""
    return parameter_tensors(w) * w.passes


def parameter_tensors(w: "Workload") -> float:
    """Parameter tensors of one rank's stage."""
    return TENSORS_PER_LAYER[w.layout] * w.n_layers / w.pp + TENSORS_OUTSIDE


def uses_fp16_optimizer(w: "Workload") -> bool:
    """DeepSpeed 0.19.8's stage 0 with 16-bit parameters wraps the optimizer in its FP16_Optimizer, under
    bf16 too: without ZeRO and with the gradient accumulation dtype at its default (the model's),
    ``engine._do_optimizer_sanity_check`` returns DDP_BFLOAT16, not BF16_Optimizer. FusedAdam (profile
    ``tuned``) gets the flat FP16_Optimizer, a client optimizer (``matched``) the per-tensor
    FP16_UnfusedOptimizer (the records' ``optimizer_wrapper``)."""
    return w.facts.stage0_fp16_optimizer and w.precision in ("bf16", "fp16") and w.recipe == "master"


def ds_stage0_tensors(w: "Workload") -> float:
    """Parameter tensors whose overflow check waits on the host per step (``uses_fp16_optimizer``):
    ``CheckOverflow.has_overflow_serial`` takes each gradient's amax and amin and tests the result's
    truth on the host, a synchronisation per tensor, before anything else of the step is issued."""
    return parameter_tensors(w) if uses_fp16_optimizer(w) else 0.0


NOT_MODELLED = PlanFacts()


@functools.cache
def facts(strategy: str) -> PlanFacts:
    """How the planner models ``strategy``: its registry row's ``plan`` (a strategy without a row is
    not modelled)."""
    from parabench.registry import STRATEGIES

    row = STRATEGIES.get(strategy)
    return row.plan if row is not None else NOT_MODELLED


def family_of(strategy: str) -> str | None:
    """The strategy family the planner models (None: not modelled), from the registry row."""
    return facts(strategy).family


@dataclass(frozen=True)
class Workload:
    """One configuration, with what the theory expects of it (bytes per rank)."""

    model: str
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    params: int
    flops_per_token: float  # model FLOPs (6N + 12Lsd)
    hw_flops_per_token: float  # + recomputation
    strategy: str
    family: str
    world_size: int
    precision: str
    recipe: str | None
    micro_batch: int
    grad_accum: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1  # pipeline micro-batches per micro_batch
    virtual_stages: int = 1
    schedule: str | None = None  # "1f1b" | "gpipe" | "zb_h1"
    stage_layers: tuple | None = None  # blocks per pipeline stage (option stage_layers); None: equal split
    # ZB-H1's mean forward, input-gradient and weight-gradient times (a record's measured ones; the
    # ratio is what matters): None for the paper's headline T_F = T_B = T_W
    zb_times: tuple | None = None
    # ref.pp_zb version 1 only (its records): finished micro-batches' graphs kept to the step's end
    zb_keeps_done_graphs: bool = False
    # the strategy's version the configuration ran (a record's), or will run (the current code's);
    # None: a record made before versions were written (version 1)
    strategy_version: str | None = None
    layout: str = "separate"  # parabench.models.LAYOUTS
    sp: bool = False
    checkpointing: bool = False
    offload: bool = False
    profile: str | None = None
    compiled: bool = False  # option compile: each block under torch.compile
    state_bytes: float | None = None  # model states of the heaviest rank (at the optimizer step)
    state_parts: dict | None = None  # the same as {params, grads, optimizer}
    state_source: str = "theory"
    working_set_bytes: float = 0.0
    # of which gradient buffers: made in backward as gradients arrive, after the loss's peak
    working_set_grad_bytes: float = 0.0
    cpu_state_bytes: float = 0.0
    comm_bytes: dict = field(default_factory=dict)  # kind -> payload bytes per step, rank 0
    # why the model's terms do not describe this configuration (None: they do); the calibration
    # leaves it out, the planner and the report do not predict it
    unmodelled: str | None = None
    # DDP's bucket bytes where Dynamo's DDPOptimizer splits each compiled block's graph at them
    # (torch.ddp, option compile, ddp_optimizer on): the split graphs save more for backward
    split_bucket_bytes: float | None = None

    @property
    def impl(self) -> str:
        return f"{self.strategy}:{self.profile}" if self.profile else self.strategy

    @property
    def facts(self) -> PlanFacts:
        return facts(self.strategy)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp * self.seq_len

    @property
    def rows(self) -> float:
        """Sequences in one forward pass of one rank."""
        return self.micro_batch / (self.microbatches if self.pp > 1 else 1)

    @property
    def passes(self) -> int:
        """Forward+backward passes of one rank per optimizer step."""
        return self.grad_accum * (self.microbatches if self.pp > 1 else 1)

    @property
    def gemm_size(self) -> float:
        return self.rows * self.seq_len * self.d_model / self.tp / 1e6


@dataclass
class Prediction:
    step_s: float
    time_s: dict  # part -> seconds (after the implementation factor)
    tokens_per_s_per_gpu: float
    mfu: float | None
    peak_bytes: float | None
    memory_bytes: dict
    comm_bytes: dict
    bottleneck: str
    notes: list = field(default_factory=list)
    peak_phase: str | None = None  # "start of backward" or "optimizer step"


# --- step time ---------------------------------------------------------------------------------


def exposure_class(w: Workload, kind: str) -> str:
    if kind in ("send", "recv"):
        return "exp_p2p"
    if w.family == "model_parallel":
        return "exp_tp" if w.tp > 1 else "exp_dp"
    return "exp_shard" if w.family == "sharded" else "exp_dp"


def group_size(w: Workload, kind: str) -> int:
    if kind in ("send", "recv"):
        return 2
    if w.family == "model_parallel" and w.tp > 1:
        return w.tp
    return w.dp


def collective_fit(collectives: dict, kind: str, n: int) -> dict:
    """The alpha-beta fit for ``kind`` in a group of n: the measured group size nearest n from
    below (the smallest measured one for smaller groups), or the op's top-level fit where the
    calibration has no sizes."""
    c = collectives.get(BENCH_OP.get(kind, "all_reduce")) or collectives.get("all_reduce")
    sizes = sorted(int(k) for k in (c.get("by_group") or {}))
    if not sizes:
        return c
    below = [s for s in sizes if s <= n]
    return c["by_group"][str(below[-1] if below else sizes[0])]


def unmeasured_group_notes(w: Workload, collectives: dict) -> list[str]:
    """A note per collective whose group size the calibration did not measure: it is priced with
    the nearest measured size below (NCCL's bus bandwidth grows with the group on one host)."""
    notes = []
    for kind, nbytes in w.comm_bytes.items():
        n = group_size(w, kind)
        c = collective_fit(collectives, kind, n)
        if nbytes > 0 and n > 1 and c.get("group_size", n) < n:
            notes.append(f"{kind} over {n} ranks priced with the {c['group_size']}-rank fit: no measurement of {n}")
    return notes


def collective_s(collectives: dict, kind: str, nbytes: float, n: int, calls: float, queued: bool = False) -> float:
    """alpha-beta time of ``calls`` collectives moving ``nbytes`` payload in a group of n. ``queued``:
    the calls are issued back to back (a bucket loop with nothing between), so every call after the
    first costs a queued call's alpha and bandwidth (the collectives suite's bursts), where measured."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    c = collective_fit(collectives, kind, n)
    if queued and calls > 1 and "alpha_queued_s" in c:
        first = nbytes / calls
        return (
            c["alpha_s"]
            + first * bus_factor(kind, n) / c["busbw_Bps"]
            + (calls - 1) * c["alpha_queued_s"]
            + (nbytes - first) * bus_factor(kind, n) / c["busbw_queued_Bps"]
        )
    return calls * c["alpha_s"] + nbytes * bus_factor(kind, n) / c["busbw_Bps"]


# Sharded trainers that issue one collective per unit (each block, and the root: embeddings, final
# norm, head) and pass, whatever its size: reference_impls/fsdp.py's ``_gather`` and ``_grad_ready``,
# FSDP2's ``foreach_all_gather`` and ``foreach_reduce`` per ``fully_shard`` module; HSDP adds one
# all-reduce across replicas per unit. (Their rows: ``PlanFacts.per_unit_launches``.)


def comm_calls(w: Workload, kind: str, nbytes: float) -> float:
    """Collective launches per step: per layer and pass for tensor parallelism and pipelines, per
    unit and pass for the per-unit sharded trainers (all-gathers in forward and again in backward),
    25 MiB buckets for the other gradient traffic (the default of DDP and the references)."""
    if kind in ("send", "recv"):
        return 2 * w.passes
    if w.family == "model_parallel" and w.tp > 1:
        return 4 * w.n_layers / w.pp * w.passes
    if uses_fp16_optimizer(w) and kind == "all_reduce":  # buffered_allreduce_fallback's 16-bit buckets
        return max(1.0, math.ceil(nbytes / 2 / DEEPSPEED_REDUCE_BUCKET_ELEMS))
    if w.facts.per_unit_launches and kind in ("all_gather", "reduce_scatter", "all_reduce"):
        return (2 if kind == "all_gather" else 1) * (w.n_layers + 1) * w.passes
    if w.family == "sharded":
        return max(1.0, nbytes / (25 << 20), w.n_layers)
    return max(1.0, nbytes / (25 << 20))


def bubble_ratio(w: Workload) -> float:
    """Pipeline idle time over the rank's compute time with equal stages (the papers' theory; the
    model stretches by ``pipeline_factor``, which equals 1 + this for equal stage costs). GPipe and 1F1B: (p-1)/m, i.e. a bubble
    (p-1)/(m+p-1) of the step; interleaved 1F1B divides it by the v chunks per rank (Narayanan et
    al. 2021, Sec. 2.2). ZB-H1 (Qi et al. 2024): (p-1) max(T_F, T_B, T_F+T_B-T_W) against
    m (T_F+T_B+T_W) of compute, from reference_impls.pipeline_zb's own formula; (p-1)/(3m) at the
    paper's equal times."""
    if w.pp <= 1:
        return 0.0
    if w.schedule == "zb_h1":
        from reference_impls.pipeline_zb import bubble_fraction_theory

        frac = bubble_fraction_theory(w.pp, w.microbatches, *(w.zb_times or (1.0, 1.0, 1.0)))
        return frac / (1 - frac)
    return (w.pp - 1) / (w.virtual_stages * w.microbatches)


# The loss's memory-bound work (fp32 cast, log-softmax, NLL and their gradients) splits about evenly
# between forward and backward: gpt-1.3b pp 4 on CUDA events (results/pp-timeline-gpu/20261126-231828,
# ref.pp_1f1b m 8) spent 1.65 ms (forward) and 1.8 ms (backward) per micro-batch on the last stage
# beyond the others, less the head matmul's 2dV and 4dV FLOPs per token.
LOGIT_FORWARD_SHARE = 0.5


def _chunk_layers(w: Workload) -> list[int]:
    """Blocks per virtual stage (global chunk order): parabench's split (reference_impls.pipeline
    partition_layers over p stages, the option stage_layers where given, or over p*v chunks for
    interleaved 1F1B, chunk c on rank c mod p)."""
    from reference_impls.pipeline import partition_layers

    interleaved = any(chunk > 0 for _, chunk, _ in _stage_orders(w)[0])
    n = w.pp * (w.virtual_stages if interleaved else 1)
    return [hi - lo for lo, hi in partition_layers(w.n_layers, n, None if interleaved else w.stage_layers)]


def pipeline_op_costs(w: Workload, consts: dict) -> list[tuple[float, float, float]]:
    """Seconds of one micro-batch's F, B and W on each virtual stage (global chunk order), from the
    same amounts and constants as the step's terms: per block its matmul FLOPs (with recomputation),
    elementwise traffic and host launches; the first chunk also the embedding's dense V x d gradient
    (written, then added into .grad: 4 accesses); the last the head matmul (6dV FLOPs per token) and
    the loss's logit work (``logit_s`` per logit element). Backward is the rest of each part (about
    twice the forward for matmuls); ZB-H1 splits it into B and W by the measured (or the paper's
    equal) T_B : T_W. W is 0 for the other schedules."""
    c = time_constants(consts)
    has_w = any(kind == "W" for kind, _, _ in _stage_orders(w)[0])
    layers = _chunk_layers(w)
    tokens = w.rows * w.seq_len
    tdiv = w.tp if w.family == "model_parallel" else 1
    head_flops = 6 * w.d_model * w.vocab_size
    recompute = 4 / 3 if w.checkpointing else 1.0
    attn_flops, attn_s = attention_per_block(w, c)
    block_flops = (w.hw_flops_per_token - head_flops) / w.n_layers * tokens / w.tp - attn_flops
    sp_div = w.tp if (w.sp or w.facts.sequence_parallel) else 1
    tp_share = 1 / sp_div if sp_div > 1 else activation_layer_bytes(w) / (34 * w.seq_len * w.rows * w.d_model)
    per_block = (
        c["inv_rate"] * block_flops
        + c["attn_s"] * attn_s
        + c["inv_rate_x"] * block_flops / w.gemm_size
        + c[act_column(w)] * tokens * w.d_model * tp_share * recompute * ACT_BYTES.get(w.recipe, 2)
        + c["host_s"]
    )
    fwd_share = 1 / (3 + (1 if w.checkpointing else 0))  # recomputation runs in backward
    head = (c["inv_rate"] + c["inv_rate_x"] / w.gemm_size) * head_flops * tokens / tdiv
    logits = c["logit_s"] * tokens * w.vocab_size / tdiv
    embed_grad = c["inv_mem_bw"] * 4 * (4 if w.recipe == "amp" else 2) * w.vocab_size * w.d_model / tdiv
    if has_w:
        t_f, t_b, t_w = w.zb_times or (1.0, 1.0, 1.0)
        b_share = t_b / (t_b + t_w)
    else:
        b_share = 1.0
    out = []
    for chunk, n in enumerate(layers):
        fwd = n * per_block * fwd_share
        bwd = n * per_block * (1 - fwd_share)
        if chunk == 0:
            bwd += embed_grad
        if chunk == len(layers) - 1:
            fwd += head / 3 + logits * LOGIT_FORWARD_SHARE
            bwd += 2 * head / 3 + logits * (1 - LOGIT_FORWARD_SHARE)
        out.append((fwd, bwd * b_share, bwd * (1 - b_share)))
    return out


def balanced_stage_layers(w: Workload, consts: dict) -> list[int] | None:
    """Blocks per stage (``w.pp`` stages, one per rank) that minimise the largest stage's F+B+W
    seconds per micro-batch under ``pipeline_op_costs``. Those costs are linear in the block
    counts, so the pieces are read off it at the equal split and at one block moved from the first
    stage to the second: the block's cost, the first stage's extra (embedding gradient) and the
    last's (head and loss). Then each stage gets one block and the rest go one at a time to the
    stage whose cost grows to the least: exact for a min-max of equal increments (the largest of the
    n smallest costs reachable), ties to the earlier stage, so equal extras give partition_layers'
    equal split. None without a pipeline or with no block to move."""
    if w.pp <= 1 or w.n_layers <= w.pp:
        return None
    equal = _chunk_layers(replace(w, stage_layers=None, virtual_stages=1))
    moved = [equal[0] - 1, equal[1] + 1, *equal[2:]]

    def stage_costs(split):
        return [sum(op) for op in pipeline_op_costs(replace(w, stage_layers=tuple(split), virtual_stages=1), consts)]

    at_equal, at_moved = stage_costs(equal), stage_costs(moved)
    block = at_equal[0] - at_moved[0]
    if block <= 0:
        return None
    extra = [c - n * block for c, n in zip(at_equal, equal)]
    split = [1] * w.pp
    for _ in range(w.n_layers - w.pp):
        # in whole blocks, rounded, so the subtraction's float noise cannot break a tie
        grown = [round((n + 1) + e / block, 9) for n, e in zip(split, extra)]
        split[grown.index(min(grown))] += 1
    return split


_ORDER_CACHE: dict = {}
_FACTOR_CACHE: dict = {}


def _stage_orders(w: Workload) -> tuple:
    """Each stage's ``(kind, global chunk, micro-batch)`` order (pipeline_order, chunk made global)."""
    key = (w.schedule, w.pp, w.microbatches, w.virtual_stages)
    if key not in _ORDER_CACHE:
        _ORDER_CACHE[key] = tuple(
            tuple((kind, s + chunk * w.pp, mb) for kind, chunk, mb in pipeline_order(w, s)) for s in range(w.pp)
        )
    return _ORDER_CACHE[key]


def schedule_factor(orders, costs, floors=None) -> float:
    """Makespan of ``orders`` (each stage's (kind, global chunk, micro-batch) ops) with each op
    lasting ``costs[chunk][F/B/W]`` and free messages (parabench.pipeline_sim), over the mean
    stage's busy time: the step's stretch over the average rank's work. Equal stages give
    1 + (p-1)/m (GPipe, 1F1B), 1 + (p-1)/(vm) (interleaved), ZB-H1's theory. ``floors[chunk]``:
    the least an op of that chunk lasts in the makespan (its host time); the busy time stays the
    device's, so the step's excess over it is charged as stretch."""
    from parabench.pipeline_sim import Op, simulate

    index = {"F": 0, "B": 1, "W": 2}

    def lasting(chunk, kind):
        cost = costs[chunk][index[kind]]
        return max(cost, floors[chunk]) if floors and cost > 0 else cost

    # each stage's device time (pipeline_sim's busy_s without the floors), summed: no second replay
    busy = [sum(costs[c][index[k]] for k, c, _ in order) for order in orders]
    res = simulate([[Op(k, mb, c, lasting(c, k)) for k, c, mb in order] for order in orders])
    mean_busy = sum(busy) / len(busy)
    return res["step_s"] / mean_busy if mean_busy > 0 else 1.0


def pipeline_factor(w: Workload, consts: dict | None = None) -> float:
    """Step over the average stage's busy time for ``w``'s schedule on its unequal stages
    (``pipeline_op_costs`` under ``consts``; the defaults without: matmul FLOPs and the head only).
    1 without a pipeline. Cached on the schedule and the cost ratios (3 significant digits)."""
    if w.pp <= 1:
        return 1.0
    costs = pipeline_op_costs(w, consts or {})
    floors = pipeline_host_floors(w, consts or {})
    top = max(max(c) for c in costs) or 1.0
    rounded = tuple(tuple(float(f"{x / top:.3g}") for x in c) for c in costs)
    floors_r = tuple(float(f"{x / top:.3g}") for x in floors) if any(floors) else None
    key = (w.schedule, w.pp, w.microbatches, w.virtual_stages, rounded, floors_r)
    if key not in _FACTOR_CACHE:
        _FACTOR_CACHE[key] = schedule_factor(_stage_orders(w), rounded, floors_r)
    return _FACTOR_CACHE[key]


def pipeline_host_floors(w: Workload, consts: dict) -> list[float]:
    """Per virtual stage (global chunk order), the host seconds one of its actions takes: Python
    module calls and kernel launches of each block, the blocking p2p of the action
    (``pp_host_block_s`` per block). The device runs an action no faster than its host issues it,
    which shows where one action's device work is short (few rows, few blocks per chunk)."""
    per_block = (consts or {}).get("pp_host_block_s", 0.0)
    return [per_block * n for n in _chunk_layers(w)]


def host_floor_binds(w: Workload, consts: dict) -> bool:
    """Whether some pipeline action of ``w`` lasts its host floor rather than its device work."""
    if w.pp <= 1:
        return False
    floors = pipeline_host_floors(w, consts)
    return any(0 < cost < floor for costs, floor in zip(pipeline_op_costs(w, consts), floors) for cost in costs)


# Trainers whose layout holds the whole gradient, in the parameters' dtype, beside the sharded fp32
# gradient the optimizer steps on (reference_impls/zero1.py: backward fills it, the reduce-scatter
# reads it); ZeRO-2 streams the same bytes through buckets instead. Backward writes it and the
# reduction reads it in both; the optimizer step touches neither (measured: ref.zero1 and ref.zero2
# within 0.4 % in all 9 configurations run side by side, docs/planner.md).
# (Their rows: ``PlanFacts.whole_grad_beside_shard``.)


def optimizer_step_state_bytes(w: Workload) -> float:
    """The model-state bytes the optimizer step and its casts read and write: the rank's state less
    a whole gradient held only for the reduction (``PlanFacts.whole_grad_beside_shard``)."""
    state = w.state_bytes or 0.0
    if w.facts.whole_grad_beside_shard and w.state_parts:
        state -= w.state_parts["params"]
    return state


def attention_per_block(w: Workload, consts: dict | None) -> tuple[float, float]:
    """(attention FLOPs, attention seconds) of one block of one rank in one micro-batch pass where
    the calibration holds attention's own rate (``consts['attention']``, parabench.plan.attention),
    else (0, 0): its FLOPs then stay priced at the matmul rate. The FLOPs are the convention's (12 s d
    per token, 4 s d more recomputed) over the pass's tokens and the rank's heads; the seconds are
    one causal call of those heads, a third more with recomputation (its forward runs again)."""
    table = (consts or {}).get("attention")
    if not table:
        return 0.0, 0.0
    recompute = 4 / 3 if w.checkpointing else 1.0
    flops = w.rows * w.seq_len * 12 * w.seq_len * w.d_model / w.tp * recompute
    call = attention.flops_s(table, w.rows, w.n_heads / w.tp, w.seq_len, w.d_model // w.n_heads)
    return flops, call * recompute


def time_features(w: Workload, collectives: dict, consts: dict | None = None) -> dict:
    """The amounts each fitted constant multiplies: step_s = sum(constant * feature).

    With a pipeline, every per-micro-batch amount (matmul FLOPs, elementwise traffic, logit work,
    launches) is the average stage's, stretched by ``pipeline_factor``: the step is the schedule's
    critical path over unequal stages, which ``consts`` (the calibration's own constants) cost."""
    flops = w.tokens_per_step * w.hw_flops_per_token / w.world_size
    stretch = pipeline_factor(w, consts)
    params_rank = w.params / (w.tp * w.pp)
    mem_bytes = 2 * optimizer_step_state_bytes(w)
    if w.recipe in AUTOCAST_RECIPES:
        fp8_params = block_linear_params(w) if w.recipe == "fp8" else 0.0
        mem_bytes += (AMP_CAST_BYTES * (params_rank - fp8_params) + FP8_WEIGHT_BYTES * fp8_params) * w.passes
    sp_div = w.tp if (w.sp or w.facts.sequence_parallel) else 1
    recompute = 4 / 3 if w.checkpointing else 1.0  # forward runs twice: (2 + 2) / (1 + 2)
    # Tensor parallelism splits the elementwise work inside its regions (attention, GELU) over the t
    # ranks and replicates the rest (LayerNorms, dropouts, residuals); sequence parallelism splits that
    # too: per layer the share of Korthikanti's activations, (10 + 24/t)/34 or 1/t
    tp_share = 1 / sp_div if sp_div > 1 else activation_layer_bytes(w) / (34 * w.seq_len * w.rows * w.d_model)
    act_elems = w.rows * w.seq_len * w.d_model * tp_share * w.n_layers / w.pp * w.passes * recompute
    f = dict.fromkeys(TIME_CONSTANTS, 0.0)
    fp8_share, cast_elems = fp8_flops_share(w), fp8_cast_elems(w)
    blocks = w.n_layers / w.pp * w.passes
    attn_flops, attn_s = (x * blocks for x in attention_per_block(w, consts))
    f["inv_rate"] = (flops * (1 - fp8_share) - attn_flops) * stretch
    f["inv_rate_fp8"] = flops * fp8_share * stretch
    f["fp8_cast_s"] = cast_elems * stretch
    f["inv_rate_x"] = (flops - attn_flops) * stretch / w.gemm_size
    f["attn_s"] = attn_s * stretch
    f["inv_mem_bw"] = mem_bytes
    act_col = act_column(w)
    f[act_col] = act_elems * ACT_BYTES.get(w.recipe, 2) * stretch
    # the last stage's loss, shared out over the p stages and stretched like the rest
    f["logit_s"] = w.rows * w.seq_len * w.vocab_size / (w.tp if w.family == "model_parallel" else 1) * w.passes
    f["logit_s"] *= stretch / w.pp
    f["host_s"] = w.n_layers / w.pp * w.passes * stretch
    f["ds_stage0_tensor_s"] = ds_stage0_tensors(w)
    f["inv_host_bw"] = 2 * w.cpu_state_bytes if w.offload else 0.0
    f["inv_mem_bw"] += device_copy_bytes(w)
    c = time_constants(consts)
    # the compute a collective issued during the passes can hide behind: the rank's matmuls,
    # elementwise work and the implementation's device copies (casts into gather buffers, gradient
    # concatenation: kernels on the compute stream beside the collective) of one pass (a pipeline's
    # stretch excluded: its gradient traffic runs after the schedule, or beside the last
    # micro-batch's backward only)
    pass_work = (
        c["inv_rate"] * (flops * (1 - fp8_share) - attn_flops)
        + c["attn_s"] * attn_s
        + c["inv_rate_fp8"] * flops * fp8_share
        + c["fp8_cast_s"] * cast_elems
        + c[act_col] * act_elems * ACT_BYTES.get(w.recipe, 2)
    )
    pass_s = (pass_work + c["inv_mem_bw"] * device_copy_bytes(w)) / max(1, w.passes)
    for kind, nbytes in w.comm_bytes.items():
        n = group_size(w, kind)
        if n <= 1:  # an out-of-place collective of one rank is a device copy (read and write every byte)
            f["inv_mem_bw"] += 2 * nbytes if kind in OUT_OF_PLACE else 0.0
            continue
        calls = comm_calls(w, kind, nbytes)
        overlap = comm_overlap(w, kind, nbytes)
        if overlap is None:
            cls = exposure_class(w, kind)
            # DeepSpeed's stage 0-2 engine: its measured steps show no serial all-gather (gpt-1.3b
            # mb4: 162.9 / 162.3 / 160.5 ms at 1 / 2 / 4 GPUs), so its traffic costs a share of its
            # own, fitted, not the per-unit sharders' (their hidden gathers slow compute otherwise)
            deepspeed_shard = w.facts.own_exposure and cls == "exp_shard" and not uses_fp16_optimizer(w)
            if deepspeed_shard:
                f["exp_deepspeed"] += collective_s(collectives, kind, nbytes, n, calls)
            elif cls in ("exp_dp", "exp_shard"):
                # issued where nothing runs beside it, bucket after bucket
                f["comm_serial"] += collective_s(collectives, kind, nbytes, n, calls, queued=True)
            else:
                f[cls] += collective_s(collectives, kind, nbytes, n, calls)
            continue
        t = collective_s(collectives, kind, nbytes, n, calls)
        hide_share, units, last_bytes, comm_passes = overlap
        tail = overlap_tail_s(t, hide_share * pass_s * comm_passes, units, last_bytes / nbytes)
        f["comm_serial"] += tail
        f[exposure_class(w, kind)] += t - tail
    return f


# Gradient buckets of the references (reference_impls/dp_common.plan_buckets, ``bucket_mb`` 25) and
# torch DDP (``bucket_cap_mb`` 25), and DeepSpeed ZeRO-1/2's reduce bucket (``reduce_bucket_size``
# 5e8 elements, its default; the tuned profile writes none); the stage-0 engine's all-reduce buckets
# (``buffered_allreduce_fallback``, MEMORY_OPT_ALLREDUCE_SIZE) hold as many.
BUCKET_BYTES = 25 * 2**20
DEEPSPEED_REDUCE_BUCKET_ELEMS = 5e8
# Which share of a pass's compute a collective issued during it can hide behind: gradient traffic
# is launched from backward hooks (backward: 2 of 3 matmul passes), ZeRO-3 / FSDP gathers run one
# unit ahead in forward and backward (the whole pass).
BACKWARD_SHARE = 2 / 3


def comm_overlap(w: Workload, kind: str, nbytes: float) -> tuple | None:
    """How the code overlaps ``kind``: None where it is issued with nothing to hide behind, else
    (share of a pass's compute it runs beside, collectives it is issued as per communicating pass,
    bytes of the last of them, passes that communicate). Read off each implementation:

    - ref.ddp / torch.ddp: all-reduce per 25 MiB bucket from backward hooks, the last micro-batch
      only (no_sync); the last bucket holds the token embedding (V x d), whose gradient is made last.
    - ref.zero1 / zero2: reduce-scatter per bucket from backward hooks (zero1 on the last
      micro-batch, zero2 on every one); the all-gather of the updated shards follows the update:
      serial.
    - ref.zero3 / ref.fsdp / torch.fsdp2 / deepspeed.zero3 (and HSDP's): one all-gather per unit
      (block) in forward and again in backward, prefetched one unit ahead; one reduce-scatter (HSDP:
      and one all-reduce across replicas) per unit from backward; every micro-batch.
    - deepspeed.zero1 / zero2 tuned (overlap_comm on): reduce per 5e8-element bucket beside
      backward; matched (DeepSpeed's default overlap_comm off at stages 0-2), zero0, ref.ps: serial.
    - torch.pp_gpipe / 1f1b / interleaved from version 3 (``ddp_stages``): each of the rank's stage
      modules is DDP-wrapped and all-reduces in DDP's rebuilt buckets (the first closes at 1 MiB,
      the rest at 25 MiB) during the last micro-batch's backward only: the compute it hides behind
      is one micro-batch's backward of the rank's stage(s); rank 0's last bucket holds the token
      embedding. Earlier versions, torch.pp_zb and the other pipelines' data parallelism: serial."""
    f = w.facts
    elem = 2 if w.recipe != "amp" else 4  # the gradient / gathered dtype on the wire
    embed = w.vocab_size * w.d_model / (w.tp if w.family == "model_parallel" else 1) * elem
    if kind == "all_reduce" and w.tp == 1 and not w.offload and ddp_stages(w):
        # DDP's rebuilt first bucket, as the theory counts it (the planner's torch.ddp keeps its
        # calibrated 25 MiB pieces); imported here to keep torch out of the planner's import
        from parabench.families.model_parallel import DDP_FIRST_BUCKET_BYTES

        chunks = w.virtual_stages  # one DDP, so one 1 MiB first bucket, per stage module of the rank
        units = chunks + max(0.0, nbytes - chunks * DDP_FIRST_BUCKET_BYTES) / BUCKET_BYTES
        return BACKWARD_SHARE, units, max(BUCKET_BYTES, embed), 1
    if w.family == "model_parallel" or kind in ("send", "recv") or w.offload:
        return None
    grad_passes = 1 if f.grad_sync_once_per_step else w.passes
    per_pass = nbytes / grad_passes
    if f.grad_sync == "all_reduce" and kind == "all_reduce":
        return BACKWARD_SHARE, max(1.0, per_pass / BUCKET_BYTES), max(BUCKET_BYTES, embed), grad_passes
    if f.grad_sync == "reduce_scatter" and kind == "reduce_scatter":
        return BACKWARD_SHARE, max(1.0, per_pass / BUCKET_BYTES), max(BUCKET_BYTES, embed), grad_passes
    if f.grad_sync == "per_unit":
        units = w.n_layers + 1  # blocks and the root (embeddings, final norm, head)
        if kind == "all_gather":  # forward and backward each gather every unit
            per_pass = nbytes / w.passes
            return 1.0, 2 * units, per_pass / (2 * units), w.passes
        if kind in ("reduce_scatter", "all_reduce"):  # HSDP: each unit's shard all-reduced across replicas
            per_pass = nbytes / w.passes
            return BACKWARD_SHARE, units, max(per_pass / units, embed), w.passes
    return None


def overlap_tail_s(comm_s: float, hide_s: float, units: float, last_share: float) -> float:
    """Seconds of a collective issued in ``units`` equal pieces as the compute it overlaps
    (``hide_s``) produces them, that end after that compute: each piece starts when it is ready and
    the previous one is done, so the end is max(hide_s + the last piece, the first piece's ready
    time + all the communication). The last piece is ``last_share`` of the traffic (the embedding's
    bucket), at least 1/units."""
    if comm_s <= 0:
        return 0.0
    units = max(1.0, units)
    last = comm_s * min(1.0, max(last_share, 1 / units))
    return max(last, comm_s - hide_s * (1 - 1 / units))


# Collectives whose output is not their input: at one rank NCCL copies the input to the output
# (step_breakdown memcpy at 1 GPU, results/h100x4/20261126-203946, gpt-1.3b mb4: 2.9 ms for ref.zero1/2/3,
# one 2 B x params reduce-scatter; 0.5 ms for ref.ddp and torch.ddp, whose all-reduce is in place). The
# references' and FSDP2's all-gathers are in place (the local shard is a slot of the output).
OUT_OF_PLACE = ("reduce_scatter",)


def block_params(w: Workload) -> float:
    """Parameters of one GPT block (parabench.models): q, k, v, proj, fc (4d), fc2 (4d) weights and
    biases, two LayerNorms: 12 d^2 + 13 d."""
    return 12 * w.d_model**2 + 13 * w.d_model


def device_copy_bytes(w: Workload) -> float:
    """HBM bytes an implementation moves per step beyond single-process training, read off its code
    (every master-recipe trainer casts its fp32 master into the 16-bit parameters and its 16-bit
    gradients into fp32 once per step, 6 B per parameter of its shard each: not counted here).

    - torch.ddp: the reducer divides every gradient bucket by the world size (``bucket_view.div_``,
      also at one rank): read and write every gradient byte.
    - ref.ddp: ``flat_grad.zero_()`` after every update: write every gradient byte.
    - ref.zero3 / ref.fsdp: before each all-gather the fp32 shard is cast into the gathered buffer's
      slot (``u.slot.copy_(u.master)``): 4 + b bytes per gathered shard element; the first gather's
      cast is the master cast above.
    - torch.fsdp2 (FSDP2's ``foreach_all_gather`` / ``foreach_all_gather_copy_out`` /
      ``foreach_reduce``): per all-gather the shard copied (cast) into the gather buffer (4 + b per
      shard element), the gathered buffer split into the unsharded parameters (2b per element);
      per reduce the gradients concatenated into the reduce-scatter input in the reduce dtype
      (b + r per parameter; with a 16-bit reduce the fp32 shard gradient cast after it); at one rank
      the reduce-scatter's copy (2r per parameter, the theory counts no traffic there).
    b: bytes of a gathered (compute) parameter, r: of a reduced gradient."""
    parts = w.state_parts or {}
    n = max(1, w.dp)
    psi = w.params / (w.tp * w.pp)
    master = w.recipe == "master"
    copies = w.facts.device_copies
    if copies == "bucket_div":
        return 2 * parts.get("grads", 0.0)  # once per step: no_sync during accumulation
    if copies == "flat_grad_zero":
        return min(parts.get("grads", 0.0), parts.get("params", 0.0))
    if uses_fp16_optimizer(w):
        # per step (FP16_Optimizer.step, engine.allreduce_bucket): the overflow check's amax and amin
        # (2 + 2), the gradients cast to fp32 (2 + 4) and flattened (4 + 4), the norm (4), the unscale
        # (4 + 4); the all-reduce's flatten, averaging and copy back in bf16 (3 x (2 + 2)); less the
        # gradient cast every master trainer makes (6)
        return (4 + 14 + 4 + 8 + 12 - 6) * psi
    b = 2 if master else 4
    master_cast = 6 * psi / n if master else 0.0
    if copies == "slot_cast":
        gathered = w.comm_bytes.get("all_gather", 0.0) / 2  # gathered in the compute dtype (bf16)
        b = 2
        return max(0.0, (4 + b) * gathered / n - master_cast)
    if copies == "fsdp2":
        ag, rs = w.comm_bytes.get("all_gather"), w.comm_bytes.get("reduce_scatter")
        # without traffic in the theory (one rank): every block gathered for forward and again for
        # backward, but in ``tuned`` the last (torchtitan's policy); fp32 reduction unless ``matched``
        per_pass = 2 * w.params - (block_params(w) if w.profile == "tuned" else 0.0)
        gathered = ag / b if ag else per_pass * w.passes
        reduces = w.passes
        r = rs / (w.params * reduces) if rs else (2 if master and w.profile == "matched" else 4)
        copy_in = (4 + b) * gathered / n - master_cast
        copy_out = 2 * b * gathered
        reduce_in = (b + r) * w.params * reduces + ((r + 4) * w.params / n if r < 4 else 0.0) - master_cast
        one_rank = 2 * r * w.params * reduces if n == 1 else 0.0
        return max(0.0, copy_in) + copy_out + max(0.0, reduce_in) + one_rank
    if copies == "torch_pipeline" and w.pp > 1:
        # torch.distributed.pipelining, after the schedule: scale_grads divides every gradient of the
        # stage by the micro-batch count (``p.grad.div_``; the references divide the loss instead),
        # and step() on the last stage merges every micro-batch's output (torch.cat of the 16-bit
        # logits, read and written)
        logits = w.micro_batch * w.grad_accum * w.seq_len * w.vocab_size / (w.tp if w.family == "model_parallel" else 1)
        return 2 * parts.get("grads", 0.0) + 2 * TORCH_PP_OUTPUT_BYTES * logits
    return 0.0


# The terms paid once per micro-batch pass on a pipeline stage (stretched by pipeline_factor).
PER_MICROBATCH = (
    "inv_rate",
    "inv_rate_x",
    "inv_rate_fp8",
    "fp8_cast_s",
    "inv_act_bw",
    "inv_act_bw_compiled",
    "logit_s",
    "host_s",
    "attn_s",
)
TIME_PARTS = {
    "compute": ("inv_rate", "inv_rate_x", "inv_rate_fp8", "attn_s"),
    "memory": ("inv_mem_bw", "inv_act_bw", "inv_act_bw_compiled", "logit_s", "fp8_cast_s"),
    "host": ("host_s", "ds_stage0_tensor_s"),
    "offload": ("inv_host_bw",),
    "comm": ("exp_dp", "exp_shard", "exp_deepspeed", "exp_tp", "exp_p2p", "comm_serial"),
}


# --- memory --------------------------------------------------------------------------------------


# Which model states coexist at the peak. The allocator peaks in one of two phases:
# - backward: the start of backward (every forward activation and the logits alive, no gradient
#   produced yet). The memory breakdown meter puts every committed peak there (op
#   _log_softmax_backward; results/zero-memory-gpu/20261126-092640: ref.zero1/2 and deepspeed.zero1/2
#   at gpt-350m/1.3b/2.7b, "gradients" 4 bytes at the peak, parameters + optimizer = the states).
#   Only states that outlive a step are alive then: gradients are not, except in flat buffers kept
#   for the whole run.
# - step: the optimizer update, every state the theory counts (it is measured there), activations
#   freed. With small activations this phase wins: ref.zero3 and torch.fsdp2 at gpt-6.7b mb1
#   (same run) peak late in backward with 12.0 of 12.8 GiB of fp32 gradient shards alive.
# Gradients ramp up as activations are freed during backward, so the larger of the two ends bounds
# the interior.
def keeps_flat_grad_buffer(w: Workload) -> bool:
    """DeepSpeed ZeRO-3 without offload: its gradient partitions live in one flat buffer from start-up."""
    return w.facts.persistent_grads == "flat_partitions" and not w.offload


def persistent_grad_bytes(w: Workload) -> float:
    """Gradient bytes alive at the start of backward (kept from step to step). Everything else the
    theory counts as gradients is made during backward and released after the update: torch's
    ``zero_grad(set_to_none=True)`` (single, torch.tp/pp, fsdp2, the model-parallel references),
    the references' per-bucket buffers and fp32 main-gradient shards (reference_impls/zero.py:
    "released until the next step's first reduce-scatter", fsdp.py), DeepSpeed's reduce buckets
    (the meter: 4 bytes of gradients at the peak of deepspeed.zero1/2)."""
    parts = w.state_parts or {}
    grads, params = parts.get("grads", 0.0), parts.get("params", 0.0)
    kept = 0.0
    kept_form = w.facts.persistent_grads
    if kept_form == "flat":  # flat_grad (the size of flat_param) kept; the fp32 main gradient made at the update
        kept = min(grads, params)
    elif kept_form == "server":  # the server's flat_grad and receive buffer kept; the fp32 sum made at the update
        kept = min(grads, 2 * params)
    elif kept_form == "buckets":  # the reducer's buckets live as long as DDP (gradient_as_bucket_view)
        kept = grads
    elif keeps_flat_grad_buffer(w):
        # allocated once at start-up (runtime/zero/stage3.py): the gradient partitions' flat buffer,
        # in the gradient-accumulation dtype, which is the parameters' unless grad_accum_dtype is set
        # (grad_partitions_flat_buffer; engine.py get_data_types), and the contiguous-gradients
        # reduce bucket (ipg bucket buffer, reduce_bucket_size elements in the parameters' dtype)
        kept = grads + DS_REDUCE_BUCKET_ELEMENTS * (4 if w.precision == "fp32" else 2)
    return kept + (accumulated_grad_bytes(w) if w.grad_accum > 1 else 0.0)


def accumulated_grad_bytes(w: Workload) -> float:
    """Gradient bytes that gradient accumulation keeps alive through the backward of every
    micro-batch after the first, beyond those kept from step to step: what the earlier micro-batches
    accumulated into. The references' DDP and parameter server, and DeepSpeed ZeRO-3 (its flat
    gradient-partition buffer), accumulate into the buffer they keep anyway. ZeRO-1 (the reference)
    keeps its full gradient buckets, in the parameters' dtype, and reduces on the last micro-batch
    only (reference_impls/zero.py: its fp32 main gradient is made at the update); torch DDP keeps a
    second copy beside its buckets. The others accumulate into what the theory counts as gradients:
    the references' fp32 main-gradient shards (ZeRO-2/3, FSDP: reduce-scattered every micro-batch),
    FSDP2's and DeepSpeed's sharded gradients, the model-parallel trainers' ``p.grad``."""
    parts = w.state_parts or {}
    grads, params = parts.get("grads", 0.0), parts.get("params", 0.0)
    if w.facts.persistent_grads in ("flat", "server") or keeps_flat_grad_buffer(w):
        return 0.0
    if w.facts.accumulates_into_copy:
        # torch DDP: under no_sync the reducer's hooks do not run, so autograd accumulates into a
        # ``p.grad`` of its own beside the buckets (gradient_as_bucket_view makes it a view only when
        # the reducer copies in, on the last micro-batch): plan-check-accum-h100x4 measured 2.3 GiB of
        # the 2.6 GiB this adds
        return min(grads, params)
    return grads


# Trainers whose "master" recipe runs reference_impls.mixed_precision.MasterWeightOptimizer, which
# allocates an fp32 gradient copy of every parameter once (``_master_grads``) and keeps it: 4 bytes
# per local parameter beyond the theory's states (which count the fp32 master and moments only).
# (Their rows: ``PlanFacts.master_grad_buffer``.)


def master_grad_buffer_bytes(w: Workload) -> float:
    if w.recipe != "master" or not w.facts.master_grad_buffer or not w.state_parts:
        return 0.0
    return 2.0 * w.state_parts.get("params", 0.0)  # fp32 copy of the 16-bit parameters


# DeepSpeed ZeRO-1/2 without offload (runtime/zero/stage_1_and_2.py, ``step``): the rank's 16-bit
# gradient partition is flattened into a new buffer and cast to an fp32 copy for the optimizer, while
# the 16-bit parameters, the fp32 master partition, the Adam moments and the partition's gradients
# are alive. Measured (docs/results.md, "2026-11-28, evening"): 12 bytes per parameter at 2 ranks
# (gpt-6.7b, 76.9 GiB) and 22 at one rank (gpt-2.7b, 57.0 GiB); ZeRO-1/2 at gpt-13b on 2x H200 ran
# out of memory in that cast. (Their rows: ``PlanFacts.step_grad_copies``.)
# DeepSpeed's default reduce_bucket_size (runtime/zero/config.py, 0.19.8), which sizes ZeRO-3's
# contiguous-gradients bucket (``persistent_grad_bytes``); parabench's DeepSpeed peers keep the default.
DS_REDUCE_BUCKET_ELEMENTS = 500_000_000


def step_copy_bytes(w: Workload) -> float:
    """Bytes alive in the optimizer step beyond the states the theory counts: DeepSpeed ZeRO-1/2's
    16-bit gradient partition, its flattened copy and its fp32 copy (2 + 2 + 4 bytes per local
    parameter) beside the parameters and optimizer states; where the theory's gradients (ZeRO-1's
    full 16-bit gradients on many ranks) outweigh those, nothing."""
    parts = w.state_parts
    if not w.facts.step_grad_copies or w.offload or w.precision not in ("bf16", "fp16") or not parts:
        return 0.0
    partition_16bit = parts.get("params", 0.0) / max(1, w.dp)
    at_cast = parts.get("params", 0.0) + parts.get("optimizer", 0.0) + 4 * partition_16bit
    return max(0.0, at_cast - sum(parts.values()))


def states_at(w: Workload, phase: str) -> float:
    """Model-state bytes alive in ``phase`` ("backward" or "step"), the persistent fp32 gradient
    buffer of the master-weight optimizer included, and in the step the copies the step makes
    (``step_copy_bytes``)."""
    parts = w.state_parts
    if not parts:
        return w.state_bytes or 0.0
    buf = master_grad_buffer_bytes(w)
    if phase == "step":
        return sum(parts.values()) + buf + step_copy_bytes(w)
    return parts.get("params", 0.0) + parts.get("optimizer", 0.0) + persistent_grad_bytes(w) + buf


def is_ref_sharded(w: Workload) -> bool:
    """The references' ZeRO-3, FSDP and HSDP (reference_impls/fsdp.py): one flat unit per block and a
    root unit of the rest (embeddings, final LayerNorm, head)."""
    return w.facts.sharded_units is not None


def ref_root_params(w: Workload) -> tuple[float, float]:
    """(root unit, the part of it whose gradients arrive first: head and final LayerNorm) in
    parameters; the head is untied in every parabench model (parabench.models)."""
    return w.params - w.n_layers * block_params(w), w.vocab_size * w.d_model + 2 * w.d_model


def _gathered_bytes_per_param(w: Workload) -> int:
    """Bytes per element of what the references gather and reduce-scatter: the parameters' dtype
    (fp32 under autocast's fp32 parameters)."""
    return 4 if w.recipe in AUTOCAST_RECIPES or w.precision == "fp32" else 2


def states_in(w: Workload, phase: str) -> float:
    """Model-state bytes alive in a peak ``phase`` of ``memory_features``. At the end of the
    references' ZeRO-3/FSDP backward ("end") every fp32 gradient shard is made but the root's: it is
    allocated when the root's first reduce-scatter lands, after the root's flat buffer is made (with
    gradient accumulation, in the step's first micro-batch: alive at the end of the last)."""
    if phase == "end":
        root, _ = ref_root_params(w)
        first_pass = w.grad_accum == 1
        root_shard = (w.state_parts or {}).get("grads", 0.0) * root / w.params if first_pass else 0.0
        return states_at(w, "step") - step_copy_bytes(w) - root_shard
    return states_at(w, "step" if phase == "step" else "backward")


def working_set_at(w: Workload, phase: str) -> float:
    """The theory's transient bytes (``working_set_bytes``: gathered units, gradient buffers) alive in
    ``phase``. The theory counts the most the references' ZeRO-3/FSDP hold at any point of backward,
    the root's gradients twice among them (autograd's own tensors and the flat buffer they are copied
    into, reference_impls/fsdp.py ``_grad_ready``); those coexist only at the end of backward, when the
    embeddings' gradients, the last, arrive. At the start of backward the root holds the head's and
    final LayerNorm's gradients only; at the end the units are freed (no gathered parameters, no
    activations) and ``in_flight`` blocks' buffers are still being reduce-scattered, one fewer than
    the theory's in-flight + 1. At the loss, before backward, no block is gathered (the last block's
    forward prefetches nothing), and the root is only where it is not resharded after forward
    (``reshard_root``: False for ref.fsdp and ref.hsdp, True for ref.zero3)."""
    if phase == "step":
        return 0.0
    if not is_ref_sharded(w):
        # the loss: gradient buffers are made after it
        return w.working_set_bytes - (w.working_set_grad_bytes if phase == "first" else 0.0)
    b = _gathered_bytes_per_param(w)
    root, head = ref_root_params(w)
    if phase == "first":
        return 0.0 if w.facts.sharded_units == "reshard_root" else b * root
    if phase == "end":
        return max(0.0, w.working_set_grad_bytes - b * block_params(w))
    return w.working_set_bytes - b * (2 * root - head)


def activation_layer_bytes(w: Workload) -> float:
    """Korthikanti et al. Table 2 bytes per layer per micro-batch (16-bit, flash attention)."""
    sbh = w.seq_len * w.rows * w.d_model
    t = w.tp if w.family == "model_parallel" else 1
    if t == 1:
        return 34 * sbh
    return 34 * sbh / t if w.sp or w.facts.sequence_parallel else sbh * (10 + 24 / t)


# What a pipeline stage holds beyond Korthikanti's per-layer activations, read off the engines'
# code (reference_impls/pipeline*.py, parabench/peers/torch_pipeline.py) and the GPT block
# (parabench/models.py), in units of one layer's 34 sbh activation bytes or per logit element:
# - Each loss graph alive besides the one whose backward starts keeps cross-entropy's saved fp32
#   log-softmax output (4 B per logit element): GPipe's last stage holds m of them, interleaved's
#   with m == p too (every forward first). ZB-H1's head keeps its output and output gradient
#   (bf16 + bf16) from B until the deferred W: 4 B as well.
RETAINED_LOGIT_BYTES = 4.0
# - torch.distributed.pipelining's last stage keeps every micro-batch's output (the bf16 logits)
#   until step() merges them.
TORCH_PP_OUTPUT_BYTES = 2.0
# - ZB-H1 (reference_impls.pipeline_zb), per layer of a micro-batch: from B until its W the output
#   gradient dy of each parameter-owning module (ln1, q, k, v, attn proj, ln2, fc, mlp proj: 11 sbh
#   elements of 2 B = 22 sbh B); from F until W the recorded outputs nothing else saves (the two
#   projections' outputs, 4 sbh B).
ZB_DY = 22 / 34
ZB_OUTPUTS = 4 / 34
# - ref.pp_zb version 1 (its committed records; ``Workload.zb_keeps_done_graphs``) on every stage
#   but the last kept ``out`` (with its graph) in ``sends`` until the step ended, and B ran with
#   retain_graph: W frees only the linear nodes' saved inputs (ln1 and ln2
#   outputs, the attention projection's input copy, GELU's output: 14 sbh B), so 20 of 34 sbh B per
#   layer (ln1 and ln2 inputs, q, k, v, the attention output, GELU's input) stay until the step
#   ends, for every micro-batch done.
ZB_RETAINED = 20 / 34


def pipeline_order(w: Workload, stage: int) -> list[tuple[str, int, int]]:
    """``(kind, local chunk, micro-batch)`` in the order the engine runs them on ``stage``: the
    reference engines' own schedule functions (torch.pipelining runs the same orders)."""
    from reference_impls import pipeline as P

    p, m, v = w.pp, w.microbatches, w.virtual_stages
    if w.schedule == "zb_h1" and m >= p:
        from reference_impls.pipeline_zb import zb_h1_order

        return [(k, 0, i) for k, i in zb_h1_order(stage, p, m)]
    if v > 1:
        from reference_impls.pipeline_interleaved import interleaved_order

        try:
            return list(interleaved_order(stage, p, v, m))
        except ValueError:  # m not a multiple of p: the engine refuses it; count as 1F1B
            pass
    order = P.gpipe_order(stage, p, m) if w.schedule == "gpipe" else P.one_f_one_b_order(stage, p, m)
    return [(k, 0, i) for k, i in order]


def pipeline_stage_peaks(w: Workload) -> list[tuple[float, float, float]]:
    """Per pipeline stage, at its peak: (activation bytes before the fitted multiplier, logit
    elements of the backward that starts (x the fitted bytes per element), fixed bytes of the
    other retained logits). The peak is the largest total after a forward (backward is about to
    start) or, for ZB-H1, after a B (its output gradients made), walking the engine's order."""
    p, v = w.pp, w.virtual_stages
    sp_div = w.tp if (w.sp or w.facts.sequence_parallel) else 1
    if w.checkpointing:  # each block's input kept; one block's activations live during recompute
        layer_bytes, transient = 2 * w.seq_len * w.rows * w.d_model / sp_div, activation_layer_bytes(w)
    else:
        layer_bytes, transient = activation_layer_bytes(w), 0.0
    unit_bytes = layer_bytes * w.n_layers / (p * v)
    logit_elems = w.rows * w.seq_len * w.vocab_size / (w.tp if w.family == "model_parallel" else 1)
    zb = w.schedule == "zb_h1" and w.microbatches >= p
    ref_zb = zb and w.facts.pipeline_engine == "ref"
    torch_outputs = w.facts.pipeline_engine == "torch"
    out = []
    for stage in range(p):
        if w.stage_layers and v == 1:  # an uneven split: this stage's own blocks
            unit_bytes = layer_bytes * w.stage_layers[stage]
        last = stage == p - 1
        full: set = set()
        with_dy: set = set()
        done = outputs = 0
        best = (0.0, 0.0, 0.0)
        for kind, chunk, mb in pipeline_order(w, stage):
            u = (chunk, mb)
            if kind == "F":
                full.add(u)
                outputs += last and chunk == v - 1
            elif kind == "B":
                if zb:
                    with_dy.add(u)
                else:
                    full.discard(u)
            else:  # W
                full.discard(u)
                with_dy.discard(u)
                done += 1
            if kind == "W":
                continue
            act = unit_bytes * (len(full) * (1 + (ZB_OUTPUTS if ref_zb else 0.0)) + len(with_dy) * ZB_DY)
            if ref_zb and not last and w.zb_keeps_done_graphs:
                act += unit_bytes * ZB_RETAINED * done
            heads = sum(1 for c, _ in full if c == v - 1) if last else 0
            logit = logit_elems if heads else 0.0
            fixed = max(0, heads - 1) * RETAINED_LOGIT_BYTES * logit_elems
            if torch_outputs and last:
                fixed += outputs * TORCH_PP_OUTPUT_BYTES * logit_elems
            # the loss's backward is over before the recomputation of a block starts
            for cand in ((act, logit, fixed), (act + transient, 0.0, fixed)):
                if cand[0] + 12 * cand[1] + cand[2] > best[0] + 12 * best[1] + best[2]:
                    best = cand
        out.append(best)
    return out


# DDP's first bucket cap, which Dynamo's DDPOptimizer also gives the first of its buckets (the last
# ops of each compiled graph): torch.distributed._DEFAULT_FIRST_BUCKET_BYTES.
DDP_FIRST_BUCKET_BYTES = 1 << 20
# The linears that read each 16-bit-cast input of a block, and the input's width in units of d.
_CAST_READERS = {"ln1": (("q", "k", "v", "qkv"), 1), "ln2": (("fc",), 1), "attn": (("proj",), 1), "gelu": (("fc2",), 4)}
# fp8: what a cut block saves beyond the whole block's graph, bytes per token and unit of width, as the
# one H100 record measured it at gpt-1.3b's default cuts (3.75 GiB at mb 4); coarser cuts save less
# (results/fp8-peers-gpu: 9 and 6 at 100 and 400 MiB buckets). A CPU's float8 path saves other tensors.
SPLIT_SAVED_BYTES_FP8 = 10


def _block_ops(w: "Workload") -> list:
    """One block's forward as DDPOptimizer's scan meets it: (op, parameter elements), in order
    (parabench.models.Block; a linear's view and transpose go with it)."""
    d = w.d_model
    if w.layout == "fused":
        qkv = [("qkv", 3 * d * d + 3 * d)]
    else:  # separate q, k, v; k has no bias
        qkv = [("q", d * d + d), ("k", d * d), ("v", d * d + d)]
    return [
        ("ln1", 2 * d),
        *qkv,
        ("attn", 0),
        ("proj", d * d + d),
        ("add1", 0),
        ("ln2", 2 * d),
        ("fc", 4 * d * d + 4 * d),
        ("gelu", 0),
        ("fc2", 4 * d * d + d),
        ("add2", 0),
    ]


def ddp_split_graphs(w: "Workload", bucket_bytes: float) -> list:
    """The ops of each graph Dynamo's DDPOptimizer cuts one compiled block into, in forward order.

    Its scan (torch/_dynamo/backends/distributed.py): walk the graph backwards adding each linear's
    parameter bytes to the current bucket; once the bucket holds ``bucket_bytes`` (the first one
    ``DDP_FIRST_BUCKET_BYTES``), the next op starts a new one."""
    elem = 4 if w.recipe in AUTOCAST_RECIPES else 2  # autocast recipes keep fp32 parameters
    graphs, size = [[]], 0.0
    for op, params in reversed(_block_ops(w)):
        cap = min(DDP_FIRST_BUCKET_BYTES, bucket_bytes) if len(graphs) == 1 else bucket_bytes
        if graphs[0] and size >= cap:
            graphs.insert(0, [])
            size = 0.0
        graphs[0].insert(0, op)
        size += params * elem
    return graphs


def _blocks_cut(w: "Workload") -> bool:
    return bool(w.split_bucket_bytes) and len(ddp_split_graphs(w, w.split_bucket_bytes)) > 1


def split_unmodelled(w: "Workload") -> bool:
    """Whether DDPOptimizer cuts ``w``'s blocks where no measurement says what that saves."""
    return _blocks_cut(w) and (w.checkpointing or w.pp > 1 or w.recipe not in AUTOCAST_RECIPES)


def split_saved_bytes(w: "Workload") -> float:
    """What one compiled block cut by Dynamo's DDPOptimizer saves for backward beyond its whole graph, in
    bytes per token (torch.ddp, option compile, ``ddp_optimizer`` on).

    amp: each graph that reads an input through a 16-bit cast saves a cast of its own, where the whole
    block saves one (LayerNorm 1's output, read by q, k and v, is cast once per graph holding one of
    them); and the residual stream between the two halves of the block, once it leaves its graph, is
    saved in fp32 instead of being recomputed from the 16-bit attention output. Exact for the five cut
    structures of the CPU probe (results/ddp-optimizer-cpu) and the three of the H100 records
    (results/ddp-optimizer-h100x1, results/fp8-peers-gpu: 2, 4 and 4 bytes per token and width).
    fp8: ``SPLIT_SAVED_BYTES_FP8`` per token and width."""
    d = w.d_model
    if w.recipe == "fp8":
        return SPLIT_SAVED_BYTES_FP8 * d
    graph_of = {op: i for i, ops in enumerate(ddp_split_graphs(w, w.split_bucket_bytes)) for op in ops}
    extra = 2 * d if graph_of["add1"] != graph_of["add2"] else 0
    for readers, width in _CAST_READERS.values():
        graphs = {graph_of[r] for r in readers if r in graph_of}
        extra += (len(graphs) - 1) * 2 * width * d
    return extra


def split_graphs_bytes(w: "Workload") -> float:
    """What DDPOptimizer's cuts add to a rank's saved activations: ``split_saved_bytes`` per token and
    cut block."""
    if not _blocks_cut(w) or split_unmodelled(w):
        return 0.0
    return split_saved_bytes(w) * w.rows * w.seq_len * w.n_layers


def memory_features(w: Workload) -> dict:
    """Per peak phase, (bytes fixed by the physics, amounts per fitted memory constant). Phases:
    the start of backward with the states alive then (one per pipeline stage, each at its own
    peak: ``pipeline_stage_peaks``), and ``step``, the optimizer update with every state. The
    phase of the largest total is the peak."""
    vocab_div = w.tp if w.family == "model_parallel" else 1
    # Autocast's 16-bit copies of the weights, under amp: each linear saves its cast weight for
    # backward, so the copies outlive the fp32 parameters they came from, the sharded trainers' freed
    # gathered units included (torch.fsdp2 amp peaks, -3.5 to -6.5 % without them). Under fp8 the
    # float8 linears read the fp32 parameter (no autocast copy); the rest stays autocast's.
    amp = w.recipe in AUTOCAST_RECIPES
    cast_params = w.params / (w.tp * w.pp) - (block_linear_params(w) if w.recipe == "fp8" else 0.0)
    cast = 2 * cast_params if amp else 0.0
    act_key = act_constant(w)
    logit_key = "logit_bytes_amp" if amp else "logit_bytes_master"
    base = dict.fromkeys(MEMORY_CONSTANTS, 0.0)
    base["const_bytes"] = 1.0
    step = dict(base)
    base["cast"] = cast
    during = states_in(w, "backward") + working_set_at(w, "backward")
    # the references' ZeRO-3/FSDP at the end of backward: every state but the root's fp32 gradient
    # shard, the root's gradients twice, blocks still reduce-scattering; nothing gathered, no activation
    end = {"end": (states_in(w, "end") + working_set_at(w, "end"), step)} if is_ref_sharded(w) else {}
    if w.pp <= 1:
        per_layer = activation_layer_bytes(w)
        logits = w.rows * w.seq_len * w.vocab_size / vocab_div
        # The loss's backward (the logits' buffers) is over before the first gradient buffer is made
        # and before the last block is recomputed: those are alive in a later phase of their own.
        at_loss = states_in(w, "first") + working_set_at(w, "first")
        if not w.checkpointing:
            acts = {**base, act_key: per_layer * w.n_layers}
            split = split_graphs_bytes(w)
            return {
                "first": (at_loss + split, {**acts, logit_key: logits}),
                "backward": (during + split, acts),
                **end,
                "step": (states_at(w, "step"), step),
            }
        sp_div = w.tp if (w.sp or w.facts.sequence_parallel) else 1
        inputs = 2 * w.seq_len * w.rows * w.d_model / sp_div * w.n_layers  # each block's input kept
        return {
            "first": (at_loss, {**base, act_key: inputs, logit_key: logits}),
            "recompute": (during, {**base, act_key: inputs + per_layer}),
            **end,
            "step": (states_at(w, "step"), step),
        }
    phases = {}
    for i, (act, logit, fixed) in enumerate(pipeline_stage_peaks(w)):
        phases[f"stage{i}"] = (during + fixed, {**base, act_key: act, logit_key: logit})
    phases["step"] = (states_at(w, "step"), step)
    return phases


def peak_phase(w: Workload, consts: dict) -> tuple[float, dict]:
    """(fixed bytes, features) of the phase with the largest predicted total."""
    return max(memory_features(w).values(), key=lambda ff: ff[0] + _dot(consts, ff[1]))


def memory_unit(w: Workload) -> float:
    """What an implementation's extra memory scales with: its model states (parameter bytes
    where everything is offloaded)."""
    return w.state_bytes or 2.0 * w.params / (w.tp * w.pp)


# --- prediction ----------------------------------------------------------------------------------


def _dot(consts: dict, feats: dict) -> float:
    return sum(consts[k] * feats[k] for k in feats)


def predict(w: Workload, cal: dict, *, impl: bool = True) -> Prediction:
    """Step time, throughput, MFU, peak memory and traffic of ``w`` under calibration ``cal``."""
    tc = time_constants(cal["time"])
    mc = {**MEMORY_DEFAULTS, **cal["memory"]}
    feats = time_features(w, cal["collectives"], tc)
    parts = {part: sum(tc[k] * feats[k] for k in keys) for part, keys in TIME_PARTS.items()}
    flops = w.tokens_per_step * w.hw_flops_per_token / w.world_size
    # the stretch of the per-micro-batch work over the average stage's is idle time of the average
    # rank: shown as the bubble
    stretch = pipeline_factor(w, tc)
    parts["bubble"] = 0.0
    for part in ("compute", "memory", "host"):
        per_mb = sum(tc[k] * feats[k] for k in TIME_PARTS[part] if k in PER_MICROBATCH)
        parts["bubble"] += per_mb * (1 - 1 / stretch)
        parts[part] -= per_mb * (1 - 1 / stretch)
    notes = [HOST_FLOOR_NOTE] if host_floor_binds(w, tc) else []
    notes += unmeasured_group_notes(w, cal["collectives"])
    widths = cal.get("widths")
    if widths and not widths[0] <= w.d_model <= widths[1]:
        notes.append(WIDTH_NOTE.format(width=w.d_model, lo=widths[0], hi=widths[1]))
    if w.pp > 1 and w.d_model >= WIDE_PIPELINE_WIDTH:
        notes.append(WIDE_PIPELINE_NOTE.format(width=w.d_model))
    factor = 1.0
    if impl:
        factor, source = impl_factor(w, cal.get("impl_time") or {})
        if source is None and time_factor_cause(w.impl) and not is_host_bound(w):
            notes.append(f"no calibrated record of {w.impl}: implementation factor 1")
        elif source not in (None, w.impl):
            notes.append(f"implementation factor of {source}: no calibrated record of {w.impl}")
    parts = {k: v * factor for k, v in parts.items()}
    device = sum(parts.values())
    parts["host_wait"] = 0.0
    if waits_on_host(w):
        per_tensor, source = host_cost(w, cal.get("host_tensor_s") or {})
        if per_tensor is None:
            notes.append(f"no calibrated host cost of {w.impl}: device time only")
        else:
            if source not in (host_key(w), w.impl):
                notes.append(f"host cost of {source}: no calibrated record of {w.impl}")
            parts["host_wait"] = max(0.0, per_tensor * host_units(w) - device)
    step = sum(parts.values())
    tokens_per_gpu = w.tokens_per_step / step / w.world_size
    peak_flops = cal.get("peak_flops")
    mfu = w.tokens_per_step * w.flops_per_token / step / w.world_size / peak_flops if peak_flops else None
    if mfu and mfu > POWER_CAP_MFU and "derived_from" in cal:
        notes.append(POWER_CAP_NOTE.format(mfu=mfu))
    mem = None
    mem_parts: dict = {}
    mem_phase = None
    if w.state_bytes is not None:
        phases = memory_features(w)
        name = max(phases, key=lambda k: phases[k][0] + _dot(mc, phases[k][1]))
        stage = phases[name][1]
        extra_frac = (cal.get("impl_memory") or {}).get(w.impl, 0.0) if impl else 0.0
        extra_frac = min(max(0.0, extra_frac), IMPL_MEMORY_MAX)
        after_backward = name in ("step", "end")
        split = 0.0 if after_backward else split_graphs_bytes(w)
        step_copies = step_copy_bytes(w) if name == "step" else 0.0
        working_set = working_set_at(w, name)
        states = states_in(w, name)
        mem_parts = {
            "model_states": states - master_grad_buffer_bytes(w) - step_copies,
            "master_grad_buffer": master_grad_buffer_bytes(w),
            "step_copies": step_copies,
            "activations": sum(mc[k] * stage[k] for k in ACT_CONSTANTS),
            "split_graphs": split,
            "logits": mc["logit_bytes_master"] * stage["logit_bytes_master"]
            + mc["logit_bytes_amp"] * stage["logit_bytes_amp"],
            "cast_copies": mc["cast"] * stage["cast"],
            "working_set": working_set,
            # other micro-batches' loss graphs and outputs a pipeline stage still holds
            "retained_logits": 0.0 if after_backward else phases[name][0] - states - working_set - split,
            "fixed": mc["const_bytes"],
            "implementation": extra_frac * memory_unit(w),
        }
        mem = sum(mem_parts.values())
        mem_phase = {
            "step": "optimizer step",
            "recompute": "first block recomputation",
            "backward": "first gradient buffers",
            "end": "end of backward",
        }.get(name, "start of backward" + (f", {name}" if w.pp > 1 else ""))
        if split_unmodelled(w):
            notes.append(SPLIT_GRAPHS_NOTE)
    else:
        notes.append("no model-state expectation: no memory prediction")
    # a step that waits on its host lasts the host's time, however its device parts compare
    bottleneck = "host_wait" if parts["host_wait"] > 0 else max((k for k in parts), key=lambda k: parts[k])
    del flops
    return Prediction(
        step, parts, tokens_per_gpu, mfu, mem, mem_parts, dict(w.comm_bytes), bottleneck, notes, mem_phase
    )


def with_options(w: Workload, **changes) -> Workload:
    return replace(w, **changes)


def is_finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
