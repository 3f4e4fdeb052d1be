"""Plain data parallelism: the single-process ground truth, torch DDP, the reference DDP and the
parameter server (``reference_impls/data_parallel.py``), and the pieces every reference
data-parallel builder shares (loss scaler, model, learning-rate spike)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.distributed as dist

from parabench.fp8 import Fp8Filter
from parabench.models import build_model, lm_loss
from parabench.strategies import (
    ANY_LAYOUT,
    DP_PRECISIONS,
    TORCH_PEER_RECIPES,
    CommonOptions,
    PeerProfile,
    StrategySpec,
    TrainSpec,
    as_trainer,
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
class DDPPeerOptions(DataParallelOptions):
    profile: PeerProfile = "tuned"  # strategies.PEER_PROFILE_HELP
    # with option compile: Dynamo's DDPOptimizer (torch._dynamo.config.optimize_ddp, torch's default
    # and torchtitan's "ddp_optimizer") splits each compiled graph at DDP's bucket boundaries so the
    # buckets' all-reduce overlaps backward; false compiles each block as one graph, as without DDP
    ddp_optimizer: bool = True

    RECORDED_DEFAULTS: ClassVar[tuple[str, ...]] = ("profile",)


# --- shared by the reference builders -----------------------------------------------------------


def scaler(spec: TrainSpec, o: LossScaleOptions, groups):
    """fp16: the dynamic loss scaler whose inf check all-reduces over ``groups`` (every group
    holding a shard); None for fp32/bf16, where nothing is scaled and nothing syncs."""
    if spec.precision != "fp16":
        return None
    from reference_impls.mixed_precision import DynamicLossScaler

    return DynamicLossScaler(
        init_scale=float(o.init_scale),
        growth_interval=int(o.growth_interval),
        check=o.scaler_check,
        groups=[g for g in groups if g is not None],
        inject_inf=o.inject_inf,
    )


def common_kwargs(spec: TrainSpec, o: LossScaleOptions, groups=()) -> dict:
    if spec.precision not in DP_PRECISIONS:
        raise ValueError(f"reference data-parallel strategies support fp32, bf16 and fp16, not {spec.precision!r}")
    a = spec.optim
    return dict(
        grad_accum=spec.grad_accum,
        compute_dtype=spec.param_dtype,
        adam=dict(lr=a.lr, betas=a.betas, eps=a.eps, weight_decay=a.weight_decay),
        grad_scaler=scaler(spec, o, groups),
    )


def reference_model(spec: TrainSpec, o: DataParallelOptions):
    """The GPT a reference trains. Under the "amp" recipe its forward runs under torch.autocast (the
    reference then keeps, reduces and updates fp32 parameters: ``compute_dtype`` is fp32); "fp8" is
    "amp" with the blocks' linears in float8 (``parabench.fp8``); under
    "master" the reference casts its flat buffers to bf16/fp16 itself."""
    model = build_model(spec.model, spec.seed, spec.device)
    if spec.recipe == "fp8":  # torchao Float8Linear in the blocks, before the flat buffers see them
        from parabench.fp8 import convert

        convert(model, o.fp8_filter)
    if spec.recipe in ("amp", "fp8") and spec.precision != "fp32":
        model.forward = torch.autocast(device_type=spec.device.type, dtype=spec.compute_dtype)(model.forward)
    if o.activation_checkpointing:
        from reference_impls.activation_checkpointing import checkpoint_blocks

        checkpoint_blocks(model.blocks)
    from parabench.peers.common import compile_blocks

    compile_blocks(model.blocks, spec)  # after checkpointing, before the flat buffers and their hooks
    return model


def with_lr_spike(trainer, o: LossScaleOptions):
    """Option ``lr_spike = {step, factor}``: multiply the learning rate of that one step by factor."""
    spike = o.lr_spike
    if not spike:
        return trainer
    inner, counter = trainer.train_step, [0]

    def train_step(inputs, targets):
        opt = getattr(trainer, "optimizer", None)
        hit = opt is not None and counter[0] == int(spike.get("step", 0))
        if hit:
            saved = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] *= float(spike.get("factor", 10.0))
        try:
            return inner(inputs, targets)
        finally:
            counter[0] += 1
            if hit:
                for g, lr in zip(opt.param_groups, saved):
                    g["lr"] = lr

    trainer.train_step = train_step
    return trainer


def dp_groups(spec: TrainSpec) -> list:
    return [spec.topology.dp_group or dist.group.WORLD]


# --- builders -----------------------------------------------------------------------------------


def build_ps(spec: TrainSpec):
    from reference_impls.data_parallel import ParameterServer

    o = DataParallelOptions.read(spec.options)
    # Only the server decides (it holds the summed gradient): no all-reduce of the inf flag.
    return with_lr_spike(
        as_trainer(ParameterServer)(
            reference_model(spec, o), lm_loss, spec.topology.dp_group, **common_kwargs(spec, o)
        ),
        o,
    )


def build_ddp(spec: TrainSpec):
    from reference_impls.data_parallel import DDP

    o = DataParallelOptions.read(spec.options)
    # Every rank holds the full reduced gradient; the global check still all-reduces the inf flag
    # over the dp group, so an inf that appears on one rank only (after the all-reduce) skips everywhere.
    return with_lr_spike(
        as_trainer(DDP)(
            reference_model(spec, o),
            lm_loss,
            spec.topology.dp_group,
            bucket_mb=float(o.bucket_mb),
            **common_kwargs(spec, o, dp_groups(spec)),
        ),
        o,
    )


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


def validate_single(case, o, cfg) -> None:
    if case.world_size != 1:
        raise ValueError("strategy 'single' runs on world_size 1 only")


def validate_torch_ddp(case, o, cfg) -> None:
    # Dynamo's DDPOptimizer gives its first bucket DDP's 1 MiB and asserts that no other bucket is smaller
    if case.options.get("compile") and o.ddp_optimizer and o.bucket_mb < 1:
        raise ValueError(
            f"torch.ddp with compile and ddp_optimizer needs bucket_mb >= 1 (Dynamo's DDPOptimizer makes its first "
            f"bucket 1 MiB and no other may be smaller), not {o.bucket_mb}: raise bucket_mb or set ddp_optimizer = false"
        )


# Option compile: these builders compile the blocks (peers.common.compile_blocks); the others refuse it.
COMPILES = ("single", "torch.ddp", "ref.ddp", "ref.ps")
# Recipe fp8: these builders convert the linears (parabench.fp8.convert).
TAKES_FP8 = ("single", "torch.ddp", "ref.ddp")


# Layouts: these take the fused-qkv model too (StrategySpec.layouts; the rest train the separate one).
ANY_LAYOUT_STRATEGIES = ("single", "torch.ddp", "ref.ddp")


def _row(name, builder, kind, description, expect, options=DataParallelOptions, **kw):
    if name in COMPILES:
        kw.setdefault("compile_unsupported", None)
    if name in ANY_LAYOUT_STRATEGIES:
        kw.setdefault("layouts", ANY_LAYOUT)
    recipes = TORCH_PEER_RECIPES if kind == "peer" or name == "single" else {}
    recipes = with_fp8(recipes) if name in TAKES_FP8 else recipes
    return StrategySpec(
        name,
        "data_parallel",
        builder,
        kind,
        description,
        precisions=DP_PRECISIONS,
        options=options,
        expect=expect,
        **recipes,
        **kw,
    )


ROWS = (
    _row(
        "single",
        "parabench.peers.single:build",
        "reference",
        "one process, no parallelism: the ground truth the others are checked against",
        expect_torch_ddp,
        validate=validate_single,
    ),
    _row(
        "torch.ddp",
        "parabench.peers.torch_ddp:build",
        "peer",
        "PyTorch DistributedDataParallel (bucketed all-reduce overlapped with backward)",
        expect_torch_ddp,
        options=DDPPeerOptions,
        validate=validate_torch_ddp,
    ),
    _row(
        "ref.ps",
        "parabench.families.data_parallel:build_ps",
        "reference",
        "reference parameter server: gradients sent to rank 0, AdamW there, parameters broadcast",
        expect_ref_ps,
    ),
    _row(
        "ref.ddp",
        "parabench.families.data_parallel:build_ddp",
        "reference",
        "reference DDP: bucketed all-reduce from grad hooks, overlapped with backward (option bucket_mb)",
        expect_ref_ddp,
    ),
)
