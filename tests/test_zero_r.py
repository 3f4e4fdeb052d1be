"""ref.zero_r (reference_impls/zero_r.py): ZeRO-R over the reference tensor parallelism. Partitioned
activation checkpoints (Pa, and Pa+cpu), constant-size gradient windows (CB) and the contiguous
activation arena and gradient buffer (MD) train to the losses and parameters of one process on the
global batch (tp 2, grad_accum 2, gloo); the checkpoint bytes held, the arena's allocations, the
gradient windows and every collective byte equal the theory (ZeRO paper Sec. 6 and 8). Tolerances
and Adam's epsilon as tests/test_reference_mp.py."""

from __future__ import annotations

import pytest
from harness import assert_matches_single, payload_by_kind, run_cases, single_truth

from parabench.case import Case
from parabench.models import model_config
from parabench.registry import expected, get_strategy

N_STEPS = 2


def mk(**options):
    return Case(
        model="tiny",
        strategy="ref.zero_r",
        world_size=2,
        micro_batch=2,
        grad_accum=2,
        lr=1e-3,
        device="cpu",
        options={"tp": 2, "optim": {"eps": 1e-6}, "constant_buffer_mb": 0.05, **options},
    )


CASES = {
    "pa": mk(),
    "pa+cpu, no md": mk(cpu_checkpointing=True, contiguous_memory_optimization=False),
    "replicated": mk(partition_activations=False),
}


def _stats(trainer, case, record):
    record["stats"] = trainer.strategy_stats()


@pytest.fixture(scope="module")
def group():
    return run_cases(2, CASES, N_STEPS, meter_steps=(N_STEPS - 1,), measure_state_from=N_STEPS - 1, on_end=_stats)


@pytest.mark.parametrize("name", list(CASES))
def test_trains_like_one_process_with_the_bytes_of_its_theory(group, name):
    res, case = group[name], CASES[name]
    assert_matches_single(res, single_truth(case, N_STEPS), loss_rtol=1e-5, rtol=1e-5, atol=1e-5)
    exp = expected(case, model_config("tiny"), 2)
    o = get_strategy("ref.zero_r").options.read(case.options)
    for r in res["per_rank"]:
        assert payload_by_kind(r["comm"]) == exp["comm_payload_bytes"], name
        assert r["state"] == exp["state_bytes"]
        stats = r["stats"]
        assert stats["activation_checkpoint_bytes"] == exp["activation_checkpoint_bytes"]
        assert stats["grad_reduce_calls"] == exp["grad_reduce_calls"] > 1  # the window is smaller than the model
        cfg = model_config("tiny")
        if o.contiguous_memory_optimization:  # one arena for every micro-batch of every step (and the extra one)
            assert stats["activation_arena_allocations"] == 1
            assert stats["activation_arena_bytes"] == sum(exp["activation_checkpoint_bytes"].values())
        else:  # a fresh tensor per checkpoint
            assert stats["activation_arena_allocations"] == cfg.n_layers * case.grad_accum * N_STEPS


def test_partitioning_divides_the_checkpoints_by_the_tp_degree(group):
    """Sec. 6.1: Pa holds 1/t of what every TP rank holds without it (here measured, t = 2); Pa+cpu holds
    the same slices in CPU memory and none on the device."""
    held = {n: group[n]["per_rank"][0]["stats"]["activation_checkpoint_bytes"] for n in CASES}
    assert held["replicated"]["device"] == 2 * held["pa"]["device"]
    assert held["pa+cpu, no md"] == {"host": held["pa"]["device"]}
    assert (
        held["replicated"]["device"]
        == expected(CASES["pa"], model_config("tiny"), 2)["activation_checkpoint_bytes_replicated"]
    )


def test_the_record_check_compares_the_checkpoint_bytes_with_the_theory():
    from parabench.metrics import check_against_theory

    theory = {"activation_checkpoint_bytes": {"device": 8192}}

    def rank(held):
        return [{"rank": 0, "strategy_stats": {"activation_checkpoint_bytes": held}}]

    assert check_against_theory(theory, rank({"device": 8192}))["ok"] is True
    off = check_against_theory(theory, rank({"device": 16384}))
    assert off["ok"] is False and off["activation_checkpoints_ok"] is False
