"""PyTorch tensor parallelism: DTensor ``parallelize_module`` over ``topology.mesh["tp"]``.

``torch.tp``: q/k/v and MLP fc ``ColwiseParallel``, attention and MLP proj ``RowwiseParallel``
(the Megatron layout), the attention's input made a replicated DTensor once by
``PrepareModuleInput`` (one backward all-reduce for q, k and v together, as Megatron's ``f``), the
token embedding ``RowwiseParallel`` (split by vocabulary) and the head ``ColwiseParallel`` with
vocab-sharded logits fed to ``loss_parallel`` (no logits gather).
``torch.tp_sp``: the sequence-parallel plan of the torch TP tutorial / torchtitan: LayerNorms
``SequenceParallel``, ``PrepareModuleInput`` all-gathers the sequence before attention and the
MLP, row-parallel outputs reduce-scattered along the sequence (``Shard(1)``). The learned
position embedding (torchtitan's Llama has none) is ``RowwiseParallel`` with ``Shard(0)`` output,
so it is added to the embedding's sequence shard.

After backward every DTensor gradient is given its parameter's placements
(``_match_parameter_layouts``). With ``dp > 1`` the gradients of the local shards are then averaged
over ``topology.dp_group`` in flat buckets of ``DP_BUCKET_BYTES`` (``average_over_dp``): DDP's
bucketed all-reduce, replicated data parallelism with ref.tp's memory and traffic. PyTorch's own
ways to compose TP with replication do not fit: ``DistributedDataParallel`` refuses DTensor
parameters; ``torch.distributed._composable.replicate`` (private, DDP-based) swaps every DTensor
parameter for a plain local tensor outside forward (``tensor.parallel.ddp._localize_dtensor``), so
the optimizer, ``full_parameters`` and the Partial-gradient sum above would see plain tensors; and
the FSDP-based ``replicate_with_fsdp.replicate`` takes a 1-D mesh, a TP'd 2-D mesh only through
``dp_mesh_dims`` (newer than torch 2.11). torchtitan's TP x DP is FSDP2 (sharding), a different
memory and traffic from ref.tp's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from parabench.models import build_model, lm_loss
from parabench.peers.common import (
    DP_BUCKET_BYTES,
    TorchTrainer,
    autocast,
    average_over_dp,
    compile_blocks,
    local_tensor,
    recipe_module,
    recipe_optimizer,
    tensor_bytes,
)
from parabench.trainer import TrainSpec


def _plan(model, sequence_parallel: bool) -> dict:
    if not sequence_parallel:
        plan = {
            "tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        for i in range(len(model.blocks)):
            b = f"blocks.{i}"
            plan.update(
                {
                    # The attention input becomes one replicated DTensor shared by q, k and v, so
                    # their input gradients add up as one Partial and are all-reduced once
                    # (Megatron's f); converted per linear, each would all-reduce its own.
                    f"{b}.attn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
                    f"{b}.attn.q": ColwiseParallel(),
                    f"{b}.attn.k": ColwiseParallel(),
                    f"{b}.attn.v": ColwiseParallel(),
                    f"{b}.attn.proj": RowwiseParallel(),
                    f"{b}.mlp.fc": ColwiseParallel(),
                    f"{b}.mlp.proj": RowwiseParallel(),
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
    def __init__(self, spec: TrainSpec, module, optimizer):
        super().__init__(spec, module, optimizer)
        # Resolved once: each ``topology.dp_group`` slices the DeviceMesh anew (a sub-mesh built
        # from mesh tensors, three ``nonzero`` calls), host time a step need not pay.
        self.tp_group = spec.topology.tp_group
        self.dp_group = spec.topology.dp_group
        self._dp_buckets = 0

    def strategy_stats(self) -> dict:
        return {
            "dp_grad_sync": "bucketed_all_reduce_after_backward",
            "dp_bucket_bytes": DP_BUCKET_BYTES,
            "dp_buckets": self._dp_buckets,
        }

    def train_step(self, inputs, targets):
        accum = self.spec.grad_accum
        total = torch.zeros((), device=inputs.device)
        for x, y in zip(inputs.chunk(accum), targets.chunk(accum)):
            with autocast(self.spec), loss_parallel():
                loss = lm_loss(self.module(x), y) / accum
                loss.backward()
            total += local_tensor(loss.detach()).reshape(())
        _match_parameter_layouts(self.module, self.tp_group)
        if dist.get_world_size(self.dp_group) > 1:
            self._dp_buckets = average_over_dp(self.module.parameters(), self.dp_group)
        if self.measure_state:
            self._grad_bytes = tensor_bytes(p.grad for p in self.module.parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def full_parameters(self):
        full = {
            # clone: on a CPU, .float().cpu() of a plain fp32 parameter is the live tensor itself
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
            for n, p in self.module.named_parameters()
        }
        return full if dist.get_rank() == 0 else None


def _match_parameter_layouts(module: torch.nn.Module, tp_group) -> None:
    """Give every DTensor gradient its parameter's placements, once per step, before the optimizer.

    DTensor leaves two kinds of gradient in another layout than their parameter: replicated
    parameters applied to sequence shards (SP LayerNorms) get ``Partial`` gradients, and the
    vocab-sharded embeddings get full ``Replicate`` ones (``embedding_dense_backward`` runs
    replicated). Left as they are, every optimizer op that reads a ``Partial`` gradient all-reduces
    it again (three all-reduces per LayerNorm tensor per step with the for-loop AdamW), and a
    fused or foreach kernel receives mismatched layouts.

    The ``Partial`` -> ``Replicate`` gradients are summed in one all-reduce of a flat buffer
    (Megatron's all-reduce of the sequence-parallel parameters' gradients, and DDP's bucketing):
    ``redistribute`` per tensor would issue one collective and one DTensor dispatch per LayerNorm
    tensor (4L + 2 of them). The others (the embeddings' local slice) are redistributed."""
    partial: list[torch.nn.Parameter] = []
    for p in module.parameters():
        g = p.grad
        if g is None or not hasattr(p, "placements") or tuple(g.placements) == tuple(p.placements):
            continue
        if all(_summed(gp) and pp.is_replicate() for gp, pp in zip(g.placements, p.placements)):
            partial.append(p)
        else:
            p.grad = g.redistribute(p.device_mesh, p.placements)
    if not partial:
        return
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in partial:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for ps in by_dtype.values():
        locals_ = [p.grad.to_local() for p in ps]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        dist.all_reduce(flat, group=tp_group)
        for p, local, summed in zip(ps, locals_, flat.split([t.numel() for t in locals_])):
            p.grad = DTensor.from_local(summed.view_as(local), p.device_mesh, p.placements, run_check=False)


def tp_adamw(params, spec: TrainSpec) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA and foreach elsewhere (as ``common.adamw``), with one param group per
    parameter kind: torch's fused and foreach kernels refuse a tensor list that mixes DTensors and
    plain tensors (torch.tp's LayerNorms and position table stay plain), and each group is one
    kernel call. Gradients reach it in their parameter's layout (``_match_parameter_layouts``)."""
    o = spec.optim
    params = list(params)
    dtensors = [p for p in params if hasattr(p, "placements")]
    plain = [p for p in params if not hasattr(p, "placements")]
    groups = [{"params": ps} for ps in (dtensors, plain) if ps]
    impl = {"fused": True} if spec.device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, **impl)


def _build(spec: TrainSpec, sequence_parallel: bool) -> TorchTPTrainer:
    model = recipe_module(build_model(spec.model, spec.seed, spec.device), spec)
    parallelize_module(model, spec.topology.mesh["tp"], _plan(model, sequence_parallel))
    compile_blocks(model.blocks, spec)  # after TP, so the DTensor blocks are traced (torchtitan's order)
    # "master": AdamW over fp32 copies of the local shards (plain tensors: one group, one kernel).
    return TorchTPTrainer(spec, model, recipe_optimizer(model.parameters(), spec, make=lambda ps: tp_adamw(ps, spec)))


def build_tp(spec: TrainSpec) -> TorchTPTrainer:
    return _build(spec, False)


def build_tp_sp(spec: TrainSpec) -> TorchTPTrainer:
    return _build(spec, True)


def _summed(placement) -> bool:
    return placement.is_partial() and getattr(placement, "reduce_op", None) == "sum"
