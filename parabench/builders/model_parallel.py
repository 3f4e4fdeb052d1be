"""Builders of the reference tensor and pipeline parallel strategies (``reference_impls/compose.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parabench.families.model_parallel import ModelParallelOptions
from parabench.models import build_model
from parabench.peers.common import (
    autocast,
    compile_blocks,
    optimizer_state_bytes,
    recipe_module,
    recipe_optimizer,
    tensor_bytes,
)
from parabench.trainer import Trainer, TrainSpec

# --- reference builders -------------------------------------------------------------------------


def gather_full_parameters(named: dict[str, torch.Tensor], shard_dims: dict, coords) -> dict | None:
    """Rank 0 assembles the full model from every rank's shards (collective over the world).

    ``coords`` = (dp, pp, tp) of this rank. Only dp replica 0 is used; each name is owned by one
    pipeline stage; tensor-parallel shards are concatenated along their split dimension in tp order.
    """
    mine = {
        "coords": tuple(coords),
        "params": {n: (t.detach().float().cpu(), shard_dims.get(n)) for n, t in named.items()},
    }
    everything = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everything, dst=0)
    if dist.get_rank() != 0:
        return None
    parts: dict[str, list] = {}
    for r in everything:
        dp_rank, _, tp_rank = r["coords"]
        if dp_rank != 0:
            continue
        for n, (t, dim) in r["params"].items():
            parts.setdefault(n, []).append((tp_rank, t, dim))
    full = {}
    for n, shards in parts.items():
        shards.sort(key=lambda x: x[0])
        dim = shards[0][2]
        full[n] = shards[0][1] if dim is None else torch.cat([t for _, t, _ in shards], dim=dim)
    return full


class ModelParallelTrainer(Trainer):
    def __init__(self, spec: TrainSpec, sequence_parallel: bool, schedule: str, virtual_stages: int = 1):
        from reference_impls.compose import parallelize

        self.spec = spec
        topo = spec.topology
        o = ModelParallelOptions.read(spec.options)
        model = recipe_module(build_model(spec.model, spec.seed, spec.device), spec)
        self.par = parallelize(
            model,
            tp_group=topo.tp_group,
            pp_group=topo.pp_group,
            dp_group=topo.dp_group,
            sequence_parallel=sequence_parallel,
            schedule=schedule,
            microbatches=o.microbatches,
            virtual_stages=virtual_stages,
            stage_layers=o.stage_layers,
        )
        del model
        blocks = self.par.module.blocks  # a ModuleDict keyed by global index on a pipeline stage
        compile_blocks(blocks.values() if isinstance(blocks, torch.nn.ModuleDict) else blocks, spec)
        self.optimizer = recipe_optimizer(self.par.module.parameters(), spec)
        self.measure_state = False
        self._grad_bytes = 0

    def train_step(self, inputs, targets):
        if self.par.engine is not None:
            self.par.engine.record_timeline = self.record_timeline
        with autocast(self.spec):
            loss = self.par.forward_backward(inputs, targets, self.spec.grad_accum)
        if self.measure_state:
            self._grad_bytes = tensor_bytes(p.grad for p in self.par.module.parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def state_bytes(self):
        return {
            "params": tensor_bytes(self.par.module.parameters()),
            "grads": self._grad_bytes,
            "optimizer": optimizer_state_bytes(self.optimizer),
        }

    def full_parameters(self):
        return gather_full_parameters(
            dict(self.par.module.named_parameters()), self.par.shard_dims, self.spec.topology.coords
        )

    def pipeline_stats(self) -> dict | None:
        """This stage's last-step schedule record: order, compute/wait seconds, measured and
        theoretical bubble fraction, peak live micro-batches (None without a pipeline)."""
        return self.par.pipeline_stats()

    def close(self):
        self.optimizer = None
        self.par = None


def build_tp(spec: TrainSpec) -> ModelParallelTrainer:
    return ModelParallelTrainer(
        spec, sequence_parallel=False, schedule=ModelParallelOptions.read(spec.options).schedule
    )


def build_tp_sp(spec: TrainSpec) -> ModelParallelTrainer:
    return ModelParallelTrainer(spec, sequence_parallel=True, schedule=ModelParallelOptions.read(spec.options).schedule)


def build_pp_gpipe(spec: TrainSpec) -> ModelParallelTrainer:
    return ModelParallelTrainer(spec, sequence_parallel=ModelParallelOptions.read(spec.options).sp, schedule="gpipe")


def build_pp_1f1b(spec: TrainSpec) -> ModelParallelTrainer:
    return ModelParallelTrainer(spec, sequence_parallel=ModelParallelOptions.read(spec.options).sp, schedule="1f1b")


def build_pp_zb(spec: TrainSpec) -> ModelParallelTrainer:
    return ModelParallelTrainer(spec, sequence_parallel=False, schedule="zb_h1")


def build_pp_interleaved(spec: TrainSpec) -> ModelParallelTrainer:
    o = ModelParallelOptions.read(spec.options)
    return ModelParallelTrainer(spec, sequence_parallel=o.sp, schedule="1f1b", virtual_stages=o.virtual_stages)
