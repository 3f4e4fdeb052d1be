"""PyTorch FSDP2: ``fully_shard`` on every transformer block, then on the root module.

Parameters are DTensors sharded along dim 0 over the data-parallel mesh; each block's
parameters are all-gathered before its forward and backward and resharded after, and gradients
are reduce-scattered. With bf16 the policy is bf16 parameters for compute and fp32 gradient
reduction (torchtitan's default), so the sharded fp32 parameters are the master weights.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from parabench.models import build_model
from parabench.peers.common import TorchTrainer, adamw
from parabench.strategies import TrainSpec


class FSDP2Trainer(TorchTrainer):
    def full_parameters(self):
        return {n: p.full_tensor().detach().float().cpu() for n, p in self.module.named_parameters()}


def build(spec: TrainSpec) -> FSDP2Trainer:
    model = build_model(spec.model, spec.seed, spec.device)
    mesh = spec.topology.mesh["dp"]
    mp = MixedPrecisionPolicy(param_dtype=spec.compute_dtype, reduce_dtype=torch.float32)
    reshard = bool(spec.options.get("reshard_after_forward", True))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    # FSDP2 casts parameters itself; autocast on top would only add casts.
    return FSDP2Trainer(spec, model, adamw(model.parameters(), spec), autocast_enabled=False)
