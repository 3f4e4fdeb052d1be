"""ZeRO-R: the residual-state optimizations of ZeRO, over Megatron tensor parallelism (torch only).

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", Sec. 6
(the three techniques) and Sec. 8 (their communication). Residual states are "activations, temporary
buffers and unusable fragmented memory"; ZeRO-R "optimizes the memory consumption of residual states,
using partitioned activation recomputation, constant buffer size and on-the-fly memory
defragmentation" (as the paper's summary is quoted in the seed notes this project started from).

* **Pa, partitioned activation checkpointing** (Sec. 6.1). Under tensor (model) parallelism every rank
  of the TP group holds the same replicated residual stream ``x`` [b, s, h], so a checkpoint of it
  (activation checkpointing keeps one per transformer block) is stored t times over. Pa keeps only
  this rank's 1/t slice of each checkpoint (flattened, padded to a multiple of t) and, in backward,
  **all-gathers** the slices over the TP group to rebuild ``x`` just before the block's forward is
  recomputed. Checkpoint memory per rank: L·ceil(b·s·h/t)·e bytes instead of L·b·s·h·e (L blocks, e
  bytes an element), the factor t of Sec. 6.1. Its price (Sec. 8): one all-gather of b·s·h per block
  per micro-batch, against Megatron's 12·b·s·h of all-reduce traffic per block with recomputation
  (two all-reduces each in forward, recomputed forward and backward, each counted twice): under a
  tenth of it, the paper's argument that Pa is cheap.
* **Pa+cpu** (Sec. 6.1): the partitioned checkpoints go to CPU memory (pinned on GPUs) and come back
  before the all-gather: device checkpoint memory ~0, 2·L·ceil(b·s·h/t)·e bytes over the host link
  per micro-batch.
* **CB, constant-size buffers** (Sec. 6.2): a fused buffer of all gradients for one all-reduce grows
  with the model (the paper's example: 12 GB for the fp32 gradients of a 3B-parameter model); here
  the data-parallel gradient all-reduce runs over windows of a constant ``buffer_elements``,
  whatever the model size: ceil(Ψ_local / buffer) all-reduces, none larger than the buffer.
* **MD, memory defragmentation** (Sec. 6.3): long-lived tensors (activation checkpoints, parameter
  gradients) interleaved with short-lived ones (recomputed activations) fragment memory. ZeRO
  pre-allocates contiguous memory for the checkpoints and the gradients and copies each into it as
  it is produced. Here: one **activation arena** (L
  slots, allocated at the first micro-batch and reused by every later one) into which each block's
  checkpoint (slice) is copied, and one contiguous gradient buffer of which every ``p.grad`` is a
  view (allocated once, zeroed per step). With MD the CB windows are views of that buffer (no copy);
  without it, gradients are packed into one constant-size fused buffer per window and unpacked.

Recomputation is the reentrant form (Megatron's and DeepSpeed's ``CheckpointFunction``): the block
runs under ``no_grad`` in forward; backward rebuilds its input, reruns it with grad and backpropagates
through it, accumulating the parameters' gradients directly. The model has no dropout, so the rerun
is exact. Composition: TP is applied first (``tensor_parallel.apply_tensor_parallel``, Megatron's
layers unchanged), then each block's forward is wrapped, then DP reduces once per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference_impls._compat import all_gather_into
from reference_impls.dp_common import adamw, optimizer_state_bytes, tensor_bytes
from reference_impls.tensor_parallel import apply_tensor_parallel


class ActivationArena:
    """The activation checkpoints of one micro-batch: with ``contiguous`` (MD) slots of one buffer made
    at first use and reused, else one tensor per checkpoint, allocated as it is stored. ``host``:
    the buffer lives in CPU memory (Pa+cpu), pinned when the model is on a GPU."""

    def __init__(self, n_slots: int, contiguous: bool, host: bool, pin: bool):
        self.n_slots, self.contiguous, self.host, self.pin = n_slots, contiguous, host, pin
        self.buffer, self.slot_numel = None, 0
        self.slots: list = [None] * n_slots
        self.allocations = 0  # buffer (MD) or per-checkpoint allocations since construction
        self.held_bytes = 0  # checkpoint bytes stored now

    def store(self, i: int, t: torch.Tensor) -> None:
        t = t.reshape(-1)
        device = torch.device("cpu") if self.host else t.device
        if self.contiguous:
            if self.buffer is None or self.slot_numel != t.numel() or self.buffer.dtype != t.dtype:
                self.slot_numel = t.numel()
                self.buffer = torch.empty(self.n_slots * t.numel(), dtype=t.dtype, device=device, pin_memory=self.pin)
                self.allocations += 1
            dst = self.buffer[i * self.slot_numel : (i + 1) * self.slot_numel]
        else:
            dst = torch.empty(t.numel(), dtype=t.dtype, device=device, pin_memory=self.pin)
            self.allocations += 1
        dst.copy_(t)
        self.slots[i] = dst
        self.held_bytes += tensor_bytes([dst])

    def load(self, i: int, device) -> torch.Tensor:
        """Slot ``i``'s checkpoint on ``device``; the slot is released (its bytes reusable)."""
        t, self.slots[i] = self.slots[i], None
        self.held_bytes -= tensor_bytes([t])
        return t.to(device)


class _Checkpoint(torch.autograd.Function):
    """One block: forward without keeping its activations (its input goes to the arena, partitioned
    with Pa); backward rebuilds the input, reruns the block with grad and backpropagates through it."""

    @staticmethod
    def forward(ctx, x, zr, index, run):
        ctx.zr, ctx.index, ctx.run, ctx.shape, ctx.device = zr, index, run, x.shape, x.device
        with torch.no_grad():
            y = run(x)
        zr._save(index, x.detach())
        return y

    @staticmethod
    def backward(ctx, dy):
        x = ctx.zr._restore(ctx.index, ctx.shape, ctx.device).requires_grad_(True)
        with torch.enable_grad():
            y = ctx.run(x)
        torch.autograd.backward(y, dy)
        return x.grad, None, None, None


class ZeroR:
    def __init__(
        self,
        model,
        tp_group,
        dp_group,
        *,
        grad_accum: int = 1,
        adam: dict,
        partition_activations: bool = True,
        cpu_checkpointing: bool = False,
        contiguous_memory_optimization: bool = True,
        buffer_elements: int = 25 * 2**20 // 4,
    ):
        self.module = apply_tensor_parallel(model, tp_group)
        self.tp_group, self.dp_group = tp_group, dp_group
        self.tp, self.tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.dp = dist.get_world_size(dp_group)
        self.grad_accum, self.partition = grad_accum, partition_activations
        self.buffer_elements = int(buffer_elements)
        device = next(self.module.parameters()).device
        self.arena = ActivationArena(
            len(self.module.blocks),
            contiguous_memory_optimization,
            host=cpu_checkpointing,
            pin=cpu_checkpointing and device.type == "cuda",
        )
        for i, block in enumerate(self.module.blocks):
            inner = block.forward
            block.forward = lambda x, i=i, inner=inner: _Checkpoint.apply(x, self, i, inner)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.flat_grad, self.fused = None, None
        if contiguous_memory_optimization:  # MD for gradients: every p.grad a view of one buffer
            self.flat_grad = torch.zeros(sum(p.numel() for p in self.params), device=device)
            start = 0
            for p in self.params:
                p.grad = self.flat_grad[start : start + p.numel()].view(p.shape)
                start += p.numel()
        self.optimizer = adamw(self.params, **adam)
        self.measure_state, self._grad_bytes = False, 0
        self.stats = {}

    # --- Pa: checkpoints partitioned over the TP group ----------------------------------------------

    def _save(self, index: int, x: torch.Tensor) -> None:
        flat = x.reshape(-1)
        if self.partition:
            part = -(-flat.numel() // self.tp)
            flat = torch.nn.functional.pad(flat, (0, part * self.tp - flat.numel()))
            flat = flat[self.tp_rank * part : (self.tp_rank + 1) * part]
        self.arena.store(index, flat)
        self.stats["checkpoint_bytes_peak"] = max(self.stats.get("checkpoint_bytes_peak", 0), self.arena.held_bytes)

    def _restore(self, index: int, shape, device) -> torch.Tensor:
        mine = self.arena.load(index, device)
        numel = shape.numel()
        if self.partition:
            full = mine.new_empty(mine.numel() * self.tp)
            all_gather_into(full, mine, group=self.tp_group)
            mine = full[:numel]
        return mine.view(shape)

    # --- CB: the data-parallel gradient all-reduce in constant-size windows --------------------------

    def _windows(self):
        """(pieces, numel) per window of ``buffer_elements`` over the gradients laid end to end; each
        piece is (gradient slice, offset in the window)."""
        window, used = [], 0
        for p in self.params:
            g, start = p.grad.reshape(-1), 0
            while start < g.numel():
                n = min(g.numel() - start, self.buffer_elements - used)
                window.append((g[start : start + n], used))
                used, start = used + n, start + n
                if used == self.buffer_elements:
                    yield window, used
                    window, used = [], 0
        if window:
            yield window, used

    def _reduce_gradients(self) -> None:
        calls = 0
        if self.flat_grad is not None:  # MD: the windows are views of the contiguous gradients
            for start in range(0, self.flat_grad.numel(), self.buffer_elements):
                dist.all_reduce(self.flat_grad[start : start + self.buffer_elements], group=self.dp_group)
                calls += 1
            self.flat_grad.div_(self.dp)
        else:  # one constant-size fused buffer, allocated once: pack, all-reduce, unpack
            if self.fused is None:
                self.fused = self.params[0].new_empty(self.buffer_elements)
            for pieces, used in self._windows():
                for g, at in pieces:
                    self.fused[at : at + g.numel()].copy_(g)
                dist.all_reduce(self.fused[:used], group=self.dp_group)
                for g, at in pieces:
                    g.copy_(self.fused[at : at + g.numel()]).div_(self.dp)
                calls += 1
        self.stats["grad_reduce_calls"] = calls

    # --- one step ------------------------------------------------------------------------------------

    def train_step(self, inputs, targets):
        total = torch.zeros((), device=inputs.device)
        for p in self.params:  # unused parameters keep a zero gradient (the windows cover every one)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for x, y in zip(inputs.chunk(self.grad_accum), targets.chunk(self.grad_accum)):
            loss = self.module(x, y)
            (loss / self.grad_accum).backward()
            total += loss.detach()
        self._reduce_gradients()
        if self.measure_state:
            self._grad_bytes = (
                tensor_bytes([self.flat_grad])
                if self.flat_grad is not None
                else tensor_bytes(p.grad for p in self.params)
            )
        self.optimizer.step()
        if self.flat_grad is not None:
            self.flat_grad.zero_()
        else:
            for p in self.params:
                p.grad = None
        return total / self.grad_accum

    def strategy_stats(self) -> dict:
        """The ZeRO-R measurements: checkpoint bytes held at the peak, on the device or the host; arena
        allocations since construction (MD: one); data-parallel all-reduce windows of the last step."""
        where = "host" if self.arena.host else "device"
        return {
            "activation_checkpoint_bytes": {where: self.stats.get("checkpoint_bytes_peak", 0)},
            "activation_arena_bytes": tensor_bytes([self.arena.buffer]),
            "activation_arena_allocations": self.arena.allocations,
            "grad_reduce_calls": self.stats.get("grad_reduce_calls", 0),
        }

    def state_bytes(self):
        return {
            "params": tensor_bytes(self.params),
            "grads": self._grad_bytes,
            "optimizer": optimizer_state_bytes(self.optimizer),
        }

    def close(self):
        for block in self.module.blocks:
            block.__dict__.pop("forward", None)
