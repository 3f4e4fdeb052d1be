"""Plain data parallelism: the single-process ground truth, torch DDP, the reference DDP and the
parameter server (``reference_impls/data_parallel.py``), and the options every data-parallel
family extends (loss scaling, buckets, fp8 filter; their builders share ``parabench.builders.data_parallel``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from parabench.fp8 import Fp8Filter
from parabench.strategies import (
    ANY_LAYOUT,
    DP_PRECISIONS,
    TORCH_PEER_RECIPES,
    CommonOptions,
    PeerProfile,
    PlanFacts,
    StrategySpec,
    with_fp8,
)
from parabench.theory import (
    BYTES,
    Expectation,
    psi,
    recipe_state_bytes,
    ref_bucket_sizes,
    volume,
    zero_paper_state_bytes,
)


@dataclass(frozen=True)
class LossScaleOptions(CommonOptions):
    """Options of the strategies that train in fp16 (and of the faults that test their scaling)."""

    init_scale: float = 2.0**16  # fp16: the dynamic loss scale to start from
    growth_interval: int = 2000  # fp16: clean steps before the loss scale doubles
    scaler_check: Literal["global", "local"] = (
        "global"  # fp16 references: inf check over every shard, or per rank (broken on purpose)
    )
    inject_inf: dict | None = (
        None  # fp16 test hook {rank, step, where = "shard" | "backward"}: an inf in that rank's gradient
    )
    lr_spike: dict | None = None  # {step, factor}: that one step's learning rate times factor
    activation_checkpointing: bool = False  # recompute every transformer block in backward


@dataclass(frozen=True)
class DataParallelOptions(LossScaleOptions):
    bucket_mb: float = 25.0  # gradient bucket size in MiB of the compute dtype (torch DDP's bucket_cap_mb too)
    # recipe fp8: which linears become float8, "all" (torchtitan's default) or "auto" (torchao's
    # tensorwise auto filter: large K or N only); parabench.fp8.module_filter
    fp8_filter: Fp8Filter = "all"


@dataclass(frozen=True)
class RefDDPOptions(DataParallelOptions):
    # with option compile: split each compiled block's graph at gradient buckets of bucket_mb, as
    # Dynamo's DDPOptimizer does for torch.ddp (peers.common.bucket_split_backend); false compiles
    # each block as one graph
    ddp_optimizer: bool = False


@dataclass(frozen=True)
class DDPPeerOptions(DataParallelOptions):
    profile: PeerProfile = "tuned"  # strategies.PEER_PROFILE_HELP
    # with option compile: Dynamo's DDPOptimizer (torch._dynamo.config.optimize_ddp, torch's default
    # and torchtitan's "ddp_optimizer") splits each compiled graph at DDP's bucket boundaries so the
    # buckets' all-reduce overlaps backward; false compiles each block as one graph, as without DDP
    ddp_optimizer: bool = True

    RECORDED_DEFAULTS: ClassVar[tuple[str, ...]] = ("profile",)

    def bucket_cap_mb(self, given: dict) -> float:
        """DDP's ``bucket_cap_mb``: option ``bucket_mb`` where the case gives it; else the tuned
        profile's ``TUNED_DDP_BUCKET_MB`` and the matched profile's 25 MiB (DDP's default, and the
        references' ``bucket_mb``)."""
        if "bucket_mb" in given or self.profile != "tuned":
            return float(self.bucket_mb)
        return TUNED_DDP_BUCKET_MB


# torchtitan's DDP setup (``apply_ddp``: ``replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)``,
# torchtitan/models/llama3/parallelize.py up to commit e1847f4, which replaced DDP with FSDP2's
# replicate). On 2 H100s, gpt-1.3b bf16-amp compiled mb 4, one launch each: 46,006 tok/s per GPU at 25 MiB,
# 47,716 at 100 (results/studies/fp8-peers-gpu/20261127-062328).
TUNED_DDP_BUCKET_MB = 100.0


@dataclass(frozen=True)
class AsyncPSOptions(DataParallelOptions):
    # ref.ps_async: how many updates old the parameters a gradient is computed on may be (the bounded
    # delay τ of Li et al. 2014, Sec. 3); 0 is the synchronous parameter server, bit for bit
    max_staleness: int = 1


# --- expectations -------------------------------------------------------------------------------


def expect_torch_ddp(cfg, case, o, dp):
    p = psi(cfg)
    # DDP all-reduces even on a one-rank group (measured on 1 GPU: a copy, no wire traffic; the
    # wire estimate 2(n-1)/n x payload is then 0); only the plain single-process trainer sends nothing.
    e = BYTES[case.param_precision]
    comm = {"all_reduce": e * p} if case.strategy == "torch.ddp" else {}
    return Expectation(
        state_bytes=recipe_state_bytes(case, p),
        comm_payload_bytes=comm,
        paper_state_bytes=zero_paper_state_bytes(0, p, dp),
        notes="amp: fp32 parameters and gradients, autocast forward; master: bf16/fp16 parameters and "
        "gradients, fp32 master copy; Adam moments fp32; one all-reduce of all gradients per step in the "
        "parameter dtype (no_sync during accumulation).",
    )


# The reference layouts are restated here, not imported, so that a change in the code shows up as
# a mismatch with the measurement. b = bytes of the compute dtype; Ψ the parameter count; N the
# data-parallel degree.


def expect_ref_ddp(cfg, case, o, dp):
    p, b, mixed = psi(cfg), BYTES[case.param_precision], case.param_precision != "fp32"
    buckets = ref_bucket_sizes(cfg, b, float(o.bucket_mb), 1)
    return Expectation(
        state_bytes={
            "params": b * p,
            "grads": b * p + (4 * p if mixed else 0),
            "optimizer": 8 * p + (4 * p if mixed else 0),
        },
        comm_payload_bytes={"all_reduce": volume(b * n for n in buckets)},
        paper_state_bytes=zero_paper_state_bytes(0, p, dp),
        notes="flat buffers, no padding. fp32: 4Ψ params (= the master) + 4Ψ grads + 8Ψ Adam = 16Ψ. bf16: 2Ψ "
        "params + 2Ψ grads + 4Ψ fp32 main gradient (made just before the update) + 4Ψ master + 8Ψ Adam = "
        "20Ψ (paper 16Ψ: it does not count the fp32 gradient). One all-reduce per bucket per step, in "
        "the compute dtype (bf16 on the wire for bf16); no_sync during accumulation.",
    )


def expect_ref_ps(cfg, case, o, dp):
    p, b, mixed = psi(cfg), BYTES[case.param_precision], case.param_precision != "fp32"
    server_state = {
        "params": b * p,
        "grads": 2 * b * p + (4 * p if mixed else 0),
        "optimizer": 8 * p + (4 * p if mixed else 0),
    }
    worker_state = {"params": b * p, "grads": b * p, "optimizer": 0}
    server_comm = {**({"recv": (dp - 1) * b * p} if dp > 1 else {}), "broadcast": b * p}
    worker_comm = {"send": b * p, "broadcast": b * p}
    return Expectation(
        state_bytes=[server_state] + [worker_state] * (dp - 1),
        comm_payload_bytes=server_comm,
        comm_payload_bytes_per_rank=[server_comm] + [worker_comm] * (dp - 1),
        paper_state_bytes=zero_paper_state_bytes(0, p, dp),
        notes="figures for the server (rank 0), the busiest rank: own gradient + one receive buffer (+ the fp32 "
        "main gradient in bf16), master and Adam moments; it receives (N-1) gradients per step. A worker "
        "holds bΨ params + bΨ grads, no optimizer state, and moves send bΨ + broadcast bΨ.",
    )


def expect_ref_ps_async(cfg, case, o, dp):
    p, b, mixed = psi(cfg), BYTES[case.param_precision], case.param_precision != "fp32"
    server_comm = {"recv": (dp - 1) * b * p, "send": (dp - 1) * b * p} if dp > 1 else {}
    return Expectation(
        # the server's snapshots in flight and a worker's versions received per step vary with timing
        state_bytes=None,
        comm_payload_bytes=server_comm,
        paper_state_bytes=zero_paper_state_bytes(0, p, dp),
        notes="server (rank 0), per step: receives (N-1) gradients and sends each worker the new parameters, "
        f"(N-1)·bΨ each way (b = {b}); it holds the fp32 master{' and main gradient' if mixed else ''}, Adam moments "
        "and up to max_staleness + 1 parameter snapshots in flight. A worker sends bΨ and receives 0 to "
        "max_staleness + 1 versions in a step (bΨ each), so its traffic per step is not fixed.",
    )


def validate_ps_async(case, o, cfg) -> None:
    if case.precision == "fp16":
        raise ValueError("ref.ps_async has no loss scaling: train it in fp32 or bf16")
    if int(o.max_staleness) < 0:
        raise ValueError(f"ref.ps_async: max_staleness must be >= 0, not {o.max_staleness}")


def validate_single(case, o, cfg) -> None:
    if case.world_size != 1:
        raise ValueError("strategy 'single' runs on world_size 1 only")


def validate_torch_ddp(case, o, cfg) -> None:
    # Dynamo's DDPOptimizer gives its first bucket DDP's 1 MiB and asserts that no other bucket is smaller
    if case.options.get("compile") and o.ddp_optimizer and o.bucket_cap_mb(case.options) < 1:
        raise ValueError(
            f"torch.ddp with compile and ddp_optimizer needs bucket_mb >= 1 (Dynamo's DDPOptimizer makes its first "
            f"bucket 1 MiB and no other may be smaller), not {o.bucket_mb}: raise bucket_mb or set ddp_optimizer = false"
        )


def _row(name, builder, kind, description, expect, options=DataParallelOptions, fp8=False, **kw):
    """A data-parallel row; ``fp8``: its builder converts the linears (``parabench.fp8.convert``), so
    it takes the fp8 recipe beside the others it declares."""
    return StrategySpec(
        name,
        "data_parallel",
        builder,
        kind,
        description,
        precisions=DP_PRECISIONS,
        options=options,
        expect=expect,
        **(with_fp8(kw) if fp8 else kw),
    )


ROWS = (
    _row(
        "single",
        "parabench.peers.single:build",
        "reference",
        "one process, no parallelism: the ground truth the others are checked against",
        expect_torch_ddp,
        **TORCH_PEER_RECIPES,
        fp8=True,
        layouts=ANY_LAYOUT,
        compile_unsupported=None,
        validate=validate_single,
        plan=PlanFacts(
            family="data_parallel",
            search=("one_gpu",),
            master_grad_buffer=True,
        ),
    ),
    _row(
        "torch.ddp",
        "parabench.peers.torch_ddp:build",
        "peer",
        "PyTorch DistributedDataParallel (bucketed all-reduce overlapped with backward)",
        expect_torch_ddp,
        **TORCH_PEER_RECIPES,
        fp8=True,
        layouts=ANY_LAYOUT,
        compile_unsupported=None,
        options=DDPPeerOptions,
        validate=validate_torch_ddp,
        version="2",  # 2: the tuned profile's buckets are torchtitan's 100 MiB (1: DDP's default 25)
        report_sections=("compression_to_loss",),  # the plain baseline the compressors are measured against
        plan=PlanFacts(
            family="data_parallel",
            search=("data_parallel",),
            search_order=2,
            grad_sync="all_reduce",
            grad_sync_once_per_step=True,
            persistent_grads="buckets",
            accumulates_into_copy=True,
            master_grad_buffer=True,
            device_copies="bucket_div",
            compiled_bucket_split=True,
        ),
    ),
    _row(
        "ref.ps",
        "parabench.builders.data_parallel:build_ps",
        "reference",
        "reference parameter server: gradients sent to rank 0, AdamW there, parameters broadcast",
        expect_ref_ps,
        compile_unsupported=None,
        plan=PlanFacts(
            family="data_parallel",
            persistent_grads="server",
        ),
    ),
    _row(
        "ref.ps_async",
        "parabench.builders.data_parallel:build_ps_async",
        "reference",
        "reference asynchronous parameter server: bounded staleness (option max_staleness), no barrier; "
        "the staleness histogram in strategy_stats",
        expect_ref_ps_async,
        compile_unsupported=None,
        options=AsyncPSOptions,
        validate=validate_ps_async,
        plan=PlanFacts(
            family="data_parallel",
            persistent_grads="server",
        ),
    ),
    _row(
        "ref.ddp",
        "parabench.builders.data_parallel:build_ddp",
        "reference",
        "reference DDP: bucketed all-reduce from grad hooks, overlapped with backward (option bucket_mb)",
        expect_ref_ddp,
        fp8=True,
        layouts=ANY_LAYOUT,
        compile_unsupported=None,
        options=RefDDPOptions,
        plan=PlanFacts(
            family="data_parallel",
            search=("data_parallel",),
            search_order=1,
            grad_sync="all_reduce",
            grad_sync_once_per_step=True,
            persistent_grads="flat",
            device_copies="flat_grad_zero",
            compiled_bucket_split=True,
        ),
        peers=("torch.ddp", "deepspeed.zero0"),
        report_sections=("compression_to_loss",),  # the plain baseline the compressors are measured against
    ),
)
