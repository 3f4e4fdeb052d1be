"""Minimal PyTorch tensor-parallel training of the parabench GPT, from PyTorch's docs only.

Sources:
- The TP tutorial, https://pytorch.org/tutorials/intermediate/TP_tutorial.html, and the
  ``torch.distributed.tensor.parallel`` reference
  (https://pytorch.org/docs/stable/distributed.tensor.parallel.html): ``parallelize_module`` with
  ``ColwiseParallel`` on the attention's q, k, v and the MLP's first linear (``mlp.fc``),
  ``RowwiseParallel`` on the attention's and the MLP's output projections (the Megatron layout);
  ``PrepareModuleInput`` on the attention module, so its input becomes one replicated DTensor
  that q, k and v share (one backward all-reduce for the three); the token embedding
  ``RowwiseParallel(input_layouts=Replicate())`` and the output head
  ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` with ``loss_parallel()``
  (the tutorial's "Apply Loss Parallel": no gather of the vocabulary-sharded logits).
- ``torch.optim.AdamW`` ``fused`` (CUDA) / ``foreach``: those kernels refuse a list that mixes
  DTensors and plain tensors (here: the LayerNorms and the position table stay plain), so one
  parameter group per kind.

The tensor-parallel degree is the world size (no data parallelism).

Recipes (``--recipe``, bf16 only): ``amp`` (the default): fp32 parameters under
``torch.autocast``. ``master``: bf16 parameters, fp32 master weights and AdamW states
(``_gpt.MasterWeightAdamW``, on the local shards).

Run: ``torchrun --nproc-per-node 2 torch_tp.py --precision bf16 --micro-batch 8 --out result.json``.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402


def plan(n_layer: int) -> dict:
    p = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(n_layer):
        b = f"blocks.{i}"
        p[f"{b}.attn"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            p[f"{b}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            p[f"{b}.{name}"] = RowwiseParallel()
    return p


def main():
    ap = _gpt.parser(__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=("amp", "master"), default="amp")
    args = ap.parse_args()
    if args.layout != "separate":  # ColwiseParallel on a fused qkv would split q|k|v, not heads
        ap.error("the TP plan shards the separate q, k, v linears by heads: --layout separate only")
    device = _gpt.init(args)
    bf16 = args.precision == "bf16"
    master = bf16 and args.recipe == "master"
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    model = _gpt.build_gpt(args, device)
    if master:
        model = model.to(torch.bfloat16)
    parallelize_module(model, mesh, plan(args.n_layer))
    cuda = device.type == "cuda"
    params = list(model.parameters())
    if master:
        opt = _gpt.MasterWeightAdamW(params, fused=cuda, **_gpt.adamw_hyper(args))
    else:
        groups = [
            {"params": [p for p in params if hasattr(p, "placements")]},
            {"params": [p for p in params if not hasattr(p, "placements")]},
        ]
        impl = {"fused": True} if cuda else {"foreach": True}
        opt = torch.optim.AdamW([g for g in groups if g["params"]], **_gpt.adamw_hyper(args), **impl)
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 and not master else contextlib.nullcontext
    )

    def step(x, y):
        with autocast(), loss_parallel():
            loss = _gpt.lm_loss(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    batches = _gpt.local_batches(args, 0, 1, device)  # every rank of the TP group sees the same batch
    library = {
        "library": "torch.tp",
        "recipe": (args.recipe if bf16 else None),
        "tp": world,
        "optimizer": ("MasterWeightAdamW over " if master else "one group per parameter kind, ")
        + ("fused" if cuda else "foreach")
        + " AdamW",
    }
    return args, _gpt.measure(args, device, step, batches, args.micro_batch * args.seq_len, library)


if __name__ == "__main__":
    _gpt.finish(*main())
