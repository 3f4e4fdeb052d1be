"""PyTorch DistributedDataParallel: gradients all-reduced in buckets, overlapped with backward.

Profiles (option ``profile``; option ``bucket_mb``, where given, sets the bucket in both):

* ``tuned`` (the default): torchtitan's DDP setup, the last one it shipped before it moved data
  parallelism to FSDP2's ``replicate`` (commit e1847f4, pytorch/torchtitan#2458):
  torchtitan/models/llama3/parallelize.py ``apply_ddp`` wraps the model with ``bucket_cap_mb=100``
  (``DDPPeerOptions.bucket_cap_mb``, ``TUNED_DDP_BUCKET_MB``) and, with compile, sets
  ``torch._dynamo.config.optimize_ddp = "ddp_optimizer"``. From the DDP notes
  (https://pytorch.org/docs/stable/notes/ddp.html) and the ``DistributedDataParallel`` reference:
  ``gradient_as_bucket_view=True`` saves the gradient copy into the buckets. torch's fused AdamW
  on GPUs (``common.adamw``).
* ``matched``: the same with DDP's default 25 MiB buckets, the references' ``bucket_mb``.

Gradients are all-reduced in the dtype they live in, in both profiles (DDP has no reduce-dtype
setting): fp32 under "amp" and "fp8", bf16/fp16 under "master".

Recipes: "amp" is the DDP + torch.amp recipe of PyTorch's AMP examples (fp32 parameters, gradients
and buckets, autocast forward); "master" gives DDP bf16 parameters (bf16 buckets on the wire) and
AdamW fp32 master copies (``common.recipe_optimizer``).

With option ``compile`` (per-block torch.compile, torchtitan's order) Dynamo's DDPOptimizer is on, as
torch and torchtitan (``apply_ddp``: ``optimize_ddp = "ddp_optimizer"``) set it; option
``ddp_optimizer = false`` turns it off. It changes what a compiled block saves for backward: on a CPU
probe (2 blocks, d 256) 4 % more saved bytes under amp and 20 % more under fp8 than the same blocks
without DDP, and none more with it off."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from parabench.families.data_parallel import DDPPeerOptions
from parabench.models import build_model
from parabench.peers.common import TorchTrainer, checkpoint_blocks, compile_blocks, recipe_module, recipe_optimizer
from parabench.trainer import TrainSpec


class DDPTrainer(TorchTrainer):
    def full_parameters(self):
        return {n: p.detach().float().cpu() for n, p in self.module.module.named_parameters()}


def build(spec: TrainSpec) -> DDPTrainer:
    o = DDPPeerOptions.read(spec.options)
    model = recipe_module(build_model(spec.model, spec.seed, spec.device), spec)
    checkpoint_blocks(model, spec)  # before DDP: DDP wraps whatever forward the blocks have
    compile_for_ddp(model, spec, o.ddp_optimizer)  # after checkpointing
    ddp = DDP(model, process_group=spec.topology.dp_group, **ddp_settings(spec, o))
    return DDPTrainer(spec, ddp, recipe_optimizer(ddp.parameters(), spec), no_sync=ddp.no_sync)


def compile_for_ddp(model, spec: TrainSpec, ddp_optimizer: bool = True) -> None:
    """``compile_blocks`` before DDP wraps ``model`` (torchtitan's order), with Dynamo's DDPOptimizer
    on or off for this case: Dynamo reads the setting when the blocks first compile (the first
    step), and a batched launch runs several cases in one process."""
    compile_blocks(model.blocks, spec)
    torch._dynamo.config.optimize_ddp = bool(ddp_optimizer)


def ddp_settings(spec: TrainSpec, o: DDPPeerOptions) -> dict:
    """DistributedDataParallel's settings under the case's profile (module docstring)."""
    return {
        "device_ids": [spec.device.index] if spec.device.type == "cuda" else None,
        "bucket_cap_mb": o.bucket_cap_mb(spec.options),
        "gradient_as_bucket_view": True,
    }
