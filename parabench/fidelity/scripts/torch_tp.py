"""Minimal PyTorch tensor-parallel training of the parabench GPT, following torchtitan's TP plan.

Sources:
- The TP tutorial, https://pytorch.org/tutorials/intermediate/TP_tutorial.html, and the
  ``torch.distributed.tensor.parallel`` reference
  (https://pytorch.org/docs/stable/distributed.tensor.parallel.html): ``parallelize_module`` with
  ``ColwiseParallel`` on the attention's q, k, v and the MLP's first linear (``mlp.fc``),
  ``RowwiseParallel`` on the attention's and the MLP's output projections (the Megatron layout);
  the token embedding ``RowwiseParallel(input_layouts=Replicate())`` and the output head
  ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` with ``loss_parallel()``
  (the tutorial's "Apply Loss Parallel", torchtitan's default: no gather of the vocabulary-sharded
  logits).
- torchtitan's plan without sequence parallelism (``enable_sequence_parallel = false``;
  ``set_gqa_attention_sharding`` in torchtitan/models/common/decoder_sharding.py): the attention
  block's input is made replicated once at the attention module, so q, k and v share it (one
  backward all-reduce for the three): ``PrepareModuleInput`` on ``attn``.
- ``--sequence-parallel`` (``torch.tp_sp``): torchtitan's ``apply_tp`` (its default,
  ``enable_sequence_parallel = true``; torchtitan/models/llama3/infra/parallelize.py before
  pytorch/torchtitan#2386, the tutorial's "Sequence Parallel" section): the token embedding's output
  ``Shard(1)``; every LayerNorm ``SequenceParallel``; ``PrepareModuleInput`` all-gathers the sequence
  (``Shard(1)`` -> ``Replicate()``) before the attention and the MLP; the row-parallel outputs
  reduce-scattered along the sequence (``output_layouts=Shard(1)``); the final norm
  ``SequenceParallel`` and the head ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
  use_local_output=False)``. The GPT's learned position table (torchtitan's Llama has RoPE instead)
  is ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))``: each rank adds its
  positions' rows to its sequence shard (the GPT's own forward, unchanged).
- ``torch.optim.AdamW`` ``fused`` (CUDA) / ``foreach``: those kernels refuse a list that mixes
  DTensors and plain tensors (here: the LayerNorms and, without SP, the position table stay
  plain), so one parameter group per kind.

The tensor-parallel degree is the world size (no data parallelism).

Recipes (``--recipe``, bf16 only): ``amp`` (the default): fp32 parameters under
``torch.autocast``. ``master``: bf16 parameters, fp32 master weights and AdamW states
(``_gpt.MasterWeightAdamW``, on the local shards: torch documents no bf16-master recipe for TP).

Run: ``torchrun --nproc-per-node 2 torch_tp.py --precision bf16 --micro-batch 8 --out result.json``
(add ``--sequence-parallel`` for tensor + sequence parallelism).
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
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402


def plan(n_layer: int) -> dict:
    """Tensor parallelism alone: activations replicated between the blocks."""
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


def sequence_parallel_plan(n_layer: int) -> dict:
    """torchtitan's ``apply_tp``: activations sharded along the sequence between the blocks."""
    p = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(n_layer):
        b = f"blocks.{i}"
        p[f"{b}.ln1"] = SequenceParallel()
        p[f"{b}.attn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        p[f"{b}.ln2"] = SequenceParallel()
        p[f"{b}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            p[f"{b}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            p[f"{b}.{name}"] = RowwiseParallel(output_layouts=Shard(1))
    return p


def main():
    ap = _gpt.parser(__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=("amp", "master"), default="amp")
    ap.add_argument("--sequence-parallel", action="store_true", help="torchtitan's tensor + sequence parallel plan")
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
    sp = args.sequence_parallel
    if sp and args.seq_len % world:
        raise SystemExit(f"sequence parallelism: --seq-len {args.seq_len} does not split over {world} ranks")
    parallelize_module(model, mesh, sequence_parallel_plan(args.n_layer) if sp else plan(args.n_layer))
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
        "library": "torch.tp_sp" if sp else "torch.tp",
        "plan": "torchtitan apply_tp (sequence parallel)" if sp else "torchtitan, enable_sequence_parallel false",
        "recipe": (args.recipe if bf16 else None),
        "tp": world,
        "optimizer": ("MasterWeightAdamW over " if master else "one group per parameter kind, ")
        + ("fused" if cuda else "foreach")
        + " AdamW",
    }
    return args, _gpt.measure(args, device, step, batches, args.micro_batch * args.seq_len, library)


if __name__ == "__main__":
    _gpt.finish(*main())
