"""Pipeline terms: the schedule replayed on unequal stages (bubble), the per-op costs and host
floors of a stage, and each stage's activations at its peak."""

from __future__ import annotations

from dataclasses import replace

from parabench.plan.terms.common import (
    ACT_BYTES,
    TORCH_PP_OUTPUT_BYTES,
    Workload,
    act_column,
    activation_layer_bytes,
    time_constants,
)
from parabench.plan.terms.compute import attention_per_block

# Pipelines from this width on ran slower than predicted on both parts, more so the wider
# (results/studies/plan-check-13b-h200x4/20261128-143848/NOTES.md: 8-15 % at widths 4096-5120, against a
# few percent at 2048). Part of it is the stages' in-place weight-gradient adds, measured and not charged:
# the model that charges them ranks worse.
WIDE_PIPELINE_WIDTH = 4096
WIDE_PIPELINE_NOTE = (
    "pipeline at width {width}: at widths 4096-5120 the pipelines measured ran 8-15 % slower than predicted; "
    "part of it is each stage's in-place weight-gradient adds (32 of the 87 ms missed at width 5120), which "
    "the model does not charge (docs/planner.md)"
)


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
# between forward and backward: gpt-1.3b pp 4 on CUDA events (results/studies/pp-timeline-gpu/20261126-231828,
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
    last's (head and loss); ``reference_impls.pipeline_balance.balance_counts`` splits with them.
    None without a pipeline or with no block to move."""
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
    from reference_impls.pipeline_balance import balance_counts

    return balance_counts(w.n_layers, [(c - n * block) / block for c, n in zip(at_equal, equal)])


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


# What a pipeline stage holds beyond Korthikanti's per-layer activations, read off the engines'
# code (reference_impls/pipeline*.py, parabench/peers/torch_pipeline.py) and the GPT block
# (parabench/models.py), in units of one layer's 34 sbh activation bytes or per logit element:
# - Each loss graph alive besides the one whose backward starts keeps cross-entropy's saved fp32
#   log-softmax output (4 B per logit element): GPipe's last stage holds m of them, interleaved's
#   with m == p too (every forward first). ZB-H1's head keeps its output and output gradient
#   (bf16 + bf16) from B until the deferred W: 4 B as well.
RETAINED_LOGIT_BYTES = 4.0
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
