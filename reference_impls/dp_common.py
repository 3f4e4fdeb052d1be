"""What the data-parallel reference implementations share: flat buckets, AdamW, the loss-scaling seam.

Used by ``data_parallel.py`` (parameter server, DDP), ``zero.py`` (ZeRO-1/2) and ``fsdp.py``
(ZeRO-3 / FSDP / HSDP). Each of those files issues its own collectives; nothing here talks.

Flat buffers. Every strategy keeps parameters (and, where it keeps them, gradients) in a few
large contiguous tensors and turns each ``nn.Parameter`` into a *view* of one of them
(``p.data = flat[a:b].view(shape)``, as Megatron-LM and picotron do). One collective then moves
a whole bucket, and the optimizer runs a handful of multi-tensor kernels instead of one per
parameter.

Buckets (Li et al. 2020, "PyTorch Distributed", Sec. 3.2.3): parameters are grouped in *reverse*
registration order, which is close to the order in which backward produces their gradients,
so the first bucket fills first and its communication overlaps the rest of backward. A bucket
closes as soon as it holds at least ``bucket_bytes`` of gradients (counted in the compute
dtype); ZeRO pads each bucket to a multiple of the data-parallel degree N so that it splits
into N equal shards (Megatron-core's distributed optimizer lays out its buffer the same way).

Loss-scaling seam (fp16, added later in ``mixed_precision.py``): every trainer takes a
``grad_scaler`` object or None. When given, the loss is multiplied by ``grad_scaler.scale``
before backward and, just before the optimizer update, ``grad_scaler.unscale_and_check(grads,
group)`` gets the fp32 gradients this rank owns, divides them by the scale in place and returns
whether the step may be applied. ``group`` is the process group the gradients are sharded over
(ZeRO, FSDP: the scaler must all-reduce its inf flag there so every rank decides alike), or None
where every rank holds the same full, already-reduced gradient (DDP; the parameter server, which
calls it on the server only). ``grad_scaler.update(applied)`` then adjusts the scale. With
``grad_scaler=None`` (fp32, bf16) none of this runs and nothing syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MiB = 1 << 20


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class Bucket:
    index: int
    params: list  # the parameters laid out in this bucket, in order
    offset: int  # first element in the flat buffer
    numel: int  # elements including the padding (a multiple of ``pad_to``)
    used: int  # elements holding parameters (numel - used is padding, kept at zero)
    starts: list = field(default_factory=list)  # offset of each parameter inside the flat buffer


def plan_buckets(params, bucket_bytes: float, elem_size: int, pad_to: int = 1) -> list[Bucket]:
    """Group ``params`` (last registered first) into buckets of at least ``bucket_bytes``, each
    padded to a multiple of ``pad_to`` elements, laid out back to back in one flat buffer."""
    buckets, cur, used, offset = [], [], 0, 0

    def close():
        nonlocal cur, used, offset
        b = Bucket(len(buckets), cur, offset, round_up(used, pad_to), used)
        start = offset
        for p in cur:
            b.starts.append(start)
            start += p.numel()
        buckets.append(b)
        offset += b.numel
        cur, used = [], 0

    for p in reversed(list(params)):
        cur.append(p)
        used += p.numel()
        if used * elem_size >= bucket_bytes:
            close()
    if cur:
        close()
    return buckets


def flatten(buckets: list[Bucket], dtype: torch.dtype) -> torch.Tensor:
    """The current parameter values, laid out as ``buckets`` (padding zero), in ``dtype``."""
    device = buckets[0].params[0].device
    flat = torch.zeros(sum(b.numel for b in buckets), dtype=dtype, device=device)
    for b in buckets:
        for p, start in zip(b.params, b.starts):
            flat[start : start + p.numel()].copy_(p.detach().reshape(-1))
    return flat


def bind_params(buckets: list[Bucket], flat: torch.Tensor) -> None:
    """Make every parameter a view of its slot in ``flat`` (its dtype becomes ``flat``'s)."""
    for b in buckets:
        for p, start in zip(b.params, b.starts):
            p.data = flat[start : start + p.numel()].view(p.shape)


def bind_grads(buckets: list[Bucket], flat_grad: torch.Tensor) -> None:
    """Make every ``p.grad`` a view of ``flat_grad``: autograd then accumulates straight into the
    bucket (torch DDP's ``gradient_as_bucket_view``), no copy."""
    for b in buckets:
        for p, start in zip(b.params, b.starts):
            p.grad = flat_grad[start : start + p.numel()].view(p.shape)


def adamw(params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over flat tensors: the fused kernel on CUDA, the multi-tensor (foreach) one elsewhere."""
    params = list(params)
    impl = {"fused": True} if params[0].device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **impl)


def free_now(tensor: torch.Tensor) -> None:
    """Free ``tensor``'s bytes now, whoever still refers to it: a collective's work handle can outlive its
    ``wait()`` on the backend's thread (gloo drops it when it next takes its queue's lock), and the buffer
    with it. Only for a buffer no one reads again."""
    tensor.untyped_storage().resize_(0)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Adam's moments (the 0-d step counters are not model state)."""
    return tensor_bytes(
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    )
