"""The peers (PyTorch DDP/FSDP2, DeepSpeed ZeRO-0..3) train the same model to the same losses as
one process on the same global batch: fp32, 2 gloo ranks, 1e-4 relative at every step."""

import os

import pytest
from harness import max_rel_diff, params_close, payload_by_kind, replica_mean_losses, run_cases, single_truth

from parabench.case import Case
from parabench.models import model_config, parameter_count
from parabench.registry import expected

os.environ.setdefault("DS_ACCELERATOR", "cpu")
PEERS = ["torch.ddp", "torch.fsdp2", "deepspeed.zero0", "deepspeed.zero1", "deepspeed.zero2", "deepspeed.zero3"]
N_STEPS = 5
BASE = dict(model="tiny", world_size=2, micro_batch=2, lr=1e-3)
ACCUM = dict(model="tiny", world_size=2, micro_batch=1, grad_accum=2, lr=1e-3)

CASES = {s: Case(strategy=s, **BASE) for s in PEERS}
CASES["wrong-lr"] = Case(strategy="torch.ddp", **{**BASE, "lr": 1.1e-3})
for _s in ("torch.ddp", "deepspeed.zero2"):
    CASES[f"{_s}-ga2"] = Case(strategy=_s, **ACCUM)
# DeepSpeed's communication at grad_accum 2 (test_deepspeed_comm_with_grad_accumulation_equals_theory)
DS_COMM = {f"zero{stage}": Case(strategy=f"deepspeed.zero{stage}", **ACCUM) for stage in (0, 1, 2)}
DS_COMM["zero2_buckets"] = Case(strategy="deepspeed.zero2", options={"bucket_mb": 0.25}, **ACCUM)
CASES.update({f"comm-{n}": c for n, c in DS_COMM.items()})


def _ds_bucket(trainer, case, spec):
    return {"reduce_bucket_size": getattr(trainer.engine.optimizer, "reduce_bucket_size", None)}


def _plan(name, case):
    if name.startswith("comm-"):
        return {"meter_steps": (1,), "want_params": False, "on_build": _ds_bucket}
    return {}


@pytest.fixture(scope="module")
def group():
    """Every case on one spawned 2-rank group (DeepSpeed imported once per rank, not per case)."""
    return run_cases(2, CASES, N_STEPS, plan=_plan)


@pytest.fixture(scope="module")
def reference():
    return single_truth(CASES["torch.ddp"], N_STEPS)


@pytest.mark.parametrize("strategy", PEERS)
def test_peer_matches_single_process(group, strategy, reference):
    run = group[strategy]
    assert max_rel_diff(replica_mean_losses(run), reference["losses"]) < 1e-4
    assert reference["losses"][-1] < reference["losses"][0]  # the data is learnable
    assert params_close(run["params"], reference["params"], rtol=1e-4, atol=1e-5) == []


def test_grad_accumulation_matches_single_process(group):
    ref = single_truth(CASES["torch.ddp-ga2"], N_STEPS)
    for strategy in ("torch.ddp", "deepspeed.zero2"):
        assert max_rel_diff(replica_mean_losses(group[f"{strategy}-ga2"]), ref["losses"]) < 1e-4, strategy


def test_wrong_learning_rate_is_caught(group, reference):
    """The equivalence check has teeth: a peer trained differently does not pass it."""
    assert max_rel_diff(replica_mean_losses(group["wrong-lr"]), reference["losses"]) > 1e-4


def test_deepspeed_comm_with_grad_accumulation_equals_theory(group):
    """At grad_accum 2, stages 0 and 1 reduce once per step (at the accumulation boundary) and
    stage 2 reduces every micro-batch's gradients: the metered step moves what the theory says,
    also with ``bucket_mb`` splitting the gradients into several buckets, whose size DeepSpeed
    receives in elements (0.25 MiB of fp32: 65536, so tiny's 136,832 elements span three)."""
    res = {name: group[f"comm-{name}"] for name in DS_COMM}
    cfg = model_config("tiny")
    psi_bytes = 4 * parameter_count(cfg)["total"]
    for name, case in DS_COMM.items():
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
