"""Precision recipes of a bf16/fp16 case (an fp32 case has none). Imports nothing heavy: the
report reads recipes from records without training code.

- ``master``: parameters and gradients in the low precision, fp32 master weights and fp32
  optimizer states (Micikevicius et al. 2018, "Mixed Precision Training", Sec. 3.1; DeepSpeed's
  bf16/fp16, Megatron's and ZeRO's layout). What travels is in the low precision.
- ``amp``: fp32 parameters, gradients and optimizer states, matmuls in the low precision under
  ``torch.autocast`` (torch.amp's recipe). What travels is fp32.
- ``fp8`` (bf16 cases only): "amp" with the transformer blocks' linears swapped for torchao's
  ``Float8Linear`` (dynamic tensorwise scaling: e4m3 inputs and weights, e5m2 gradients), as
  torchtitan's float8 training does; everything else computes in bf16 under autocast. Parameters,
  gradients and optimizer states are those of "amp" (``parabench.fp8`` says why).

Compute, memory and traffic all differ between the two, so a ratio pairs like recipes only.
"""

from __future__ import annotations

RECIPES = ("master", "amp", "fp8")
# The precisions each recipe applies to (fp8 replaces bf16 matmuls; no fp16 variant is documented).
RECIPE_PRECISIONS = {"master": ("bf16", "fp16"), "amp": ("bf16", "fp16"), "fp8": ("bf16",)}


def recipe_name(precision: str, recipe: str | None) -> str:
    """How tables and labels name a precision recipe: ``fp32``, ``bf16-master``, ``bf16-amp``..."""
    return precision if precision == "fp32" or not recipe else f"{precision}-{recipe}"


def wire_precision(precision: str, recipe: str | None) -> str:
    """The precision a recipe keeps parameters and gradients in, and so sends them in unless a
    library casts them for the wire: fp32 under "amp" and "fp8", else the case's precision."""
    return "fp32" if recipe in ("amp", "fp8") else precision
