"""ref.pp_2bw (PipeDream-2BW): its parameters after a few steps are those of one process applying the
1-step delayed update W(t+1) = W(t) - ν·∇f(W(t-1)) (Narayanan et al. 2021, Sec. 3.1), it holds exactly
two weight versions per stage, it really runs without a flush (backwards of one batch inside the next
step), and at equal steps its loss stays beside 1F1B's. CPU, gloo, tiny model, two stages."""

from __future__ import annotations

import pytest
import torch
from harness import params_close, run_cases

from parabench.case import Case
from parabench.models import build_model, global_batch, lm_loss
from parabench.registry import expected
from parabench.trainer import OptimConfig
from reference_impls.pipeline_2bw import delayed_update_reference

N_STEPS = 4
OPTIM = {"eps": 1e-6}


def mk(strategy):
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=2,
        micro_batch=4,
        lr=1e-3,
        device="cpu",
        options={"optim": OPTIM, "pp": 2, "microbatches": 2},
    )


CASES = {"2bw": mk("ref.pp_2bw"), "1f1b": mk("ref.pp_1f1b")}


def _stats(trainer, case, record):
    record["pipeline"] = trainer.pipeline_stats()


@pytest.fixture(scope="module")
def runs():
    return run_cases(2, CASES, N_STEPS, on_step=_on_step, on_end=_stats)


def _on_step(trainer, case, step, record):
    record.setdefault("in_flight", []).append(trainer.pipeline_stats().get("microbatches_in_flight_at_end"))


def _delayed_truth(case: Case) -> dict:
    cfg = case.model_config()
    model = build_model(cfg, case.seed, torch.device("cpu"))
    batches = [global_batch(step, case.global_batch, cfg, case.seed) for step in range(N_STEPS)]
    a = OptimConfig(lr=case.lr, **OPTIM)
    adam = dict(lr=a.lr, betas=a.betas, eps=a.eps, weight_decay=a.weight_decay)
    delayed_update_reference(model, lm_loss, batches, adam=adam)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_parameters_match_the_one_step_delayed_update(runs):
    got, want = runs["2bw"]["params"], _delayed_truth(CASES["2bw"])
    assert params_close(got, want, rtol=1e-5, atol=1e-6) == []
    # and not the synchronous update: the delay shows in the parameters
    assert len(params_close(got, runs["1f1b"]["params"], rtol=1e-5, atol=1e-6)) > len(want) // 2


def test_two_weight_versions_per_stage_as_theory_says(runs):
    case = CASES["2bw"]
    theory = expected(case, case.model_config(), 1)
    for rank, rec in enumerate(runs["2bw"]["per_rank"]):
        assert rec["state"] == theory["state_bytes"][rank], (rank, rec["state"])
        assert rec["pipeline"]["weight_versions"] == 2
        assert rec["pipeline"]["weight_versions_pipedream"] == 2 - rank
    one_f_one_b = runs["1f1b"]["per_rank"][0]["state"]
    assert runs["2bw"]["per_rank"][0]["state"]["params"] == 2 * one_f_one_b["params"]


def test_no_flush_between_steps(runs):
    """Stage 0 ends every step with its last micro-batch's backward still owed; the last stage never."""
    first, last = runs["2bw"]["per_rank"]
    assert first["in_flight"] == [1] * N_STEPS and last["in_flight"] == [0] * N_STEPS


def test_loss_stays_beside_1f1b_at_equal_steps(runs):
    bw = runs["2bw"]["per_rank"][1]["losses"]
    flush = runs["1f1b"]["per_rank"][1]["losses"]
    assert bw[0] == pytest.approx(flush[0], rel=1e-6)  # batch 0 runs on W(0) in both
    assert abs(bw[-1] - flush[-1]) / flush[-1] < 0.02, (bw, flush)
