"""Minimal DeepSpeed-MoE (expert parallel) training of the parabench MoE GPT, from DeepSpeed's docs and examples.

Sources:
- The MoE tutorial, https://www.deepspeed.ai/tutorials/mixture-of-experts/: replace a block's MLP
  by ``deepspeed.moe.layer.MoE(hidden_size=..., expert=<the MLP>, num_experts=..., ep_size=...,
  k=...)``, which returns ``(output, l_aux, exp_counts)``; add ``l_aux`` to the loss; give the
  optimizer ``split_params_into_different_moe_groups_for_optimizer`` groups (expert parameters are
  reduced over their expert-data-parallel group only).
- DeepSpeedExamples training/cifar/cifar10_deepspeed.py (``--moe``): the same calls, the engine
  built with ``model_parameters=create_moe_param_groups(net)``; Megatron-DeepSpeed
  megatron/model/transformer.py (``ParallelTransformerLayer``: MoE every ``expert_interval``
  layers, ``moe_loss`` summed over the layers and added with ``moe_loss_coeff``).
- The engine config as in deepspeed_zero.py (ZeRO stage 0, the config's AdamW, bf16 as
  bf16-master); ``--profile tuned`` adds the keys parabench's tuned profile claims (throughput
  timer off; in bf16 no overflow check).

The gate keeps DeepSpeed's defaults where they do not define the model: random token selection
(``use_rts=True``) and sampled second experts (``top2_2nd_expert_sampling=True``). The case's model
sets the expert count, top-k, the MoE interval, the capacity factor (none: dropless,
``drop_tokens=False``), ``min_capacity`` and the auxiliary-loss coefficient. Where parabench's
adapter (parabench/peers/cp_ep_peers.py) makes other choices, the result lists them under
``choices``.

Run: ``torchrun --nproc-per-node 2 deepspeed_moe.py --n-experts 4 --precision bf16 --out r.json``.
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


class MoEMLP(nn.Module):
    """The MLP slot of an MoE block: DeepSpeed's MoE layer; the auxiliary loss is kept for the loop."""

    def __init__(self, args, ep: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        dropless = args.capacity_factor is None
        self.moe = MoE(
            hidden_size=args.d_model,
            expert=_gpt.MLP(args.d_model),
            num_experts=args.n_experts,
            ep_size=ep,
            k=args.top_k,
            capacity_factor=1.0 if dropless else args.capacity_factor,
            eval_capacity_factor=1.0 if dropless else args.capacity_factor,
            min_capacity=args.min_capacity,
            drop_tokens=not dropless,
        )
        self.l_aux = None

    def forward(self, x):
        out, self.l_aux, _ = self.moe(x)
        return out


class RouterAndExperts(nn.Module):
    """The whole MoE layer's parameters as one process would hold them (a router, then every
    expert): walked on the meta device only, to draw the initial values in a fixed order."""

    def __init__(self, args):
        super().__init__()
        self.router = nn.Linear(args.d_model, args.n_experts, bias=False)
        self.experts = nn.ModuleList(_gpt.MLP(args.d_model) for _ in range(args.n_experts))


def is_moe_block(i: int, args) -> bool:
    return (i + 1) % args.moe_every == 0


def build_moe_gpt(args, device, ep: int, rank: int) -> nn.Module:
    """The GPT with DeepSpeed's MoE layer in every ``moe_every``-th block. GPT-2 initialisation,
    the values the whole model would get from one seeded generator on the device walking its
    parameters in order (``_gpt.build_gpt``'s rule, the MoE blocks holding a router and all
    experts): the gate takes the router's values, each rank's experts those of the global experts
    it owns, so the start does not depend on the expert-parallel degree."""
    with torch.device(device):
        model = _gpt.GPT(args.n_layer, args.n_head, args.d_model, args.vocab, args.seq_len, args.layout)
        for i, block in enumerate(model.blocks):
            if is_moe_block(i, args):
                block.mlp = MoEMLP(args, ep)
    with torch.device("meta"):
        whole = _gpt.GPT(args.n_layer, args.n_head, args.d_model, args.vocab, args.seq_len, args.layout)
        for i, block in enumerate(whole.blocks):
            if is_moe_block(i, args):
                block.mlp = RouterAndExperts(args)
    local = args.n_experts // ep
    mine = dict(model.named_parameters())

    def target(name: str):
        parts = name.split(".")
        if len(parts) > 3 and parts[2] == "mlp" and parts[3] in ("router", "experts"):
            moe = ".".join(parts[:3]) + ".moe.deepspeed_moe."
            if parts[3] == "router":
                return mine.pop(moe + "gate.wg.weight")
            j = int(parts[4]) - rank * local
            return mine.pop(moe + f"experts.deepspeed_experts.{j}." + ".".join(parts[5:])) if 0 <= j < local else None
        return mine.pop(name)

    gen = torch.Generator(device=device).manual_seed(args.seed)
    resid_std = 0.02 / math.sqrt(2 * args.n_layer)
    with torch.no_grad():
        for name, meta in whole.named_parameters():
            p = target(name)
            if name.endswith("bias") or ".ln" in name or name.startswith("ln_"):
                if p is not None:
                    p.fill_(0.0 if name.endswith("bias") else 1.0)
                continue
            draw = torch.randn(meta.shape, generator=gen, device=device)
            if p is not None:
                p.copy_(draw.mul_(resid_std if name.endswith("proj.weight") else 0.02))
    assert not mine, f"parameters outside the MoE GPT: {sorted(mine)}"
    return model


def ds_config(args, cuda: bool) -> dict:
    hyper = _gpt.adamw_hyper(args)
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
    ap.add_argument("--n-experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-every", type=int, default=2, help="block i is MoE when (i + 1) %% moe_every == 0")
    ap.add_argument("--capacity-factor", type=float, default=None, help="none: dropless")
    ap.add_argument("--min-capacity", type=int, default=4, help="the gate's minimum slots per expert (DeepSpeed: 4)")
    ap.add_argument("--aux-loss-coef", type=float, default=0.01)
    return ap.parse_args(argv)


def main():
    args = parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    choices = {
        "gate": {
            "script": "DeepSpeed's defaults: use_rts=True, top2_2nd_expert_sampling=True",
            "case": "deterministic: use_rts=False, top2_2nd_expert_sampling=False",
            "source": "deepspeed/moe/layer.py MoE.__init__ defaults",
        },
        "aux_loss": {
            "script": "added to the loss (lm + coef * sum of l_aux)",
            "case": "its gradient injected, the reported loss the LM loss alone",
            "source": "https://www.deepspeed.ai/tutorials/mixture-of-experts/",
        },
    }
    if args.layout != "fused":
        choices["layout"] = {"script": "fused", "case": args.layout, "source": MEGATRON_QKV}
        args.layout = "fused"
    device = _gpt.init(args)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    ep, rank = dist.get_world_size(), dist.get_rank()
    if args.n_experts % ep:
        raise SystemExit(f"ep={ep} does not divide {args.n_experts} experts")
    model = build_moe_gpt(args, device, ep, rank)
    moe_layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"}
    )
    config = ds_config(args, cuda)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)

    def step(x, y):
        lm = _gpt.lm_loss(engine(x), y)
        aux = sum(m.l_aux for m in moe_layers)
        engine.backward(lm + args.aux_loss_coef * aux)
        engine.step()
        return lm.detach()

    batches = _gpt.local_batches(args, rank, ep, device)
    inner = getattr(optimizer, "optimizer", optimizer)
    library = {
        "library": "deepspeed.moe",
        "recipe": "master" if args.precision == "bf16" else None,
        "optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
        "optimizer_wrapper": type(optimizer).__name__,
        "ds_config": config,
        "deepspeed": deepspeed.__version__,
        "ep": ep,
        "choices": choices,
    }
    return args, _gpt.measure(args, device, step, batches, args.micro_batch * ep * args.seq_len, library)


if __name__ == "__main__":
    _gpt.finish(*main())
