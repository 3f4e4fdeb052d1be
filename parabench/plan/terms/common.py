"""The planner's vocabulary: a configuration (``Workload``), a prediction, the constants the
calibration fits with their meaning and defaults, and the facts every term reads (the strategy's
registry row, ``PlanFacts``; the model's parameter tensors and per-layer activations)."""

from __future__ import annotations

from dataclasses import dataclass, field

from parabench.strategies import PlanFacts

GIB = 1 << 30

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
COMPILED_LOSS = (
    "option compile_loss: the logit terms (logit_s, the logits' bytes) were fitted on the eager fp32 "
    "cross-entropy, whose upcasts and softmax kernels took 11.7 ms of a gpt-350m micro-batch of 8 on one H200 "
    "and 2.1 ms compiled (results/studies/ref-mfu-loss-h200x1)"
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
# tensors x passes). DeepSpeed ZeRO-1/2 under the tuned profile (results/studies/ds-host-gpu/20261127-043817,
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
# Bytes per activation element of the elementwise kernels: bf16, or fp32 under autocast (norms and
# the residual stream stay fp32).
ACT_BYTES = {"amp": 4, "fp8": 4, None: 2}


def block_linear_params(w: "Workload") -> float:
    """Weights of a rank's block linears (q, k, v, proj, fc, fc2: 12 d^2 per block): the ones the
    fp8 recipe converts (parabench/fp8.py, filter "all")."""
    return 12 * w.d_model**2 * w.n_layers / (w.tp * w.pp)


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


def unmodelled_reason(recipe: str | None, options: dict) -> str | None:
    """Why a configuration of ``recipe`` with ``options`` falls outside the model's terms, or None."""
    if options.get("zero"):
        return DS_ZERO_KEYS
    if options.get("compile_loss"):
        return COMPILED_LOSS
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


NOT_MODELLED = PlanFacts()


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


def block_params(w: Workload) -> float:
    """Parameters of one GPT block (parabench.models): q, k, v, proj, fc (4d), fc2 (4d) weights and
    biases, two LayerNorms: 12 d^2 + 13 d."""
    return 12 * w.d_model**2 + 13 * w.d_model


def activation_layer_bytes(w: Workload) -> float:
    """Korthikanti et al. Table 2 bytes per layer per micro-batch (16-bit, flash attention)."""
    sbh = w.seq_len * w.rows * w.d_model
    t = w.tp if w.family == "model_parallel" else 1
    if t == 1:
        return 34 * sbh
    return 34 * sbh / t if w.sp or w.facts.sequence_parallel else sbh * (10 + 24 / t)


# - torch.distributed.pipelining's last stage keeps every micro-batch's output (the bf16 logits)
#   until step() merges them.
TORCH_PP_OUTPUT_BYTES = 2.0


# DDP's first bucket cap, which Dynamo's DDPOptimizer also gives the first of its buckets (the last
# ops of each compiled graph): torch.distributed._DEFAULT_FIRST_BUCKET_BYTES.
DDP_FIRST_BUCKET_BYTES = 1 << 20
