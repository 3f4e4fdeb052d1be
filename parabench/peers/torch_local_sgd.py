"""PyTorch's local SGD: ``torch.distributed.optim.PostLocalSGDOptimizer`` with a ``PeriodicModelAverager``.

Each rank runs its own AdamW step on its own gradient (no DDP, no gradient communication); the wrapped
optimizer's ``step`` then lets the averager all-reduce the parameters, flattened into one buffer and
pre-divided by N, every ``period`` steps from ``warmup_steps`` on (torch's post-local-SGD recipe, Lin et al.
2020 "Don't Use Large Mini-Batches, Use Local SGD"; the averager skips parameters without a gradient, so it
must run inside the step, before the gradients are cleared). ``period = sync_every`` and
``warmup_steps = sync_every - 1`` average after the same steps as ``ref.local_sgd`` (0-based indices
H-1, 2H-1, ...). Only the parameters are averaged: torch has no averaging of the optimizer's moments, so the
reference's twin is ``ref.local_sgd`` with ``average_optimizer_state = false``.
"""

from __future__ import annotations

from parabench.families.compression import CompressionOptions
from parabench.models import build_model
from parabench.peers.common import TorchTrainer, adamw
from parabench.trainer import TrainSpec


class LocalSGDTrainer(TorchTrainer):
    def full_parameters(self):
        # a copy: on a CPU .float().cpu() of an fp32 tensor is the tensor itself, which later steps change
        return {n: p.detach().float().cpu().clone() for n, p in self.module.named_parameters()}


def build(spec: TrainSpec) -> LocalSGDTrainer:
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    h = int(CompressionOptions.read(spec.options).sync_every)
    model = build_model(spec.model, spec.seed, spec.device)
    averager = PeriodicModelAverager(period=h, warmup_steps=h - 1, process_group=spec.topology.dp_group)
    return LocalSGDTrainer(spec, model, PostLocalSGDOptimizer(adamw(model.parameters(), spec), averager))
