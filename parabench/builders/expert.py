"""Builder of the reference expert parallelism (``reference_impls/expert_parallel.py``)."""

from __future__ import annotations

import torch.distributed as dist

from parabench.families.expert import ExpertOptions
from parabench.models import MOE_ROUTING, build_model, lm_loss
from parabench.peers.common import ReplicatedTrainer, adamw, assemble_on_rank0, autocast, check_degree
from parabench.trainer import TrainSpec


class EPTrainer(ReplicatedTrainer):
    def __init__(self, spec: TrainSpec):
        from reference_impls.expert_parallel import ExpertParallel

        self.spec = spec
        check_degree("ep", ExpertOptions.read(spec.options).ep)
        if not spec.model.is_moe:
            raise ValueError("expert parallelism needs an MoE model (n_experts > 0), e.g. tiny-moe")
        self.module = build_model(spec.model, spec.seed, spec.device)
        self.ep = ExpertParallel(self.module, spec.topology.dp_group, MOE_ROUTING, lm_loss)
        self.optimizer = adamw(self.module.parameters(), spec)

    def train_step(self, inputs, targets):
        loss = self.ep.forward_backward(inputs, targets, self.spec.grad_accum, autocast=lambda: autocast(self.spec))
        return self._step(loss)

    def full_parameters(self):
        """Rank 0 assembles the full MoE: dense parameters from itself, experts from their owners."""
        mine = {
            self.ep.global_name(n): p.detach().float().cpu().clone()
            for n, p in self.module.named_parameters()
            if any(p is q for q in self.ep.expert_params) or dist.get_rank() == 0
        }
        return assemble_on_rank0(mine, self.spec)

    def strategy_stats(self) -> dict:
        """Routing of the last micro-batch per MoE layer: tokens per expert (this rank's tokens),
        rows received per local expert, rows sent/received, dropped assignments."""
        return {"ep": self.ep.ep, "moe_layers": self.ep.routing_stats()}


def build_ep(spec: TrainSpec) -> EPTrainer:
    return EPTrainer(spec)
