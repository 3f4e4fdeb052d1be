"""Analytic expectations every record carries beside its measurements.

For each strategy: the model-state bytes one rank holds (parameters, gradients, optimizer
states incl. master weights) *as the implementation lays them out*, next to the ZeRO paper's
figure, and the communication payload per optimizer step by kind (nccl-tests conventions,
see ``parabench.meters.comm``). Ψ is the parameter count, N the data-parallel degree.

ZeRO paper (Rajbhandari et al. 2020, Sec. 5, mixed precision + Adam, K = 12):
DP 16Ψ; stage 1: 4Ψ + 12Ψ/N; stage 2: 2Ψ + 14Ψ/N; stage 3: 16Ψ/N.

A strategy without an entry gets no expectation (``None``), never a guess.
"""

from __future__ import annotations

from typing import Callable

from parabench.models import GPTConfig, parameter_count

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def zero_paper_state_bytes(stage: int, psi: int, n: int) -> float:
    """Model-state bytes per rank from the ZeRO paper (mixed precision, Adam, K=12)."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def _shard(numel: int, n: int) -> int:
    """Elements of the largest shard when ``numel`` is split over ``n`` ranks (padding up)."""
    return -(-numel // n)


class Expectation(dict):
    """{'state_bytes': {params, grads, optimizer} | None, 'comm_payload_bytes': {kind: bytes} | None,
    'paper_state_bytes': float | None, 'notes': str}"""


# name -> function(cfg, case, dp) -> Expectation
EXPECTATIONS: dict[str, Callable[..., Expectation]] = {}


def expectation(name: str):
    def deco(fn):
        EXPECTATIONS[name] = fn
        return fn
    return deco


def expected(case, cfg: GPTConfig, dp: int) -> Expectation | None:
    fn = EXPECTATIONS.get(case.strategy)
    return fn(cfg, case, dp) if fn else None


def _counts(cfg: GPTConfig) -> dict[str, int]:
    return parameter_count(cfg)


# --- peers --------------------------------------------------------------------------------

@expectation("single")
@expectation("torch.ddp")
def _torch_ddp(cfg, case, dp):
    psi = _counts(cfg)["total"]
    comm = {"all_reduce": 4 * psi} if dp > 1 else {}
    return Expectation(
        state_bytes={"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi},
        comm_payload_bytes=comm,
        paper_state_bytes=zero_paper_state_bytes(0, psi, dp),
        notes="fp32 parameters and gradients (autocast for bf16), Adam moments fp32; one fp32 all-reduce of "
              "all gradients per step (no_sync during accumulation).",
    )


@expectation("torch.fsdp2")
def _torch_fsdp2(cfg, case, dp):
    psi = _counts(cfg)["total"]
    pbytes = BYTES[case.precision]
    accum = case.grad_accum
    comm = {
        # forward gathers every parameter group (blocks and root), backward gathers each again
        # (reshard_after_forward=True, the root included); gradients are reduce-scattered in fp32
        # after every micro-batch.
        "all_gather": accum * 2 * psi * pbytes,
        "reduce_scatter": accum * psi * 4,
    } if dp > 1 else {}
    return Expectation(
        state_bytes=None,  # per-parameter dim-0 sharding: shard sizes vary by rank, see the measurement
        comm_payload_bytes=comm,
        paper_state_bytes=zero_paper_state_bytes(3, psi, dp),
        notes="fp32 sharded parameters are the master weights; gathered in the compute dtype.",
    )


def _deepspeed(stage: int):
    """DeepSpeed 0.19 as it behaves (read from its source, confirmed by the meter): gradients
    travel in the parameter dtype; stages 1 and 2 all-reduce each gradient bucket and then
    all-gather the updated parameters, so their payload is 2Ψ elements and their wire traffic 3Ψ
    (the paper's reduce-scatter + all-gather would be 2Ψ); stage 3, configured to reshard after
    forward, gathers parameters in forward and again in backward and reduce-scatters gradients."""
    def fn(cfg, case, dp):
        psi = _counts(cfg)["total"]
        b = BYTES[case.precision]
        accum = case.grad_accum
        comm = None
        if dp > 1:
            comm = {0: {"all_reduce": b * psi},
                    1: {"all_reduce": b * psi, "all_gather": b * psi},
                    2: {"all_reduce": b * psi, "all_gather": b * psi},
                    3: {"all_gather": accum * 2 * b * psi, "reduce_scatter": accum * b * psi}}[stage]
        return Expectation(
            state_bytes=None,
            comm_payload_bytes=comm,
            paper_state_bytes=zero_paper_state_bytes(stage, psi, dp),
            notes="DeepSpeed's internal layout is read from the engine; the paper's figure is given for reference.",
        )
    return fn


for _stage in range(4):
    EXPECTATIONS[f"deepspeed.zero{_stage}"] = _deepspeed(_stage)
