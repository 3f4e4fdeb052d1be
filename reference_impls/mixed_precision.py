"""fp16 mixed precision: fp32 master weights and the dynamic loss scaler.

Micikevicius et al. 2018, "Mixed Precision Training" (Sec. 3.1-3.2): compute in fp16, keep an fp32
master copy of the weights that the optimizer updates, and multiply the loss by a scale S before
backward so that small gradients do not underflow fp16 (its smallest normal is 6e-5). The
gradients are divided by S again (*unscaled*) before the update. *Dynamic* scaling (Sec. 3.2 and
NVIDIA's Apex/``torch.amp.GradScaler``): start high; when a gradient holds an inf or NaN, **skip the
step** and **back off** (S *= 0.5); after ``growth_interval`` clean steps in a row, **grow** (S *= 2).

The master weights live in the data-parallel classes (``data_parallel.py``, ``zero.py``,
``fsdp.py``); this file is the scaler they call through the seam documented in ``dp_common.py``:
``scale`` (a host float the loss is multiplied by), ``unscale_and_check(grads, group)``,
``update(applied)``.

Why the overflow check must be **global** (Zhao et al. 2023, PyTorch FSDP, Sec. 6 / FSDP's
``ShardedGradScaler``): once gradients are sharded, a rank sees only its own shard, so an inf in
rank 1's shard is invisible to rank 0. If each rank decided alone, rank 1 would skip the step and
back off while rank 0 applied its update and kept its scale: the shards of one model would then be
updated from different steps, and from then on the ranks would multiply their losses by
*different* scales, so the reduce-scattered sum mixes gradients scaled by S and S/2. The fix is a
tiny all-reduce (MAX) of the inf flag over **every group that holds a shard**: the data-parallel
group (ZeRO), the shard group, and for HSDP the replica group as well. ``check="local"`` keeps
the broken variant, each rank deciding from its own shard, to demonstrate that failure.

Cost. Deciding whether to step needs the flag on the host: one ``.item()`` per step (a device
sync on GPUs, as in DeepSpeed's fp16 optimizer; GradScaler avoids it by skipping inside a kernel).

Fault injection (for the loss-scale suite and tests): ``inject_inf={"rank": r, "step": k}`` writes
an inf into the first element of the gradient shard global rank r passes to
``unscale_and_check`` at optimizer step k (0-based, skipped steps included), *before* unscaling.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class DynamicLossScaler:
    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 2.0**-24,
        check: str = "global",
        groups=(),
        inject_inf: dict | None = None,
    ):
        if check not in ("global", "local"):
            raise ValueError(f"check must be 'global' or 'local', not {check!r}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.min_scale = int(growth_interval), float(min_scale)
        self.check = check
        self.groups = list(groups)  # every group holding a shard (besides the one the seam passes)
        self.inject_inf = inject_inf
        self.step = 0  # optimizer steps seen, skipped ones included
        self.clean = 0  # clean steps since the last overflow or growth
        self.last: dict | None = None  # {"scale_used", "scale", "overflow", "skipped"} of the last step
        self._scale_used = self.scale

    def maybe_inject(self, grads) -> None:
        """Write an inf into this rank's gradient (shard) if the fault injection says so."""
        f = self.inject_inf
        if f and int(f.get("step", 0)) == self.step and int(f.get("rank", 0)) == dist.get_rank():
            grads[0].view(-1)[0] = float("inf")

    def unscale_and_check(self, grads, group) -> bool:
        """Divide ``grads`` (fp32, this rank's) by the scale in place; True if the step may be applied."""
        self.maybe_inject(grads)
        self._scale_used = self.scale
        inv = 1.0 / self.scale
        found = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        for g in grads:
            g.mul_(inv)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        if self.check == "global":
            groups = list(self.groups)
            if group is not None and all(group is not g for g in groups):
                groups.append(group)
            for g in groups:  # MAX over every group that holds a shard: all ranks decide alike
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=g)
        return not bool(found.item())  # the host must know: one sync per step

    def update(self, applied: bool) -> None:
        if not applied:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean = 0
        else:
            self.clean += 1
            if self.clean >= self.growth_interval:
                self.scale *= self.growth_factor
                self.clean = 0
        self.last = {
            "scale_used": self._scale_used,
            "scale": self.scale,
            "overflow": not applied,
            "skipped": not applied,
        }
        self.step += 1

    def follow(self, scale: float, applied: bool) -> None:
        """For ranks that never decide (parameter-server workers): adopt the decider's outcome."""
        self._scale_used = self.scale
        self.scale = float(scale)
        self.last = {
            "scale_used": self._scale_used,
            "scale": self.scale,
            "overflow": not applied,
            "skipped": not applied,
        }
        self.step += 1


class MasterWeightOptimizer:
    """fp32 master weights for a module whose parameters are bf16 (the "master" recipe, Sec. 3.1).

    The module computes and its gradients arrive in bf16; the optimizer (built by
    ``make_optimizer`` over fp32 tensors) updates an fp32 copy of every parameter, which is then
    rounded back into the bf16 parameter. Without the fp32 copy, updates smaller than bf16's
    spacing (2^-8 relative) would be lost. Each tensor is handled as this rank stores it (a
    DTensor's local shard): AdamW is elementwise, so updating the shards updates the whole.

    No communication here: the strategy has reduced the gradients before ``step``."""

    def __init__(self, params, make_optimizer):
        self.params = [p for p in params if p.requires_grad]
        self.master = [_local(p).detach().float().clone() for p in self.params]
        self._master_grads = [torch.empty_like(m) for m in self.master]
        self.optimizer = make_optimizer(self.master)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def master_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.master)

    @torch.no_grad()
    def step(self):
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not with_grad:
            return
        torch._foreach_copy_(
            [self._master_grads[i] for i in with_grad], [_local(self.params[i].grad) for i in with_grad]
        )
        for i in with_grad:
            self.master[i].grad = self._master_grads[i]  # fp32 copies of the bf16 gradients
        self.optimizer.step()
        torch._foreach_copy_([_local(p) for p in self.params], self.master)  # fp32 -> bf16, rounded to nearest

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
