"""Minimal DeepSpeed pipeline-parallel training of the parabench GPT, from DeepSpeed's docs and examples.

Sources:
- The pipeline tutorial, https://www.deepspeed.ai/tutorials/pipeline/, and the API reference,
  https://deepspeed.readthedocs.io/en/latest/pipeline.html: the model as a flat list of
  ``LayerSpec`` (each stage builds only its own layers), ``PipelineModule(layers=...,
  loss_fn=..., num_stages=..., partition_method=...)`` with DeepSpeed's default partition method
  ``"parameters"`` (balance the stages' trainable parameter counts), then
  ``engine.train_batch(data_iter)``, which runs ``gradient_accumulation_steps`` micro-batches of
  ``train_micro_batch_size_per_gpu`` through DeepSpeed's 1F1B TrainSchedule and steps once.
- DeepSpeedExamples training/pipeline_parallelism/train.py: the same calls, the engine's
  ``train_batch`` over an iterator of (input, label) micro-batches.
- Megatron-DeepSpeed megatron/model/gpt_model.py ``GPTModelPipe``: an embedding layer, one layer
  per transformer block, a final norm and the output head as pipeline layers.
- The engine config as in deepspeed_zero.py (ZeRO stage 0: the pipeline engine's usual setting):
  ``--profile tuned`` adds the throughput keys parabench's tuned profile claims (throughput timer
  off; in bf16 no overflow check).

The library's choices, where parabench's adapter (parabench/peers/deepspeed_pipe.py) makes
others, go under ``choices`` in the result: the stage split (DeepSpeed's ``partition_method``,
when it differs from parabench's equal blocks per stage) and the fused q/k/v layout (Megatron-DeepSpeed).
The head stays untied from the token embeddings, as in the case's model.

Every layer draws its GPT-2 initialisation from a generator seeded by the run's seed and its own
index, so the initial weights do not depend on where the stages are cut.

Run: ``torchrun --nproc-per-node 2 deepspeed_pipe.py --microbatches 4 --precision bf16 --out r.json``.
"""

import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402

MEGATRON_QKV = "Megatron-DeepSpeed megatron/model/transformer.py ParallelAttention.query_key_value (fused, bias)"


def equal_block_parts(n_layer: int, pp: int) -> list[int]:
    """Layer bounds over [embed, blocks, head] of an equal block split, the first stages taking the
    remainder, the embeddings with the first stage and the head with the last: parabench's split
    (reference_impls/pipeline.py partition_layers), set beside DeepSpeed's in ``choices``."""
    base, extra = divmod(n_layer, pp)
    bounds, hi = [0], 0
    for s in range(pp - 1):
        hi += base + (1 if s < extra else 0)
        bounds.append(1 + hi)
    return bounds + [n_layer + 2]


def gpt2_init_(module: nn.Module, seed: int, n_layer: int) -> None:
    """GPT-2 initialisation (N(0, 0.02), residual projections 1/sqrt(2L), LayerNorm 1, biases 0)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif isinstance(module, nn.LayerNorm) or ".ln" in name or name.startswith("ln"):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen).mul_(std))


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int, seq_len: int, seed: int, n_layer: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq_len, d)
        gpt2_init_(self, seed, n_layer)

    def forward(self, tokens):
        return self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))


class PipeBlock(_gpt.Block):
    def __init__(self, d: int, n_head: int, layout: str, seed: int, n_layer: int):
        super().__init__(d, n_head, layout)
        gpt2_init_(self, seed, n_layer)


class Head(nn.Module):
    def __init__(self, d: int, vocab: int, seed: int, n_layer: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        gpt2_init_(self, seed, n_layer)

    def forward(self, x):
        return self.head(self.ln_f(x))


def layer_specs(args):
    from deepspeed.pipe import LayerSpec

    seeds = [args.seed * 1_000 + i for i in range(args.n_layer + 2)]
    return [
        LayerSpec(Embed, args.vocab, args.d_model, args.seq_len, seeds[0], args.n_layer),
        *(
            LayerSpec(PipeBlock, args.d_model, args.n_head, args.layout, seeds[1 + i], args.n_layer)
            for i in range(args.n_layer)
        ),
        LayerSpec(Head, args.d_model, args.vocab, seeds[-1], args.n_layer),
    ]


def ds_config(args, cuda: bool, microbatches: int) -> dict:
    hyper = _gpt.adamw_hyper(args)
    mb = args.micro_batch // microbatches
    config = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": microbatches,
        "train_batch_size": mb * microbatches,  # no data parallelism beside the pipeline
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
        "bf16": {"enabled": args.precision == "bf16"},
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,  # the recipe (DeepSpeed's default clips at 1.0)
        "steps_per_print": 10**9,
    }
    if args.profile == "tuned":
        config["timers"] = {"throughput": {"enabled": False}}
        if args.precision == "bf16":
            config["bf16"]["check_grad_overflow"] = False
    return config


def parse_args(argv=None):
    ap = _gpt.parser(__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=("master",), default="master", help="DeepSpeed's bf16 is bf16-master")
    ap.add_argument("--profile", choices=("defaults", "tuned"), default="defaults")
    ap.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches per step (default 2 * pp)")
    ap.add_argument("--virtual-stages", type=int, choices=(1,), default=1, help="TrainSchedule: one stage per rank")
    ap.add_argument(
        "--partition-method",
        default="parameters",
        help="PipelineModule's partition_method: DeepSpeed's default 'parameters', 'uniform' or 'type:PipeBlock'",
    )
    return ap.parse_args(argv)


def main():
    args = parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.pipe import PipelineModule

    choices = {}
    if args.layout != "fused":
        choices["layout"] = {"script": "fused", "case": args.layout, "source": MEGATRON_QKV}
        args.layout = "fused"
    device = _gpt.init(args)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    pp = dist.get_world_size()
    microbatches = args.microbatches or 2 * pp
    if args.micro_batch % microbatches:
        raise SystemExit(f"{microbatches} micro-batches do not divide micro_batch={args.micro_batch}")
    pipe = PipelineModule(
        layers=layer_specs(args),
        loss_fn=_gpt.lm_loss,
        num_stages=pp,
        partition_method=args.partition_method,
        activation_checkpoint_interval=0,
    )
    pipe.to(device)
    config = ds_config(args, cuda, microbatches)
    engine, optimizer, _, _ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=config)
    parts = [int(b) for b in pipe.parts]
    equal = equal_block_parts(args.n_layer, pp)
    if parts != equal:
        choices["pipeline_split"] = {
            "script": f"partition_method={args.partition_method!r}: layer bounds {parts} over [embed, blocks, head]",
            "case": f"equal blocks per stage: layer bounds {equal}",
            "source": "https://deepspeed.readthedocs.io/en/latest/pipeline.html (PipelineModule partition_method)",
        }
    mb = args.micro_batch // microbatches
    last = engine.is_last_stage()

    def step(x, y):
        loss = engine.train_batch(iter(zip(x.split(mb), y.split(mb))))
        return loss.detach().float() if last else None  # every stage gets the loss; the last computed it

    batches = _gpt.local_batches(args, 0, 1, device)  # one pipeline: every stage reads the whole batch
    inner = getattr(optimizer, "optimizer", optimizer)
    library = {
        "library": "deepspeed.pp",
        "recipe": "master" if args.precision == "bf16" else None,
        "optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
        "optimizer_wrapper": type(optimizer).__name__,
        "ds_config": config,
        "deepspeed": deepspeed.__version__,
        "pp": pp,
        "microbatches": microbatches,
        "parts": parts,
        "choices": choices,
    }
    return args, _gpt.measure(args, device, step, batches, args.micro_batch * args.seq_len, library)


if __name__ == "__main__":
    _gpt.finish(*main())
