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

The terms live in ``parabench.plan.terms``; this module composes them into a prediction and
keeps their names importable from here.
"""

from __future__ import annotations

import math
from dataclasses import replace

from parabench.plan.terms.comm import (  # noqa: F401 (the planner's names, importable from here)
    BACKWARD_SHARE,
    BENCH_OP,
    BUCKET_BYTES,
    DEEPSPEED_REDUCE_BUCKET_ELEMS,
    OUT_OF_PLACE,
    bus_factor,
    collective_fit,
    collective_s,
    comm_calls,
    comm_overlap,
    exposure_class,
    group_size,
    overlap_tail_s,
    unmeasured_group_notes,
)
from parabench.plan.terms.common import (  # noqa: F401 (the planner's names, importable from here)
    ACT_BYTES,
    ACT_CONSTANTS,
    AUTOCAST_RECIPES,
    COMPILED_LOSS,
    DDP_FIRST_BUCKET_BYTES,
    DS_ZERO_KEYS,
    FIXED_TIME_CONSTANTS,
    FP8_ALL_GATHER,
    FP8_EAGER,
    FP8_FILTER_AUTO,
    GIB,
    IMPL_MEMORY_MAX,
    IMPL_TIME_BOUNDS,
    MEMORY_BOUND_TIME_CONSTANTS,
    MEMORY_CONSTANTS,
    MEMORY_DEFAULTS,
    MEMORY_DOC,
    NOT_MODELLED,
    SHRINK,
    TENSORS_OUTSIDE,
    TENSORS_PER_LAYER,
    TIME_CONSTANTS,
    TIME_DEFAULTS,
    TIME_DOC,
    TORCH_PP_OUTPUT_BYTES,
    Prediction,
    Workload,
    _runs_ddp_stages,
    act_column,
    act_constant,
    activation_layer_bytes,
    block_linear_params,
    block_params,
    ddp_stages,
    facts,
    family_of,
    modelled_version,
    parameter_tensors,
    time_constants,
    unmodelled_reason,
    uses_fp16_optimizer,
)
from parabench.plan.terms.compute import (  # noqa: F401 (the planner's names, importable from here)
    AMP_CAST_BYTES,
    FP8_CAST_ELEMS,
    FP8_WEIGHT_BYTES,
    attention_per_block,
    device_copy_bytes,
    fp8_cast_elems,
    fp8_flops_share,
    optimizer_step_state_bytes,
)
from parabench.plan.terms.host import (  # noqa: F401 (the planner's names, importable from here)
    HOST_FLOOR_NOTE,
    ds_stage0_tensors,
    has_host_floor,
    host_cost,
    host_key,
    host_units,
    impl_factor,
    is_host_bound,
    time_factor_cause,
    waits_on_host,
)
from parabench.plan.terms.memory import (  # noqa: F401 (the planner's names, importable from here)
    _CAST_READERS,
    DS_REDUCE_BUCKET_ELEMENTS,
    SPLIT_GRAPHS_NOTE,
    SPLIT_SAVED_BYTES_FP8,
    _block_ops,
    _blocks_cut,
    _gathered_bytes_per_param,
    accumulated_grad_bytes,
    ddp_split_graphs,
    is_ref_sharded,
    keeps_flat_grad_buffer,
    master_grad_buffer_bytes,
    memory_unit,
    persistent_grad_bytes,
    ref_root_params,
    split_graphs_bytes,
    split_saved_bytes,
    split_unmodelled,
    states_at,
    states_in,
    step_copy_bytes,
    working_set_at,
)
from parabench.plan.terms.pipeline import (  # noqa: F401 (the planner's names, importable from here)
    _FACTOR_CACHE,
    _ORDER_CACHE,
    LOGIT_FORWARD_SHARE,
    RETAINED_LOGIT_BYTES,
    WIDE_PIPELINE_NOTE,
    WIDE_PIPELINE_WIDTH,
    ZB_DY,
    ZB_OUTPUTS,
    ZB_RETAINED,
    _chunk_layers,
    _stage_orders,
    balanced_stage_layers,
    bubble_ratio,
    host_floor_binds,
    pipeline_factor,
    pipeline_host_floors,
    pipeline_op_costs,
    pipeline_order,
    pipeline_stage_peaks,
    schedule_factor,
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
