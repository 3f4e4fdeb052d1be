"""One process, no parallelism: the ground truth every strategy is checked against."""

from __future__ import annotations

from parabench.models import build_model
from parabench.peers.common import TorchTrainer, adamw, checkpoint_blocks, compile_blocks
from parabench.strategies import TrainSpec


class SingleTrainer(TorchTrainer):
    def full_parameters(self):
        return {n: p.detach().float().cpu() for n, p in self.module.named_parameters()}


def build(spec: TrainSpec) -> SingleTrainer:
    model = build_model(spec.model, spec.seed, spec.device)
    checkpoint_blocks(model, spec)
    compile_blocks(model.blocks, spec)
    return SingleTrainer(spec, model, adamw(model.parameters(), spec))
