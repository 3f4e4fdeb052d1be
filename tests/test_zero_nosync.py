"""Accumulation without communication (option ``reduce_every_micro_batch = false``): ref.zero2, ref.zero3
and ref.fsdp accumulate the gradients of earlier micro-batches locally, in full size, and reduce-scatter
once per step; their peers do the same in their matching modes (FSDP2's
``set_requires_gradient_sync(False)``, DeepSpeed ZeRO-2's ``coalesce_grad_reduction``). Each trains
to the losses and parameters of one process on the global batch (grad_accum 2, two gloo ranks), and
the metered step moves exactly the bytes the theory says: one reduction a step, not two.

Tolerances and Adam's epsilon as tests/test_reference_dp.py (see its docstring)."""

from __future__ import annotations

import os

import pytest
from harness import assert_matches_single, max_rel_diff, payload_by_kind, replica_mean_losses, run_cases, single_truth

from parabench.case import Case
from parabench.models import model_config, parameter_count
from parabench.registry import expected, get_strategy

os.environ.setdefault("DS_ACCELERATOR", "cpu")
N_STEPS = 2
ACCUM = 2
OPTIM = {"eps": 1e-6}
REFS = ("ref.zero2", "ref.zero3", "ref.fsdp")
PEERS = ("torch.fsdp2", "deepspeed.zero2")


def mk(strategy, reduce_every_micro_batch=False, **extra):
    options = {"optim": OPTIM, "reduce_every_micro_batch": reduce_every_micro_batch, **extra}
    if strategy.startswith("ref."):
        options["bucket_mb"] = 0.05  # about ten ZeRO-2 buckets on the tiny model
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=2,
        micro_batch=1,
        grad_accum=ACCUM,
        lr=1e-3,
        device="cpu",
        options=options,
    )


CASES = {s: mk(s) for s in REFS + PEERS}


@pytest.fixture(scope="module")
def group():
    """Every case on one spawned 2-rank group; the last step metered, with its state sampled."""
    return run_cases(2, CASES, N_STEPS, meter_steps=(N_STEPS - 1,), measure_state_from=N_STEPS - 1)


@pytest.mark.parametrize("strategy", REFS + PEERS)
def test_trains_like_one_process_and_moves_the_theory(group, strategy):
    res, case = group[strategy], CASES[strategy]
    truth = single_truth(case, N_STEPS)
    if strategy in REFS:
        assert_matches_single(res, truth, loss_rtol=1e-5, rtol=1e-5, atol=1e-6)
    else:  # the peers' own summation orders: as tests/test_peers.py
        assert max_rel_diff(replica_mean_losses(res), truth["losses"]) < 1e-4
    exp = expected(case, model_config(case.model), case.world_size)
    for r in res["per_rank"]:
        assert payload_by_kind(r["comm"]) == exp["comm_payload_bytes"], strategy
        if exp["state_bytes"] is not None:  # the references: the whole gradient held between micro-batches
            assert r["state"] == exp["state_bytes"], (strategy, r["state"], exp["state_bytes"])


@pytest.mark.parametrize("strategy", REFS + PEERS)
def test_the_reduction_runs_once_a_step_instead_of_per_micro_batch(strategy):
    """The theory of the two forms differs only in the reduction, by the factor grad_accum; the
    references' gradient state grows by the whole gradient (bΨp: 4 bytes an element in fp32)."""
    cfg = model_config("tiny")
    local, every = (expected(mk(strategy, flag), cfg, 2) for flag in (False, True))
    kind = "all_reduce" if strategy.startswith("deepspeed.") else "reduce_scatter"
    assert every["comm_payload_bytes"][kind] == ACCUM * local["comm_payload_bytes"][kind]
    others = {k: v for k, v in every["comm_payload_bytes"].items() if k != kind}
    assert others == {k: v for k, v in local["comm_payload_bytes"].items() if k != kind}
    if local["state_bytes"] is not None:
        held = local["state_bytes"]["grads"] - every["state_bytes"]["grads"]
        assert held >= 4 * parameter_count(cfg)["total"]


def test_rows_without_the_mode_refuse_it():
    for strategy in ("ref.zero1", "ref.hsdp", "deepspeed.zero3", "torch.hsdp"):
        row = get_strategy(strategy)
        with pytest.raises(ValueError, match="reduce_every_micro_batch"):
            row.validate(mk(strategy), row.options.read(mk(strategy).options), model_config("tiny"))
