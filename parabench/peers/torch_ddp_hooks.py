"""PyTorch DDP communication hooks (fp16 compression, PowerSGD) and DeepSpeed 1-bit Adam.

* ``torch.ddp_fp16_hook``: ``default_hooks.fp16_compress_hook`` — each bucket is divided by N, cast to
  fp16, all-reduced and cast back.
* ``torch.ddp_powersgd_hook``: ``powerSGD_hook.PowerSGDState`` + ``powerSGD_hook`` with rank
  ``powersgd_rank`` (default 2), error feedback and warm start on, ``min_compression_rate=1``
  (compress every 2-D gradient whose rank-r factors are smaller than it, as ref.ddp_powersgd does; the
  default 2 would leave some square matrices uncompressed) and ``start_powerSGD_iter=2``: torch
  requires at least 2 when error feedback or warm start is on, and runs plain all-reduce before that
  iteration. Iterations are counted per backward, so with ``warmup >= 2`` every timed step and the
  instrumented step are compressed (suites/compression.toml uses warmup = 2).
* ``deepspeed.onebit_adam``: DeepSpeed's 1-bit Adam (``"optimizer": {"type": "OneBitAdam"}``). The
  optimizer and its compressed backends (``deepspeed.runtime.fp16.onebit``, ``runtime.comm.nccl`` /
  ``mpi`` / ``compressed``) were removed from DeepSpeed before 0.19 — 0.19.8 lists only adagrad, adam,
  adamw, lamb, lion, muadam(w), musgd and muon — and where it exists its backends are NCCL (with
  cupy for packing) or MPI, never gloo. The builder checks for it and raises a clear error otherwise.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel as DDP

from parabench.families.compression import CompressionOptions
from parabench.models import build_model
from parabench.peers.common import adamw
from parabench.peers.torch_ddp import DDPTrainer
from parabench.strategies import TrainSpec

START_POWERSGD_ITER = 2
MIN_COMPRESSION_RATE = 1.0


def _ddp(spec: TrainSpec) -> DDP:
    model = build_model(spec.model, spec.seed, spec.device)
    return DDP(
        model,
        device_ids=[spec.device.index] if spec.device.type == "cuda" else None,
        process_group=spec.topology.dp_group,
        bucket_cap_mb=float(CompressionOptions.read(spec.options).bucket_mb),
        gradient_as_bucket_view=True,
    )


def build_fp16(spec: TrainSpec) -> DDPTrainer:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = _ddp(spec)
    ddp.register_comm_hook(spec.topology.dp_group, default_hooks.fp16_compress_hook)
    return DDPTrainer(spec, ddp, adamw(ddp.parameters(), spec), no_sync=ddp.no_sync)


def build_powersgd(spec: TrainSpec) -> DDPTrainer:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    ddp = _ddp(spec)
    state = psgd.PowerSGDState(
        process_group=spec.topology.dp_group,
        matrix_approximation_rank=CompressionOptions.read(spec.options).powersgd_rank,
        start_powerSGD_iter=START_POWERSGD_ITER,
        min_compression_rate=MIN_COMPRESSION_RATE,
        use_error_feedback=True,
        warm_start=True,
        random_seed=spec.seed,
    )
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    trainer = DDPTrainer(spec, ddp, adamw(ddp.parameters(), spec), no_sync=ddp.no_sync)
    trainer.powersgd_state = state
    return trainer


def onebit_adam_unavailable_reason() -> str | None:
    """Why DeepSpeed's 1-bit Adam cannot run here, or None if this DeepSpeed ships it."""
    try:
        import deepspeed
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return f"DeepSpeed is not importable: {exc}"
    if "onebitadam" not in [o.lower() for o in DEEPSPEED_OPTIMIZERS]:
        return (
            f"DeepSpeed {deepspeed.__version__} does not ship 1-bit Adam: 'OneBitAdam' is not among its optimizers "
            f"({', '.join(DEEPSPEED_OPTIMIZERS)}) and deepspeed.runtime.fp16.onebit is gone; older releases "
            "had it, with NCCL (+ cupy) or MPI compressed backends only, never gloo/CPU"
        )
    return None


def build_deepspeed_onebit_adam(spec: TrainSpec):
    reason = onebit_adam_unavailable_reason()
    if reason is not None:
        raise NotImplementedError(f"deepspeed.onebit_adam cannot run: {reason}")
    if spec.device.type != "cuda":  # pragma: no cover - only with an old DeepSpeed
        raise NotImplementedError(
            "deepspeed.onebit_adam cannot run: its compressed all-reduce backends are "
            "NCCL (with cupy) or MPI; there is none for gloo/CPU"
        )
    import deepspeed  # pragma: no cover - untested: no DeepSpeed here ships it

    from parabench.peers.deepspeed_zero import DeepSpeedTrainer

    o = spec.optim

    class _OneBit(DeepSpeedTrainer):
        def __init__(self, spec):  # the engine's own optimizer instead of a client AdamW
            self.spec, self.measure_state = spec, False
            model = build_model(spec.model, spec.seed, spec.device)
            config = {
                "train_micro_batch_size_per_gpu": spec.micro_batch,
                "gradient_accumulation_steps": spec.grad_accum,
                "bf16": {"enabled": spec.precision == "bf16"},
                "optimizer": {
                    "type": "OneBitAdam",
                    "params": {
                        "lr": o.lr,
                        "betas": list(o.betas),
                        "eps": o.eps,
                        "weight_decay": o.weight_decay,
                        "freeze_step": CompressionOptions.read(spec.options).freeze_step,
                        "cuda_aware": False,
                        "comm_backend_name": "nccl",
                    },
                },
            }
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    return _OneBit(spec)
