"""The ``fp8`` precision recipe: torchao's float8 training (``torchao.float8``) on the GPT's linears.

What it is. ``convert_to_float8_training`` swaps ``nn.Linear`` modules for ``Float8Linear``, whose
three matmuls (output, input gradient, weight gradient) run in float8 through ``torch._scaled_mm``
with *dynamic tensorwise* scaling, torchao's default and fastest recipe ("tensorwise" in
``Float8LinearRecipeName``): each input and weight is cast to e4m3 and each output gradient to e5m2
with a scale computed from the tensor's current absolute maximum, every step. Everything else
(attention's score/value products, LayerNorm, the embeddings, the output head) computes in bf16.

Which modules. The linears of the transformer blocks (q, k, v, attention and MLP projections),
when both dimensions are multiples of 16 (``torch._scaled_mm``'s requirement). The output head is
left in bf16, as torchtitan's float8 converter leaves ``output`` (its default ``filter_fqns``): its
vocabulary-sized logits feed the loss directly, where float8's 3 significant bits cost accuracy.
A mixture-of-experts router is left alone too (its width is the expert count).

Which parameter layout: fp32 parameters, gradients and AdamW states, the "amp" recipe's. torchao's
README sends float8 pre-training users to torchtitan (docs/float8.md), which keeps fp32 parameters in
every path: under FSDP2 the fp32 shards are cast on all-gather (``MixedPrecisionPolicy``), without
FSDP its ``maybe_enable_amp`` runs the forward under ``torch.autocast(bf16)``. A float8 weight is cast from the
parameter each step, so an fp32 parameter gives its scale the full-precision amax; bf16 parameters
with fp32 masters ("master") would round the weight twice. Hence, per rank, the model state of
"amp" (``theory.recipe_state_bytes``, ``Case.param_precision`` fp32) and amp's traffic: fp32
gradients, fp32 FSDP2 gathers (option ``fp8_all_gather`` of torch.fsdp2 gathers the float8
linears' weights in float8 instead: torchao's ``enable_fsdp_float8_all_gather``).

Activations. torchao 0.17's ``matmul_with_hp_or_float8_args`` saves the linear's *high-precision*
input (bf16 under autocast) and the weight for backward, and casts to float8 again in backward, so
activation memory is amp's; only the bf16 copy autocast caches of each weight is not made (the
float8 linear reads the fp32 parameter). Nothing is saved in float8 in this recipe.

Where it runs. float8 matmuls need an NVIDIA GPU of compute capability 8.9 or higher (Ada,
Hopper); elsewhere the case is recorded as skipped with the reason (``skip_reason``), as is a
machine without torchao (``pip install parabench[fp8]``: torchao 0.17.0, built against torch
2.11 and ABI-stable from there; its float8 training is pure Python on ``torch._scaled_mm``).
"""

from __future__ import annotations

import importlib.util

import torch

# The torchao release the optional extra pins (pyproject.toml ``[project.optional-dependencies] fp8``).
TORCHAO_VERSION = "0.17.0"
INSTALL_HINT = f"install parabench[fp8] (torchao=={TORCHAO_VERSION})"
MIN_CAPABILITY = (8, 9)
# torchao's emulated float8 matmul (``Float8LinearConfig.emulate``: the casts and scales are real, the
# product runs in high precision, so it runs on a CPU). For tests only: no case runs emulated, the
# runner skips fp8 cases without an sm_89+ GPU instead.
EMULATE = False
# Module names never converted: the output head (bf16, as torchtitan's ``output``) and MoE routers.
SKIPPED_MODULES = ("head", "router")


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def skip_reason(device: str, capability: tuple[int, int] | None = None) -> str | None:
    """Why an fp8 case cannot run here, or None. ``device``: "cpu" or "cuda"; ``capability``: the
    GPU's (major, minor) compute capability (asked of torch when None)."""
    if not torchao_available():
        return f"the fp8 recipe needs torchao's float8 training: {INSTALL_HINT}"
    if device != "cuda":
        return (
            "the fp8 recipe needs float8 matmuls (torch._scaled_mm), which need an NVIDIA GPU of compute "
            f"capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper); this case runs on {device}"
        )
    cap = tuple(capability) if capability is not None else torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return (
            f"the fp8 recipe needs float8 matmuls on a GPU of compute capability >= "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}; this GPU has {cap[0]}.{cap[1]}"
        )
    return None


def converts(module: torch.nn.Module, fqn: str) -> bool:
    """``module_filter_fn``: a linear outside the head and routers whose dimensions are multiples of 16."""
    if not isinstance(module, torch.nn.Linear) or fqn.split(".")[-1] in SKIPPED_MODULES:
        return False
    out_features, in_features = module.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0


def float8_numel(model: torch.nn.Module) -> int:
    """Elements of the weights the conversion casts to float8 (biases stay high precision)."""
    return sum(m.weight.numel() for n, m in model.named_modules() if converts(m, n))


def block_float8_numel(cfg) -> int:
    """Float8 weight elements of one transformer block of ``cfg`` (every block has the same shapes),
    counted on the meta device: no memory, no initialisation."""
    from parabench.models import Block

    with torch.device("meta"):
        return float8_numel(Block(cfg, 0))


def block_float8_linears(cfg) -> int:
    """Linears of one transformer block of ``cfg`` the conversion casts to float8."""
    from parabench.models import Block

    with torch.device("meta"):
        return sum(1 for n, m in Block(cfg, 0).named_modules() if converts(m, n))


def convert(model: torch.nn.Module, fsdp_float8_all_gather: bool = False) -> torch.nn.Module:
    """Swap the chosen linears for torchao ``Float8Linear`` in place (before DDP, FSDP2, a reference's
    flat buffers, activation checkpointing and compile: torchtitan converts the model first)."""
    if not torchao_available():
        raise RuntimeError(f"the fp8 recipe needs torchao: {INSTALL_HINT}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=EMULATE)
    return convert_to_float8_training(model, config=config, module_filter_fn=converts)


def is_fp8(spec) -> bool:
    """The spec (TrainSpec or Case) trains in the fp8 recipe."""
    return getattr(spec, "recipe", None) == "fp8" and spec.precision == "bf16"
