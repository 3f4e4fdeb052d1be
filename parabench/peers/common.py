"""Pieces shared by the adapters that drive a plain ``torch.nn.Module`` with a torch optimizer."""

from __future__ import annotations

import contextlib

import torch

from parabench.models import lm_loss
from parabench.strategies import Trainer, TrainSpec


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank stores (a DTensor's local shard, else ``t`` itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)


def adamw(params, spec: TrainSpec) -> torch.optim.Optimizer:
    """AdamW with parabench's explicit hyperparameters; the fused CUDA kernel where there is one."""
    o = spec.optim
    impl = {"fused": True} if spec.device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, **impl)


def autocast(spec: TrainSpec):
    """Mixed precision for torch peers: fp32 parameters (the master copy), compute in bf16/fp16."""
    if spec.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=spec.device.type, dtype=spec.compute_dtype)


class TorchTrainer(Trainer):
    """Forward/backward over ``grad_accum`` micro-batches, then one optimizer step.

    ``no_sync`` (DDP) suppresses gradient communication on all but the last micro-batch.
    Gradient bytes are sampled just before the optimizer step (when gradients are largest)
    but only when ``measure_state`` is set, which the runner does on an untimed step.
    """

    def __init__(self, spec: TrainSpec, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 no_sync=None, autocast_enabled: bool = True):
        self.spec, self.module, self.optimizer = spec, module, optimizer
        self.no_sync = no_sync
        self.autocast_enabled = autocast_enabled
        self.measure_state = False
        self._grad_bytes = 0

    def train_step(self, inputs, targets):
        accum = self.spec.grad_accum
        total = torch.zeros((), device=inputs.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
            last = i == accum - 1
            sync = contextlib.nullcontext() if last or self.no_sync is None else self.no_sync()
            with sync:
                with autocast(self.spec) if self.autocast_enabled else contextlib.nullcontext():
                    loss = lm_loss(self.module(x), y) / accum
                loss.backward()
            total += loss.detach()
        if self.measure_state:
            self._grad_bytes = tensor_bytes(p.grad for p in self.module.parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def state_bytes(self):
        return {
            "params": tensor_bytes(self.module.parameters()),
            "grads": self._grad_bytes,
            "optimizer": optimizer_state_bytes(self.optimizer),
        }
