"""ZeRO-3 / FSDP full shard, and HSDP hybrid shard: parameters partitioned too, gathered per block.

* ZeRO stage 3, P_os+g+p (Rajbhandari et al. 2020, Sec. 5.3 and 7.2.2): a rank keeps 1/N of
  every parameter, gradient and optimizer state. Parameters are all-gathered just before they
  are needed in forward, freed after, all-gathered again for backward, and gradients are
  reduce-scattered to their owners: 3Ψ of traffic instead of 2Ψ.
* FSDP (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel"):
  the same algorithm organised in *units*, here one per transformer block plus a root unit for
  what is left (embeddings, final LayerNorm, head). Each unit is one **flat parameter**
  (Sec. 3.2.1: flatten the unit's parameters, concatenate, pad to a multiple of N, chunk into N
  shards); each rank stores its shard. Forward and backward **prefetch** the next unit's
  all-gather while the current one computes (Sec. 3.3.2 / 3.3.3).
* HSDP, hybrid shard (same paper, Sec. 3.2.2): shard within a group of ``shard_size`` ranks
  (normally one host) and replicate across groups: reduce-scatter inside the shard group, then
  all-reduce the shard across replicas. Parameters are only gathered within the shard group.

``ref.zero3`` and ``ref.fsdp`` are this class with one option apart: ZeRO-3 frees *every* unit
after its forward (``reshard_root=True``: the root is gathered again for backward, exactly 3Ψ
of traffic), FSDP keeps the root unit gathered from its forward to the end of its backward
(FSDP2's behaviour for the root with its default ``reshard_after_forward=None``: the head and
embeddings are not gathered twice, at the cost of the root's bytes at the loss; ``torch.fsdp2``
here passes ``True``, which reshards the root too, like ``ref.zero3``).

Mechanics. A unit's gathered buffer ``full`` exists for the whole run, and its parameters are
permanent views of it; freeing it means shrinking its *storage* to zero bytes
(``untyped_storage().resize_(0)``, as FSDP1 does), and gathering grows it back and all-gathers
into it. Tensors that autograd saved in forward are views of the same storage, so backward sees
the re-gathered values without any re-binding.

* pre-forward hook: wait for (or issue) this unit's all-gather; prefetch the next unit's;
* post-forward hook: free the unit (unless it is the root and ``reshard_root`` is False);
  register a hook on its output, which fires when backward reaches the unit (pre-backward):
  wait for its all-gather and prefetch the unit backward visits next;
* post-accumulate-grad hooks: every ``p.grad`` of a block is a view of one flat gradient buffer
  (made at its first gradient; the root's at its last, see ``_grad_ready``); when all of them
  arrived, free the unit and reduce-scatter the buffer asynchronously.

Precision. Every rank keeps one **fp32 shard** per unit, the only persistent copy of the
parameters: the master weights the optimizer updates. Before each all-gather it is **cast into
this rank's slot of the gathered buffer** (compute dtype), which is then all-gathered in place
(cast-on-gather, as FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16)``): no 16-bit shard lives
between steps and no separate all-gather input is allocated. bf16: **bf16 on the wire** for
all-gather and reduce-scatter (the ZeRO paper's layout), gradient shards accumulated in fp32.
HSDP's all-reduce across replicas runs once per step on the **fp32** main-gradient shards.
fp16: the same layout with fp16 in place of bf16, plus dynamic loss scaling through the
``grad_scaler`` seam (``mixed_precision.DynamicLossScaler``), which unscales the fp32 main gradient
and skips the update on inf/NaN.

Memory per rank (Ψp = parameters padded per unit, N = shard-group size, b = compute-dtype bytes):
model state 16Ψp/N in every precision, the ZeRO paper's stage-3 figure: fp32 shard 4Ψp/N, Adam
moments 8Ψp/N, and the fp32 main-gradient shard 4Ψp/N, which exists only from its unit's first
reduce-scatter of a step to the update (allocated unit by unit as backward frees activations,
like FSDP2's sharded gradients). Working set on top, b bytes an element: gathered units — the one
computing, at most one prefetched, and the root while its forward or backward runs — and the
gradients before their reduce-scatter: the root's, and the flat buffers of at most ``in_flight`` + 1
blocks, each outstanding one with a unit/N receive shard in 16-bit (``parabench.theory`` states the
bound). ZeRO-3 (Rajbhandari et al. 2020, Sec. 5.3) counts the model state only; FSDP (Zhao et al.
2023, Sec. 3.2) the same layout: the peak is the model state plus this working set plus activations.

Gradient accumulation (``reduce_every_micro_batch``). True (the default, as FSDP2's default
``set_requires_gradient_sync(True)`` and DeepSpeed's stage 3): every micro-batch reduce-scatters
each unit's gradient, so per step A·bΨp of reduce-scatter payload (A = grad_accum) and no
full-size gradient outlives its unit's backward. False (accumulation without communication, the
FSDP paper's ``no_sync``, Zhao et al. 2023 Sec. 3.3.4; FSDP2's ``set_requires_gradient_sync(False)``
on all micro-batches but the last): a unit's flat gradient buffer is kept, unsharded, from the
first micro-batch and autograd accumulates into it; only the last micro-batch reduce-scatters it.
Per step bΨp of reduce-scatter payload, A times less; all-gathers are unchanged (parameters are
still freed after each use), and every unit's unsharded gradient, bΨp in all, is held across the
accumulation window: the memory ZeRO-3 set out to save (Sec. 5.2), traded for the traffic.

Averaging: the loss is multiplied by 1/(grad_accum x N_total) before backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference_impls._compat import all_gather_into, reduce_scatter_into
from reference_impls.dp_common import adamw, free_now, optimizer_state_bytes, round_up, tensor_bytes


class _Unit:
    """One flat parameter: the parameters of one module, this rank's fp32 shard of them, and the
    gathered buffer they are views of."""

    def __init__(self, index, module, params, world, rank, compute_dtype, reshard_after_forward):
        self.index, self.module, self.params = index, module, params
        self.reshard_after_forward = reshard_after_forward
        self.numel = sum(p.numel() for p in params)
        self.padded = round_up(self.numel, world)
        self.shard_numel = self.padded // world
        values = torch.cat([p.detach().reshape(-1).float() for p in params])
        values = torch.nn.functional.pad(values, (0, self.padded - self.numel))
        # fp32 shard: master weights and all-gather source (its own storage: ``full`` gets freed).
        self.master = values[rank * self.shard_numel : (rank + 1) * self.shard_numel].clone()
        self.full = values.to(compute_dtype)
        start = 0
        for p in params:  # parameters become permanent views of the gathered buffer
            p.data = self.full[start : start + p.numel()].view(p.shape)
            start += p.numel()
        # This rank's slot of the gathered buffer: the cast shard goes here, then the in-place all-gather.
        self.slot = self.full[rank * self.shard_numel : (rank + 1) * self.shard_numel]
        self.nbytes = self.full.untyped_storage().nbytes()
        self.gathered, self.work, self.ready = True, None, 0
        self.grad_buf = None  # per micro-batch: the flat gradient buffer that is reduce-scattered


class FSDP:
    def __init__(
        self,
        model,
        loss_fn,
        blocks,
        group=None,
        *,
        replicate_group=None,
        reshard_root=False,
        prefetch=True,
        grad_accum=1,
        compute_dtype=torch.float32,
        adam: dict,
        grad_scaler=None,
        in_flight: int = 2,
        reduce_every_micro_batch: bool = True,
    ):
        self.model, self.loss_fn, self.group, self.replicate_group = model, loss_fn, group, replicate_group
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self._sync = True  # this micro-batch reduce-scatters (False: accumulate into the unsharded buffers)
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.dp_total = self.world * (dist.get_world_size(replicate_group) if replicate_group is not None else 1)
        self.grad_accum, self.grad_scaler, self.prefetch = grad_accum, grad_scaler, prefetch
        self.measure_state, self._grad_bytes = False, 0

        in_blocks = {id(p) for blk in blocks for p in blk.parameters()}
        root_params = [p for p in model.parameters() if id(p) not in in_blocks]
        self.units = [_Unit(0, model, root_params, self.world, self.rank, compute_dtype, reshard_root)]
        self.units += [
            _Unit(i + 1, blk, list(blk.parameters()), self.world, self.rank, compute_dtype, True)
            for i, blk in enumerate(blocks)
        ]
        for u in self.units:
            self._free(u)
        # The optimizer owns the fp32 shards. Each one's ``.grad`` is its unit's fp32 main-gradient shard,
        # allocated when the unit's first reduce-scatter of a step is launched (fp32) or lands (16-bit)
        # and dropped after the update: it grows unit by unit while backward frees activations.
        self.optimizer = adamw([u.master for u in self.units], **adam)
        # A unit's gradients go straight into one flat buffer (allocated when its first gradient
        # arrives, every ``p.grad`` a view of it), which is the reduce-scatter input; at most
        # ``in_flight`` reduce-scatters are outstanding, the oldest waited for (on NCCL by the compute
        # stream, not the host) and its buffers freed before another is launched.
        self.in_flight = max(1, int(in_flight))

        self._hooks = []
        for u in self.units:
            self._hooks.append(u.module.register_forward_pre_hook(lambda m, a, u=u: self._pre_forward(u)))
            self._hooks.append(u.module.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out)))
            self._hooks += [p.register_post_accumulate_grad_hook(lambda p, u=u: self._grad_ready(u)) for p in u.params]
        self._pending = []  # (work, output shard, unit), oldest first
        self._written = [False] * len(self.units)  # this step: has unit i's shard been written?

    # --- gather and free ----------------------------------------------------------------------

    def _gather(self, u):
        """Issue the all-gather of unit ``u`` (asynchronous; no-op if it is gathered or on its way):
        cast the fp32 shard into this rank's slot of the gathered buffer, all-gather in place."""
        if u.gathered or u.work is not None:
            return
        u.full.untyped_storage().resize_(u.nbytes)
        u.slot.copy_(u.master)
        u.work = all_gather_into(u.full, u.slot, group=self.group, async_op=True)

    def _wait(self, u):
        self._gather(u)
        if u.work is not None:
            u.work.wait()
            u.work, u.gathered = None, True

    def _free(self, u):
        u.full.untyped_storage().resize_(0)
        u.gathered = False

    # --- hooks --------------------------------------------------------------------------------

    def _pre_forward(self, u):
        self._wait(u)
        if self.prefetch and u.index + 1 < len(self.units):  # forward order: root, block 0, block 1, ...
            self._gather(self.units[u.index + 1])

    def _post_forward(self, u, out):
        if u.reshard_after_forward:
            self._free(u)
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, u=u: self._pre_backward(u))

    def _pre_backward(self, u):
        self._wait(u)
        # backward order: root (head, final LayerNorm), last block, ..., first block, root (embeddings)
        nxt = len(self.units) - 1 if u.index == 0 else u.index - 1
        if self.prefetch and nxt > 0:
            self._gather(self.units[nxt])

    def _grad_buffer(self, u):
        """Unit ``u``'s flat gradient buffer (zero, padding included): every ``p.grad`` becomes a view of
        it, the gradients that already arrived are copied in (their own tensors then dropped), and
        autograd accumulates the rest in place."""
        if u.grad_buf is None:
            u.grad_buf = torch.zeros(u.padded, dtype=u.full.dtype, device=u.full.device)
            start = 0
            for p in u.params:
                view = u.grad_buf[start : start + p.numel()].view(p.shape)
                if p.grad is not None:  # arrived before the buffer existed
                    view.copy_(p.grad)
                p.grad = view
                start += p.numel()
        return u.grad_buf

    def _main_shard(self, u):
        """Unit ``u``'s fp32 main-gradient shard (the ``.grad`` of its fp32 shard), allocated on first use
        in a step: when its first reduce-scatter is launched (fp32, written straight into it) or lands."""
        if u.master.grad is None:
            u.master.grad = torch.empty_like(u.master)
        return u.master.grad

    def _grad_ready(self, u):
        # A block's gradients all arrive within its backward: its flat buffer is made at the first one
        # and the rest accumulate in place (no copy). The root's arrive at both ends of backward (head
        # first, embeddings last): it keeps autograd's own gradients until the last one, so the buffer
        # does not hold the embeddings' part through all of backward (FSDP2 makes its reduce-scatter
        # input at the same point); the copy is the root's size once per micro-batch.
        if u.index > 0:
            self._grad_buffer(u)
        u.ready += 1
        if u.ready < len(u.params):
            return
        u.ready = 0
        self._free(u)  # every use of these parameters in backward is done: free before the root's buffer
        flat = self._grad_buffer(u)
        if not self._sync:  # accumulating without communication: the buffer is kept for the next micro-batch
            return
        direct = not self._written[u.index] and flat.dtype == torch.float32
        out = self._main_shard(u) if direct else flat.new_empty(u.shard_numel)
        work = reduce_scatter_into(out, flat, group=self.group, async_op=True)
        self._pending.append((work, out, u))
        while len(self._pending) > self.in_flight:
            self._retire(*self._pending.pop(0))

    def _retire(self, work, out, u):
        """Wait for unit ``u``'s reduce-scatter, fold it into the main-gradient shard, free its buffers."""
        work.wait()
        for p in u.params:  # the reduce-scatter's input is done with: free it before the fp32 shard is made
            p.grad = None
        free_now(u.grad_buf)
        u.grad_buf = None
        dst = self._main_shard(u)
        if out is not dst:
            dst.copy_(out) if not self._written[u.index] else dst.add_(out)
            free_now(out)
        self._written[u.index] = True

    def _drain(self):
        while self._pending:
            self._retire(*self._pending.pop(0))

    # --- training step ------------------------------------------------------------------------

    def train_step(self, inputs, targets):
        total = torch.zeros((), device=inputs.device)
        scale = self.grad_scaler.scale if self.grad_scaler is not None else 1.0
        mult = scale / (self.grad_accum * self.dp_total)
        self._written = [False] * len(self.units)
        held = 0
        for i, (x, y) in enumerate(zip(inputs.chunk(self.grad_accum), targets.chunk(self.grad_accum))):
            self._sync = self.reduce_every_micro_batch or i == self.grad_accum - 1
            loss = self.loss_fn(self.model(x), y)
            (loss * mult).backward()
            total += loss.detach()
            if not self._sync and self.measure_state:  # the unsharded gradients kept for the next micro-batch
                held = tensor_bytes(u.grad_buf for u in self.units if u.grad_buf is not None)
            self._drain()
            for u in self.units:  # a unit whose parameters got no gradient is still gathered
                if u.gathered:
                    self._free(u)
        for u in self.units:  # a unit none of whose parameters got a gradient: zero gradient
            if not self._written[u.index]:
                self._main_shard(u).zero_()
        grads = [u.master.grad for u in self.units]
        if self.replicate_group is not None:  # HSDP: average the shards across replicas, once per step
            works = [dist.all_reduce(g, group=self.replicate_group, async_op=True) for g in grads]
            for w in works:
                w.wait()
        if self.measure_state:
            self._grad_bytes = tensor_bytes(grads) + held
        applied = True
        if self.grad_scaler is not None:  # seam: unscale the owned shards, agree on inf over all ranks
            applied = self.grad_scaler.unscale_and_check(grads, self.group)
            self.grad_scaler.update(applied)
        if applied:
            self.optimizer.step()  # the next gathers cast the updated fp32 shards: nothing to copy here
        for u in self.units:
            u.master.grad = None  # released until the next step's first reduce-scatter
        return total / self.grad_accum

    def loss_scale(self) -> dict | None:
        """The loss scaler's outcome of the last step (fp16), else None."""
        return getattr(self.grad_scaler, "last", None)

    def state_bytes(self):
        gathered = sum(u.full.untyped_storage().nbytes() for u in self.units)  # 0 between steps
        return {
            "params": gathered + tensor_bytes(u.master for u in self.units),
            "grads": self._grad_bytes,
            "optimizer": optimizer_state_bytes(self.optimizer),
        }

    def full_parameters(self):
        """All-gather the fp32 master shards of every unit (within the shard group)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for u in self.units:
            full = u.master.new_empty(u.padded)
            all_gather_into(full, u.master, group=self.group)
            start = 0
            for p in u.params:
                out[names[id(p)]] = full[start : start + p.numel()].view(p.shape).cpu().clone()
                start += p.numel()
        return out

    def close(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
