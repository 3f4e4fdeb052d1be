"""Builders for the communication-reducing references (reference_impls/compression.py).

Options read from ``spec.options`` (validated in parabench.suite.validate_case):

* ``bucket_mb`` (all compressed DDPs): gradient bucket size in MiB, default 25, as ref.ddp;
* ``error_feedback`` (onebit, topk, powersgd): keep the compression residual, default True;
* ``topk_ratio`` (topk): fraction of each bucket's elements sent, default 0.01;
* ``powersgd_rank`` (powersgd): rank r of the approximation, default 2;
* ``sync_every`` (local_sgd): H, steps between averages, default 4;
* ``average_optimizer_state`` (local_sgd): also average the optimizer states, default True;
* ``local_optimizer`` (local_sgd): ``"adamw"`` (default) or ``"sgd"`` (momentum 0.9).
"""

from __future__ import annotations

from parabench.models import lm_loss
from parabench.reference_adapters import _model, _register
from parabench.strategies import TrainSpec


def _common(spec: TrainSpec) -> dict:
    """fp32 or bf16 (no loss scaler: fp16 training with compressed gradients is not covered)."""
    if spec.precision not in ("fp32", "bf16"):
        raise ValueError(f"compression references support fp32 and bf16, not {spec.precision!r}")
    o = spec.optim
    return dict(grad_accum=spec.grad_accum, compute_dtype=spec.compute_dtype,
                adam=dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay))


def _compressed(spec: TrainSpec, compressor):
    from reference_impls.compression import CompressedDDP

    return _register(CompressedDDP)(_model(spec), lm_loss, spec.topology.dp_group, compressor=compressor,
                                    bucket_mb=float(spec.options.get("bucket_mb", 25)), **_common(spec))


def _ef(spec: TrainSpec) -> bool:
    return bool(spec.options.get("error_feedback", True))


def build_ddp_fp16_compress(spec: TrainSpec):
    from reference_impls.compression import FP16Compressor

    return _compressed(spec, FP16Compressor())


def build_ddp_onebit(spec: TrainSpec):
    from reference_impls.compression import OneBitCompressor

    return _compressed(spec, OneBitCompressor(error_feedback=_ef(spec)))


def build_ddp_topk(spec: TrainSpec):
    from reference_impls.compression import TopKCompressor

    return _compressed(spec, TopKCompressor(float(spec.options.get("topk_ratio", 0.01)), error_feedback=_ef(spec)))


def build_ddp_powersgd(spec: TrainSpec):
    from reference_impls.compression import PowerSGDCompressor

    return _compressed(spec, PowerSGDCompressor(int(spec.options.get("powersgd_rank", 2)), error_feedback=_ef(spec),
                                                seed=spec.seed))


def build_local_sgd(spec: TrainSpec):
    from reference_impls.compression import LocalSGD

    o = spec.options
    common = _common(spec)
    return _register(LocalSGD)(_model(spec), lm_loss, spec.topology.dp_group, sync_every=int(o.get("sync_every", 4)),
                               average_optimizer_state=bool(o.get("average_optimizer_state", True)),
                               optimizer=o.get("local_optimizer", "adamw"), **common)
