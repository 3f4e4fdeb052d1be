"""Builder of ref.zero_r (``reference_impls/zero_r.py``): ZeRO-R's residual-state optimizations over the
reference tensor parallelism, data parallel across TP groups."""

from __future__ import annotations

from parabench.builders.model_parallel import gather_full_parameters
from parabench.families.sharded import ZeroROptions
from parabench.models import build_model
from parabench.trainer import TrainSpec, as_trainer


def build(spec: TrainSpec):
    from reference_impls.zero_r import ZeroR

    class ZeroRTrainer(as_trainer(ZeroR)):
        def full_parameters(self):
            """Rank 0 assembles the full model from the TP shards of data-parallel replica 0."""
            named = dict(self.module.named_parameters())
            return gather_full_parameters(named, self.module.shard_dims(), spec.topology.coords)

    o = ZeroROptions.read(spec.options)
    a = spec.optim
    return ZeroRTrainer(
        build_model(spec.model, spec.seed, spec.device),
        spec.topology.tp_group,
        spec.topology.dp_group,
        grad_accum=spec.grad_accum,
        adam=dict(lr=a.lr, betas=a.betas, eps=a.eps, weight_decay=a.weight_decay),
        partition_activations=o.partition_activations,
        cpu_checkpointing=o.cpu_checkpointing,
        contiguous_memory_optimization=o.contiguous_memory_optimization,
        buffer_elements=int(o.constant_buffer_mb * 2**20) // 4,
    )
