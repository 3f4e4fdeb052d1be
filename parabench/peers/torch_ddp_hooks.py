"""PyTorch DDP communication hooks (fp16 compression, PowerSGD).

* ``torch.ddp_fp16_hook``: ``default_hooks.fp16_compress_hook`` — each bucket is divided by N, cast to
  fp16, all-reduced and cast back.
* ``torch.ddp_powersgd_hook``: ``powerSGD_hook.PowerSGDState`` + ``powerSGD_hook`` with rank
  ``powersgd_rank`` (default 2), error feedback and warm start on, ``min_compression_rate=1``
  (compress every 2-D gradient whose rank-r factors are smaller than it, as ref.ddp_powersgd does; the
  default 2 would leave some square matrices uncompressed) and ``start_powerSGD_iter=2``: torch
  requires at least 2 when error feedback or warm start is on, and runs plain all-reduce before that
  iteration. Iterations are counted per backward, so with ``warmup >= 2`` every timed step and the
  instrumented step are compressed (suites/compression.toml uses warmup = 2).
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel as DDP

from parabench.families.compression import CompressionOptions
from parabench.models import build_model
from parabench.peers.common import adamw
from parabench.peers.torch_ddp import DDPTrainer, compile_for_ddp
from parabench.trainer import TrainSpec

START_POWERSGD_ITER = 2
MIN_COMPRESSION_RATE = 1.0


def _ddp(spec: TrainSpec) -> DDP:
    model = build_model(spec.model, spec.seed, spec.device)
    compile_for_ddp(model, spec)  # DDPOptimizer on: torch's default
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
