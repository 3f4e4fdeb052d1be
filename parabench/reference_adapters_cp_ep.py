"""parabench adapters for context parallelism and expert parallelism (``reference_impls/``).

Strategies:

* ``ref.cp_ring``: ring attention (option ``cp_split`` = "zigzag" (default) | "contiguous");
* ``ref.cp_ulysses``: DeepSpeed-Ulysses all-to-all attention;
* ``ref.ep``: expert parallelism for the MoE models (experts sharded, all-to-all dispatch/combine).

The degree is ``spec.options["cp"]`` / ``spec.options["ep"]`` and must be the whole world for now
(``parabench.suite.validate_case`` rejects anything else before launch). Both keep the worker's
data layout: every rank is handed its data-parallel slice of the global batch. Context
parallelism all-gathers the token ids of the group so that every rank sees every sample and keeps
its part of each sequence; expert parallelism is data parallel for tokens anyway.

Extra per-rank measurements of the last step: ``strategy_stats()`` (attention FLOPs and compute
seconds per rank for the ring; tokens per expert, received tokens, dropped assignments for EP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parabench.models import build_model
from parabench.peers.common import adamw, autocast, optimizer_state_bytes, tensor_bytes
from parabench.strategies import Trainer, TrainSpec


def _check_degree(spec: TrainSpec, key: str) -> int:
    world = dist.get_world_size()
    n = int(spec.options.get(key, world))
    if n != world:
        raise ValueError(f"{key}={n}: only {key} = world size ({world}) is supported for now")
    return n


class _ReplicatedTrainer(Trainer):
    """Shared plumbing: AdamW over local parameters, state bytes, full parameters on rank 0."""

    measure_state = False
    _grad_bytes = 0

    def _step(self, loss):
        if self.measure_state:
            self._grad_bytes = tensor_bytes(p.grad for p in self.module.parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def state_bytes(self):
        return {"params": tensor_bytes(self.module.parameters()), "grads": self._grad_bytes,
                "optimizer": optimizer_state_bytes(self.optimizer)}

    def close(self):
        self.optimizer = None
        self.module = None


class CPTrainer(_ReplicatedTrainer):
    def __init__(self, spec: TrainSpec, mode: str):
        from reference_impls.context_parallel import ContextParallel

        self.spec = spec
        _check_degree(spec, "cp")
        if spec.model.is_moe:
            raise ValueError("context parallelism is implemented for dense models only")
        self.module = build_model(spec.model, spec.seed, spec.device)
        self.cp = ContextParallel(self.module, spec.topology.dp_group, mode,
                                  split=spec.options.get("cp_split", "zigzag"), broken=spec.options.get("break"))
        self.optimizer = adamw(self.module.parameters(), spec)

    def train_step(self, inputs, targets):
        loss = self.cp.forward_backward(inputs, targets, self.spec.grad_accum, autocast=lambda: autocast(self.spec))
        return self._step(loss)

    def full_parameters(self):
        if dist.get_rank() != 0:
            return None
        return {n: p.detach().float().cpu().clone() for n, p in self.module.named_parameters()}

    def strategy_stats(self) -> dict:
        return {"cp": self.cp.cp, "mode": self.cp.mode, "split": self.cp.split, **self.cp.stats.as_dict()}


def build_cp_ring(spec: TrainSpec) -> CPTrainer:
    return CPTrainer(spec, "ring")


def build_cp_ulysses(spec: TrainSpec) -> CPTrainer:
    return CPTrainer(spec, "ulysses")


class EPTrainer(_ReplicatedTrainer):
    def __init__(self, spec: TrainSpec):
        from reference_impls.expert_parallel import ExpertParallel

        self.spec = spec
        _check_degree(spec, "ep")
        if not spec.model.is_moe:
            raise ValueError("expert parallelism needs an MoE model (n_experts > 0), e.g. tiny-moe")
        self.module = build_model(spec.model, spec.seed, spec.device)
        self.ep = ExpertParallel(self.module, spec.topology.dp_group)
        self.optimizer = adamw(self.module.parameters(), spec)

    def train_step(self, inputs, targets):
        loss = self.ep.forward_backward(inputs, targets, self.spec.grad_accum, autocast=lambda: autocast(self.spec))
        return self._step(loss)

    def full_parameters(self):
        """Rank 0 assembles the full MoE: dense parameters from itself, experts from their owners."""
        mine = {self.ep.global_name(n): p.detach().float().cpu().clone() for n, p in self.module.named_parameters()
                if any(p is q for q in self.ep.expert_params) or dist.get_rank() == 0}
        return assemble_on_rank0(mine, self.spec)

    def strategy_stats(self) -> dict:
        """Routing of the last micro-batch per MoE layer: tokens per expert (this rank's tokens),
        rows received per local expert, rows sent/received, dropped assignments."""
        return {"ep": self.ep.ep, "moe_layers": self.ep.routing_stats()}


def build_model_names(spec: TrainSpec):
    from parabench.models import GPT

    with torch.device("meta"):
        return list(GPT(spec.model).named_parameters())


def assemble_on_rank0(mine: dict, spec: TrainSpec) -> dict | None:
    """Rank 0: the full model's parameters, in the GPT's order, from every rank's named pieces
    (dense ones from rank 0, experts from their owners); other ranks: None."""
    everything = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everything, dst=0)
    if dist.get_rank() != 0:
        return None
    full = {}
    for part in everything:
        full.update(part)
    return {n: full[n] for n, _ in build_model_names(spec)}


def build_ep(spec: TrainSpec) -> EPTrainer:
    return EPTrainer(spec)
