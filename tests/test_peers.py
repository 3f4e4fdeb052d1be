"""The peers (PyTorch DDP/FSDP2, DeepSpeed ZeRO-0..3) train the same model to the same losses as
one process on the same global batch: fp32, 2 gloo ranks, 1e-4 relative at every step."""

import os

import pytest
from harness import payload_by_kind, run_cases
from helpers import max_rel_diff, params_close, single_reference, train

from parabench.case import Case
from parabench.models import model_config, parameter_count
from parabench.theory import expected

os.environ.setdefault("DS_ACCELERATOR", "cpu")
PEERS = ["torch.ddp", "torch.fsdp2", "deepspeed.zero0", "deepspeed.zero1", "deepspeed.zero2", "deepspeed.zero3"]


@pytest.fixture(scope="module")
def reference():
    return single_reference(Case(model="tiny", strategy="torch.ddp", world_size=2, micro_batch=2, lr=1e-3), n_steps=5)


@pytest.mark.parametrize("strategy", PEERS)
def test_peer_matches_single_process(strategy, reference):
    run = train(Case(model="tiny", strategy=strategy, world_size=2, micro_batch=2, lr=1e-3), n_steps=5)
    assert max_rel_diff(run["losses"], reference["losses"]) < 1e-4
    assert reference["losses"][-1] < reference["losses"][0]  # the data is learnable
    assert params_close(run["params"], reference["params"], rtol=1e-4, atol=1e-5) == []


def test_grad_accumulation_matches_single_process():
    case = Case(model="tiny", strategy="torch.ddp", world_size=2, micro_batch=1, grad_accum=2, lr=1e-3)
    ref = single_reference(case, n_steps=4)
    for strategy in ("torch.ddp", "deepspeed.zero2"):
        run = train(Case(**{**case.to_dict(), "strategy": strategy}), n_steps=4)
        assert max_rel_diff(run["losses"], ref["losses"]) < 1e-4, strategy


def test_wrong_learning_rate_is_caught(reference):
    """The equivalence check has teeth: a peer trained differently does not pass it."""
    run = train(Case(model="tiny", strategy="torch.ddp", world_size=2, micro_batch=2, lr=1.1e-3), n_steps=5)
    assert max_rel_diff(run["losses"], reference["losses"]) > 1e-4


def _ds_bucket(trainer, case, spec):
    return {"reduce_bucket_size": getattr(trainer.engine.optimizer, "reduce_bucket_size", None)}


def _ds_plan(name, case):
    return {"meter_steps": (1,), "want_params": False, "on_build": _ds_bucket}


def test_deepspeed_comm_with_grad_accumulation_equals_theory():
    """At grad_accum 2, stages 0 and 1 reduce once per step (at the accumulation boundary) and
    stage 2 reduces every micro-batch's gradients: the metered step moves what the theory says,
    also with ``bucket_mb`` splitting the gradients into several buckets, whose size DeepSpeed
    receives in elements (0.25 MiB of fp32: 65536, so tiny's 136,832 elements span three)."""
    base = dict(model="tiny", world_size=2, micro_batch=1, grad_accum=2, lr=1e-3)
    cases = {f"zero{stage}": Case(strategy=f"deepspeed.zero{stage}", **base) for stage in (0, 1, 2)}
    cases["zero2_buckets"] = Case(strategy="deepspeed.zero2", options={"bucket_mb": 0.25}, **base)
    res = run_cases(2, cases, 2, plan=_ds_plan)
    cfg = model_config("tiny")
    psi_bytes = 4 * parameter_count(cfg)["total"]
    for name, case in cases.items():
        want = expected(case, cfg, 2)["comm_payload_bytes"]
        assert want["all_reduce"] == psi_bytes * (1 if name in ("zero0", "zero1") else 2)
        for r in res[name]["per_rank"]:
            assert payload_by_kind(r["comm"]) == want, name
    buckets = res["zero2_buckets"]["per_rank"][0]
    assert buckets["reduce_bucket_size"] == 0.25 * 2**20 / 4
    assert (
        buckets["comm"]["by_kind"]["all_reduce"]["calls"]
        > res["zero2"]["per_rank"][0]["comm"]["by_kind"]["all_reduce"]["calls"]
    )
