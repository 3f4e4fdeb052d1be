"""Builders of the reference gradient compression strategies and local SGD
(``reference_impls/compression.py``)."""

from __future__ import annotations

from parabench.builders.data_parallel import reference_model
from parabench.families.compression import CompressionOptions
from parabench.models import lm_loss
from parabench.trainer import TrainSpec, as_trainer

# --- reference builders -------------------------------------------------------------------------


def _kwargs(spec: TrainSpec) -> dict:
    """fp32 or bf16 (no loss scaler: fp16 training with compressed gradients is not covered)."""
    if spec.precision not in ("fp32", "bf16"):
        raise ValueError(f"compression references support fp32 and bf16, not {spec.precision!r}")
    a = spec.optim
    return dict(
        grad_accum=spec.grad_accum,
        compute_dtype=spec.param_dtype,
        adam=dict(lr=a.lr, betas=a.betas, eps=a.eps, weight_decay=a.weight_decay),
    )


def _compressed(spec: TrainSpec, compressor):
    from reference_impls.compression import CompressedDDP

    o = CompressionOptions.read(spec.options)
    return as_trainer(CompressedDDP)(
        reference_model(spec, o),
        lm_loss,
        spec.topology.dp_group,
        compressor=compressor,
        bucket_mb=float(o.bucket_mb),
        **_kwargs(spec),
    )


def build_ddp_fp16_compress(spec: TrainSpec):
    from reference_impls.compression import FP16Compressor

    return _compressed(spec, FP16Compressor())


def build_ddp_onebit(spec: TrainSpec):
    from reference_impls.compression import OneBitCompressor

    return _compressed(spec, OneBitCompressor(error_feedback=CompressionOptions.read(spec.options).error_feedback))


def build_ddp_topk(spec: TrainSpec):
    from reference_impls.compression import TopKCompressor

    o = CompressionOptions.read(spec.options)
    return _compressed(spec, TopKCompressor(float(o.topk_ratio), error_feedback=o.error_feedback))


def build_ddp_powersgd(spec: TrainSpec):
    from reference_impls.compression import PowerSGDCompressor

    o = CompressionOptions.read(spec.options)
    return _compressed(spec, PowerSGDCompressor(o.powersgd_rank, error_feedback=o.error_feedback, seed=spec.seed))


def build_local_sgd(spec: TrainSpec):
    from reference_impls.compression import LocalSGD

    o = CompressionOptions.read(spec.options)
    return as_trainer(LocalSGD)(
        reference_model(spec, o),
        lm_loss,
        spec.topology.dp_group,
        sync_every=o.sync_every,
        average_optimizer_state=o.average_optimizer_state,
        optimizer=o.local_optimizer,
        **_kwargs(spec),
    )
