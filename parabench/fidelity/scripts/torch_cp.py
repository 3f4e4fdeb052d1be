"""Minimal PyTorch context-parallel training of the parabench GPT, from PyTorch's docs and torchtitan.

Sources:
- The context-parallel tutorial, https://pytorch.org/tutorials/prototype/context_parallel.html, and
  ``torch.distributed.tensor.experimental.context_parallel``: inside the context manager, the
  ``buffers`` are sharded in place along ``buffer_seq_dims`` (head-tail load balanced for causal
  attention) and ``F.scaled_dot_product_attention`` runs as ring attention over the mesh; the CUDA
  SDPA kernels only (flash, memory-efficient, cuDNN): on a CPU the script stops with that reason.
- torchtitan's use of it (``create_context_parallel_ctx`` in torchtitan/distributed/utils.py before
  pytorch/torchtitan#2386, and its train step): the buffers are the inputs, the labels and the
  position ids (torchtitan: the RoPE table), sequence dimension 1, ``no_restore_buffers={inputs,
  labels}`` (here the position ids too: made afresh each step, nothing reads them after the step,
  so gathering them back would be traffic for nothing); ``set_rotate_method("allgather")`` (its ``context_parallel_rotate_method`` default);
  forward, loss and backward inside the context.
- torchtitan's parameters under context parallelism: FSDP2 over the context-parallel ranks (its
  ``dp_shard_cp`` mesh folds cp into the FSDP dimension), with the groups of its
  ``apply_fsdp_to_decoder`` (the token embedding alone, ``[norm, output]`` not resharded, every
  block, the root with the position table).
  parabench's torch.cp adapter keeps the parameters replicated and all-reduces fp32 gradients (as
  ``ref.cp_ring``): the result's ``choices`` names the difference.
- ``torch.optim.AdamW`` ``fused`` on CUDA (torchtitan's default).

The batch: a step's ``micro_batch * world`` sequences (the adapter's: each rank's micro-batch,
gathered over the group), the same on every rank before the context shards the sequence.

Recipes (``--recipe``, bf16 only): ``amp`` (the default, the adapter's only one): fp32 parameters
all-gathered in fp32, bf16 compute under ``torch.autocast``. ``master``: torchtitan's
``MixedPrecisionPolicy`` (bf16 parameters gathered, fp32 reduction).

Run: ``torchrun --nproc-per-node 2 torch_cp.py --precision bf16 --seq-len 2048 --out result.json``.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402

ROTATE_METHOD = "allgather"  # torchtitan's context_parallel_rotate_method default


class PositionedGPT(nn.Module):
    """The GPT's forward with the position ids as an input: under the context a rank holds a
    shard of the sequence, whose positions are no longer ``arange`` of its length. Same modules."""

    def __init__(self, gpt: _gpt.GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens, positions):
        g = self.gpt
        x = g.tok_emb(tokens) + g.pos_emb(positions)
        for block in g.blocks:
            x = block(x)
        return g.head(g.ln_f(x))


def main():
    ap = _gpt.parser(__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=("amp", "master"), default="amp")
    args = ap.parse_args()
    device = _gpt.init(args)
    if device.type != "cuda":
        raise SystemExit(
            "context_parallel dispatches only the CUDA SDPA kernels; on a CPU "
            "aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy: run it on GPUs"
        )
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    world = dist.get_world_size()
    if args.seq_len % (2 * world):
        raise SystemExit(f"--seq-len {args.seq_len} does not split into {2 * world} head-tail chunks")
    bf16 = args.precision == "bf16"
    master = bf16 and args.recipe == "master"
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    set_rotate_method(ROTATE_METHOD)

    gpt = _gpt.build_gpt(args, device)
    model = PositionedGPT(gpt)
    fsdp = {"mesh": mesh}
    if master:
        fsdp["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    fully_shard(gpt.tok_emb, **fsdp, reshard_after_forward=True)
    fully_shard([gpt.ln_f, gpt.head], **fsdp, reshard_after_forward=False)
    for block in gpt.blocks:
        fully_shard(block, **fsdp, reshard_after_forward=True)
    fully_shard(model, **fsdp)
    opt = torch.optim.AdamW(model.parameters(), **_gpt.adamw_hyper(args), fused=True)
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 and not master else contextlib.nullcontext
    )

    def step(x, y):  # the context shards x, y and pos in place: each batch is used once
        pos = torch.arange(x.shape[1], device=device).expand_as(x).contiguous()
        with context_parallel(mesh, buffers=[x, y, pos], buffer_seq_dims=[1, 1, 1], no_restore_buffers={x, y, pos}):
            with autocast():
                loss = _gpt.lm_loss(model(x, pos), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    # every rank: the step's whole batch (the adapter gathers the ranks' micro-batches into it)
    batches = []
    for i in range(args.warmup + args.steps):
        x, y = _gpt.global_batch(i, args.micro_batch * world, args)
        batches.append((x.to(device), y.to(device)))
    library = {
        "library": "torch.cp",
        "recipe": (args.recipe if bf16 else None),
        "cp": world,
        "rotate_method": ROTATE_METHOD,
        "optimizer": "fused torch.optim.AdamW",
        "choices": {
            "parameters": {
                "script": "FSDP2 over the cp ranks (torchtitan's groups), gradients reduce-scattered",
                "case": "replicated, fp32 gradients all-reduced (as ref.cp_ring)",
                "source": "torchtitan: FSDP over the dp_shard_cp mesh (apply_fsdp_to_decoder)",
            },
            "restored_buffers": {
                "script": "none (no_restore_buffers: inputs, labels, positions)",
                "case": "all three gathered back at the context's exit (the default)",
                "source": "torchtitan create_context_parallel_ctx: no_restore_buffers={inputs, labels}",
            },
        },
    }
    return args, _gpt.measure(args, device, step, batches, args.micro_batch * world * args.seq_len, library)


if __name__ == "__main__":
    _gpt.finish(*main())
