"""Minimal PyTorch DistributedDataParallel training of the parabench GPT, following torchtitan's recipe.

Sources:
- DDP notes, https://pytorch.org/docs/stable/notes/ddp.html, and the ``DistributedDataParallel``
  reference (https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html):
  one process per device, ``device_ids=[local_rank]``, ``gradient_as_bucket_view=True`` (gradients
  are views into the all-reduce buckets: one copy and its memory saved).
- torchtitan's ``apply_ddp`` (torchtitan/models/llama3/infra/parallelize.py before the config
  refactor, pytorch/torchtitan#2386): ``bucket_cap_mb=100``, not DDP's default 25; the bf16
  recipe under DDP is ``torch.autocast`` (``mixed_precision_param``, torchtitan/config/configs.py).
- AMP, https://pytorch.org/docs/stable/amp.html: ``torch.autocast(dtype=torch.bfloat16)`` around
  forward and loss; bf16 needs no GradScaler.
- ``torch.optim.AdamW`` (https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html):
  ``fused=True`` on CUDA (torchtitan's ``implementation = "fused"``), ``foreach=True`` elsewhere.

Recipes (``--recipe``, bf16 only): ``amp`` (the default; torchtitan's under DDP): fp32 parameters,
bf16 compute under autocast, fp32 gradients all-reduced. ``master``: bf16 parameters, gradients
all-reduced in bf16, fp32 master copies and AdamW states kept by ``_gpt.MasterWeightAdamW`` (torch
documents no bf16-master recipe for DDP; FSDP2's ``MixedPrecisionPolicy`` is its one).

Run: ``torchrun --nproc-per-node 2 torch_ddp.py --precision bf16 --out result.json``.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402

BUCKET_CAP_MB = 100  # torchtitan's apply_ddp


def main():
    ap = _gpt.parser(__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=("amp", "master"), default="amp")
    args = ap.parse_args()
    device = _gpt.init(args)
    bf16 = args.precision == "bf16"
    master = bf16 and args.recipe == "master"

    model = _gpt.build_gpt(args, device)
    if master:
        model = model.to(torch.bfloat16)
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        bucket_cap_mb=BUCKET_CAP_MB,
    )
    cuda = device.type == "cuda"
    if master:
        opt = _gpt.MasterWeightAdamW(ddp.parameters(), fused=cuda, **_gpt.adamw_hyper(args))
    else:
        impl = {"fused": True} if cuda else {"foreach": True}
        opt = torch.optim.AdamW(ddp.parameters(), **_gpt.adamw_hyper(args), **impl)
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 and not master else contextlib.nullcontext
    )

    def step(x, y):
        with autocast():
            loss = _gpt.lm_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    world, rank = dist.get_world_size(), dist.get_rank()
    batches = _gpt.local_batches(args, rank, world, device)
    library = {
        "library": "torch.ddp",
        "recipe": (args.recipe if bf16 else None),
        "optimizer": ("MasterWeightAdamW over " if master else "") + ("fused" if cuda else "foreach") + " AdamW",
        "ddp": {"gradient_as_bucket_view": True, "bucket_cap_mb": BUCKET_CAP_MB},
    }
    return args, _gpt.measure(args, device, step, batches, args.micro_batch * world * args.seq_len, library)


if __name__ == "__main__":
    _gpt.finish(*main())
