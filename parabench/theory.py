"""The shared core of the analytic expectations every record carries beside its measurements.

Each strategy's expectation lives with its family (``parabench/families/``): the model-state bytes
one rank holds (parameters, gradients, optimizer states incl. master weights) *as the
implementation lays them out*, next to the ZeRO paper's figure, and the communication payload per
optimizer step by kind (nccl-tests conventions, see ``parabench.meters.comm``). This module holds
what the families share: byte sizes, the paper formulas, bucket planning and summing ops. Ψ is the
parameter count, N the data-parallel degree.

ZeRO paper (Rajbhandari et al. 2020, Sec. 5, mixed precision + Adam, K = 12):
DP 16Ψ; stage 1: 4Ψ + 12Ψ/N; stage 2: 2Ψ + 14Ψ/N; stage 3: 16Ψ/N.

A strategy without an expectation gets none (``None``), never a guess.
"""

from __future__ import annotations

import functools
import math

from parabench.shapes import GPTConfig, parameter_count

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def recipe_state_bytes(case, n: int) -> dict:
    """Model-state bytes of n parameters held whole: fp32 parameters, gradients and Adam moments,
    or ("master") bf16/fp16 parameters and gradients with an fp32 master copy beside the moments."""
    e = BYTES[case.param_precision]
    return {"params": e * n, "grads": e * n, "optimizer": (8 if e == 4 else 12) * n}


# The comm meter lists ops of at most this many bytes apart from the volume (parabench.meters.comm).
SCALAR_BYTES = 64


def zero_paper_state_bytes(stage: int, psi: int, n: int) -> float:
    """Model-state bytes per rank from the ZeRO paper (mixed precision, Adam, K=12)."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def shard_numel(numel: int, n: int) -> int:
    """Elements of the largest shard when ``numel`` is split over ``n`` ranks (padding up)."""
    return -(-numel // n)


class Expectation(dict):
    """{'state_bytes': {params, grads, optimizer} | None, 'comm_payload_bytes': {kind: bytes} | None,
    'paper_state_bytes': float | None, 'notes': str}"""


def psi(cfg: GPTConfig) -> int:
    """Ψ: every parameter of the model."""
    return parameter_count(cfg)["total"]


def sum_ops(ops, scalar_bytes: int = SCALAR_BYTES) -> dict[str, int]:
    """Payload bytes by kind of a list of (kind, bytes) ops, each above the meter's scalar cut-off."""
    out: dict[str, int] = {}
    for kind, nbytes in ops:
        if nbytes > scalar_bytes:
            out[kind] = out.get(kind, 0) + nbytes
    return out


def scalar_ops(ops, scalar_bytes: int = SCALAR_BYTES) -> dict[str, dict]:
    """Calls and payload by kind of the ops at or under the meter's scalar cut-off."""
    out: dict[str, dict] = {}
    for kind, nbytes in ops:
        if nbytes <= scalar_bytes:
            s = out.setdefault(kind, {"calls": 0, "payload_bytes": 0})
            s["calls"] += 1
            s["payload_bytes"] += nbytes
    return dict(sorted(out.items()))


def volume(payloads) -> int:
    """Sum of op payloads the comm meter counts as volume (ops above its scalar cut-off)."""
    return sum(x for x in payloads if x > SCALAR_BYTES)


@functools.lru_cache(maxsize=16)  # the planner asks once per candidate; a wide model takes a second to build
def _parameter_shapes(cfg: GPTConfig) -> tuple[tuple[int, ...], ...]:
    import torch

    from parabench.models import GPT

    with torch.device("meta"):
        return tuple(tuple(p.shape) for p in GPT(cfg).parameters())


def ref_bucket_shapes(cfg: GPTConfig, elem: int, bucket_mb: float) -> list[list[tuple[int, ...]]]:
    """Parameter shapes per bucket, as reference_impls/dp_common.py:plan_buckets groups them (no
    padding): parameters last-registered first, a bucket closes once it holds >= bucket_mb MiB of
    ``elem``-byte elements."""
    out, cur, used = [], [], 0
    for shape in reversed(_parameter_shapes(cfg)):
        cur.append(shape)
        used += math.prod(shape)
        if used * elem >= bucket_mb * (1 << 20):
            out.append(cur)
            cur, used = [], 0
    if cur:
        out.append(cur)
    return out


def ref_bucket_sizes(cfg: GPTConfig, elem: int, bucket_mb: float, pad_to: int) -> list[int]:
    """Bucket sizes (elements) of :func:`ref_bucket_shapes`, each padded to a multiple of ``pad_to``."""
    return [
        -(-n // pad_to) * pad_to
        for n in (sum(math.prod(s) for s in shapes) for shapes in ref_bucket_shapes(cfg, elem, bucket_mb))
    ]
