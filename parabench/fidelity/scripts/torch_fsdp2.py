"""Minimal PyTorch FSDP2 (``fully_shard``) training of the parabench GPT, from PyTorch's docs only.

Sources:
- ``fully_shard`` reference, https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html:
  apply it to every transformer block, then to the root module (the root's group takes the
  embeddings, final norm and head); ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
  reduce_dtype=torch.float32)``: the sharded fp32 parameters are the master weights, bf16 is
  all-gathered and computed in, gradients are reduce-scattered in fp32.
- The FSDP2 tutorial, https://pytorch.org/tutorials/intermediate/FSDP_tutorial.html, and
  pytorch/examples distributed/FSDP2/train.py (the same order: blocks, then root).
- torchtitan's ``apply_fsdp`` (torchtitan/models/llama3/infra/parallelize.py), the PyTorch team's
  reference for FSDP2 at scale: every block resharded after forward except the last, whose
  parameters backward would all-gather again at once.
- ``torch.optim.AdamW`` with ``fused=True`` on CUDA (``foreach`` elsewhere).
- ``--compile``: torchtitan's ``apply_compile``, before ``fully_shard``: each block replaced by
  ``torch.compile(block, fullgraph=True)`` in the model's block list, so FSDP2's hooks sit on the
  compiled module, outside its graph (PyTorch's FSDP2 + torch.compile guidance: compile per block).

Recipes (``--recipe``, bf16 only): ``master`` (the default): the MixedPrecisionPolicy above.
``amp``: no policy, fp32 parameters all-gathered in fp32, bf16 compute under ``torch.autocast``.

Run: ``torchrun --nproc-per-node 2 torch_fsdp2.py --precision bf16 --out result.json``.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402


def main():
    ap = _gpt.parser(__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=("amp", "master"), default="master")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (torchtitan's order)")
    args = ap.parse_args()
    device = _gpt.init(args)
    bf16 = args.precision == "bf16"
    master = bf16 and args.recipe == "master"
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device.type, (world,))

    model = _gpt.build_gpt(args, device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if master else None
    extra = {"mp_policy": mp} if mp is not None else {}
    if args.compile:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True)
    n = len(model.blocks)
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < n - 1, **extra)
    fully_shard(model, mesh=mesh, **extra)
    cuda = device.type == "cuda"
    impl = {"fused": True} if cuda else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), **_gpt.adamw_hyper(args), **impl)
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 and not master else contextlib.nullcontext
    )

    def step(x, y):
        with autocast():
            loss = _gpt.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    batches = _gpt.local_batches(args, rank, world, device)
    library = {
        "library": "torch.fsdp2",
        "recipe": (args.recipe if bf16 else None),
        "optimizer": ("fused" if cuda else "foreach") + " AdamW",
        "fsdp2": {
            "mp_policy": "param bf16, reduce fp32" if master else None,
            "reshard_after_forward": "every block but the last; root True",
            "compile": "torch.compile(block, fullgraph=True) per block, before fully_shard" if args.compile else None,
        },
    }
    return args, _gpt.measure(args, device, step, batches, args.micro_batch * world * args.seq_len, library)


if __name__ == "__main__":
    _gpt.finish(*main())
