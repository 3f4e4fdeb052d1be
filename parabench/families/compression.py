"""Communication-reducing data parallelism: compressed DDP (fp16, 1-bit, top-k, PowerSGD) and local
SGD as references (``reference_impls/compression.py``), torch DDP communication hooks as peers.
Plain data parallel only.

DeepSpeed's 1-bit Adam is not a peer: the pinned DeepSpeed 0.19.8 no longer ships it (its
optimizers are adagrad, adam, adamw, lamb, lion, muadam(w), musgd and muon; the ``OneBitAdam``
optimizer and its compressed backends, ``runtime.fp16.onebit`` and ``runtime.comm.nccl`` / ``mpi``
/ ``compressed``, are gone), and the releases that had it ran its compressed all-reduce only over
NCCL (with cupy) or MPI, never gloo, so it could not be checked on CPU either. ``ref.ddp_onebit``
stands without a peer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from parabench.families.data_parallel import DataParallelOptions, expect_ref_ddp
from parabench.shapes import GPTConfig
from parabench.strategies import AMP_ONLY, PlanFacts, StrategySpec
from parabench.theory import BYTES, Expectation, ref_bucket_shapes, sum_ops, zero_paper_state_bytes
from parabench.theory import psi as psi_of


@dataclass(frozen=True)
class CompressionOptions(DataParallelOptions):
    error_feedback: bool = True  # onebit, topk, powersgd: keep the compression residual for the next step
    topk_ratio: float = 0.01  # topk: fraction of each bucket's elements sent
    powersgd_rank: int = 2  # powersgd (reference and torch hook): rank r of the approximation
    sync_every: int = 4  # local SGD: H, steps between averages
    average_optimizer_state: bool = True  # local SGD: average the optimizer states too
    local_optimizer: Literal["adamw", "sgd"] = "adamw"  # local SGD: the ranks' optimizer (sgd: momentum 0.9)


def validate(case, o: CompressionOptions, cfg: GPTConfig) -> None:
    if not 0 < o.topk_ratio <= 1:
        raise ValueError(f"topk_ratio must be a number in (0, 1] (got {o.topk_ratio!r})")
    for key in ("powersgd_rank", "sync_every"):
        if getattr(o, key) < 1:
            raise ValueError(f"{key} must be a positive integer (got {getattr(o, key)!r})")


# --- expectations -------------------------------------------------------------------------------
# --- communication-reducing data parallelism: reference_impls/compression.py, torch DDP hooks ----
# Ψ parameters in buckets planned as ref.ddp plans them (25 MiB default: the small models fit in one);
# N = data-parallel degree. Per bucket b with numel_b elements and S_b tensors:
#   fp16:     all-reduce 2·numel_b                                  (2Ψ in all)
#   onebit:   all-gather N·(4·S_b + ⌈numel_b/8⌉)  [fp32 scale per tensor | signs 8 per byte]
#   topk:     all-gather N·4·k_b (fp32 values) + all-gather N·4·k_b (int32 indices), k_b = max(1, ⌈ratio·numel_b⌉)
#   powersgd: all-reduce 4·Σ n·r (P) + all-reduce 4·Σ m·r (Q) over the bucket's 2-D n×m tensors, r = min(rank, n, m),
#             + all-reduce 4·Σ numel of its 1-D tensors (uncompressed)
#   local SGD: nothing on a local step; at a sync step (every H-th) all-reduce 4Ψ (fp32 master) + 8Ψ (AdamW
#             moments) or 4Ψ (SGD momentum) when optimizer states are averaged: (4Ψ + 8Ψ)/H per step on average.
# Each op is checked against the meter's scalar cut-off (ops ≤ 64 bytes are listed apart) one by one.


def compression_ops(cfg: GPTConfig, case, dp: int, method: str, buckets=None) -> list[tuple[str, int]]:
    """Every (kind, payload bytes) op of one compressed-DDP step (see the table above)."""
    o = CompressionOptions.read(case.options)
    if buckets is None:
        b = BYTES[case.param_precision]
        buckets = ref_bucket_shapes(cfg, b, float(o.bucket_mb))
    ops: list[tuple[str, int]] = []
    for shapes in buckets:
        numel = sum(math.prod(s) for s in shapes)
        if method == "fp16":
            ops.append(("all_reduce", 2 * numel))
        elif method == "onebit":
            ops.append(("all_gather", dp * (4 * len(shapes) + -(-numel // 8))))
        elif method == "topk":
            k = max(1, math.ceil(float(o.topk_ratio) * numel))
            ops += [("all_gather", dp * 4 * k), ("all_gather", dp * 4 * k)]
        elif method in ("powersgd", "torch_powersgd"):
            rank = int(o.powersgd_rank)
            vec = ps = qs = 0
            for s in shapes:
                if len(s) == 2:
                    n, m = s
                    r = min(rank, n, m)
                    if method == "torch_powersgd" and not (n + m) * r * 1.0 < n * m:  # min_compression_rate = 1
                        vec += n * m
                        continue
                    ps, qs = ps + n * r, qs + m * r
                else:
                    vec += math.prod(s)
            ops += [("all_reduce", 4 * x) for x in (vec, ps, qs) if x]
        else:
            raise ValueError(method)
    return ops


def _compressed_state(cfg, case, o, dp, extra_grads: int):
    base = expect_ref_ddp(cfg, case, o, dp)["state_bytes"]
    return {**base, "grads": base["grads"] + extra_grads}


def compressed_expectation(method: str):
    def fn(cfg, case, o, dp):
        p = psi_of(cfg)
        ef = o.error_feedback and method != "fp16"
        extra = 4 * p if ef else 0
        if method == "powersgd":  # warm-start Q (m x r) per 2-D tensor
            rank = int(o.powersgd_rank)
            for shapes in ref_bucket_shapes(cfg, BYTES[case.param_precision], float(o.bucket_mb)):
                extra += sum(4 * s[1] * min(rank, *s) for s in shapes if len(s) == 2)
        return Expectation(
            state_bytes=_compressed_state(cfg, case, o, dp, extra),
            comm_payload_bytes=sum_ops(compression_ops(cfg, case, dp, method)),
            paper_state_bytes=zero_paper_state_bytes(0, p, dp),
            notes={
                "fp16": "ref.ddp with every bucket cast to fp16, all-reduced, cast back: 2Ψ bytes per step.",
                "onebit": "per bucket an all-gather of N x (4 bytes per tensor scale + ⌈numel/8⌉ bytes of packed "
                "signs) (≈ NΨ/8); + 4Ψ fp32 error-feedback residual under grads.",
                "topk": "per bucket two all-gathers (fp32 values, int32 indices) of N·k elements, "
                "k = ⌈topk_ratio·numel⌉ (≈ 8·N·ratio·Ψ bytes); + 4Ψ residual under grads.",
                "powersgd": "per bucket all-reduces of P (4·Σ n·r), Q (4·Σ m·r) and the uncompressed 1-D tensors "
                "(4·Σ numel); + 4Ψ residual and the warm-start Qs (4·Σ m·r) under grads.",
            }[method]
            + (" Without error feedback, no residual." if method != "fp16" and not ef else ""),
        )

    return fn


def local_sgd_synced(case, step_index: int) -> bool:
    """Whether the step with 0-based index ``step_index`` ends with an average (every H-th step)."""
    return (step_index + 1) % CompressionOptions.read(case.options).sync_every == 0


def expect_ref_local_sgd(cfg, case, o, dp):
    psi = psi_of(cfg)
    H = o.sync_every
    sgd = o.local_optimizer == "sgd"
    states = (4 * psi if sgd else 8 * psi) if o.average_optimizer_state else 0
    per_sync = [4 * psi] + ([4 * psi] if states and sgd else [4 * psi, 4 * psi] if states else [])
    instrumented = case.warmup + case.steps  # the worker's metered step (0-based)
    synced = local_sgd_synced(case, instrumented)
    state = expect_ref_ddp(cfg, case, o, dp)["state_bytes"]
    if sgd:
        state = {**state, "optimizer": state["optimizer"] - 4 * psi}
    return Expectation(
        state_bytes=state,
        comm_payload_bytes={"all_reduce": sum(per_sync)} if synced else {},
        comm_payload_bytes_avg_per_step={"all_reduce": sum(per_sync) / H},
        paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
        notes=f"no gradient communication; every {H} steps an all-reduce of the fp32 parameters (4Ψ)"
        + (f" and of the optimizer states ({'4Ψ SGD momentum' if sgd else '8Ψ AdamW moments'})" if states else "")
        + f". The metered step (index {instrumented}) {'is' if synced else 'is not'} a sync step; on average "
        f"{sum(per_sync) / H:.0f} bytes per step.",
    )


def expect_torch_local_sgd(cfg, case, o, dp):
    psi = psi_of(cfg)
    synced = local_sgd_synced(case, case.warmup + case.steps)
    return Expectation(
        state_bytes={"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi},
        comm_payload_bytes={"all_reduce": 4 * psi} if synced else {},
        comm_payload_bytes_avg_per_step={"all_reduce": 4 * psi / o.sync_every},
        paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
        notes=f"PeriodicModelAverager: every {o.sync_every} steps one all-reduce of the flattened fp32 parameters "
        "(4Ψ); the optimizer's moments stay local. 4Ψ/H bytes per step on average.",
    )


def expect_torch_fp16_hook(cfg, case, o, dp):
    psi = psi_of(cfg)
    return Expectation(
        state_bytes={"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi},
        comm_payload_bytes={"all_reduce": 2 * psi},
        paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
        notes="torch DDP buckets cast to fp16 by fp16_compress_hook: 2Ψ bytes per step.",
    )


def expect_torch_powersgd_hook(cfg, case, o, dp):
    psi = psi_of(cfg)
    import torch

    from parabench.models import GPT

    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in GPT(cfg).parameters()]
    return Expectation(
        state_bytes=None,  # torch keeps its residual and P/Q memories inside the hook state
        comm_payload_bytes=sum_ops(compression_ops(cfg, case, dp, "torch_powersgd", buckets=[shapes])),
        paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
        notes="powerSGD_hook after start_powerSGD_iter (2): per bucket all-reduces of the uncompressed tensors "
        "(1-D, and 2-D with (n+m)·r ≥ n·m), of P and of Q; computed as if all gradients were in one bucket "
        "(true for models under DDP's 1 MiB first bucket; otherwise exact unless an op falls under 64 bytes).",
    )


_HOOKS = "parabench.peers.torch_ddp_hooks"


def _row(name, builder, kind, description, expect, **kw):
    # The references and torch's DDP communication hooks compile the blocks (peers.common.compile_blocks,
    # before DDP); torch.local_sgd's PostLocalSGDOptimizer has no hook wired and refuses.
    if kind == "reference" or builder.startswith(_HOOKS):
        kw.setdefault("compile_unsupported", None)
    return StrategySpec(
        name,
        "compression",
        builder,
        kind,
        description,
        options=CompressionOptions,
        validate=validate,
        expect=expect,
        **(AMP_ONLY if kind == "peer" else {}),
        report_sections=("compression_to_loss",),  # loss against bytes and time to DDP's loss
        **kw,
    )


_REF = "parabench.builders.compression"
ROWS = (
    _row(
        "ref.ddp_fp16_compress",
        f"{_REF}:build_ddp_fp16_compress",
        "reference",
        "reference DDP with fp16 gradients on the wire (cast, all-reduce, cast back)",
        compressed_expectation("fp16"),
        peers=("torch.ddp_fp16_hook",),
    ),
    _row(
        "ref.ddp_onebit",
        f"{_REF}:build_ddp_onebit",
        "reference",
        "reference DDP, 1-bit sign compression + per-tensor scale, error feedback; all-gather of packed "
        "signs (option error_feedback)",
        compressed_expectation("onebit"),
    ),
    _row(
        "ref.ddp_topk",
        f"{_REF}:build_ddp_topk",
        "reference",
        "reference DDP, top-k sparsification with residual accumulation; all-gather of values + int32 "
        "indices (options topk_ratio, error_feedback)",
        compressed_expectation("topk"),
    ),
    _row(
        "ref.ddp_powersgd",
        f"{_REF}:build_ddp_powersgd",
        "reference",
        "reference DDP, PowerSGD rank-r (P = MQ, all-reduce, orthogonalise, Q = M^T P, all-reduce), "
        "warm start, error feedback (options powersgd_rank, error_feedback)",
        compressed_expectation("powersgd"),
        peers=("torch.ddp_powersgd_hook",),
    ),
    _row(
        "ref.local_sgd",
        f"{_REF}:build_local_sgd",
        "reference",
        "local SGD: ranks step alone, parameters + optimizer states averaged every sync_every steps "
        "(options sync_every, average_optimizer_state, local_optimizer)",
        expect_ref_local_sgd,
        peers=("torch.local_sgd",),
    ),
    _row(
        "torch.ddp_fp16_hook",
        f"{_HOOKS}:build_fp16",
        "peer",
        "PyTorch DDP + default_hooks.fp16_compress_hook",
        expect_torch_fp16_hook,
        plan=PlanFacts(
            master_grad_buffer=True,
        ),
    ),
    _row(
        "torch.local_sgd",
        "parabench.peers.torch_local_sgd:build",
        "peer",
        "PyTorch PeriodicModelAverager: local AdamW steps, parameters (not moments) averaged every sync_every steps",
        expect_torch_local_sgd,
        plan=PlanFacts(
            master_grad_buffer=True,
        ),
    ),
    _row(
        "torch.ddp_powersgd_hook",
        f"{_HOOKS}:build_powersgd",
        "peer",
        "PyTorch DDP + powerSGD_hook (rank powersgd_rank, start_powerSGD_iter 2, min_compression_rate 1)",
        expect_torch_powersgd_hook,
        plan=PlanFacts(
            master_grad_buffer=True,
        ),
    ),
)
