"""Peers for context parallelism: DeepSpeed-Ulysses and PyTorch's experimental context_parallel.

* ``deepspeed.ulysses``: DeepSpeed's ``DistributedAttention`` (``deepspeed.sequence.layer``) wraps
  the causal SDPA of every block; its all-to-alls (q, k, v to head shards, the output back) are
  DeepSpeed's. Runs on CPU over gloo. The rest of the step is the same as ``ref.cp_ulysses``
  (token-id all-gather over the group, one flat fp32 all-reduce of the gradients, / cp): DeepSpeed's
  engine only wires Ulysses through Megatron-DeepSpeed's model code, so the attention layer is the
  part of DeepSpeed measured here.
* ``torch.cp``: ``torch.distributed.tensor.experimental.context_parallel`` (ring attention over
  DTensor, load-balanced head-tail split). In torch 2.13 it only dispatches the CUDA SDPA kernels
  (flash, efficient, cuDNN); on CPU the SDPA op ``_scaled_dot_product_flash_attention_for_cpu``
  has no sharding strategy and raises NotImplementedError, so the builder refuses CPU runs
  with that reason. The GPU path is written but has NOT been run yet.
* ``deepspeed.moe`` is not registered. Probed with deepspeed 0.19.8 on CPU/gloo, 2 ranks, ep_size=2:
  ``deepspeed.moe.layer.MoE(..., k=2, drop_tokens=True, capacity_factor=2.0)`` runs forward and
  backward; dropless (``drop_tokens=False``) aborts the process in gloo ("Received data size doesn't
  match expected size", a collective-size mismatch between ranks). Its gate differs from
  ``parabench.models.MoE`` anyway (own gate weights, capacity-based dispatch, batch-level aux loss,
  optional Gumbel sampling of the second expert), so it would not train the same model and no
  equivalence check is possible; an adapter with a capacity-based comparison is future work.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from parabench.reference_adapters_cp_ep import CPTrainer
from parabench.strategies import TrainSpec


class _DeepSpeedUlyssesTrainer(CPTrainer):
    def __init__(self, spec: TrainSpec):
        super().__init__(spec, "ulysses")
        import deepspeed
        import deepspeed.comm as ds_dist
        from deepspeed.sequence.layer import DistributedAttention

        if not ds_dist.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo" if spec.device.type == "cpu" else "nccl")

        def local_attention(q, k, v):  # [b, s, a/cp, d] -> same layout
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return y.transpose(1, 2)

        self.dist_attn = DistributedAttention(local_attention, spec.topology.dp_group, scatter_idx=2, gather_idx=1)

        def attention(q, k, v):  # parabench layout [b, a, s/cp, d]
            out = self.dist_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0)
            return out.transpose(1, 2)

        self.cp.attention = attention


def build_deepspeed_ulysses(spec: TrainSpec):
    if spec.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return _DeepSpeedUlyssesTrainer(spec)


class _TorchCPTrainer(CPTrainer):
    """torch context_parallel around each step: the token ids, targets and position ids are the
    sharded buffers (the head-tail load balancer reorders them); parameters are replicated plain
    tensors, gradients all-reduced as in ``ref.cp_ring``. UNVERIFIED on GPU."""

    def __init__(self, spec: TrainSpec):
        super().__init__(spec, "ring")
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(spec.device.type, (self.cp.cp,), mesh_dim_names=("cp",))

    def train_step(self, inputs, targets):
        from parabench.models import lm_loss
        from parabench.peers.common import autocast
        from torch.distributed.tensor.experimental import context_parallel

        cp = self.cp
        x_all, y_all = cp.gather_batch(inputs, targets)
        pos = torch.arange(x_all.shape[1], device=x_all.device).expand_as(x_all).contiguous()
        total = torch.zeros((), device=inputs.device)
        accum = self.spec.grad_accum
        for x, y, p in zip(x_all.chunk(accum), y_all.chunk(accum), pos.chunk(accum)):
            x, y, p = x.contiguous(), y.contiguous(), p.contiguous()
            with context_parallel(self.mesh, buffers=[x, y, p], buffer_seq_dims=[1, 1, 1]):
                with autocast(self.spec):
                    loss = lm_loss(self._forward(x, p), y) / accum
                loss.backward()
            total += loss.detach()
        cp.all_reduce_grads()
        return self._step(total)

    def _forward(self, tokens, pos):
        m = self.module
        x = m.tok_emb(tokens) + m.pos_emb(pos)
        for blk in m.blocks:
            x = blk(x)  # SDPA(is_causal=True) is what context_parallel swaps for ring attention
        return m.head(m.ln_f(x))


def build_torch_cp(spec: TrainSpec):
    if spec.device.type != "cuda":
        raise NotImplementedError(
            "torch.cp: torch.distributed.tensor.experimental.context_parallel (torch "
            f"{torch.__version__}) handles only the CUDA SDPA kernels (flash/efficient/cuDNN); on CPU "
            "aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy. Run it on GPUs.")
    return _TorchCPTrainer(spec)
