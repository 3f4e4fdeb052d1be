"""Builders of the reference data-parallel strategies (``reference_impls/data_parallel.py``) and
the pieces every reference data-parallel builder shares (loss scaler, model, learning-rate spike)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parabench.families.data_parallel import DataParallelOptions, LossScaleOptions
from parabench.models import build_model, lm_loss
from parabench.strategies import DP_PRECISIONS
from parabench.trainer import TrainSpec, as_trainer

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


def reference_model(spec: TrainSpec, o: DataParallelOptions, split_bucket_bytes: int | None = None):
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

    compile_blocks(model.blocks, spec, split_bucket_bytes)  # after checkpointing, before the flat buffers and hooks
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
    from parabench.families.data_parallel import RefDDPOptions
    from reference_impls.data_parallel import DDP

    o = RefDDPOptions.read(spec.options)
    split = int(o.bucket_mb * 2**20) if o.ddp_optimizer else None
    # Every rank holds the full reduced gradient; the global check still all-reduces the inf flag
    # over the dp group, so an inf that appears on one rank only (after the all-reduce) skips everywhere.
    return with_lr_spike(
        as_trainer(DDP)(
            reference_model(spec, o, split),
            lm_loss,
            spec.topology.dp_group,
            bucket_mb=float(o.bucket_mb),
            **common_kwargs(spec, o, dp_groups(spec)),
        ),
        o,
    )


def build_ps_async(spec: TrainSpec):
    from parabench.families.data_parallel import AsyncPSOptions
    from reference_impls.async_ps import AsyncParameterServer

    o = AsyncPSOptions.read(spec.options)
    trainer = as_trainer(AsyncParameterServer)(
        reference_model(spec, o),
        lm_loss,
        spec.topology.dp_group,
        max_staleness=int(o.max_staleness),
        **common_kwargs(spec, o),
    )
    trainer.strategy_stats = trainer.staleness_stats
    return with_lr_spike(trainer, o)
