"""One process, no parallelism: the ground truth every strategy is checked against."""

from __future__ import annotations

from parabench.models import build_model
from parabench.peers.common import TorchTrainer, checkpoint_blocks, compile_blocks, recipe_module, recipe_optimizer
from parabench.trainer import TrainSpec


class SingleTrainer(TorchTrainer):
    def full_parameters(self):
        return {n: p.detach().float().cpu() for n, p in self.module.named_parameters()}


def build(spec: TrainSpec) -> SingleTrainer:
    model = recipe_module(build_model(spec.model, spec.seed, spec.device), spec)
    checkpoint_blocks(model, spec)
    compile_blocks(model.blocks, spec)
    return SingleTrainer(spec, model, recipe_optimizer(model.parameters(), spec))
