"""Minimal DeepSpeed-Ulysses (sequence parallel) training of the parabench GPT, from DeepSpeed's docs and
Megatron-DeepSpeed, the model code DeepSpeed wires Ulysses through.

Sources:
- The Ulysses tutorial, https://www.deepspeed.ai/tutorials/ds-sequence/: wrap the local attention
  in ``deepspeed.sequence.layer.DistributedAttention(local_attention, sequence_parallel_group)``;
  its all-to-alls turn a sequence shard of every head into every position of a head shard and
  back. The heads must divide by the group size.
- Megatron-DeepSpeed megatron/model/transformer.py ``ParallelAttention``: the fused
  ``query_key_value`` linear, its output cut into contiguous q | k | v blocks under sequence
  parallelism, and ``DistributedAttention(local_attn, get_sequence_parallel_group(),
  gather_idx=1)`` for flash attention's [batch, seq, heads, dim] layout (the layout kept here: the
  local attention is SDPA, flash on GPUs); megatron/training.py trains through the DeepSpeed
  engine, whose data-parallel all-reduce covers the sequence-parallel ranks (each holds other
  positions of the same samples), averaging over them.
- The engine config reference, https://www.deepspeed.ai/docs/config-json/: ZeRO stage 0, the
  ``optimizer`` section (FusedAdam on CUDA, torch's AdamW with ``torch_adam`` on CPUs), and for the
  amp recipe ``torch_autocast`` (``enabled``, ``dtype: bfloat16``): fp32 parameters, bf16 compute.

Data: the group trains ``micro_batch x cp`` samples per step (parabench's global batch); every
rank reads them and keeps its contiguous ``seq_len / cp`` positions, with their position ids, as
Megatron-DeepSpeed's pretrain_gpt.py ``get_batch`` slices ``tokens[:, sub_seq_start:sub_seq_end]``.

Where parabench's adapter (parabench/peers/cp_ep_peers.py) makes other choices, the result lists
them under ``choices``.

Run: ``torchrun --nproc-per-node 2 deepspeed_ulysses.py --precision bf16 --recipe amp --out r.json``.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402

MEGATRON = "Megatron-DeepSpeed megatron/model/transformer.py ParallelAttention"


class UlyssesAttention(nn.Module):
    """A fused-qkv attention whose core runs under DistributedAttention ([b, s/p, h, d] in and out)."""

    def __init__(self, attn: nn.Module, group):
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.qkv, self.proj, self.head_dim = attn.qkv, attn.proj, attn.head_dim

        def local_attention(q, k, v):  # [b, s, h/p, d]
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return y.transpose(1, 2)

        self.dist_attn = DistributedAttention(local_attention, group, scatter_idx=2, gather_idx=1)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in self.qkv(x).chunk(3, dim=-1))
        y = self.dist_attn(q, k, v, 0)  # batch_dim_idx 0
        return self.proj(y.reshape(b, s, -1))


class SequenceShardGPT(nn.Module):
    """The GPT on this rank's positions ``[offset, offset + s/p)`` of every sample."""

    def __init__(self, gpt: nn.Module, offset: int):
        super().__init__()
        self.gpt, self.offset = gpt, offset

    def forward(self, tokens):
        g = self.gpt
        pos = torch.arange(self.offset, self.offset + tokens.shape[1], device=tokens.device)
        x = g.tok_emb(tokens) + g.pos_emb(pos)
        for block in g.blocks:
            x = block(x)
        return g.head(g.ln_f(x))


def ds_config(args, cuda: bool, samples: int) -> dict:
    hyper = _gpt.adamw_hyper(args)
    return {
        "train_micro_batch_size_per_gpu": samples,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": hyper["lr"],
                "betas": list(hyper["betas"]),
                "eps": hyper["eps"],
                "weight_decay": hyper["weight_decay"],
                "torch_adam": not cuda,
            },
        },
        "torch_autocast": {"enabled": args.precision == "bf16", "dtype": "bfloat16"},
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,  # the recipe (DeepSpeed's default clips at 1.0)
        "steps_per_print": 10**9,
    }


def parse_args(argv=None):
    ap = _gpt.parser(__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=("amp",), default="amp", help="bf16: torch autocast, fp32 parameters")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    choices = {
        "gradient_reduction": {
            "script": "the DeepSpeed engine's (ZeRO stage 0) all-reduce over the group, averaged",
            "case": "one flat fp32 all-reduce of every gradient over the group / cp, outside DeepSpeed",
            "source": "Megatron-DeepSpeed megatron/training.py (the model trains through deepspeed.initialize)",
        },
        "optimizer": {
            "script": "the engine config's AdamW (FusedAdam on CUDA)",
            "case": "torch.optim.AdamW",
            "source": "https://www.deepspeed.ai/docs/config-json/#optimizer-parameters",
        },
        "data": {
            "script": "every rank reads the group's samples and keeps its positions",
            "case": "each rank reads its own samples; the group all-gathers the token ids",
            "source": "Megatron-DeepSpeed pretrain_gpt.py get_batch (sub_seq_start:sub_seq_end of the same batch)",
        },
    }
    if args.layout != "fused":
        choices["layout"] = {"script": "fused", "case": args.layout, "source": f"{MEGATRON}.query_key_value"}
        args.layout = "fused"
    device = _gpt.init(args)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    if args.n_head % cp or args.seq_len % cp:
        raise SystemExit(f"cp={cp} must divide the {args.n_head} heads and seq_len={args.seq_len}")
    group = dist.new_group(list(range(cp)))
    gpt = _gpt.build_gpt(args, device)
    for block in gpt.blocks:
        block.attn = UlyssesAttention(block.attn, group)
    local = args.seq_len // cp
    model = SequenceShardGPT(gpt, rank * local)
    samples = args.micro_batch * cp
    config = ds_config(args, cuda, samples)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(x, y):
        loss = _gpt.lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    batches = []
    for i in range(args.warmup + args.steps):
        x, y = _gpt.global_batch(i, samples, args)
        cut = slice(rank * local, (rank + 1) * local)
        batches.append((x[:, cut].contiguous().to(device), y[:, cut].contiguous().to(device)))
    inner = getattr(optimizer, "optimizer", optimizer)
    library = {
        "library": "deepspeed.ulysses",
        "recipe": "amp" if args.precision == "bf16" else None,
        "optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
        "optimizer_wrapper": type(optimizer).__name__,
        "ds_config": config,
        "deepspeed": deepspeed.__version__,
        "cp": cp,
        "choices": choices,
    }
    return args, _gpt.measure(args, device, step, batches, samples * args.seq_len, library)


if __name__ == "__main__":
    _gpt.finish(*main())
