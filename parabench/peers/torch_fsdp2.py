"""PyTorch FSDP2: ``fully_shard`` on every transformer block, then on the root module.

Parameters are DTensors sharded along dim 0 over the data-parallel mesh; each block's
parameters are all-gathered before its forward and backward and resharded after, and gradients
are reduce-scattered. With bf16/fp16 the policy is 16-bit parameters for compute and fp32 gradient
reduction (torchtitan's default), so the sharded fp32 parameters are the master weights. fp16 adds
the plain ``torch.amp.GradScaler`` (see ``common.TorchTrainer``): its unscale of DTensor gradient
shards all-reduces the found-inf flag over the mesh, so every rank skips alike (FACTS).

``torch.fsdp2_offload``: the same with ``CPUOffloadPolicy`` — sharded parameters, gradients and
the optimizer step live in CPU memory; each block's shard is copied to the device for its
all-gather. On a CPU-only machine the "device" is the CPU already, so the copies are no-ops and the
numbers measure only the policy's bookkeeping.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from parabench.families.sharded import ShardedOptions
from parabench.models import build_model
from parabench.peers.common import TorchTrainer, adamw, checkpoint_blocks
from parabench.strategies import TrainSpec


class FSDP2Trainer(TorchTrainer):
    def full_parameters(self):
        return {n: p.full_tensor().detach().float().cpu() for n, p in self.module.named_parameters()}


def build(spec: TrainSpec, offload: bool = False, mesh=None) -> FSDP2Trainer:
    model = build_model(spec.model, spec.seed, spec.device)
    checkpoint_blocks(model, spec)  # before fully_shard: its hooks stay outside the recomputed region
    mesh = mesh if mesh is not None else spec.topology.mesh["dp"]
    mp = MixedPrecisionPolicy(param_dtype=spec.compute_dtype, reduce_dtype=torch.float32)
    reshard = ShardedOptions.read(spec.options).reshard_after_forward
    extra = {"offload_policy": CPUOffloadPolicy(pin_memory=spec.device.type == "cuda")} if offload else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, **extra)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, **extra)
    # FSDP2 casts parameters itself; autocast on top would only add casts.
    # With offload the parameters (and the AdamW step) are on the CPU: no fused CUDA kernel there.
    opt_spec = replace(spec, device=torch.device("cpu")) if offload else spec
    return FSDP2Trainer(spec, model, adamw(model.parameters(), opt_spec), autocast_enabled=False)


def build_offload(spec: TrainSpec) -> FSDP2Trainer:
    return build(spec, offload=True)


def build_hsdp(spec: TrainSpec) -> FSDP2Trainer:
    """FSDP2 hybrid shard: a 2-D (replicate, shard) mesh over the data-parallel ranks; parameters
    are sharded within groups of ``shard_size`` consecutive ranks and replicated across groups
    (gradients reduce-scattered in the group, then all-reduced across replicas)."""
    from torch.distributed.device_mesh import init_device_mesh

    topo = spec.topology
    if topo.tp != 1 or topo.pp != 1:
        raise ValueError("torch.hsdp composes with neither tp nor pp here")
    shard = ShardedOptions.read(spec.options).shard_size
    if topo.dp % shard:
        raise ValueError(f"shard_size={shard} does not divide the data-parallel degree {topo.dp}")
    mesh = init_device_mesh(spec.device.type, (topo.dp // shard, shard), mesh_dim_names=("replicate", "shard"))
    return build(spec, mesh=mesh)
