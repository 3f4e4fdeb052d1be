"""Minimal DeepSpeed ZeRO (stage 1, 2 or 3) training of the parabench GPT, from DeepSpeed's docs only.

Sources:
- The config reference, https://www.deepspeed.ai/docs/config-json/: ``bf16.enabled``;
  ``zero_optimization.stage``; ``overlap_comm`` ("Attempts to overlap the reduction of the gradients
  with backward computation") and ``contiguous_gradients`` ("Avoids memory fragmentation during
  backward pass") on; every other ZeRO key at its default (bucket sizes, stage-3 prefetch bucket,
  persistence threshold, max live parameters, reuse distance); the ``optimizer`` section with
  ``type: AdamW``: DeepSpeed builds its FusedAdam (``adam_w_mode``) on CUDA, and with
  ``torch_adam: true`` torch's AdamW, which is what runs on CPUs (FusedAdam is a CUDA op).
- The ZeRO tutorial, https://www.deepspeed.ai/tutorials/zero/, and the getting-started guide,
  https://www.deepspeed.ai/getting-started/: ``deepspeed.initialize(model=..., model_parameters=...,
  config=...)``, then ``engine(x)``, ``engine.backward(loss)``, ``engine.step()`` (the engine zeroes
  gradients itself).

bf16 in DeepSpeed is its bf16-master recipe (bf16 parameters and compute, fp32 master weights and
optimizer states); fp32 trains in fp32. On CPUs set ``DS_ACCELERATOR=cpu`` (done here when no GPU
is present). On GPUs whose ``TORCH_CUDA_ARCH_LIST`` has a suffix ("9.0a"), export
``TORCH_CUDA_ARCH_LIST=9.0`` first, or the JIT build of FusedAdam fails.

Run: ``torchrun --nproc-per-node 2 deepspeed_zero.py --stage 3 --precision bf16 --out result.json``.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402

# ``--profile tuned``: the keys DeepSpeed's docs name for throughput when the training loop needs
# neither a per-step timer nor an overflow check. The throughput timer ("timers": {"throughput":
# {"enabled": false}}; its docstring: synchronizing "comes at the expense of performance
# degradation") and, in bf16, "check_grad_overflow": false (bf16 needs no loss scaling). The
# gradient-norm pass (``compute_grad_norm``) can be skipped only at stages 1-2 and is left alone.
TUNED_KEYS = {"timers": {"throughput": {"enabled": False}}}


def ds_config(args, cuda: bool) -> dict:
    hyper = _gpt.adamw_hyper(args)
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
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
        "bf16": {
            "enabled": args.precision == "bf16",
            **({"check_grad_overflow": False} if args.profile == "tuned" and args.precision == "bf16" else {}),
        },
        "zero_optimization": {"stage": args.stage, "overlap_comm": True, "contiguous_gradients": True},
        "steps_per_print": 10**9,
        **(TUNED_KEYS if args.profile == "tuned" else {}),
    }


def main():
    ap = _gpt.parser(__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
    ap.add_argument("--recipe", choices=("master",), default="master", help="DeepSpeed's bf16 is bf16-master")
    ap.add_argument(
        "--profile", choices=("defaults", "tuned"), default="defaults", help="DeepSpeed's defaults, or TUNED_KEYS"
    )
    args = ap.parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    device = _gpt.init(args)
    model = _gpt.build_gpt(args, device)
    config = ds_config(args, cuda)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(x, y):
        loss = _gpt.lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    world, rank = dist.get_world_size(), dist.get_rank()
    batches = _gpt.local_batches(args, rank, world, device)
    inner = getattr(optimizer, "optimizer", optimizer)
    library = {
        "library": f"deepspeed.zero{args.stage}",
        "recipe": "master" if args.precision == "bf16" else None,
        "optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
        "optimizer_wrapper": type(optimizer).__name__,
        "ds_config": config,
        "deepspeed": deepspeed.__version__,
    }
    return args, _gpt.measure(args, device, step, batches, args.micro_batch * world * args.seq_len, library)


if __name__ == "__main__":
    _gpt.finish(*main())
