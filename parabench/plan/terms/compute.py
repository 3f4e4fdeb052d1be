"""Compute terms: matmul and attention work, the float8 recipe's casts, the optimizer step's and the
implementations' device copies."""

from __future__ import annotations

from parabench.plan import attention
from parabench.plan.terms.common import TORCH_PP_OUTPUT_BYTES, Workload, block_params, uses_fp16_optimizer

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
