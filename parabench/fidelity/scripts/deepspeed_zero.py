"""Minimal DeepSpeed ZeRO (stage 0 to 3, optionally with optimizer offload or ZeRO++) training of the
parabench GPT, from DeepSpeed's docs and its own examples only.

Sources:
- The config reference, https://www.deepspeed.ai/docs/config-json/: ``bf16.enabled``;
  ``zero_optimization.stage``, ``overlap_comm``, ``contiguous_gradients``, ``offload_optimizer``;
  the ``optimizer`` section with ``type: AdamW``: DeepSpeed builds its FusedAdam (``adam_w_mode``)
  on CUDA, DeepSpeedCPUAdam under optimizer offload, and with ``torch_adam: true`` torch's AdamW,
  which is what runs on CPUs (FusedAdam is a CUDA op).
- The config models of DeepSpeed itself (deepspeed/runtime/zero/config.py: ``overlap_comm``
  defaults on only at stage 3, ``contiguous_gradients`` on; ``compute_grad_norm`` may be false at
  stages 1-2 when nothing clips; deepspeed/runtime/precision_config.py: ``bf16.check_grad_overflow``;
  deepspeed/utils/config.py: the throughput timer, whose synchronisation "comes at the expense of
  performance degradation").
- The ZeRO tutorial, https://www.deepspeed.ai/tutorials/zero/, and the getting-started guide,
  https://www.deepspeed.ai/getting-started/: ``deepspeed.initialize(model=..., model_parameters=...,
  config=...)``, then ``engine(x)``, ``engine.backward(loss)``, ``engine.step()`` (the engine zeroes
  gradients itself). ZeRO-Offload: https://www.deepspeed.ai/tutorials/zero-offload/
  (``offload_optimizer.device: cpu``). ZeRO++: https://www.deepspeed.ai/tutorials/zeropp/
  (``zero_quantized_weights``, ``zero_hpz_partition_size``, ``zero_quantized_gradients`` at stage 3).

Profiles: ``defaults`` writes only the stage (and the offload / ZeRO++ keys asked for): every other
key at DeepSpeed's default. ``tuned`` adds the documented throughput keys of ``TUNED`` below, the
same ones parabench's tuned DeepSpeed profile claims to set, so the check tests that claim.

The model follows the library's usual recipe, not parabench's: Megatron-DeepSpeed's GPT
(megatron/model/transformer.py, ``ParallelAttention.query_key_value``: one fused q/k/v linear with
a bias) and the HF GPT-2 of DeepSpeedExamples (``c_attn``) both fuse q, k and v. A case run in
parabench's separate layout is recorded under ``choices`` (result JSON) with both values.

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

MEGATRON_QKV = "Megatron-DeepSpeed megatron/model/transformer.py ParallelAttention.query_key_value (fused, bias)"


def tuned_keys(stage: int, precision: str, offload: bool) -> dict:
    """``--profile tuned``: DeepSpeed's documented throughput keys for a loop that needs neither a
    per-step timer, nor an overflow check (bf16 has no loss scale), nor a gradient norm (nothing
    clips). The norm may be skipped at stages 1-2 only, and not under offload (DeepSpeed computes it
    there for its CPU step) or fp16 (part of its overflow detection)."""
    out: dict = {"timers": {"throughput": {"enabled": False}}}
    zero: dict = {}
    if stage >= 1:
        zero.update(overlap_comm=True, contiguous_gradients=True)
    if stage in (1, 2) and not offload and precision != "fp16":
        zero["compute_grad_norm"] = False
    out["zero_optimization"] = zero
    if precision == "bf16":
        out["bf16"] = {"check_grad_overflow": False}
    return out


def ds_config(args, cuda: bool) -> dict:
    hyper = _gpt.adamw_hyper(args)
    offload = getattr(args, "offload_optimizer", "none") == "cpu"
    zero = {"stage": args.stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    zeropp = {
        key: value
        for key, value in (
            ("zero_quantized_weights", getattr(args, "zero_quantized_weights", False)),
            ("zero_hpz_partition_size", getattr(args, "zero_hpz_partition_size", 1)),
            ("zero_quantized_gradients", getattr(args, "zero_quantized_gradients", False)),
        )
        if value not in (False, 1)  # DeepSpeed's defaults: not written
    }
    zero.update(zeropp)
    config = {
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
        "bf16": {"enabled": args.precision == "bf16"},
        "zero_optimization": zero,
        # The training recipe, not a tuning knob: parabench trains every strategy without clipping,
        # while DeepSpeed clips at 1.0 by default (runtime/constants.py GRADIENT_CLIPPING_DEFAULT).
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    if not cuda and offload:
        # DeepSpeedCPUAdam is a JIT-built C++ op; torch's AdamW on the CPU does the same update
        config["zero_force_ds_cpu_optimizer"] = False
    if args.profile == "tuned":
        tuned = tuned_keys(args.stage, args.precision, offload)
        config["zero_optimization"].update(tuned.pop("zero_optimization"))
        if "bf16" in tuned:
            config["bf16"].update(tuned.pop("bf16"))
        config.update(tuned)
    return config


def layout_choices(args) -> dict:
    """The library's layout replaces the case's; a difference is recorded, the case's value kept."""
    if args.layout == "fused":
        return {}
    case = args.layout
    args.layout = "fused"
    return {"layout": {"script": "fused", "case": case, "source": MEGATRON_QKV}}


def flag(text: str) -> bool:
    return text.lower() in ("1", "true", "yes")


def parse_args(argv=None):
    ap = _gpt.parser(__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, choices=(0, 1, 2, 3), required=True)
    ap.add_argument("--recipe", choices=("master",), default="master", help="DeepSpeed's bf16 is bf16-master")
    ap.add_argument(
        "--profile", choices=("defaults", "tuned"), default="defaults", help="DeepSpeed's defaults, or tuned_keys()"
    )
    ap.add_argument("--offload-optimizer", choices=("none", "cpu"), default="none", help="ZeRO-Offload (stages 1-3)")
    ap.add_argument("--zero-quantized-weights", type=flag, default=False, help="ZeRO++ qwZ (stage 3, CUDA)")
    ap.add_argument("--zero-hpz-partition-size", type=int, default=1, help="ZeRO++ hpZ: ranks per secondary partition")
    ap.add_argument("--zero-quantized-gradients", type=flag, default=False, help="ZeRO++ qgZ (stage 3, CUDA)")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    choices = layout_choices(args)
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
    zeropp = any(key.startswith("zero_") for key in config["zero_optimization"])
    name = "zeropp" if zeropp else f"zero{args.stage}" + ("_offload" if args.offload_optimizer == "cpu" else "")
    library = {
        "library": f"deepspeed.{name}",
        "recipe": "master" if args.precision == "bf16" else None,
        "optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
        "optimizer_wrapper": type(optimizer).__name__,
        "ds_config": config,
        "deepspeed": deepspeed.__version__,
        "choices": choices,
    }
    return args, _gpt.measure(args, device, step, batches, args.micro_batch * world * args.seq_len, library)


if __name__ == "__main__":
    _gpt.finish(*main())
