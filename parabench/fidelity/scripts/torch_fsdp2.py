"""Minimal PyTorch FSDP2 (``fully_shard``) training of the parabench GPT, following torchtitan's recipe.

Sources:
- ``fully_shard`` reference, https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html, and
  ``MixedPrecisionPolicy``: the sharded fp32 parameters are the master weights, bf16 is all-gathered
  and computed in, gradients are reduce-scattered in ``reduce_dtype``.
- torchtitan, the PyTorch team's reference for FSDP2 at scale: ``apply_fsdp_to_decoder``
  (torchtitan/distributed/fsdp.py; ``apply_fsdp`` in torchtitan/models/llama3/infra/parallelize.py
  before the config refactor, pytorch/torchtitan#2386) with its defaults
  (``fsdp_reshard_after_forward = "default"``, no pipelining; ``mixed_precision_param = bfloat16``,
  ``mixed_precision_reduce = float32``, torchtitan/config/configs.py):

  * the token embedding in a group of its own, resharded after forward;
  * ``[norm, output]`` in one group, NOT resharded after forward ("FSDP would prefetch them
    immediately after the forward pass");
  * every transformer block in its own group, resharded after forward;
  * the root last, with what no group took (here the GPT's learned position table: torchtitan's
    Llama has RoPE instead); ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32,
    cast_forward_inputs=False)``.
- HSDP (``--shard-size N`` below the world size): torchtitan's ``data_parallel_replicate_degree``
  x ``data_parallel_shard_degree``, a 2-D ``("dp_replicate", "dp_shard")`` device mesh passed to
  the same ``fully_shard`` calls: parameters sharded within groups of N consecutive ranks,
  replicated across them (gradients reduce-scattered in the group, all-reduced across replicas).
- torchtitan's optimizer default: ``torch.optim.AdamW`` with ``implementation = "fused"`` (CUDA;
  ``foreach`` elsewhere, where there is no fused kernel).
- ``--cpu-offload`` (``torch.fsdp2_offload``): torchtitan's ``training.enable_cpu_offload``,
  ``CPUOffloadPolicy()`` in every ``fully_shard`` call: the sharded parameters, their gradients and
  the optimizer step live in host memory (AdamW ``foreach`` there: the fused kernel is CUDA's).
- ``--compile``: torchtitan's ``apply_compile``, before ``fully_shard``: each block replaced by
  ``torch.compile(block, fullgraph=True)``, so FSDP2's hooks sit on the compiled module.

Not followed: torchtitan divides gradients by the global token count itself
(``set_gradient_divide_factor(1.0)`` and a summed loss); the script keeps FSDP's default mean over
ranks with a mean loss: the same gradient.

Recipes (``--recipe``, bf16 only): ``master`` (the default): the MixedPrecisionPolicy above.
``amp``: no policy, fp32 parameters all-gathered in fp32, bf16 compute under ``torch.autocast``.

Run: ``torchrun --nproc-per-node 2 torch_fsdp2.py --precision bf16 --out result.json``;
HSDP: ``torchrun --nproc-per-node 4 torch_fsdp2.py --shard-size 2 --precision bf16``.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402


def main():
    ap = _gpt.parser(__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=("amp", "master"), default="master")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (torchtitan's order)")
    ap.add_argument("--cpu-offload", action="store_true", help="CPUOffloadPolicy (torchtitan's enable_cpu_offload)")
    ap.add_argument("--shard-size", type=int, default=None, help="HSDP: ranks per shard group (default: the world)")
    args = ap.parse_args()
    device = _gpt.init(args)
    bf16 = args.precision == "bf16"
    master = bf16 and args.recipe == "master"
    world, rank = dist.get_world_size(), dist.get_rank()
    shard = args.shard_size or world
    if world % shard:
        raise SystemExit(f"--shard-size {shard} does not divide the world size {world}")
    if shard == world:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    else:
        mesh = init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("dp_replicate", "dp_shard"))

    model = _gpt.build_gpt(args, device)
    fsdp = {"mesh": mesh}
    if master:
        fsdp["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    if args.cpu_offload:
        fsdp["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # no pinned memory without a GPU
    if args.compile:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True)
    fully_shard(model.tok_emb, **fsdp, reshard_after_forward=True)
    fully_shard([model.ln_f, model.head], **fsdp, reshard_after_forward=False)
    for block in model.blocks:
        fully_shard(block, **fsdp, reshard_after_forward=True)
    fully_shard(model, **fsdp)
    fused = device.type == "cuda" and not args.cpu_offload  # offloaded: the parameters are on the host
    impl = {"fused": True} if fused else {"foreach": True}
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
    groups = "tok_emb resharded | [ln_f, head] kept | each block resharded | root (pos_emb)"
    library = {
        "library": "torch.hsdp" if shard < world else "torch.fsdp2_offload" if args.cpu_offload else "torch.fsdp2",
        "recipe": (args.recipe if bf16 else None),
        "optimizer": ("fused" if fused else "foreach") + " torch.optim.AdamW",
        "fsdp2": {
            "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)),
            "offload_policy": "CPUOffloadPolicy()" if args.cpu_offload else None,
            "mp_policy": "param bf16, reduce fp32, cast_forward_inputs False" if master else None,
            "groups": groups,
            "compile": "torch.compile(block, fullgraph=True) per block, before fully_shard" if args.compile else None,
        },
    }
    return args, _gpt.measure(args, device, step, batches, args.micro_batch * world * args.seq_len, library)


if __name__ == "__main__":
    _gpt.finish(*main())
