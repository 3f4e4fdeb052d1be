"""Memory terms: the model states alive in each peak phase, gradient buffers kept between steps,
the step's copies, the sharded references' working sets and Dynamo's split graphs."""

from __future__ import annotations

from parabench.plan.terms.common import AUTOCAST_RECIPES, DDP_FIRST_BUCKET_BYTES, Workload, block_params

SPLIT_GRAPHS_NOTE = (
    "peak may be low: Dynamo's DDPOptimizer cuts the compiled blocks at DDP's buckets, and nothing measured "
    "says what that saves with this recipe or checkpointing (ddp_optimizer = false compiles whole blocks)"
)


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
# are alive. Measured (results/studies/plan-check-13b-h200x2/20261128-121653): 12 bytes per parameter at 2 ranks
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


# The linears that read each 16-bit-cast input of a block, and the input's width in units of d.
_CAST_READERS = {"ln1": (("q", "k", "v", "qkv"), 1), "ln2": (("fc",), 1), "attn": (("proj",), 1), "gelu": (("fc2",), 4)}
# fp8: what a cut block saves beyond the whole block's graph, bytes per token and unit of width, as the
# one H100 record measured it at gpt-1.3b's default cuts (3.75 GiB at mb 4); coarser cuts save less
# (results/studies/fp8-peers-gpu: 9 and 6 at 100 and 400 MiB buckets). A CPU's float8 path saves other tensors.
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
    structures of the CPU probe (results/studies/ddp-optimizer-cpu) and the three of the H100 records
    (results/studies/ddp-optimizer-h100x1, results/studies/fp8-peers-gpu: 2, 4 and 4 bytes per token and width).
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


def memory_unit(w: Workload) -> float:
    """What an implementation's extra memory scales with: its model states (parameter bytes
    where everything is offloaded)."""
    return w.state_bytes or 2.0 * w.params / (w.tp * w.pp)
