"""torch.local_sgd (PyTorch's PeriodicModelAverager) is the production twin of ref.local_sgd without averaged
optimizer states: on two gloo ranks the two train to the same losses and parameters, and the peer's metered sync
step moves the 4Ψ bytes and holds the 16Ψ its theory says. Tiny model, CPU."""

from __future__ import annotations

import pytest
from harness import params_close, run_cases

from parabench.case import Case
from parabench.metrics import check_against_theory
from parabench.record import theory_for

N_STEPS = 4  # syncs after steps 1 and 3 (H = 2); the metered step, index 3, is a sync step
OPTIONS = {"optim": {"eps": 1e-6}, "sync_every": 2}


def mk(strategy, **options):
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=2,
        micro_batch=2,
        lr=1e-3,
        device="cpu",
        steps=2,
        warmup=1,  # warmup + steps = 3: the index of the step the theory takes as metered
        options={**OPTIONS, **options},
    )


CASES = {"ref": mk("ref.local_sgd", average_optimizer_state=False), "torch": mk("torch.local_sgd")}


@pytest.fixture(scope="module")
def runs():
    return run_cases(2, CASES, N_STEPS - 1, extra_step=True, meter_steps=(N_STEPS - 1,), measure_state_from=N_STEPS - 1)


def test_same_losses_and_parameters(runs):
    for rank in (0, 1):
        ref, peer = runs["ref"]["per_rank"][rank]["losses"], runs["torch"]["per_rank"][rank]["losses"]
        assert peer == pytest.approx(ref, rel=1e-5), rank
    assert params_close(runs["torch"]["params"], runs["ref"]["params"]) == []


def test_the_peers_sync_step_is_its_theory(runs):
    per_rank = [
        {"rank": i, "comm": r["comm"], "state_bytes": r["state"]} for i, r in enumerate(runs["torch"]["per_rank"])
    ]
    checks = check_against_theory(theory_for(CASES["torch"], per_rank), per_rank)
    assert checks["comm_ok"] is True, checks["comm"]
    assert checks["state_ok"] is True, checks["state"]
