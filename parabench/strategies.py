"""The Strategy interface shared by reference implementations and peer adapters, and the registry.

A strategy is a builder ``build(spec: TrainSpec) -> Trainer``. The runner never special-cases
a library: it builds a trainer, feeds it this rank's slice of every global batch, and asks it
for the memory it holds. Builders are named by import path and imported only when used, so a
case with ``torch.ddp`` never imports DeepSpeed.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from parabench.models import GPTConfig
from parabench.topology import Topology

PRECISIONS = ("fp32", "bf16", "fp16")
# Data-parallel strategies also train in fp16 (fp32 master weights + dynamic loss scaling).
DP_PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, every hyperparameter explicit: library defaults differ (weight decay above all)."""

    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)


@dataclass
class TrainSpec:
    """Everything a strategy needs to build its trainer on this rank."""

    model: GPTConfig
    seed: int
    device: torch.device
    precision: str
    topology: Topology
    micro_batch: int
    grad_accum: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)
    options: dict = field(default_factory=dict)

    @property
    def compute_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.precision]


class Trainer(ABC):
    """One rank's view of a training run under some strategy."""

    @abstractmethod
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step over this rank's data-parallel slice, ``[grad_accum * micro_batch, s]``.

        Returns the mean loss over the slice as a detached 0-d tensor (not synchronised to the
        host, so the step does not stall), or None on ranks that never see the loss (pipeline
        stages before the last).
        """

    @abstractmethod
    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds: keys ``params``, ``grads``, ``optimizer``
        (master weights count under optimizer)."""

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        """Every parameter of the full model as fp32 CPU tensors keyed by the GPT's own names.

        A collective: call it on every rank. Used by equivalence tests; None if unsupported.
        """
        return None

    def loss_scale(self) -> dict | None:
        """For fp16 runs: ``{"scale": float, "skipped": bool}`` for the last step, else None."""
        return None

    def close(self) -> None:
        """Release what the strategy holds (called between cases that share a launch)."""


@dataclass(frozen=True)
class StrategyInfo:
    name: str
    builder: str  # "module:function"
    kind: str  # "peer" or "reference"
    description: str
    precisions: tuple[str, ...] = ("fp32", "bf16")
    min_world_size: int = 1
    version: str = "1"  # bump when the implementation changes what it measures
    # False for strategies that leave state behind in the process (device memory, global hooks)
    # after close(): the runner then gives each of their cases a launch of its own, so the
    # next case is not measured on a contaminated process.
    shares_launch: bool = True
    # (precision, text): known behaviour of the implementation a reader of its numbers must know,
    # copied into every record of that precision and shown in the report beside the case.
    caveats: tuple[tuple[str, str], ...] = ()

    def caveats_for(self, precision: str) -> list[str]:
        return [text for p, text in self.caveats if p == precision]

    def build(self, spec: TrainSpec) -> Trainer:
        module, func = self.builder.split(":")
        return getattr(importlib.import_module(module), func)(spec)


STRATEGIES: dict[str, StrategyInfo] = {}


def register(info: StrategyInfo) -> None:
    if info.name in STRATEGIES:
        raise ValueError(f"strategy {info.name!r} registered twice")
    STRATEGIES[info.name] = info


def get_strategy(name: str) -> StrategyInfo:
    if name not in STRATEGIES:
        raise KeyError(f"unknown strategy {name!r}; valid strategies: {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]


# Peer adapters (parabench/peers/) and reference implementations (reference_impls/, adapted in
# parabench/reference_adapters.py). Add a strategy by appending one line here.
_BUILTIN = (
    StrategyInfo("single", "parabench.peers.single:build", "reference",
                 "one process, no parallelism: the ground truth the others are checked against", precisions=DP_PRECISIONS),
    StrategyInfo("torch.ddp", "parabench.peers.torch_ddp:build", "peer",
                 "PyTorch DistributedDataParallel (bucketed all-reduce overlapped with backward)", precisions=DP_PRECISIONS),
    StrategyInfo("torch.fsdp2", "parabench.peers.torch_fsdp2:build", "peer",
                 "PyTorch FSDP2 fully_shard per transformer block + root (ZeRO-3 style)", precisions=DP_PRECISIONS),
    StrategyInfo("torch.hsdp", "parabench.peers.torch_fsdp2:build_hsdp", "peer",
                 "PyTorch FSDP2 hybrid shard: 2-D (replicate, shard) mesh, option shard_size (default 2)",
                 precisions=DP_PRECISIONS, min_world_size=4),
    StrategyInfo("deepspeed.zero0", "parabench.peers.deepspeed_zero:build_zero0", "peer",
                 "DeepSpeed engine, ZeRO disabled (plain data parallel)", precisions=DP_PRECISIONS,
                 caveats=(("fp16", "DeepSpeed 0.19.8, stage 0 fp16 with a client optimizer (FP16_UnfusedOptimizer): "
                           "engine.backward never multiplies the loss by the loss scale, but the optimizer step "
                           "still divides the gradients by it (2**16), so Adam sees gradients 65536x too small and "
                           "the loss barely moves (upstream PR deepspeedai/DeepSpeed#8393; "
                           "tests/test_mixed_precision.py::test_deepspeed_zero0_fp16_mechanism)."),)),
    StrategyInfo("deepspeed.zero1", "parabench.peers.deepspeed_zero:build_zero1", "peer",
                 "DeepSpeed ZeRO stage 1 (optimizer states partitioned)", precisions=DP_PRECISIONS),
    StrategyInfo("deepspeed.zero2", "parabench.peers.deepspeed_zero:build_zero2", "peer",
                 "DeepSpeed ZeRO stage 2 (+ gradients partitioned)", precisions=DP_PRECISIONS),
    StrategyInfo("deepspeed.zero3", "parabench.peers.deepspeed_zero:build_zero3", "peer",
                 "DeepSpeed ZeRO stage 3 (+ parameters partitioned)", precisions=DP_PRECISIONS,
                 shares_launch=False),
    StrategyInfo("ref.ps", "parabench.reference_adapters:build_ps", "reference",
                 "reference parameter server: gradients sent to rank 0, AdamW there, parameters broadcast", precisions=DP_PRECISIONS),
    StrategyInfo("ref.ddp", "parabench.reference_adapters:build_ddp", "reference",
                 "reference DDP: bucketed all-reduce from grad hooks, overlapped with backward (option bucket_mb)", precisions=DP_PRECISIONS),
    StrategyInfo("ref.zero1", "parabench.reference_adapters:build_zero1", "reference",
                 "reference ZeRO-1: optimizer states + fp32 master sharded per bucket; reduce-scatter, all-gather", precisions=DP_PRECISIONS, version="2"),
    StrategyInfo("ref.zero2", "parabench.reference_adapters:build_zero2", "reference",
                 "reference ZeRO-2: + gradients reduce-scattered in buckets during backward and freed", precisions=DP_PRECISIONS, version="2"),
    StrategyInfo("ref.zero3", "parabench.reference_adapters:build_zero3", "reference",
                 "reference ZeRO-3: per-block flat parameters gathered for forward and backward, every unit resharded", precisions=DP_PRECISIONS, version="3"),
    StrategyInfo("ref.fsdp", "parabench.reference_adapters:build_fsdp", "reference",
                 "reference FSDP full shard: as ref.zero3 but the root unit stays gathered from forward to backward", precisions=DP_PRECISIONS, version="3"),
    StrategyInfo("ref.hsdp", "parabench.reference_adapters:build_hsdp", "reference",
                 "reference hybrid shard: FSDP within shard groups (option shard_size), all-reduce across replicas",
                 min_world_size=4, precisions=DP_PRECISIONS, version="3"),
    StrategyInfo("ref.zero2_offload", "parabench.reference_adapters:build_zero2_offload", "reference",
                 "reference ZeRO-Offload: ZeRO-2 with fp32 master, Adam states and the AdamW update on the CPU",
                 precisions=DP_PRECISIONS, version="2"),
    StrategyInfo("deepspeed.zero2_offload", "parabench.peers.deepspeed_zero:build_zero2_offload", "peer",
                 "DeepSpeed ZeRO-2 + offload_optimizer to CPU (ZeRO-Offload)", precisions=DP_PRECISIONS),
    StrategyInfo("deepspeed.zero3_offload", "parabench.peers.deepspeed_zero:build_zero3_offload", "peer",
                 "DeepSpeed ZeRO-3 + offload_optimizer to CPU", precisions=DP_PRECISIONS, shares_launch=False),
    StrategyInfo("torch.fsdp2_offload", "parabench.peers.torch_fsdp2:build_offload", "peer",
                 "PyTorch FSDP2 with CPUOffloadPolicy (sharded params, grads and AdamW on the CPU)",
                 precisions=DP_PRECISIONS),
    StrategyInfo("ref.tp", "parabench.reference_adapters_mp:build_tp", "reference",
                 "Megatron tensor parallel: f/g operators, column/row-parallel layers, vocab-parallel "
                 "embedding and cross-entropy (options tp, pp; x dp)"),
    StrategyInfo("ref.tp_sp", "parabench.reference_adapters_mp:build_tp_sp", "reference",
                 "Megatron tensor + sequence parallel: all-gather/reduce-scatter along the sequence"),
    StrategyInfo("ref.pp_gpipe", "parabench.reference_adapters_mp:build_pp_gpipe", "reference",
                 "GPipe pipeline over send/recv (options pp, microbatches, tp, sp; x dp)"),
    StrategyInfo("ref.pp_1f1b", "parabench.reference_adapters_mp:build_pp_1f1b", "reference",
                 "1F1B (PipeDream-Flush) pipeline over send/recv (options pp, microbatches, tp, sp; x dp)"),
    StrategyInfo("torch.tp", "parabench.peers.torch_tp:build_tp", "peer",
                 "PyTorch DTensor parallelize_module, ColwiseParallel/RowwiseParallel over the tp mesh"),
    StrategyInfo("torch.tp_sp", "parabench.peers.torch_tp:build_tp_sp", "peer",
                 "PyTorch DTensor tensor parallel + SequenceParallel LayerNorms"),
    StrategyInfo("torch.pp_gpipe", "parabench.peers.torch_pipeline:build_gpipe", "peer",
                 "torch.distributed.pipelining PipelineStage + ScheduleGPipe", version="2"),
    StrategyInfo("torch.pp_1f1b", "parabench.peers.torch_pipeline:build_1f1b", "peer",
                 "torch.distributed.pipelining PipelineStage + Schedule1F1B", version="2"),
    StrategyInfo("torch.pp_interleaved", "parabench.peers.torch_pipeline:build_interleaved", "peer",
                 "torch.distributed.pipelining ScheduleInterleaved1F1B, virtual_stages (default 2) chunks per rank", version="2"),
    StrategyInfo("deepspeed.pp", "parabench.peers.deepspeed_pipe:build", "peer",
                 "DeepSpeed pipeline engine: PipelineModule (parabench's stage split) + engine.train_batch, "
                 "TrainSchedule (1F1B), blocking send/recv, ZeRO-0 with the client AdamW (options pp = world_size, "
                 "microbatches; no dp/tp)", min_world_size=2),
    StrategyInfo("ref.cp_ring", "parabench.reference_adapters_cp_ep:build_cp_ring", "reference",
                 "ring attention context parallel: K/V round the ring over send/recv, fused block kernels, "
                 "log-sum-exp merge, ring backward (option cp_split = zigzag | contiguous)", min_world_size=2,
                 version="3"),
    StrategyInfo("ref.cp_ulysses", "parabench.reference_adapters_cp_ep:build_cp_ulysses", "reference",
                 "DeepSpeed-Ulysses context parallel: all-to-all sequence shards <-> head shards around attention",
                 min_world_size=2),
    StrategyInfo("ref.ep", "parabench.reference_adapters_cp_ep:build_ep", "reference",
                 "expert parallel MoE: experts sharded, tokens dispatched/combined with all-to-all (counts first), "
                 "dense parameters all-reduced", min_world_size=2, version="2"),
    StrategyInfo("deepspeed.ulysses", "parabench.peers.cp_ep_peers:build_deepspeed_ulysses", "peer",
                 "DeepSpeed-Ulysses DistributedAttention (deepspeed.sequence.layer) around SDPA; gradients "
                 "all-reduced over the cp group", min_world_size=2),
    StrategyInfo("deepspeed.moe", "parabench.peers.cp_ep_peers:build_deepspeed_moe", "peer",
                 "DeepSpeed-MoE (deepspeed.moe.layer.MoE, top-2, deterministic gate; capacity mode for models with a "
                 "capacity factor, else dropless) in the MoE blocks; ZeRO-0 engine reduces expert / non-expert gradients",
                 min_world_size=2),
    StrategyInfo("torch.cp", "parabench.peers.cp_ep_peers:build_torch_cp", "peer",
                 "torch.distributed.tensor.experimental.context_parallel (ring attention); CUDA only",
                 min_world_size=2),
    StrategyInfo("ref.ddp_fp16_compress", "parabench.reference_adapters_compression:build_ddp_fp16_compress",
                 "reference", "reference DDP with fp16 gradients on the wire (cast, all-reduce, cast back)"),
    StrategyInfo("ref.ddp_onebit", "parabench.reference_adapters_compression:build_ddp_onebit", "reference",
                 "reference DDP, 1-bit sign compression + per-tensor scale, error feedback; all-gather of packed "
                 "signs (option error_feedback)"),
    StrategyInfo("ref.ddp_topk", "parabench.reference_adapters_compression:build_ddp_topk", "reference",
                 "reference DDP, top-k sparsification with residual accumulation; all-gather of values + int32 "
                 "indices (options topk_ratio, error_feedback)"),
    StrategyInfo("ref.ddp_powersgd", "parabench.reference_adapters_compression:build_ddp_powersgd", "reference",
                 "reference DDP, PowerSGD rank-r (P = MQ, all-reduce, orthogonalise, Q = M^T P, all-reduce), "
                 "warm start, error feedback (options powersgd_rank, error_feedback)"),
    StrategyInfo("ref.local_sgd", "parabench.reference_adapters_compression:build_local_sgd", "reference",
                 "local SGD: ranks step alone, parameters + optimizer states averaged every sync_every steps "
                 "(options sync_every, average_optimizer_state, local_optimizer)"),
    StrategyInfo("torch.ddp_fp16_hook", "parabench.peers.torch_ddp_hooks:build_fp16", "peer",
                 "PyTorch DDP + default_hooks.fp16_compress_hook"),
    StrategyInfo("torch.ddp_powersgd_hook", "parabench.peers.torch_ddp_hooks:build_powersgd", "peer",
                 "PyTorch DDP + powerSGD_hook (rank powersgd_rank, start_powerSGD_iter 2, min_compression_rate 1)"),
    StrategyInfo("deepspeed.onebit_adam", "parabench.peers.torch_ddp_hooks:build_deepspeed_onebit_adam", "peer",
                 "DeepSpeed 1-bit Adam (\"OneBitAdam\" optimizer); needs a DeepSpeed that ships it (not 0.19.x)"),
)
for _info in _BUILTIN:
    register(_info)
