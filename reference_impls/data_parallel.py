"""Data parallelism: a parameter server, and DDP's bucketed all-reduce overlapped with backward.

Every rank holds the whole model and trains on its own slice of the global batch; the gradients
are averaged across the data-parallel group before every update, so training matches one
process on the whole batch.

* :class:`ParameterServer` (Li et al. 2014, "Scaling Distributed Machine Learning with the
  Parameter Server", Sec. 3): workers send gradients to one server rank, which averages them,
  applies AdamW and broadcasts the new parameters. The server receives N-1 full gradients one
  after the other, so its traffic and time grow linearly with the number of workers: the
  bottleneck that motivated all-reduce.
* :class:`DDP` (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
  Training", Sec. 3.2): gradients are all-reduced in buckets (Sec. 3.2.3) launched from
  per-parameter hooks as soon as a bucket is complete, so communication overlaps the rest of
  backward (Sec. 3.2.4); with gradient accumulation only the last micro-batch communicates
  (``no_sync``, Sec. 3.2.5).

Averaging: the loss of each micro-batch is multiplied by 1/(grad_accum x N) before backward,
so the *sum* that all-reduce computes is already the mean (gloo has no AVG op, and this saves a
pass over the gradients).

Precision. fp32: parameters, gradients and Adam state in fp32; the flat parameter buffer is
itself the optimizer's parameter. bf16 (the ZeRO paper's mixed-precision layout, Sec. 3.1):
bf16 parameters and gradients for compute, an fp32 master copy and fp32 Adam moments; the
gradients cross the wire in **bf16** and are upcast to an fp32 main gradient for the update.
fp16: the same layout with fp16 in place of bf16, plus dynamic loss scaling through the
``grad_scaler`` seam (``mixed_precision.DynamicLossScaler``), which unscales the fp32 main gradient
and skips the update on inf/NaN.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference_impls.dp_common import (
    MiB,
    adamw,
    bind_grads,
    bind_params,
    flatten,
    optimizer_state_bytes,
    plan_buckets,
    tensor_bytes,
)


class _FlatReplica:
    """A full replica in flat buffers: ``flat_param`` (compute dtype, every parameter a view of it),
    ``flat_grad`` (every ``p.grad`` a view of it) and the fp32 ``master`` the optimizer updates."""

    def __init__(self, model, loss_fn, group, grad_accum, compute_dtype, bucket_mb, adam, grad_scaler):
        self.model, self.loss_fn, self.group = model, loss_fn, group
        self.world = dist.get_world_size(group)
        self.grad_accum, self.grad_scaler = grad_accum, grad_scaler
        self.measure_state, self._grad_bytes = False, 0
        elem = torch.empty((), dtype=compute_dtype).element_size()
        self.buckets = plan_buckets(model.parameters(), bucket_mb * MiB, elem)
        master = flatten(self.buckets, torch.float32)
        self.flat_param = master if compute_dtype == torch.float32 else master.to(compute_dtype)
        bind_params(self.buckets, self.flat_param)
        self.flat_grad = torch.zeros_like(self.flat_param)
        bind_grads(self.buckets, self.flat_grad)
        self.master = master  # is flat_param itself in fp32
        self.adam = adam

    def _loss_multiplier(self) -> float:
        scale = self.grad_scaler.scale if self.grad_scaler is not None else 1.0
        return scale / (self.grad_accum * self.world)

    def _forward_backward(self, inputs, targets, before_backward=None):
        """Run the micro-batches; returns the mean loss (detached, on the device)."""
        total = torch.zeros((), device=inputs.device)
        mult = self._loss_multiplier()
        for i, (x, y) in enumerate(zip(inputs.chunk(self.grad_accum), targets.chunk(self.grad_accum))):
            if before_backward is not None:
                before_backward(last=i == self.grad_accum - 1)
            loss = self.loss_fn(self.model(x), y)
            (loss * mult).backward()
            total += loss.detach()
        return total / self.grad_accum

    def _update(self, main_grad: torch.Tensor, held=()) -> bool:
        """AdamW on the fp32 master with ``main_grad`` (fp32, already averaged); the loss-scaling seam.

        ``held``: other gradient buffers alive at this point, counted in the gradient bytes."""
        self.master.grad = main_grad
        if self.measure_state:  # sampled just before the update, when gradients are largest
            self._grad_bytes = tensor_bytes({id(t): t for t in (self.flat_grad, main_grad, *held)}.values())
        applied = True
        if self.grad_scaler is not None:
            applied = self.grad_scaler.unscale_and_check([main_grad], None)
            self.grad_scaler.update(applied)
        if applied:
            self.optimizer.step()
        self.master.grad = None
        if self.master is not self.flat_param:
            self.flat_param.copy_(self.master)  # fp32 master -> bf16 compute copy
        self.flat_grad.zero_()
        return applied

    def loss_scale(self) -> dict | None:
        """The loss scaler's outcome of the last step (fp16), else None."""
        return getattr(self.grad_scaler, "last", None)

    def state_bytes(self) -> dict:
        master = self.master.numel() * 4 if self.master is not self.flat_param else 0
        return {
            "params": tensor_bytes([self.flat_param]),
            "grads": self._grad_bytes,
            "optimizer": master + (optimizer_state_bytes(self.optimizer) if self.optimizer else 0),
        }

    def _full_parameters_from(self, master: torch.Tensor) -> dict:
        out = {}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for b in self.buckets:
            for p, start in zip(b.params, b.starts):
                out[names[id(p)]] = master[start : start + p.numel()].view(p.shape).detach().float().cpu().clone()
        return out


class DDP(_FlatReplica):
    """Bucketed gradient all-reduce, launched from post-accumulate-grad hooks during backward."""

    def __init__(
        self,
        model,
        loss_fn,
        group=None,
        *,
        grad_accum=1,
        compute_dtype=torch.float32,
        bucket_mb=25.0,
        adam: dict,
        grad_scaler=None,
    ):
        super().__init__(model, loss_fn, group, grad_accum, compute_dtype, bucket_mb, adam, grad_scaler)
        self.optimizer = adamw([self.master], **adam)
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda p, b=b: self._grad_ready(b))
            for b in self.buckets
            for p in b.params
        ]
        self._sync = False
        self._ready = [0] * len(self.buckets)
        self._next = 0  # buckets are launched strictly in order, the same order on every rank
        self._works = []

    def _grad_ready(self, bucket):
        if not self._sync:  # no_sync: an earlier micro-batch only accumulates into flat_grad
            return
        self._ready[bucket.index] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket):
        grad = self.flat_grad[bucket.offset : bucket.offset + bucket.numel]
        self._works.append(dist.all_reduce(grad, group=self.group, async_op=True))  # sum of pre-scaled grads

    def _arm(self, last: bool):
        self._sync = last
        self._ready = [0] * len(self.buckets)
        self._next = 0

    def train_step(self, inputs, targets):
        loss = self._forward_backward(inputs, targets, before_backward=self._arm)
        for b in self.buckets[self._next :]:  # a bucket with unused parameters never completes
            self._launch(b)
        for w in self._works:
            w.wait()  # on NCCL: the compute stream waits for the comm stream; the host does not block
        self._works, self._sync = [], False
        main_grad = self.flat_grad if self.flat_grad.dtype == torch.float32 else self.flat_grad.float()
        self._update(main_grad)
        return loss

    def full_parameters(self):
        return self._full_parameters_from(self.master)

    def close(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []


class ParameterServer(_FlatReplica):
    """Workers send gradients to the server (group rank 0), which updates and broadcasts parameters.

    Only the server holds the fp32 master and the Adam moments. It receives the workers'
    gradients one by one into a single receive buffer and adds them up (``main_grad``), so its
    memory does not grow with N, but its time and received bytes do: (N-1) x the gradients.
    """

    def __init__(
        self, model, loss_fn, group=None, *, grad_accum=1, compute_dtype=torch.float32, adam: dict, grad_scaler=None
    ):
        super().__init__(model, loss_fn, group, grad_accum, compute_dtype, float("inf"), adam, grad_scaler)
        self.server = dist.get_global_rank(group or dist.group.WORLD, 0)
        self.is_server = dist.get_rank() == self.server
        self.optimizer = adamw([self.master], **adam) if self.is_server else None
        if not self.is_server:
            self.master = self.flat_param  # workers keep no master copy
        self.recv_buf = torch.empty_like(self.flat_grad) if self.is_server else None

    def train_step(self, inputs, targets):
        loss = self._forward_backward(inputs, targets)  # gradients accumulate locally in flat_grad
        if self.is_server:
            main_grad = self.flat_grad if self.flat_grad.dtype == torch.float32 else self.flat_grad.float()
            for r in dist.get_process_group_ranks(self.group or dist.group.WORLD):
                if r != self.server:
                    dist.recv(self.recv_buf, src=r, group=self.group)  # one worker after another
                    main_grad.add_(self.recv_buf)
            self._update(main_grad, held=(self.recv_buf,))
        else:
            if self.grad_scaler is not None:  # fault injection only: workers never unscale
                self.grad_scaler.maybe_inject([self.flat_grad])
            dist.send(self.flat_grad, dst=self.server, group=self.group)
            if self.measure_state:
                self._grad_bytes = tensor_bytes([self.flat_grad])
            self.flat_grad.zero_()
        dist.broadcast(self.flat_param, src=self.server, group=self.group)  # new parameters to every worker
        if self.grad_scaler is not None:
            # fp16: only the server decides; workers must scale the next loss by the server's new
            # scale, or the server would add up gradients scaled differently (one scalar broadcast).
            last = self.grad_scaler.last if self.is_server else None
            flag = torch.tensor(
                [last["scale"], float(last["skipped"])] if last else [0.0, 0.0],
                dtype=torch.float64,
                device=self.flat_param.device,
            )
            dist.broadcast(flag, src=self.server, group=self.group)
            if not self.is_server:
                self.grad_scaler.follow(float(flag[0]), not bool(flag[1]))
        return loss

    def state_bytes(self):
        if self.is_server:
            return super().state_bytes()
        return {"params": tensor_bytes([self.flat_param]), "grads": self._grad_bytes, "optimizer": 0}

    def full_parameters(self):
        return self._full_parameters_from(self.flat_param if not self.is_server else self.master)

    def close(self):
        pass
