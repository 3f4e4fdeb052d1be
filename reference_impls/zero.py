"""ZeRO stages 1 and 2: optimizer states (1), and gradients (2), partitioned over the data-parallel group.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".

* Stage 1, P_os (Sec. 5.1): each of the N ranks keeps the fp32 master weights and Adam moments
  of 1/N of the parameters only. Gradients are computed in full, **reduce-scattered** so that
  every rank receives the average of the shard it owns, each rank updates its shard, and the
  new parameters are **all-gathered** (Sec. 7.2.1: the same 2Ψ volume as DDP's all-reduce,
  which is itself a reduce-scatter followed by an all-gather).
* Stage 2, P_os+g (Sec. 5.2): in addition, a rank never keeps the full gradient. As backward
  produces gradients they are copied into a bucket and the parameter's own gradient is freed
  at once; a complete bucket is reduce-scattered straight into the owners' shards while
  backward goes on, and the bucket is dropped as soon as its collective completes. With
  gradient accumulation this happens on every micro-batch (ZeRO-1 accumulates the full
  gradient locally and communicates on the last micro-batch only).

Two forms of gradient accumulation at stage 2 (``reduce_every_micro_batch``):

* True (the default, as DeepSpeed's ZeRO-2: engine.py ``allreduce_gradients``, "ZeRO stage >= 2
  communicates during non gradient accumulation boundaries as well"): every micro-batch
  reduce-scatters its buckets, so no rank ever holds the whole gradient. Per step A·bΨp of
  reduce-scatter payload (A = grad_accum); gradient memory 4Ψp/N plus at most in_flight + 1
  buckets alive during backward.
* False (accumulation without communication, DDP's ``no_sync``, Li et al. 2020 Sec. 3.2.5;
  DeepSpeed's ``engine.coalesce_grad_reduction()``): earlier micro-batches only accumulate into
  the full-size buckets; the last one reduce-scatters them once. Per step bΨp of reduce-scatter
  payload, A times less, at the price of holding the whole gradient bΨp from the first
  micro-batch to the last: ZeRO-1's gradient memory, bΨp + 4Ψp/N (the paper's Sec. 5.2 saving
  of gradient memory is given up for the accumulation window).

Layout (see ``dp_common.py``): the flat buffer is cut into buckets (bucket_mb of the compute
dtype, last parameters first) and **each bucket is padded to a multiple of N and split into N
equal shards**, rank r owning shard r of every bucket (Megatron-core's distributed optimizer
shards its buckets the same way). So every bucket's reduce-scatter and all-gather lands exactly
on shard boundaries and can be launched as soon as the bucket is ready.

Precision. fp32: the shard of ``flat_param`` a rank owns *is* its master copy (the optimizer
updates it in place, then the in-place all-gather sends it out). bf16 (the paper's mixed-
precision layout, Sec. 3.1): bf16 parameters and gradients; gradients cross the wire in **bf16**
(reduce-scatter) and are accumulated into an fp32 main-gradient shard; the fp32 master shard
is cast into the bf16 buffer and **bf16** parameters are all-gathered.
fp16: the same layout with fp16 in place of bf16, plus dynamic loss scaling through the
``grad_scaler`` seam (``mixed_precision.DynamicLossScaler``), which unscales the fp32 main gradient
and skips the update on inf/NaN.

Averaging: the loss is multiplied by 1/(grad_accum x N) before backward, so the sum that
reduce-scatter computes is the mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference_impls._compat import all_gather_into, reduce_scatter_into
from reference_impls.dp_common import (
    MiB,
    adamw,
    bind_params,
    flatten,
    free_now,
    optimizer_state_bytes,
    plan_buckets,
    tensor_bytes,
)


class ZeRO:
    def __init__(
        self,
        model,
        loss_fn,
        group=None,
        *,
        stage: int,
        grad_accum=1,
        compute_dtype=torch.float32,
        bucket_mb=25.0,
        adam: dict,
        grad_scaler=None,
        in_flight: int = 2,
        reduce_every_micro_batch: bool = True,
    ):
        assert stage in (1, 2)
        self.model, self.loss_fn, self.group, self.stage = model, loss_fn, group, stage
        # Stage 1 always accumulates locally; stage 2 does when told (see the module docstring).
        self.reduce_every_micro_batch = stage == 2 and reduce_every_micro_batch
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.grad_accum, self.grad_scaler = grad_accum, grad_scaler
        self.measure_state, self._grad_bytes, self._held_grad_bytes = False, 0, 0
        elem = torch.empty((), dtype=compute_dtype).element_size()
        self.buckets = plan_buckets(model.parameters(), bucket_mb * MiB, elem, pad_to=self.world)

        full32 = flatten(self.buckets, torch.float32)
        self.flat_param = full32 if compute_dtype == torch.float32 else full32.to(compute_dtype)
        bind_params(self.buckets, self.flat_param)
        if compute_dtype == torch.float32:
            self.master_flat = None  # the owned shards of flat_param are the master weights
            self.master = [self._mine(self.flat_param, b) for b in self.buckets]
        else:
            self.master_flat = torch.cat([self._mine(full32, b) for b in self.buckets])
            self.master = list(self.master_flat.split([b.numel // self.world for b in self.buckets]))
        del full32
        # fp32 main-gradient shard: allocated when the first reduce-scatter of a step lands, dropped
        # after the update, so it is not held through forward (where activations peak).
        self.main_grad, self.main_grads = None, None
        self._written = [False] * len(self.buckets)  # this step: has bucket i's shard been written?
        self.optimizer = adamw(self.master, **adam)

        # Gradient buckets (compute dtype): allocated when the bucket's first gradient arrives, every
        # ``p.grad`` of the bucket then a view of it (autograd accumulates in place), freed as soon as
        # its reduce-scatter completed (ZeRO-2: every micro-batch; ZeRO-1: the last one). At most
        # ``in_flight`` reduce-scatters are outstanding: launching one more waits for the oldest (on
        # NCCL the compute stream waits, the host does not), so the buckets alive are bounded by
        # in_flight + the one being filled, never the whole gradient.
        self.in_flight = max(1, int(in_flight))
        self._gbuf = [None] * len(self.buckets)
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda p, b=b, s=s: self._grad_ready(p, b, s))
            for b in self.buckets
            for p, s in zip(b.params, b.starts)
        ]
        self._pending = []  # (work, output shard, bucket), oldest first
        self._sync = False

    def _mine(self, flat, b):
        """This rank's shard of bucket ``b`` in ``flat`` (a view)."""
        s = b.numel // self.world
        return flat[b.offset + self.rank * s : b.offset + (self.rank + 1) * s]

    # --- backward: gradients into buckets, buckets reduce-scattered in order -------------------

    def _bucket(self, b, arrived=None):
        """Bucket ``b``'s gradient buffer, allocated (zero) on first use: every parameter's ``.grad``
        becomes a view of it; ``arrived`` (whose gradient autograd already made) is copied in."""
        buf = self._gbuf[b.index]
        if buf is None:
            ref = b.params[0]
            buf = self._gbuf[b.index] = torch.zeros(b.numel, dtype=self.flat_param.dtype, device=ref.device)
            for q, start in zip(b.params, b.starts):
                view = buf[start - b.offset : start - b.offset + q.numel()].view(q.shape)
                if q.grad is not None:  # the parameter that just arrived
                    view.copy_(q.grad)
                q.grad = view
        return buf

    def _release(self, b):
        """Bucket ``b``'s reduce-scatter is complete: drop its gradient buffer."""
        for q in b.params:
            q.grad = None
        free_now(self._gbuf[b.index])
        self._gbuf[b.index] = None

    def _grad_ready(self, p, b, start):
        self._bucket(b, p)
        if not self._sync:  # ZeRO-1, earlier micro-batch: only accumulate into the bucket
            return
        self._ready[b.index] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _main_shard(self, b):
        """Bucket ``b``'s fp32 main-gradient shard. Each is allocated when its bucket's first reduce-scatter
        is launched or lands, so the shard grows bucket by bucket while backward frees activations (one
        flat allocation at the first bucket would add 4Ψp/N at once, early in backward). A subclass that
        keeps its optimizer elsewhere (``self.master`` None: ZeRO-Offload) reads one flat ``main_grad``."""
        if self.master is None:
            if self.main_grad is None:
                self.main_grad = torch.empty(
                    sum(bb.numel for bb in self.buckets) // self.world,
                    dtype=torch.float32,
                    device=self.flat_param.device,
                )
                self.main_grads = list(self.main_grad.split([bb.numel // self.world for bb in self.buckets]))
            return self.main_grads[b.index]
        if self.main_grads is None:
            self.main_grads = [None] * len(self.buckets)
        if self.main_grads[b.index] is None:
            g = self.main_grads[b.index] = torch.empty(
                b.numel // self.world, dtype=torch.float32, device=self.flat_param.device
            )
            self.master[b.index].grad = g  # fp32 averaged gradient of the owned shard
        return self.main_grads[b.index]

    def _launch(self, b):
        full = self._bucket(b)  # a bucket with unused parameters may have none yet
        first = not self._written[b.index]
        direct = first and full.dtype == torch.float32  # fp32, first contribution: straight into the shard
        out = (
            self._main_shard(b) if direct else torch.empty(b.numel // self.world, dtype=full.dtype, device=full.device)
        )
        work = reduce_scatter_into(out, full, group=self.group, async_op=True)
        self._pending.append((work, out, b))
        while len(self._pending) > self.in_flight:
            self._retire(*self._pending.pop(0))

    def _retire(self, work, out, b):
        """Wait for bucket ``b``'s reduce-scatter, fold it into the fp32 main-gradient shard, free the bucket."""
        work.wait()  # on NCCL the compute stream waits, the host does not
        dst = self._main_shard(b)
        if out is not dst:
            dst.copy_(out) if not self._written[b.index] else dst.add_(out)
            free_now(out)
        self._written[b.index] = True
        self._release(b)

    def _drain(self):
        """Wait for the rest of this micro-batch's reduce-scatters."""
        while self._pending:
            self._retire(*self._pending.pop(0))

    def train_step(self, inputs, targets):
        total = torch.zeros((), device=inputs.device)
        scale = self.grad_scaler.scale if self.grad_scaler is not None else 1.0
        mult = scale / (self.grad_accum * self.world)
        self._written = [False] * len(self.buckets)
        self._held_grad_bytes = 0
        for i, (x, y) in enumerate(zip(inputs.chunk(self.grad_accum), targets.chunk(self.grad_accum))):
            last = i == self.grad_accum - 1
            self._sync = last or self.reduce_every_micro_batch
            self._ready, self._next = [0] * len(self.buckets), 0
            loss = self.loss_fn(self.model(x), y)
            (loss * mult).backward()
            total += loss.detach()
            if not self._sync and self.measure_state:  # the whole gradient, held until the last micro-batch
                self._held_grad_bytes = tensor_bytes(g for g in self._gbuf if g is not None)
            if self._sync:
                for b in self.buckets[self._next :]:  # buckets with unused parameters
                    self._launch(b)
                self._drain()
        self._sync = False
        self._step()
        return total / self.grad_accum

    # --- update: each rank its shard, then all-gather the parameters ---------------------------

    def _step(self):
        if self.measure_state:  # stage 1: the full gradient, bucket by bucket (each freed once reduced)
            full = sum(b.numel for b in self.buckets) * self.flat_param.element_size() if self.stage == 1 else 0
            # stage 2 accumulating locally: the buckets measured after an earlier micro-batch
            self._grad_bytes = tensor_bytes(self.main_grads or []) + max(full, self._held_grad_bytes)
        applied = True
        if self.grad_scaler is not None:  # seam: unscale the owned shard, agree on inf across the group
            applied = self.grad_scaler.unscale_and_check(self.main_grads, self.group)
            self.grad_scaler.update(applied)
        if applied:
            self.optimizer.step()
        works = []
        for b, master in zip(self.buckets, self.master):
            full = self.flat_param[b.offset : b.offset + b.numel]
            mine = self._mine(self.flat_param, b)
            if master is not mine:
                mine.copy_(master)  # bf16: cast the updated fp32 master shard into the compute copy
            works.append(all_gather_into(full, mine, group=self.group, async_op=True))  # in place
        for w in works:
            w.wait()
        for m in self.master:
            m.grad = None
        self.main_grad = self.main_grads = None  # released until the next step's first reduce-scatter

    def loss_scale(self) -> dict | None:
        """The loss scaler's outcome of the last step (fp16), else None."""
        return getattr(self.grad_scaler, "last", None)

    def state_bytes(self):
        master = tensor_bytes([self.master_flat]) if self.master_flat is not None else 0
        return {
            "params": tensor_bytes([self.flat_param]),
            "grads": self._grad_bytes,
            "optimizer": master + optimizer_state_bytes(self.optimizer),
        }

    def full_parameters(self):
        """All-gather the fp32 master shards; slice them back into the model's parameters."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for b, master in zip(self.buckets, self.master):
            full = torch.empty(b.numel, dtype=torch.float32, device=master.device)
            all_gather_into(full, master.float().contiguous(), group=self.group)
            for p, start in zip(b.params, b.starts):
                out[names[id(p)]] = full[start - b.offset : start - b.offset + p.numel()].view(p.shape).cpu().clone()
        return out

    def close(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
