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

Each stage builds only its layers (``LayerSpec``) and gives them the values the whole GPT would have
from ``_gpt.build_gpt`` (the adapter's initial weights), whatever the split.

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


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int, seq_len: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq_len, d)

    def forward(self, tokens):
        return self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))


class Head(nn.Module):
    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.head(self.ln_f(x))


def layer_specs(args):
    from deepspeed.pipe import LayerSpec

    return [
        LayerSpec(Embed, args.vocab, args.d_model, args.seq_len),
        *(LayerSpec(_gpt.Block, args.d_model, args.n_head, args.layout) for _ in range(args.n_layer)),
        LayerSpec(Head, args.d_model, args.vocab),
    ]


@torch.no_grad()
def init_like_the_whole_gpt(pipe, args, device) -> None:
    """This stage's layers get the values ``_gpt.build_gpt`` would give them: the whole GPT's
    parameters are walked in order (on the meta device, no memory), one seeded generator on the
    device drawing for every weight, and a draw is kept where its parameter lives on this stage.
    So the initial weights do not depend on where the stages are cut, and equal the adapter's."""
    lo = pipe.parts[pipe.stage_id]
    last = args.n_layer + 1
    local = {}
    for j, layer in enumerate(pipe.forward_funcs, start=lo):
        prefix = "" if j in (0, last) else f"blocks.{j - 1}."
        local.update({prefix + n: p for n, p in layer.named_parameters()})
    with torch.device("meta"):
        whole = _gpt.GPT(args.n_layer, args.n_head, args.d_model, args.vocab, args.seq_len, args.layout)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    resid_std = 0.02 / math.sqrt(2 * args.n_layer)
    for name, meta in whole.named_parameters():
        p = local.pop(name, None)
        if name.endswith("bias") or ".ln" in name or name.startswith("ln_"):
            if p is not None:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        draw = torch.randn(meta.shape, generator=gen, device=device)
        if p is not None:
            p.copy_(draw.mul_(resid_std if name.endswith("proj.weight") else 0.02))
    assert not local, f"parameters outside the GPT: {sorted(local)}"


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
        help="PipelineModule's partition_method: DeepSpeed's default 'parameters', 'uniform' or 'type:Block'",
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
    init_like_the_whole_gpt(pipe, args, device)
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
