"""Sharded data parallelism: ZeRO stages 1-3, FSDP (full and hybrid shard) and CPU offload, as
references (``reference_impls/zero.py``, ``fsdp.py``, ``zero_offload.py``) and as peers (PyTorch
FSDP2, DeepSpeed ZeRO)."""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from parabench.families.data_parallel import (
    DataParallelOptions,
)
from parabench.families.model_parallel import ModelParallelOptions, model_parallel_ops
from parabench.families.model_parallel import validate as validate_model_parallel
from parabench.shapes import parameter_count
from parabench.strategies import ANY_LAYOUT, DP_PRECISIONS, MASTER_ONLY, PeerProfile, PlanFacts, StrategySpec, with_fp8
from parabench.theory import (
    BYTES,
    Expectation,
    psi,
    ref_bucket_sizes,
    shard_numel,
    sum_ops,
    volume,
    zero_paper_state_bytes,
)


@dataclass(frozen=True)
class ShardedOptions(DataParallelOptions):
    # hybrid shard: ranks per shard group (replicas across them); "node": the data-parallel ranks of
    # one node, resolved by the runner from its launch (parabench.multinode.resolve_node_options)
    shard_size: int | Literal["node"] = 2
    prefetch: bool = True  # reference FSDP/ZeRO-3: all-gather the next block ahead of time
    in_flight: int = 2  # reference FSDP/ZeRO-3: gradient reduce-scatters outstanding at once
    reshard_after_forward: bool = True  # torch FSDP2: free gathered parameters after forward
    zero: dict = field(default_factory=dict)  # DeepSpeed: extra zero_optimization config keys
    # With grad_accum > 1: reduce(-scatter) the gradients of every micro-batch (true, DeepSpeed's and
    # FSDP2's default), or accumulate them locally in full size and reduce once per step (false:
    # FSDP2's set_requires_gradient_sync(False), DeepSpeed's coalesce_grad_reduction); rows in
    # ACCUMULATES_LOCALLY only
    reduce_every_micro_batch: bool = True


@dataclass(frozen=True)
class ShardedPeerOptions(ShardedOptions):
    profile: PeerProfile = "tuned"  # strategies.PEER_PROFILE_HELP
    # torch.fsdp2, recipe fp8: all-gather the float8 linears' weights in float8 (torchao's
    # enable_fsdp_float8_all_gather) instead of fp32
    fp8_all_gather: bool = False

    RECORDED_DEFAULTS: ClassVar[tuple[str, ...]] = ("profile",)


@dataclass(frozen=True)
class DeepSpeedZeroOptions(ShardedPeerOptions):
    # AdamW named in the engine config (DeepSpeed builds it: FusedAdam on GPUs), as DeepSpeed's
    # getting-started page does, instead of a client optimizer handed to deepspeed.initialize.
    optimizer_in_config: bool = False


@dataclass(frozen=True)
class ZeroPPSwitches:
    """ZeRO++ (Wang et al. 2023), each switchable alone; shared by ref.zeropp and deepspeed.zeropp."""

    qwz: bool = False  # Sec. 3.1: weights all-gathered as block-wise int8 + fp32 scales
    hpz: bool = False  # Sec. 3.2: secondary weight partition; backward all-gathers inside it
    # hpZ: ranks per secondary partition (a stand-in for a node's GPUs); "node": the data-parallel
    # ranks of one node, resolved as shard_size's
    hpz_partition_size: int | Literal["node"] = 2
    qgz: bool = False  # Sec. 3.3: gradient reduce-scatter -> all-to-all of quantized chunks


@dataclass(frozen=True)
class ZeroPPOptions(ShardedOptions, ZeroPPSwitches):
    qgz_bits: Literal[4, 8] = 4  # qgZ: bits per gradient code (4 as in the paper and DeepSpeed; packed 2 a byte)
    quant_block: int = 2048  # qwZ/qgZ: elements per quantization block (one fp32 scale each)


@dataclass(frozen=True)
class DeepSpeedZeroPPOptions(DeepSpeedZeroOptions, ZeroPPSwitches):
    pass


@dataclass(frozen=True)
class ZeroInfinityOptions(ShardedOptions):
    # swap folder root; empty: the case's scratch folder (the runner's), else the system's temporary
    # folder; each rank writes into a folder of its own there, removed when the case ends
    nvme_path: str = ""
    io_threads: int = 2  # threads reading and writing the swap files


@dataclass(frozen=True)
class ZeroROptions(ModelParallelOptions):
    """ref.zero_r (ZeRO paper Sec. 6); the names of DeepSpeed's activation_checkpointing config keys."""

    partition_activations: bool = True  # Pa: each block's checkpoint split over the TP group, all-gathered back
    cpu_checkpointing: bool = False  # Pa+cpu: the checkpoints kept in CPU memory
    contiguous_memory_optimization: bool = True  # MD: one activation arena, one contiguous gradient buffer
    constant_buffer_mb: float = 25.0  # CB: the data-parallel gradient all-reduce in windows of this many MiB (fp32)


@dataclass(frozen=True)
class DeepSpeedNVMeOptions(DeepSpeedZeroOptions):
    nvme_path: str = ""  # swap folder root; empty: a per-case folder in the launch's scratch (deleted after)
    offload_param: dict = field(default_factory=dict)  # keys over peers.deepspeed_nvme.nvme_config's
    offload_optimizer: dict = field(default_factory=dict)  # keys over peers.deepspeed_nvme.nvme_config's
    aio: dict = field(default_factory=dict)  # keys over the documented aio defaults (peers.deepspeed_nvme)
    disk_probe_mb: float = 1024.0  # sequential write/read probe of nvme_path before the steps; 0: none


# --- builders -----------------------------------------------------------------------------------


def validate_zeropp(case, o, cfg) -> None:
    unresolved = o.hpz_partition_size == "node"  # checked once the runner resolves it for its nodes
    if o.hpz and not unresolved and (o.hpz_partition_size < 1 or case.dp % o.hpz_partition_size):
        raise ValueError(
            f"{case.strategy}: hpz_partition_size {o.hpz_partition_size} must divide the data-parallel degree {case.dp}"
        )
    if getattr(o, "quant_block", 2) % 2 or getattr(o, "quant_block", 2) < 2:
        raise ValueError(f"{case.strategy}: quant_block must be even (int4 codes pack two a byte)")
    if case.strategy.startswith("deepspeed.") and o.hpz and o.hpz_partition_size == 1:
        raise ValueError(
            f"{case.strategy}: DeepSpeed reads zero_hpz_partition_size 1 as hpZ off; use hpz_partition_size >= 2 "
            "(ref.zeropp takes 1: every rank keeps the whole unit as its secondary copy)"
        )


def deepspeed_zeropp_unsupported(case, device: str) -> str | None:
    """Why a deepspeed.zeropp case cannot run on ``device`` (None: it can)."""
    o = DeepSpeedZeroPPOptions.read(case.options)
    if device != "cuda" and (o.qwz or o.qgz):
        return (
            "DeepSpeed's ZeRO++ quantizers (qwZ: CUDAQuantizer, qgZ: all_to_all_quant_reduce) load "
            "op_builder.QuantizerBuilder, a CUDA-only JIT op: not available on a CPU accelerator"
        )
    return None


def hsdp_groups(world: int, dp: int, pp: int, tp: int, shard_size: int, rank: int):
    """(shard ranks, replicate ranks) lists for every data-parallel group of the grid
    ``arange(world).view(dp, pp, tp)``, and the two lists this rank belongs to.

    Within each dp group, consecutive dp ranks form a shard group (the fast links, like torch's
    HSDP mesh ``(replicate, shard)``); ranks with the same position in their shard group form a
    replica group."""
    if dp % shard_size or shard_size < 1:
        raise ValueError(f"hsdp: shard_size {shard_size} must divide the data-parallel degree {dp}")
    shards, replicas = [], []
    for p in range(pp):
        for t in range(tp):
            col = [(d * pp + p) * tp + t for d in range(dp)]  # the grid's (:, p, t) column, world = dp*pp*tp
            shards += [col[k : k + shard_size] for k in range(0, dp, shard_size)]
            replicas += [col[j::shard_size] for j in range(shard_size)]

    def mine(lists):
        return next(g for g in lists if rank in g)

    return shards, replicas, mine(shards), mine(replicas)


# --- expectations: peers ------------------------------------------------------------------------


def fsdp2_reduce_dtype(precision: str, recipe: str | None, o) -> str:
    """The dtype FSDP2 reduce-scatters gradients in (``torch_fsdp2.mixed_precision_policy``): fp32
    where the parameters are fp32 (fp32, "amp", "fp8") and under ``tuned`` (torchtitan's
    ``training.mixed_precision_reduce`` admits float32 only); the compute dtype under ``matched``."""
    if precision == "fp32" or recipe in ("amp", "fp8") or getattr(o, "profile", "matched") == "tuned":
        return "fp32"
    return precision


def fsdp2_reduce_bytes(case, o) -> int:
    """Bytes per gradient element FSDP2 reduces in."""
    return BYTES[fsdp2_reduce_dtype(case.precision, case.recipe, o)]


def fsdp2_float8_gather_saving(cfg, case, o, pbytes: int) -> int:
    """Option ``fp8_all_gather`` (recipe fp8): the float8 linears' weights travel in 1 byte instead of
    ``pbytes``, in every gather of every block (forward, and backward unless the blocks are kept gathered)."""
    if not getattr(o, "fp8_all_gather", False):
        return 0
    from parabench.fp8 import block_float8_numel

    gathers = case.grad_accum * (2 * cfg.n_layers - fsdp2_blocks_kept_after_forward(cfg, case, o))
    return gathers * block_float8_numel(cfg, o.fp8_filter) * (pbytes - 1)


def fsdp2_float8_scale_bytes(cfg, o) -> int:
    """Option ``fp8_all_gather``: after each optimizer step torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` all-reduces (max) one fp32 amax per float8 weight,
    stacked into one tensor: a single all-reduce of 4 bytes per float8 linear."""
    if not getattr(o, "fp8_all_gather", False):
        return 0
    from parabench.fp8 import block_float8_linears

    return 4 * cfg.n_layers * block_float8_linears(cfg, o.fp8_filter)


def expect_torch_fsdp2(cfg, case, o, dp):
    p = psi(cfg)
    pbytes = BYTES[case.param_precision]
    accum = case.grad_accum
    comm = (
        {
            # forward gathers every parameter group, backward gathers again each one resharded after
            # forward (torch_fsdp2.shard_groups); gradients are reduce-scattered after every
            # micro-batch (fp32, or the compute dtype under the matched profile).
            "all_gather": accum * (2 * p - fsdp2_kept_after_forward(cfg, case, o)) * pbytes
            - fsdp2_float8_gather_saving(cfg, case, o, pbytes),
            "reduce_scatter": (accum if o.reduce_every_micro_batch else 1) * p * fsdp2_reduce_bytes(case, o),
        }
        if dp > 1
        else {}
    )
    scale_bytes = fsdp2_float8_scale_bytes(cfg, o)
    if dp > 1 and scale_bytes:
        comm["all_reduce"] = scale_bytes
    return Expectation(
        state_bytes=None,  # per-parameter dim-0 sharding: shard sizes vary by rank, see the measurement
        comm_payload_bytes=comm,
        paper_state_bytes=zero_paper_state_bytes(3, p, dp),
        notes="fp32 sharded parameters are the master weights; gathered in the compute dtype.",
    )


def expect_torch_hsdp(cfg, case, o, dp):
    p = psi(cfg)
    shard = o.shard_size
    accum = case.grad_accum
    return Expectation(
        state_bytes=None,  # per-parameter dim-0 sharding within the shard group: see the measurement
        comm_payload_bytes={
            "all_gather": accum * (2 * p - fsdp2_kept_after_forward(cfg, case, o)) * BYTES[case.param_precision],
            "reduce_scatter": accum * p * fsdp2_reduce_bytes(case, o),  # within the shard group
            "all_reduce": accum * p * fsdp2_reduce_bytes(case, o) // shard,  # the shard, across replicas
        },
        paper_state_bytes=zero_paper_state_bytes(3, p, shard),
        notes="FSDP2 on a (replicate, shard) mesh: forward and backward gathers inside the shard group, "
        "gradient reduce-scatter inside it, then an all-reduce of each shard across replicas.",
    )


def deepspeed_expectation(stage: int):
    """DeepSpeed 0.19 as it behaves (read from its source, confirmed by the meter): gradients
    travel in the parameter dtype; stages 1 and 2 all-reduce each gradient bucket and then
    all-gather the updated parameters, so their payload is 2Ψ elements and their wire traffic 3Ψ
    (the paper's reduce-scatter + all-gather would be 2Ψ). With gradient accumulation, stages 0
    and 1 reduce once per step, at the accumulation boundary, and stage 2 reduces the buckets of
    every micro-batch (engine.py ``allreduce_gradients``: "ZeRO stage >= 2 communicates during non
    gradient accumulation boundaries as well"); stage 3 gathers every parameter in
    forward and reduce-scatters gradients, but re-gathers in backward only what its parameter
    cache has released (measured: nothing on the tiny model, the output head and a few blocks on
    gpt-125m, with stage3_max_reuse_distance=0), so its all-gather is the range [Ψ, 2Ψ] — the
    flight recorder confirms the meter here, the looseness is DeepSpeed's."""

    def fn(cfg, case, o, dp):
        p = psi(cfg)
        b = BYTES[case.param_precision]
        accum = case.grad_accum
        comm = None
        if dp > 1:
            kept = deepspeed_persistent_numel(cfg, o) if stage == 3 else 0
            comm = {
                0: {"all_reduce": b * p},
                1: {"all_reduce": b * p, "all_gather": b * p},
                # coalesce_grad_reduction (reduce_every_micro_batch false): one reduction pass a step
                2: {"all_reduce": (accum if o.reduce_every_micro_batch else 1) * b * p, "all_gather": b * p},
                3: {
                    "all_gather": [b * (accum * (p - kept) + kept), b * (accum * 2 * (p - kept) + kept)],
                    "reduce_scatter": accum * b * p,
                },
            }[stage]
        kept = deepspeed_kept_gathered_numel(cfg, o) if stage == 3 else 0
        return Expectation(
            state_bytes=None,
            comm_payload_bytes=comm,
            paper_state_bytes=zero_paper_state_bytes(stage, p, dp),
            working_set_bytes={"kept_gathered_params": b * kept} if kept else None,
            notes="DeepSpeed's internal layout is read from the engine; the paper's figure is given for reference.",
        )

    return fn


def deepspeed_kept_gathered_numel(cfg, o) -> int:
    """Parameter elements DeepSpeed ZeRO-3 keeps gathered from forward into backward, at most: it
    releases a parameter after use only if its next use lies beyond ``stage3_max_reuse_distance``
    elements of fetches, and holds at most ``stage3_max_live_parameters`` (both 1e9 by default, 0
    and 1e9 under the matched profile). The all-gathers measured under the tuned profile agree: no
    re-gather in backward at gpt-350m (all 0.41e9 kept), 1.00e9 kept at gpt-1.3b, 2.7b and 6.7b,
    0.73e9 of 0.84e9 at gpt-760m, whose earliest blocks come back beyond the reuse distance."""
    matched = getattr(o, "profile", "matched") == "matched"
    reuse = o.zero.get("stage3_max_reuse_distance", 0 if matched else 1_000_000_000)
    if not reuse:
        return 0
    return min(psi(cfg), reuse, o.zero.get("stage3_max_live_parameters", 1_000_000_000))


def fsdp2_blocks_kept_after_forward(cfg, case, o) -> int:
    """Blocks FSDP2 keeps gathered from forward to backward (not all-gathered again): every one
    with ``reshard_after_forward=False`` given, else none (``torch_fsdp2.shard_groups``)."""
    if "reshard_after_forward" in case.options and not o.reshard_after_forward:
        return cfg.n_layers
    return 0


def fsdp2_kept_after_forward(cfg, case, o) -> int:
    """Parameters FSDP2 keeps gathered from forward to backward (``torch_fsdp2.shard_groups``).
    ``reshard_after_forward=False`` given: every one (FSDP2 still frees them after backward, so
    each micro-batch's forward gathers them again). ``tuned`` otherwise: the root's, the position
    embedding (a root left to FSDP2's choice is not resharded), and under torchtitan's "default"
    policy (the option not given) the [final norm, head] group's; ``matched``: none."""
    given = "reshard_after_forward" in case.options
    if given and not o.reshard_after_forward:
        return psi(cfg)
    if getattr(o, "profile", "matched") != "tuned":
        return 0
    root = cfg.seq_len * cfg.d_model
    norm_and_head = 2 * cfg.d_model + cfg.vocab_size * cfg.d_model  # LayerNorm weight and bias; the head has no bias
    return root + (0 if given else norm_and_head)


def deepspeed_persistent_numel(cfg, o) -> int:
    """Elements of the parameters DeepSpeed ZeRO-3 persists (never released after use): each one of
    at most ``stage3_param_persistence_threshold`` elements, in registration order while their sum
    stays within ``stage3_model_persistence_threshold`` (zero/parameter_offload.py). The tuned
    profile leaves both at DeepSpeed's defaults (1e5, unbounded); matched sets the first to 0. The
    persisted parameters are all-gathered once per step, after the optimizer step."""
    matched = getattr(o, "profile", "matched") == "matched"
    threshold = o.zero.get("stage3_param_persistence_threshold", 0 if matched else 100_000)
    budget = o.zero.get("stage3_model_persistence_threshold", sys.maxsize)
    kept = 0
    for shapes in _block_shapes(cfg, everything=True):
        for shape in shapes:
            n = math.prod(shape)
            if n + kept <= budget and n <= threshold:
                kept += n
    return kept


@functools.lru_cache(maxsize=16)  # asked per planner candidate; a wide model takes seconds to build
def _block_shapes(cfg, everything: bool = False) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Parameter shapes per transformer block, or (``everything``) of the whole model in
    registration order as one list."""
    import torch

    from parabench.models import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    if everything:
        return (tuple(tuple(p.shape) for p in model.parameters()),)
    return tuple(tuple(tuple(p.shape) for p in block.parameters()) for block in model.blocks)


# --- expectations: references (reference_impls/zero.py, fsdp.py) ---------------------------------
# The layout rules are restated here, not imported, so that a change in the code shows up as a
# mismatch with the measurement. b = bytes of the compute dtype (4 fp32, 2 bf16); Ψ the parameter
# count; N the data-parallel degree (the shard-group size S for hsdp); A = grad_accum.
# Padding: ZeRO-1/2 pad each gradient bucket, ZeRO-3/FSDP/HSDP each unit (a block, or the root:
# embeddings + final LayerNorm + head), to a multiple of N elements; Ψp is the padded total. The
# collectives run even at N = 1 (group of one), so the payloads below hold for any N.


def _ref_units(cfg, n: int) -> tuple[int, int]:
    """(padded root unit, padded block unit) in elements, for shard groups of ``n`` ranks."""
    c = parameter_count(cfg)
    block = c["blocks"] // cfg.n_layers
    return shard_numel(c["total"] - c["blocks"], n) * n, shard_numel(block, n) * n


def ref_zero_expectation(stage: int):
    def fn(cfg, case, o, dp):
        p, b, mixed = psi(cfg), BYTES[case.param_precision], case.param_precision != "fp32"
        buckets = ref_bucket_sizes(cfg, b, float(o.bucket_mb), dp)
        psi_p, shard = sum(buckets), sum(buckets) // dp
        local = stage == 1 or not o.reduce_every_micro_batch  # gradients accumulated locally, reduced once
        rs_rounds = 1 if local else case.grad_accum
        # the whole gradient bΨp: ZeRO-1's buckets (counted always), or ZeRO-2's held over a micro-batch
        whole = stage == 1 or (local and case.grad_accum > 1)
        return Expectation(
            state_bytes={
                "params": b * psi_p,
                "grads": (b * psi_p if whole else 0) + 4 * shard,
                "optimizer": 8 * shard + (4 * shard if mixed else 0),
            },
            comm_payload_bytes={
                "reduce_scatter": rs_rounds * volume(b * n for n in buckets),
                "all_gather": volume(b * n for n in buckets),
            },
            paper_state_bytes=zero_paper_state_bytes(stage, p, dp),
            notes=f"buckets padded to a multiple of N (Ψp = {psi_p} vs Ψ = {p}); every bucket split into N shards. "
            + (
                "ZeRO-1: full gradient buffer bΨp + fp32 main-gradient shard 4Ψp/N; "
                if stage == 1
                else "ZeRO-2 accumulating locally: the full gradient buckets bΨp, held from the first micro-batch "
                "to the last, + the fp32 main-gradient shard 4Ψp/N; "
                if whole
                else "ZeRO-2: only the fp32 main-gradient shard 4Ψp/N at update time (buckets freed); "
            )
            + "Adam 8Ψp/N, + fp32 master shard 4Ψp/N in bf16 (in fp32 the owned part of the parameter "
            "buffer is the master). bf16: 2Ψ + 16Ψ/N (stage 2) vs the paper's 2Ψ + 14Ψ/N, the difference being "
            "the fp32 gradient shard (as DeepSpeed holds). Reduce-scatter and all-gather in the compute dtype"
            + (", communication on the last micro-batch only." if local else ", reduce-scatter on every micro-batch."),
        )

    return fn


def ref_sharded_expectation(variant: str):
    def fn(cfg, case, o, dp):
        p, b, mixed = psi(cfg), BYTES[case.param_precision], case.param_precision != "fp32"
        n = o.shard_size if variant == "hsdp" else dp
        root, block = _ref_units(cfg, n)
        units = [root] + [block] * cfg.n_layers
        psi_p, shard = sum(units), sum(units) // n
        regathered = units[1:] + ([root] if variant == "zero3" else [])
        # Accumulating locally (option reduce_every_micro_batch false): one reduce-scatter per unit per
        # step, and every unit's unsharded gradient bΨp held from the first micro-batch to the last.
        held = not o.reduce_every_micro_batch and case.grad_accum > 1
        comm = {
            "all_gather": case.grad_accum * volume(b * u for u in units + regathered),
            "reduce_scatter": (case.grad_accum if o.reduce_every_micro_batch else 1) * volume(b * u for u in units),
        }
        if variant == "hsdp":  # one all-reduce per unit's fp32 gradient shard
            comm["all_reduce"] = volume(4 * u // n for u in units)
        in_flight = o.in_flight
        return Expectation(
            state_bytes={"params": 4 * shard, "grads": 4 * shard + (b * psi_p if held else 0), "optimizer": 8 * shard},
            comm_payload_bytes=comm,
            paper_state_bytes=zero_paper_state_bytes(3, p, n),
            # Transient, on top of the model state, in the compute dtype: the gathered units alive at
            # once (the root and up to three blocks: in backward the block whose last gradients are
            # landing, the one computing, the one prefetched) and the gradients before their
            # reduce-scatter: the root's (autograd's own tensors, then for a moment also its flat
            # buffer) and the flat buffers of up to in_flight + 1 blocks; in 16-bit each of the
            # in_flight outstanding reduce-scatters has a receive shard too.
            working_set_bytes={
                "gathered_params": b * (root + 3 * block),
                "grad_buffers": (b * psi_p if held else b * (2 * root + (in_flight + 1) * block))
                + (b * in_flight * max(root, block) // n if mixed else 0),
            },
            notes=f"units (root + one per block) padded to a multiple of {'S' if variant == 'hsdp' else 'N'} "
            f"(Ψp = {psi_p}); in every precision the fp32 shard 4Ψp/n is the only persistent copy of the "
            "parameters (the master weights; cast into the all-gather buffer before each gather), fp32 "
            "main-gradient shard 4Ψp/n (allocated unit by unit in backward, freed after the update), Adam "
            "8Ψp/n: 16Ψp/n (paper 16Ψ/N). Per micro-batch: "
            "all-gather of every unit for forward and of every block again for backward"
            + (" and of the root too" if variant == "zero3" else " (the root stays gathered)")
            + (
                ", reduce-scatter of every unit, in the compute dtype"
                if o.reduce_every_micro_batch
                else "; gradients accumulate in every unit's unsharded flat buffer (bΨp held, counted in the "
                "gradient state) and each unit is reduce-scattered once per step, in the compute dtype"
            )
            + (
                "; once per step an fp32 all-reduce of each unit's gradient shard across the N/S replicas"
                if variant == "hsdp"
                else ""
            )
            + ".",
        )

    return fn


def ref_zeropp_expectation(cfg, case, o, dp):
    """ref.zeropp (reference_impls/zeropp.py): ref.zero3's units, with each option changing the
    collectives of every unit per micro-batch. A quantized all-gather of an n-element source slice
    over a group of g ranks is two ops: int8 codes g·ceil(n/B)·B bytes and fp32 scales
    4·g·ceil(n/B) (B = quant_block; each op above the meter's scalar cut-off counts). qgZ: one
    all-to-all of codes, N·ceil(s/B)·B·bits/8 bytes, and one of scales, 4·N·ceil(s/B), per unit."""
    base = ref_sharded_expectation("zero3")(cfg, case, o, dp)
    b, block, k = BYTES[case.param_precision], o.quant_block, o.hpz_partition_size
    root, blk = _ref_units(cfg, dp)
    units = [root] + [blk] * cfg.n_layers

    def gather(padded: int, g: int) -> list[int]:  # all-gather ops of one unit from slices of padded/g
        if not o.qwz:
            return [b * padded]
        nb = -(-(padded // g) // block)
        return [g * nb * block, 4 * g * nb]

    gathers, a2a, rs = [], [], []
    for u in units:
        gathers += gather(u, dp)  # forward: the primary shard over the whole group
        if not o.hpz:
            gathers += gather(u, dp)  # backward: the primary again
        elif k > 1:
            gathers += gather(u, k)  # backward: the secondary partition, inside the sub-group
        if o.qgz:
            nb = -(-(u // dp) // block)
            a2a += [dp * nb * block * o.qgz_bits // 8, 4 * dp * nb]
        else:
            rs.append(b * u)
    comm = {"all_gather": case.grad_accum * volume(gathers)}
    comm.update({"all_to_all": case.grad_accum * volume(a2a)} if o.qgz else {})
    comm.update({"reduce_scatter": case.grad_accum * volume(rs)} if not o.qgz else {})
    state = dict(base["state_bytes"])
    if o.hpz:
        state["params"] += sum(b * u // k for u in units)
    zero3 = base["comm_payload_bytes"]
    saved = {kind: zero3[kind] - comm.get(kind, 0) for kind in zero3}
    return Expectation(
        state_bytes=state,
        comm_payload_bytes=comm,
        paper_state_bytes=base["paper_state_bytes"],
        zero3_comm_payload_bytes=zero3,
        comm_reduction=sum(zero3.values()) / max(1, sum(comm.values())),
        notes=f"ref.zero3 units, qwz={o.qwz} hpz={o.hpz} (k={k}) qgz={o.qgz} (int{o.qgz_bits}), block {block}. "
        + ("qwZ: every weight all-gather int8 + fp32 scales per block. " if o.qwz else "")
        + (
            f"hpZ: + a b·Ψp/{k} secondary copy per rank; backward gathers "
            + ("nothing (k = 1: the copy is whole). " if k == 1 else f"inside the sub-group of {k}. ")
            if o.hpz
            else ""
        )
        + ("qgZ: gradients as an all-to-all of quantized chunks, summed in fp32 (one hop: one node). " if o.qgz else "")
        + f"Bytes saved vs ref.zero3 by kind: {saved}.",
    )


def expect_deepspeed_zeropp(cfg, case, o, dp):
    """DeepSpeed ZeRO-3 with ZeRO++ (0.19.8, read from its source). qwZ: every parameter all-gather
    (forward, backward, primary or secondary) sends int8 codes (CUDAQuantizer) plus fp32 scales, one
    per group of an adaptive size (partition_parameters.py: the smallest group count >= n/8000 with
    n divisible by 8·groups, so between 4/8000 and 4/8 bytes of scale per element); the persistent
    parameters' once-a-step gather stays unquantized. hpZ: backward gathers from the secondary
    partition inside groups of hpz_partition_size consecutive ranks: the same payload, in a smaller
    group. qgZ: stage3.py uses the quantized all-to-all only when the world spans several nodes
    (world // accelerator.device_count() > 1); within one node, as in parabench's launches, it keeps
    ZeRO-3's reduce-scatter."""
    base = deepspeed_expectation(3)(cfg, case, o, dp)
    comm = dict(base["comm_payload_bytes"] or {})
    if comm and o.qwz:
        p, b, accum = psi(cfg), BYTES[case.param_precision], case.grad_accum
        kept = deepspeed_persistent_numel(cfg, o)
        comm["all_gather"] = [accum * (p - kept) + b * kept, 1.5 * accum * 2 * (p - kept) + b * kept]
    return Expectation(
        state_bytes=None,
        comm_payload_bytes=comm or None,
        paper_state_bytes=base["paper_state_bytes"],
        notes="DeepSpeed ZeRO++ (zero_quantized_weights / zero_hpz_partition_size / zero_quantized_gradients); "
        "one node: qgZ falls back to reduce-scatter inside DeepSpeed. " + (expect_deepspeed_zeropp.__doc__ or ""),
    )


# --- expectations: CPU offload (device-resident model state) -------------------------------------
# What stays on the device when the optimizer (and for FSDP2 the sharded parameters) live in CPU
# memory. On a CPU-only machine "device" and "CPU" are the same memory: the offload is then a copy
# within it, and these figures describe the layout, not a saving.


def expect_ref_zero2_offload(cfg, case, o, dp):
    base = ref_zero_expectation(2)(cfg, case, o, dp)
    p, b = psi(cfg), BYTES[case.param_precision]
    buckets = ref_bucket_sizes(cfg, b, float(o.bucket_mb), dp)
    psi_p, shard = sum(buckets), sum(buckets) // dp
    return Expectation(
        state_bytes={"params": b * psi_p, "grads": 4 * shard, "optimizer": 0},
        comm_payload_bytes=base["comm_payload_bytes"],
        paper_state_bytes=2 * p,  # ZeRO-Offload, Sec. 4: only the 16-bit parameters stay (2Ψ)
        cpu_state_bytes={"master": 4 * shard, "grads": 4 * shard, "optimizer": 8 * shard},
        notes="ZeRO-2 on the device: bΨp compute parameters + the fp32 main-gradient shard 4Ψp/N (reduce-scattered "
        "there, then copied out); on the CPU: fp32 master 4Ψp/N, Adam 8Ψp/N and a 4Ψp/N gradient copy. The "
        "paper's 2Ψ counts 16-bit parameters only (its gradients stream to the CPU bucket by bucket). Same "
        "collectives as ref.zero2.",
    )


def deepspeed_offload_expectation(stage: int):
    def fn(cfg, case, o, dp):
        base = deepspeed_expectation(stage)(cfg, case, o, dp)
        p, b = psi(cfg), BYTES[case.param_precision]
        device_params = b * p if stage == 2 else b * shard_numel(p, dp)
        return Expectation(
            state_bytes=None,  # read from the engine (its "optimizer" figure includes the CPU-resident part)
            comm_payload_bytes=base["comm_payload_bytes"],
            paper_state_bytes=device_params,
            device_state_bytes={"params": device_params, "grads": None, "optimizer": 0},
            working_set_bytes=base.get("working_set_bytes"),
            notes=f"DeepSpeed ZeRO-{stage} with offload_optimizer=cpu: fp32 master partitions, Adam moments and the "
            "update on the CPU; the device keeps the "
            + ("16-bit parameters (bΨ)" if stage == 2 else "16-bit parameter partition (bΨ/N)")
            + " plus gradient buckets in flight. The CPU update is DeepSpeedCPUAdam (tuned profile on a GPU "
            "machine) or torch's AdamW; strategy_stats.optimizer names the one that ran.",
        )

    return fn


def expect_deepspeed_zero3_nvme(cfg, case, o, dp):
    """ZeRO-Infinity (Rajbhandari et al. 2021, Sec. 5): on the device only the parameters of the
    modules being computed (gathered, transient); per rank on NVMe the 16-bit parameter partition
    bΨ/N, the fp32 master and Adam moments 12Ψ/N, and the fp32 gradient partition 4Ψ/N that the
    optimizer swapper writes out beside them (swap_tensor/optimizer_utils.py). Per step, read:
    the parameter partition for forward and again for backward unless still in the swap buffers
    (0 to 2bΨ/N) plus optimizer state and gradients 16Ψ/N; written: the gradients 4Ψ/N, the state 12Ψ/N
    and the updated parameters bΨ/N. Read from DeepSpeed 0.19.8's swappers. On one H100 at gpt-1.3b
    (results/zero-infinity-gpu/20261127-012755-gpu0) the bytes written equal this and the bytes read
    lie 1.7 % under the top of the range: the reuse distance is 0 under NVMe parameter offload
    (parameters read again in backward), less the small parameters stage 3 keeps resident."""
    base = deepspeed_expectation(3)(cfg, case, o, dp)
    p, b = psi(cfg), BYTES[case.param_precision]
    shard = shard_numel(p, dp)
    return Expectation(
        state_bytes=None,  # read from the engine
        comm_payload_bytes=base["comm_payload_bytes"],
        paper_state_bytes=0,
        device_state_bytes={"params": 0, "grads": None, "optimizer": 0},
        nvme_state_bytes={"params": b * shard, "grads": 4 * shard, "optimizer": 12 * shard},
        nvme_io_bytes_per_step={
            "read": [16 * shard, 16 * shard + 2 * b * shard],
            "write": 16 * shard + b * shard,
        },
        notes="ZeRO-3 with offload_param and offload_optimizer to NVMe (ZeRO-Infinity): the device holds "
        "no persistent model state, only the gathered parameters of the modules in flight (and "
        "max_in_cpu / buffer_count swap buffers sit in pinned CPU memory); per rank on NVMe bΨ/N "
        "parameters + 4Ψ/N fp32 gradients + 12Ψ/N fp32 master and Adam moments. I/O per step as in "
        "expect_deepspeed_zero3_nvme's docstring (DeepSpeed source; checked on one H100). The CPU update "
        "as deepspeed.zero3_offload (strategy_stats.optimizer). Refused where DeepSpeed 0.19.8 would read swapped "
        "gradients to misaligned offsets (peers.deepspeed_nvme.misaligned_gradient_swaps).",
    )


def expect_ref_zero3_nvme(cfg, case, o, dp):
    """ref.zero3_nvme (reference_impls/zero_infinity.py): ref.zero3's units and collectives; per rank
    on disk the compute-dtype parameter shard bΨp/N and the fp32 master and Adam moments 12Ψp/N. Per
    step the parameter shard of every unit is read for each of its two gathers a micro-batch
    (2·A·bΨp/N), the optimizer state read once (12Ψp/N); the state and the updated parameter shard
    are written once (12Ψp/N + bΨp/N). On the device: the fp32 gradient shard 4Ψp/N at the update,
    no parameters or optimizer state between steps."""
    base = ref_sharded_expectation("zero3")(cfg, case, o, dp)
    b = BYTES[case.param_precision]
    root, block = _ref_units(cfg, dp)
    shard = (root + block * cfg.n_layers) // dp
    return Expectation(
        state_bytes={"params": 0, "grads": 4 * shard, "optimizer": 0},
        comm_payload_bytes=base["comm_payload_bytes"],
        paper_state_bytes=0,
        device_state_bytes={"params": 0, "grads": 4 * shard, "optimizer": 0},
        nvme_state_bytes={"params": b * shard, "grads": 0, "optimizer": 12 * shard},
        nvme_io_bytes_per_step={"read": 2 * case.grad_accum * b * shard + 12 * shard, "write": 12 * shard + b * shard},
        working_set_bytes=base["working_set_bytes"],
        notes="ZeRO-Infinity over ref.zero3: parameter shards (compute dtype) and fp32 master + Adam moments in "
        "files per unit, read ahead of each gather and streamed unit by unit through a CPU AdamW; the fp32 "
        "gradient shard stays in memory. Bytes are those the reference's file path read and wrote (plain "
        "buffered I/O: the page cache may serve reads). Same collectives as ref.zero3.",
    )


def validate_zero_r(case, o, cfg) -> None:
    validate_model_parallel(case, o, cfg)
    if o.pp != 1 or o.tp < 2:
        raise ValueError(f"ref.zero_r partitions activations over a tensor-parallel group: tp >= 2 and pp 1, not {o}")
    if o.constant_buffer_mb <= 0:
        raise ValueError("ref.zero_r: constant_buffer_mb must be positive")


def expect_ref_zero_r(cfg, case, o, dp):
    """ref.zero_r (reference_impls/zero_r.py), fp32, per rank (t = tp, L blocks, A = grad_accum micro-batches
    of b = micro_batch samples, e = 4 bytes):

    * activation checkpoints held at the peak (ZeRO Sec. 6.1): L·ceil(b·s·h/t)·e with Pa, L·b·s·h·e without
      (every TP rank a replica), on the device, or in CPU memory with Pa+cpu;
    * communication (Sec. 8): ref.tp's Megatron ops, plus per block and micro-batch the two ``g`` all-reduces
      of the recomputed forward, and with Pa one all-gather of the checkpoint (t·ceil(b·s·h/t)·e); per step
      the data-parallel gradient all-reduce in windows of at most the constant buffer (Sec. 6.2), run even
      on a data-parallel group of one;
    * model state: fp32 parameters, the contiguous gradient buffer (Sec. 6.3) and Adam moments of the TP shard.
    """
    from parabench.families.model_parallel import _mp_local_params

    t, L = o.tp, cfg.n_layers
    e, bsh = 4, case.micro_batch * cfg.seq_len * cfg.d_model
    part = -(-bsh // t)
    ops = model_parallel_ops(cfg, case, (0, 0, 0), False, step_ops=False)
    for _ in range(case.grad_accum):
        ops += [("all_reduce", bsh * e)] * 2 * L  # the recomputed forward's g
        if o.partition_activations:
            ops += [("all_gather", part * t * e)] * L
    local = _mp_local_params(cfg, t, 0, L, True, True)
    window = int(o.constant_buffer_mb * 2**20) // e
    ops += [("all_reduce", min(window, local - start) * e) for start in range(0, local, window)]
    held = L * (part if o.partition_activations else bsh) * e
    return Expectation(
        state_bytes={"params": e * local, "grads": e * local, "optimizer": 8 * local},
        comm_payload_bytes=sum_ops(ops),
        paper_state_bytes=None,
        activation_checkpoint_bytes={"host" if o.cpu_checkpointing else "device": held},
        activation_checkpoint_bytes_replicated=L * bsh * e,
        grad_reduce_calls=-(-local // window),
        notes="ZeRO-R over Megatron TP: Pa partitions each block's checkpoint over the TP group (1/t of "
        "L·b·s·h·e per rank; Pa+cpu keeps it in CPU memory), CB reduces gradients over dp in windows of "
        "constant_buffer_mb, MD keeps checkpoints in one arena and gradients in one buffer. "
        + (expect_ref_zero_r.__doc__ or ""),
    )


def nvme_unsupported(case, device_type: str) -> str | None:
    """The runner's question before launching a deepspeed.zero3_nvme case: why DeepSpeed's async
    I/O op cannot run on this machine's ``device_type`` (its builder's verdict), or None."""
    from parabench.peers.deepspeed_aio import aio_unavailable

    return aio_unavailable(device_type)


def expect_torch_fsdp2_offload(cfg, case, o, dp):
    base = expect_torch_fsdp2(cfg, case, o, dp)
    return Expectation(
        state_bytes=None,
        comm_payload_bytes=base["comm_payload_bytes"],
        paper_state_bytes=0,
        device_state_bytes={"params": 0, "grads": 0, "optimizer": 0},
        notes="FSDP2 CPUOffloadPolicy: sharded fp32 parameters, their gradients and the AdamW step stay in CPU memory; "
        "the device holds only the gathered block being computed (transient, not model state). Same "
        "collectives as torch.fsdp2.",
    )


# Why DeepSpeed's rows refuse option compile.
DEEPSPEED_NO_COMPILE = (
    "DeepSpeed compiles through its engine (engine.compile(), which traces its ZeRO hooks with the "
    "model), which this adapter does not call; per-block torch.compile under the engine's module hooks "
    "is not wired"
)


def validate_fp8_all_gather(case, o, cfg) -> None:
    if getattr(o, "fp8_all_gather", False) and (case.strategy != "torch.fsdp2" or case.recipe != "fp8"):
        raise ValueError("option fp8_all_gather needs strategy torch.fsdp2 and recipe fp8")


# The rows that take option reduce_every_micro_batch = false: the references whose trainers accumulate
# without communication when told, and the peers with the matching mode (FSDP2's
# set_requires_gradient_sync, DeepSpeed ZeRO-2's coalesce_grad_reduction).
ACCUMULATES_LOCALLY = ("ref.zero2", "ref.zero3", "ref.fsdp", "torch.fsdp2", "deepspeed.zero2")


def _with_accumulation_check(name, validate):
    """``validate`` and, for a row outside ACCUMULATES_LOCALLY, a refusal of reduce_every_micro_batch false."""

    def check(case, o, cfg):
        if validate is not None:
            validate(case, o, cfg)
        if not o.reduce_every_micro_batch and name not in ACCUMULATES_LOCALLY:
            raise ValueError(
                f"{name}: option reduce_every_micro_batch = false is implemented by {', '.join(ACCUMULATES_LOCALLY)} only"
            )

    return check


def _row(name, builder, kind, description, expect, fp8=False, **kw):
    """A sharded row; ``fp8``: its builder converts the linears (``parabench.fp8.convert``). DeepSpeed's
    engines keep 16-bit parameters with fp32 masters and refuse option compile."""
    if name.startswith("deepspeed."):
        kw.setdefault("compile_unsupported", DEEPSPEED_NO_COMPILE)
    recipes = MASTER_ONLY if name.startswith("deepspeed.") else {}
    recipes = with_fp8(recipes) if fp8 else recipes
    if kind == "peer":
        kw.setdefault("validate", validate_fp8_all_gather)
    kw["validate"] = _with_accumulation_check(name, kw.get("validate"))
    return StrategySpec(
        name,
        "sharded",
        builder,
        kind,
        description,
        precisions=DP_PRECISIONS,
        options=kw.pop("options", None)
        or (
            (DeepSpeedZeroOptions if name.startswith("deepspeed.") else ShardedPeerOptions)
            if kind == "peer"
            else ShardedOptions
        ),
        expect=expect,
        **recipes,
        **kw,
    )


_DS = "parabench.peers.deepspeed_zero"
_REF = "parabench.builders.sharded"
ROWS = (
    _row(
        "torch.fsdp2",
        "parabench.peers.torch_fsdp2:build",
        "peer",
        "PyTorch FSDP2 fully_shard per transformer block + root (ZeRO-3 style)",
        expect_torch_fsdp2,
        fp8=True,
        layouts=ANY_LAYOUT,
        compile_unsupported=None,
        version="4",  # 4: tuned groups as torchtitan; 3: matched reduces in the compute dtype; 2: tuned by default
        grad_reduce=fsdp2_reduce_dtype,
        plan=PlanFacts(
            family="sharded",
            search=("data_parallel",),
            search_order=10,
            grad_sync="per_unit",
            per_unit_launches=True,
            zero_stage=3,
            fp32_sharded_params=True,
            host_bound=True,
            device_copies="fsdp2",
            compiled_gc_remedy=True,
        ),
    ),
    _row(
        "torch.hsdp",
        "parabench.peers.torch_fsdp2:build_hsdp",
        "peer",
        "PyTorch FSDP2 hybrid shard: 2-D (replicate, shard) mesh, option shard_size (default 2)",
        expect_torch_hsdp,
        layouts=ANY_LAYOUT,
        compile_unsupported=None,
        min_world_size=4,
        version="4",  # 4: tuned groups as torchtitan; 3: matched reduces in the compute dtype; 2: tuned by default
        grad_reduce=fsdp2_reduce_dtype,
        plan=PlanFacts(
            family="sharded",
            search=("data_parallel",),
            search_order=11,
            grad_sync="per_unit",
            per_unit_launches=True,
            zero_stage=3,
            fp32_sharded_params=True,
        ),
    ),
    _row(
        "deepspeed.zero0",
        f"{_DS}:build_zero0",
        "peer",
        "DeepSpeed engine, ZeRO disabled (plain data parallel)",
        deepspeed_expectation(0),
        caveats=(
            (
                "fp16",
                "DeepSpeed 0.19.8, stage 0 fp16 with a client optimizer (FP16_UnfusedOptimizer): "
                "engine.backward never multiplies the loss by the loss scale, but the optimizer step "
                "still divides the gradients by it (2**16), so Adam sees gradients 65536x too small and "
                "the loss barely moves (upstream PR deepspeedai/DeepSpeed#8393; "
                "tests/test_mixed_precision.py::test_deepspeed_zero0_fp16_mechanism).",
            ),
        ),
        version="2",  # 2: the tuned profile by default (1 ran what is now "matched")
        plan=PlanFacts(
            family="sharded",
            own_exposure=True,
            time_factor_cause=(
                "DeepSpeed engine's per-step work beyond the stage-0 terms (``uses_fp16_optimizer``): in "
                "the matched profile the per-tensor FP16_UnfusedOptimizer (a norm, a cast, an unscale and a "
                "copy per tensor) and the throughput timer's host sync"
            ),
            stage0_fp16_optimizer=True,
        ),
    ),
    _row(
        "deepspeed.zero1",
        f"{_DS}:build_zero1",
        "peer",
        "DeepSpeed ZeRO stage 1 (optimizer states partitioned)",
        deepspeed_expectation(1),
        layouts=ANY_LAYOUT,
        version="2",  # 2: the tuned profile by default (1 ran what is now "matched")
        plan=PlanFacts(
            family="sharded",
            search=("data_parallel",),
            search_order=4,
            grad_sync_once_per_step=True,
            own_exposure=True,
            zero_stage=1,
            host_floor_profiles=("tuned",),
            time_factor_cause=(
                "DeepSpeed engine's per-step passes over the gradients beyond the model's work (copies into "
                "its contiguous reduce buckets; in the matched profile also the gradient-norm pass, the "
                "bf16 overflow check and the throughput timer, each with a host sync: docs/results.md, the "
                "tuned profile turns them off)"
            ),
            step_grad_copies=True,
        ),
    ),
    _row(
        "deepspeed.zero2",
        f"{_DS}:build_zero2",
        "peer",
        "DeepSpeed ZeRO stage 2 (+ gradients partitioned)",
        deepspeed_expectation(2),
        layouts=ANY_LAYOUT,
        version="2",  # 2: the tuned profile by default (1 ran what is now "matched")
        plan=PlanFacts(
            family="sharded",
            search=("data_parallel",),
            search_order=6,
            own_exposure=True,
            zero_stage=2,
            host_floor_profiles=("tuned",),
            time_factor_cause="as deepspeed.zero1",
            step_grad_copies=True,
        ),
    ),
    _row(
        "deepspeed.zero3",
        f"{_DS}:build_zero3",
        "peer",
        "DeepSpeed ZeRO stage 3 (+ parameters partitioned)",
        deepspeed_expectation(3),
        layouts=ANY_LAYOUT,
        shares_launch=False,
        version="2",  # 2: the tuned profile by default (1 ran what is now "matched")
        plan=PlanFacts(
            family="sharded",
            search=("data_parallel",),
            search_order=9,
            grad_sync="per_unit",
            own_exposure=True,
            zero_stage=3,
            host_bound=True,
            persistent_grads="flat_partitions",
        ),
    ),
    _row(
        "ref.zero1",
        f"{_REF}:build_zero1",
        "reference",
        "reference ZeRO-1: optimizer states + fp32 master sharded per bucket; reduce-scatter, all-gather",
        ref_zero_expectation(1),
        fp8=True,
        layouts=ANY_LAYOUT,
        compile_unsupported=None,
        version="2",
        plan=PlanFacts(
            family="sharded",
            search=("data_parallel",),
            search_order=3,
            grad_sync="reduce_scatter",
            grad_sync_once_per_step=True,
            zero_stage=1,
            accumulates_into_copy=True,
            whole_grad_beside_shard=True,
        ),
        peers=("deepspeed.zero1",),
    ),
    _row(
        "ref.zero2",
        f"{_REF}:build_zero2",
        "reference",
        "reference ZeRO-2: + gradients reduce-scattered in buckets during backward and freed",
        ref_zero_expectation(2),
        fp8=True,
        layouts=ANY_LAYOUT,
        compile_unsupported=None,
        version="2",
        plan=PlanFacts(
            family="sharded",
            search=("data_parallel",),
            search_order=5,
            grad_sync="reduce_scatter",
            zero_stage=2,
        ),
        peers=("deepspeed.zero2",),
    ),
    _row(
        "ref.zero3",
        f"{_REF}:build_zero3",
        "reference",
        "reference ZeRO-3: per-block flat parameters gathered for forward and backward, every unit resharded",
        ref_sharded_expectation("zero3"),
        fp8=True,
        layouts=ANY_LAYOUT,
        compile_unsupported=None,
        version="3",
        plan=PlanFacts(
            family="sharded",
            search=("data_parallel",),
            search_order=7,
            grad_sync="per_unit",
            per_unit_launches=True,
            zero_stage=3,
            sharded_units="reshard_root",
            device_copies="slot_cast",
        ),
        peers=("torch.fsdp2", "deepspeed.zero3"),
    ),
    _row(
        "ref.fsdp",
        f"{_REF}:build_fsdp",
        "reference",
        "reference FSDP full shard: as ref.zero3 but the root unit stays gathered from forward to backward",
        ref_sharded_expectation("fsdp"),
        fp8=True,
        layouts=ANY_LAYOUT,
        compile_unsupported=None,
        version="3",
        plan=PlanFacts(
            family="sharded",
            search=("data_parallel",),
            search_order=8,
            grad_sync="per_unit",
            per_unit_launches=True,
            zero_stage=3,
            sharded_units="keep_root",
            device_copies="slot_cast",
        ),
        peers=("torch.fsdp2",),
        link_groups="hybrid_shard",
    ),
    _row(
        "ref.hsdp",
        f"{_REF}:build_hsdp",
        "reference",
        "reference hybrid shard: FSDP within shard groups (option shard_size), all-reduce across replicas",
        ref_sharded_expectation("hsdp"),
        layouts=ANY_LAYOUT,
        compile_unsupported=None,
        min_world_size=4,
        version="3",
        plan=PlanFacts(
            family="sharded",
            search=("data_parallel",),
            search_order=12,
            grad_sync="per_unit",
            per_unit_launches=True,
            zero_stage=3,
            sharded_units="keep_root",
        ),
        peers=("torch.hsdp",),
        link_groups="hybrid_shard",
    ),
    _row(
        "ref.zero2_offload",
        f"{_REF}:build_zero2_offload",
        "reference",
        "reference ZeRO-Offload: ZeRO-2 with fp32 master, Adam states and the AdamW update on the CPU",
        expect_ref_zero2_offload,
        version="2",
        compile_unsupported=None,
        plan=PlanFacts(
            family="sharded",
            search=("offload",),
            zero_stage=2,
            offload="cpu",
            time_factor_cause="as deepspeed.zero2_offload",
        ),
        peers=("deepspeed.zero2_offload",),
    ),
    _row(
        "deepspeed.zero2_offload",
        f"{_DS}:build_zero2_offload",
        "peer",
        "DeepSpeed ZeRO-2 + offload_optimizer to CPU (ZeRO-Offload)",
        deepspeed_offload_expectation(2),
        version="2",  # 2: the tuned profile by default (1 ran what is now "matched")
        plan=PlanFacts(
            family="sharded",
            search=("offload",),
            search_order=1,
            own_exposure=True,
            zero_stage=2,
            offload="cpu",
            time_factor_cause=("CPU Adam is host compute, not the host bandwidth the offload term charges"),
        ),
    ),
    _row(
        "deepspeed.zero3_offload",
        f"{_DS}:build_zero3_offload",
        "peer",
        "DeepSpeed ZeRO-3 + offload_optimizer to CPU",
        deepspeed_offload_expectation(3),
        shares_launch=False,
        version="2",  # 2: the tuned profile by default (1 ran what is now "matched")
        plan=PlanFacts(
            family="sharded",
            search=("offload",),
            search_order=2,
            own_exposure=True,
            zero_stage=3,
            offload="cpu",
            host_bound=True,
            time_factor_cause="as deepspeed.zero2_offload",
        ),
    ),
    _row(
        "deepspeed.zero3_nvme",
        "parabench.peers.deepspeed_nvme:build_zero3_nvme",
        "peer",
        "DeepSpeed ZeRO-3 + offload_param and offload_optimizer to NVMe (ZeRO-Infinity, async I/O op)",
        expect_deepspeed_zero3_nvme,
        shares_launch=False,
        unsupported=nvme_unsupported,
        options=DeepSpeedNVMeOptions,
        plan=PlanFacts(
            zero_stage=3,
            offload="nvme",
            host_bound=True,
        ),
        report_sections=("nvme",),
    ),
    _row(
        "ref.zero3_nvme",
        f"{_REF}:build_zero3_nvme",
        "reference",
        "reference ZeRO-Infinity: ref.zero3 with parameter shards and optimizer state in files, read ahead by threads",
        expect_ref_zero3_nvme,
        compile_unsupported=None,
        options=ZeroInfinityOptions,
        version="1",
        plan=PlanFacts(
            zero_stage=3,
            offload="nvme",
            host_bound=True,
        ),
        peers=("deepspeed.zero3_nvme",),
        report_sections=("nvme",),
    ),
    StrategySpec(
        "ref.zero_r",
        "model_parallel",
        "parabench.builders.zero_r:build",
        "reference",
        "reference ZeRO-R over ref.tp: partitioned activation checkpoints (Pa, Pa+cpu), constant-size "
        "gradient buffers, a contiguous activation arena and gradient buffer",
        precisions=("fp32",),
        options=ZeroROptions,
        validate=validate_zero_r,
        expect=expect_ref_zero_r,
        own_loss="it trains ref.tp's model, whose loss runs over vocabulary-parallel logits",
        version="1",
    ),
    _row(
        "torch.fsdp2_offload",
        "parabench.peers.torch_fsdp2:build_offload",
        "peer",
        "PyTorch FSDP2 with CPUOffloadPolicy (sharded params, grads and AdamW on the CPU)",
        expect_torch_fsdp2_offload,
        compile_unsupported=None,
        version="4",  # 4: tuned groups as torchtitan; 3: matched reduces in the compute dtype; 2: tuned by default
        grad_reduce=fsdp2_reduce_dtype,
        plan=PlanFacts(
            family="sharded",
            search=("offload",),
            search_order=3,
            zero_stage=3,
            offload="cpu",
            host_bound=True,
            time_factor_cause="as deepspeed.zero2_offload",
        ),
    ),
    _row(
        "ref.zeropp",
        f"{_REF}:build_zeropp",
        "reference",
        "reference ZeRO++ over ref.zero3: options qwz (int8 weight gathers), hpz (secondary partition), "
        "qgz (quantized gradient all-to-all)",
        ref_zeropp_expectation,
        compile_unsupported=None,
        options=ZeroPPOptions,
        validate=validate_zeropp,
        version="1",
        plan=PlanFacts(
            family="sharded",
            zero_stage=3,
        ),
        peers=("deepspeed.zeropp",),
        link_groups="secondary_partition",
    ),
    _row(
        "deepspeed.zeropp",
        f"{_DS}:build_zeropp",
        "peer",
        "DeepSpeed ZeRO-3 + ZeRO++: zero_quantized_weights (qwz), zero_hpz_partition_size (hpz), "
        "zero_quantized_gradients (qgz)",
        expect_deepspeed_zeropp,
        options=DeepSpeedZeroPPOptions,
        validate=validate_zeropp,
        unsupported=deepspeed_zeropp_unsupported,
        shares_launch=False,
        version="1",
        plan=PlanFacts(
            family="sharded",
            own_exposure=True,
            zero_stage=3,
        ),
        link_groups="two_hop_reduce",
    ),
)
