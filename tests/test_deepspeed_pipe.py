"""deepspeed.pp (DeepSpeed's PipelineModule + PipelineEngine.train_batch) trains the same model to
the same losses and parameters as one process, and moves exactly the bytes parabench.theory says.
CPU, gloo, 2 ranks = 2 stages, tiny shapes; tolerances as tests/test_reference_mp.py (fp32: 1e-5
relative on every step's loss, parameters rtol 1e-5 / atol 1e-5, Adam eps 1e-6 for the reason given
there). All cases share one spawned process group (``harness.run_cases``); the single-process truth is
computed on rank 0.
"""

from __future__ import annotations

import dataclasses

import pytest
from harness import assert_matches_single, max_rel_diff, payload_by_kind, run_cases

from parabench.case import Case
from parabench.models import model_config
from parabench.registry import expected
from parabench.suite import SuiteError, validate_case

N_STEPS = 5
TOL = 1e-5
PARAM_ATOL = 1e-5


def mk(model="tiny", micro_batch=4, grad_accum=1, precision="fp32", **options):
    return Case(
        model=model,
        strategy="deepspeed.pp",
        world_size=2,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        precision=precision,
        lr=1e-3,
        options={"optim": {"eps": 1e-6}, "pp": 2, **options},
    )


CASES = {
    "p2_m4": mk(microbatches=4),  # m = 2p
    "p2_m8_deep_ga2": mk(model="tiny-deep", micro_batch=4, grad_accum=2),  # default m = 2p = 4, x2 accumulation
    "p2_m4_bf16": mk(microbatches=4, precision="bf16"),
}
FP32 = ["p2_m4", "p2_m8_deep_ga2"]
# Built after the pipelines in the same processes: DeepSpeed keeps a process-wide model-parallel
# unit that the pipeline engine sets and must not leave behind for a later engine.
AFTER_PIPE = {
    "zero3_after_pipe": dataclasses.replace(
        mk(), strategy="deepspeed.zero3", options={"optim": {"eps": 1e-6}, "profile": "tuned"}
    )
}


@pytest.fixture(scope="module")
def group():
    """Step 0 under the comm meter (it also carries DeepSpeed's one-off tensor-meta message), then
    one more step after N_STEPS under the meter with state sampled; rank 0 adds the truth."""
    return run_cases(
        2,
        {**CASES, **AFTER_PIPE},
        N_STEPS,
        with_truth=True,
        meter_steps=(0, N_STEPS),
        extra_step=True,
        measure_state_from=N_STEPS,
    )


def _losses(res) -> list[float]:
    """The loss each step as the last stage reports it (earlier stages report None)."""
    out = []
    for i in range(N_STEPS):
        seen = [r["losses"][i] for r in res["per_rank"] if r["losses"][i] is not None]
        assert len(seen) == 1, seen
        out.append(seen[0])
    return out


@pytest.mark.parametrize("name", FP32)
def test_matches_single_process(group, name):
    res = group[name]
    truth = res["single"]
    assert [r["losses"][0] is None for r in res["per_rank"]] == [True, False]  # stage 0 / last stage
    assert_matches_single(res, truth, loss_rtol=TOL, rtol=TOL, atol=PARAM_ATOL, losses=_losses(res))


def test_an_engine_built_after_the_pipeline_in_the_same_process_trains(group):
    """ZeRO-3 after three pipeline engines on the same ranks: it builds (no pipeline grid left as
    DeepSpeed's model-parallel unit) and trains as one process does."""
    res = group["zero3_after_pipe"]
    assert_matches_single(res, res["single"], loss_rtol=1e-4, rtol=1e-4, atol=1e-4)


def test_bf16_runs_close_to_single_process_bf16(group):
    """DeepSpeed's bf16 (bf16 module, fp32 master in BF16_Optimizer) against single-process autocast:
    different recipes, the same model up to bf16 rounding."""
    res = group["p2_m4_bf16"]
    assert max_rel_diff(_losses(res), res["single"]["losses"]) < 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_measured_comm_and_state_equal_theory(group, name):
    case = CASES[name]
    exp = expected(case, model_config(case.model, case.seq_len), 1)
    res = group[name]
    for rank, r in enumerate(res["per_rank"]):
        got = payload_by_kind(r["comm"])
        assert got == exp["comm_payload_bytes_per_rank"][rank], (rank, got)  # exact bytes
        assert r["comm"]["scalar_ops"] == exp["comm_scalar_ops_per_rank"][rank], (rank, r["comm"]["scalar_ops"])
        assert r["state"] == exp["state_bytes"][rank], (rank, r["state"], exp["state_bytes"][rank])
        want_dtype = "torch.float32" if case.precision == "fp32" else "torch.bfloat16"
        assert {d for v in r["comm"]["by_kind"].values() for d in v["dtypes"]} == {want_dtype}
    n_micro = exp["pipeline"]["microbatches"]
    assert n_micro == case.options.get("microbatches", 4) * case.grad_accum
    assert res["per_rank"][0]["comm"]["by_kind"]["send"]["calls"] == n_micro
    assert exp["pipeline"]["bubble_fraction"] == pytest.approx(1 / (n_micro + 1))


@pytest.mark.parametrize("name", FP32)
def test_first_step_adds_one_tensor_meta_message(group, name):
    """Step 0 = a later step + DeepSpeed's 256 x int32 tensor-meta message, stage 0 -> stage 1."""
    for rank, r in enumerate(group[name]["per_rank"]):
        first, later = r["comm_by_step"][0]["by_kind"], r["comm"]["by_kind"]
        extra = {k: first[k]["payload_bytes"] - later.get(k, {}).get("payload_bytes", 0) for k in first}
        assert extra == {"send": 1024 if rank == 0 else 0, "recv": 1024 if rank == 1 else 0, "all_reduce": 0}


def test_validation_rejects_impossible_cases():
    validate_case(mk(microbatches=4))
    with pytest.raises(SuiteError, match="world_size must equal pp"):
        validate_case(dataclasses.replace(mk(), world_size=4))
    with pytest.raises(SuiteError, match="needs options.pp >= 2"):
        validate_case(dataclasses.replace(mk(), options={"pp": 1}))
    with pytest.raises(SuiteError, match="stages for a model of 2 layers"):
        validate_case(dataclasses.replace(mk(), world_size=4, options={"pp": 4}))
    with pytest.raises(SuiteError, match="micro-batches do not divide"):
        validate_case(mk(microbatches=3))
    with pytest.raises(SuiteError, match="does not support precision fp16"):
        validate_case(mk(precision="fp16"))
    with pytest.raises(SuiteError, match="tp must be 1"):
        validate_case(dataclasses.replace(mk(), world_size=4, options={"pp": 2, "tp": 2}))
