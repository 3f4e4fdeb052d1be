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

Option ``fp8_filter`` picks among those linears (``FP8_FILTERS``), for every strategy that takes the
recipe alike (the references' ``reference_model``, the torch peers' ``recipe_module`` and torch.fsdp2):

- ``"all"`` (the default): every one of them, as torchtitan's float8 converter does by default
  (every linear not named in its ``filter_fqns``).
- ``"auto"``: torchao's automatic filter for the tensorwise recipe,
  ``torchao.float8.float8_linear_utils._auto_filter_for_recipe("tensorwise", filter_fqns)``, with the
  head and routers as ``filter_fqns``. It also skips a linear of ``K <= 4096`` inputs and ``N <= 1024``
  outputs, where torchao's README (float8, "Performance", "tensorwise scaling": a microbenchmark table
  of float8-over-bf16 speedup by M, K, N on H100) shows float8 no faster than bf16. torchtitan offers
  the same choice as the flag ``auto_filter_small_kn`` in its float8 converter's ``filter_fqns``
  (``Float8LinearConverter._init_filter_fn``, torchtitan/components/quantization/float8.py). At
  gpt-350m (d 1024) it keeps only ``mlp.fc``; at gpt-1.3b (d 2048) all six block linears.

The theory's float8 counts (``block_float8_numel``, ``block_float8_linears``: torch.fsdp2's float8
all-gather) follow the chosen filter, and each rank records what ``convert`` swapped
(``strategy_stats["float8"]``: filter, Float8Linear count per block and their names).

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

import contextlib
import contextvars
import functools
import importlib.util
import typing
from typing import TYPE_CHECKING, Callable, Literal

# Cases, suites and the registry read the option types below without torch; the functions that
# touch modules import it.
if TYPE_CHECKING:
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
# Option ``fp8_filter``: which of the convertible linears become Float8Linear (module docstring).
Fp8Filter = Literal["all", "auto"]
FP8_FILTERS: tuple[str, ...] = typing.get_args(Fp8Filter)
# Where ``convert`` reports what it swapped: the list of the innermost ``recorded_conversions``
# scope (the worker opens one around a case's build), or nowhere.
_conversions: contextvars.ContextVar[list | None] = contextvars.ContextVar("fp8_conversions", default=None)


class TorchaoMissing(RuntimeError):
    """Something needs torchao (a float8 conversion, or "auto"'s filter) on a machine without it."""


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
    if capability is None:
        import torch

        capability = torch.cuda.get_device_capability()
    cap = tuple(capability)
    if cap < MIN_CAPABILITY:
        return (
            f"the fp8 recipe needs float8 matmuls on a GPU of compute capability >= "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}; this GPU has {cap[0]}.{cap[1]}"
        )
    return None


def converts(module: torch.nn.Module, fqn: str) -> bool:
    """``module_filter_fn`` of ``fp8_filter = "all"``: a linear outside the head and routers whose
    dimensions are multiples of 16."""
    import torch

    if not isinstance(module, torch.nn.Linear) or fqn.split(".")[-1] in SKIPPED_MODULES:
        return False
    out_features, in_features = module.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0


def module_filter(fp8_filter: str = "all") -> Callable[[torch.nn.Module, str], bool]:
    """The ``module_filter_fn`` of option ``fp8_filter``: ``converts`` for "all"; for "auto",
    torchao's own tensorwise auto filter (needs torchao), with the skipped modules as its
    ``filter_fqns`` (matched as substrings of the name there; no other GPT module name contains them)."""
    if fp8_filter == "all":
        return converts
    if fp8_filter == "auto":
        if not torchao_available():
            raise TorchaoMissing(f"fp8_filter 'auto' is torchao's filter: {INSTALL_HINT}")
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

        return _auto_filter_for_recipe("tensorwise", filter_fqns=list(SKIPPED_MODULES))
    raise ValueError(f"unknown fp8_filter {fp8_filter!r}; valid values: {', '.join(FP8_FILTERS)}")


def float8_weights(model: torch.nn.Module, fp8_filter: str = "all") -> dict[str, int]:
    """Module name -> weight elements, of the linears ``convert`` casts to float8 (biases stay high
    precision)."""
    keep = module_filter(fp8_filter)
    return {n: m.weight.numel() for n, m in model.named_modules() if keep(m, n)}


def float8_numel(model: torch.nn.Module, fp8_filter: str = "all") -> int:
    """Elements of the weights the conversion casts to float8."""
    return sum(float8_weights(model, fp8_filter).values())


def block_float8_weights(cfg, fp8_filter: str = "all") -> dict[str, int]:
    """``float8_weights`` of one transformer block of ``cfg`` (every block has the same shapes),
    built on the meta device: no memory, no initialisation."""
    return dict(_block_float8_weights(cfg, fp8_filter))


@functools.cache  # the theory asks once per expectation; a gpt-13b block takes ~10 ms to build on meta
def _block_float8_weights(cfg, fp8_filter: str) -> tuple[tuple[str, int], ...]:
    import torch

    from parabench.models import Block

    with torch.device("meta"):
        return tuple(float8_weights(Block(cfg, 0), fp8_filter).items())


def block_float8_numel(cfg, fp8_filter: str = "all") -> int:
    """Float8 weight elements of one transformer block of ``cfg``."""
    return sum(block_float8_weights(cfg, fp8_filter).values())


def block_float8_linears(cfg, fp8_filter: str = "all") -> int:
    """Linears of one transformer block of ``cfg`` the conversion casts to float8."""
    return len(block_float8_weights(cfg, fp8_filter))


def convert(model: torch.nn.Module, fp8_filter: str = "all", fsdp_float8_all_gather: bool = False) -> torch.nn.Module:
    """Swap the linears ``fp8_filter`` picks for torchao ``Float8Linear`` in place (before DDP, FSDP2,
    a reference's flat buffers, activation checkpointing and compile: torchtitan converts the model
    first), and report what was swapped to the open ``recorded_conversions`` scope, if any."""
    if not torchao_available():
        raise RuntimeError(f"the fp8 recipe needs torchao: {INSTALL_HINT}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=EMULATE)
    model = convert_to_float8_training(model, config=config, module_filter_fn=module_filter(fp8_filter))
    sink = _conversions.get()
    if sink is not None:
        sink.append(conversion_summary(model, fp8_filter))
    return model


def conversion_summary(model: torch.nn.Module, fp8_filter: str) -> dict:
    """What a converted GPT holds in float8: the filter, the Float8Linear count per block and their
    names inside a block, and their weight elements."""
    from torchao.float8.float8_linear import Float8Linear

    swapped = {n: m.weight.numel() for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    blocks = getattr(model, "blocks", ())
    per_block = [sum(1 for n in swapped if n.startswith(f"blocks.{i}.")) for i in range(len(blocks))]
    return {
        "fp8_filter": fp8_filter,
        "float8_linears": len(swapped),
        "float8_linears_per_block": per_block,
        "block_modules": sorted({n.split(".", 2)[2] for n in swapped if n.startswith("blocks.")}),
        "float8_numel": sum(swapped.values()),
    }


@contextlib.contextmanager
def recorded_conversions():
    """A scope whose ``convert`` calls append their ``conversion_summary`` to the list it yields:
    what one case's builder swapped, and nothing another case did."""
    found: list[dict] = []
    token = _conversions.set(found)
    try:
        yield found
    finally:
        _conversions.reset(token)


def filter_option_error(case) -> str | None:
    """Why a case's ``fp8_filter`` option cannot apply, or None (its value's type is checked with
    the strategy's options)."""
    if "fp8_filter" not in case.options or case.recipe == "fp8":
        return None
    ran = f"the {case.recipe!r} recipe" if case.recipe else f"{case.precision}, which has no recipe"
    return (
        f"option fp8_filter ({' or '.join(repr(f) for f in FP8_FILTERS)}) picks the linears of the fp8 recipe; "
        f"this case trains in {ran}: give it recipe fp8 or drop the option"
    )


def is_fp8(spec) -> bool:
    """The spec (TrainSpec or Case) trains in the fp8 recipe."""
    return getattr(spec, "recipe", None) == "fp8" and spec.precision == "bf16"
