"""PyTorch tensor parallelism: DTensor ``parallelize_module`` over ``topology.mesh["tp"]``.

``torch.tp``: q/k/v and MLP fc ``ColwiseParallel``, attention and MLP proj ``RowwiseParallel``
(the Megatron layout), the token embedding ``RowwiseParallel`` (split by vocabulary) and the head
``ColwiseParallel`` with vocab-sharded logits fed to ``loss_parallel`` (no logits gather).
``torch.tp_sp``: the sequence-parallel plan of the torch TP tutorial / torchtitan: LayerNorms
``SequenceParallel``, ``PrepareModuleInput`` all-gathers the sequence before attention and the
MLP, row-parallel outputs reduce-scattered along the sequence (``Shard(1)``). The learned
position embedding (torchtitan's Llama has none) is ``RowwiseParallel`` with ``Shard(0)`` output,
so it is added to the embedding's sequence shard.

With ``dp > 1`` the gradients of the local shards are averaged over ``topology.dp_group`` after
backward (one all-reduce per parameter; DDP does not accept DTensor parameters).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from parabench.models import build_model, lm_loss
from parabench.peers.common import TorchTrainer, autocast, local_tensor, tensor_bytes
from parabench.strategies import TrainSpec


def _plan(model, sequence_parallel: bool) -> dict:
    if not sequence_parallel:
        plan = {
            "tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        for i in range(len(model.blocks)):
            plan.update(
                {
                    f"blocks.{i}.attn.q": ColwiseParallel(),
                    f"blocks.{i}.attn.k": ColwiseParallel(),
                    f"blocks.{i}.attn.v": ColwiseParallel(),
                    f"blocks.{i}.attn.proj": RowwiseParallel(),
                    f"blocks.{i}.mlp.fc": ColwiseParallel(),
                    f"blocks.{i}.mlp.proj": RowwiseParallel(),
                }
            )
        return plan
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan.update(
            {
                f"{b}.ln1": SequenceParallel(),
                f"{b}.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                f"{b}.attn.q": ColwiseParallel(),
                f"{b}.attn.k": ColwiseParallel(),
                f"{b}.attn.v": ColwiseParallel(),
                f"{b}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                f"{b}.ln2": SequenceParallel(),
                f"{b}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                f"{b}.mlp.fc": ColwiseParallel(),
                f"{b}.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
            }
        )
    return plan


class TorchTPTrainer(TorchTrainer):
    def train_step(self, inputs, targets):
        accum = self.spec.grad_accum
        total = torch.zeros((), device=inputs.device)
        for x, y in zip(inputs.chunk(accum), targets.chunk(accum)):
            with autocast(self.spec), loss_parallel():
                loss = lm_loss(self.module(x), y) / accum
                loss.backward()
            total += local_tensor(loss.detach()).reshape(())
        dp = self.spec.topology.dp_group
        if dist.get_world_size(dp) > 1:
            for p in self.module.parameters():
                if p.grad is not None:
                    g = local_tensor(p.grad)
                    dist.all_reduce(g, group=dp)
                    g.div_(dist.get_world_size(dp))
        if self.measure_state:
            self._grad_bytes = tensor_bytes(p.grad for p in self.module.parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def full_parameters(self):
        full = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
            for n, p in self.module.named_parameters()
        }
        return full if dist.get_rank() == 0 else None


def _build(spec: TrainSpec, sequence_parallel: bool) -> TorchTPTrainer:
    model = build_model(spec.model, spec.seed, spec.device)
    parallelize_module(model, spec.topology.mesh["tp"], _plan(model, sequence_parallel))
    o = spec.optim
    # foreach=False: the parameters mix DTensors (sharded) and plain tensors (LayerNorms w/o SP).
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=False
    )
    return TorchTPTrainer(spec, model, opt)


def build_tp(spec: TrainSpec) -> TorchTPTrainer:
    return _build(spec, False)


def build_tp_sp(spec: TrainSpec) -> TorchTPTrainer:
    return _build(spec, True)
