"""The reference data-parallel family (ref.ps, ref.ddp, ref.zero1/2/3, ref.fsdp, ref.hsdp) trains the
same model to the same losses and parameters as one process on the global batch, holds exactly the
model-state bytes parabench.theory says, and moves exactly the bytes it says. CPU, gloo, tiny model.

Cases of one world size share one spawned process group (spawning costs far more than training the
tiny model); the single-process truth is computed in this process.

Adam's epsilon is 1e-6 here (default 1e-8), as in test_reference_mp.py: an element whose true
gradient is ~1e-8 (a cancellation) turns fp32 rounding differences between *any* two summation
orders into parameter differences of up to ~lr after Adam's normalisation. With eps 1e-8 and
grad_accum 2, torch.ddp itself misses params_close on the same 3 elements (of 137k) as every
reference strategy here, bit for bit; eps 1e-6 takes that amplifier out without hiding real errors
(the broken variants below are still caught).

Small buckets (bucket_mb 0.05: about ten per step) make the bucketing, the in-order launch and the
per-bucket sharding do real work on the tiny model.
"""

from __future__ import annotations

import pytest
import torch
from harness import (
    assert_matches_single,
    max_rel_diff,
    mismatch,
    payload_by_kind,
    replica_mean_losses,
    run_cases,
    single_truth,
)

from parabench.case import Case
from parabench.models import model_config, parameter_count
from parabench.registry import expected

N_STEPS = 5
OPTIM = {"eps": 1e-6}
TOL = 1e-5
FAMILY = ("ref.ps", "ref.ddp", "ref.zero1", "ref.zero2", "ref.zero3", "ref.fsdp")


def mk(strategy, world, precision="fp32", grad_accum=1, broken=None, **options):
    name = f"{strategy}-w{world}-{precision}-ga{grad_accum}" + (f"-{broken}" if broken else "")
    opts = {"optim": OPTIM, "bucket_mb": 0.05, **options}
    if broken:
        opts["broken"] = broken
    return name, Case(
        model="tiny",
        strategy=strategy,
        world_size=world,
        precision=precision,
        micro_batch=2,
        grad_accum=grad_accum,
        lr=1e-3,
        device="cpu",
        options=opts,
    )


CASES_2 = dict(
    [mk(s, 2, grad_accum=ga) for s in FAMILY for ga in (1, 2)]
    + [mk(s, 2, precision="bf16") for s in FAMILY]
    + [mk("ref.ddp", 2, broken="skip_bucket"), mk("ref.zero2", 2, broken="no_average")]
)
CASES_4 = dict(
    [mk(s, 4) for s in FAMILY + ("ref.hsdp",)]
    + [mk("ref.hsdp", 4, grad_accum=2), mk("ref.hsdp", 4, precision="bf16"), mk("ref.zero2", 4, grad_accum=2)]
)

# Three ranks: the tiny model's parameter counts are multiples of 64, so only an odd world size makes
# the per-bucket (ZeRO) and per-unit (FSDP) padding non-empty.
CASES_3 = dict([mk("ref.zero2", 3), mk("ref.fsdp", 3)])


class _SumNotMean:
    """A 'loss scaler' of scale N that never unscales: gradients are summed over ranks, not averaged."""

    def __init__(self, n):
        self.scale = float(n)

    def unscale_and_check(self, grads, group):
        return True

    def update(self, applied):
        pass


def _break(trainer, kind):
    if kind == "skip_bucket":  # DDP that never all-reduces its first bucket
        launch = trainer._launch
        trainer._launch = lambda b: None if b.index == 0 else launch(b)
    elif kind == "no_average":  # ZeRO-2 whose reduce-scatter sums instead of averaging
        trainer.grad_scaler = _SumNotMean(trainer.world)
    else:
        raise ValueError(kind)


def _instrument(trainer, case, spec) -> dict:
    """Break the trainer when the case asks for it, and note for every bucket collective whether it
    was launched while backward was running."""
    if "broken" in case.options:
        _break(trainer, case.options["broken"])
    in_backward = []
    if hasattr(trainer, "_launch"):
        launch = trainer._launch
        trainer._launch = lambda b: (in_backward.append(torch._C._current_graph_task_id() != -1), launch(b))
    return {"in_backward": in_backward}


def _group(cases: dict, world: int) -> dict:
    """Every rank trains each case for N_STEPS, the last one metered and with state sampled."""
    return run_cases(
        world, cases, N_STEPS, meter_steps=(N_STEPS - 1,), measure_state_from=N_STEPS - 1, on_build=_instrument
    )


@pytest.fixture(scope="module")
def group2():
    return _group(CASES_2, 2)


@pytest.fixture(scope="module")
def group4():
    return _group(CASES_4, 4)


@pytest.fixture(scope="module")
def group3():
    return _group(CASES_3, 3)


def _mismatch(res, case) -> tuple[float, list[str]]:
    return mismatch(replica_mean_losses(res), res["params"], single_truth(case, N_STEPS), rtol=TOL, atol=1e-6)


def _check(groups, cases, name):
    res, case = groups[name], cases[name]
    truth = single_truth(case, N_STEPS)
    if case.precision == "fp32":
        assert_matches_single(res, truth, loss_rtol=TOL, rtol=TOL, atol=1e-6)
    else:  # bf16 compute vs bf16 autocast truth: close, not equal
        assert max_rel_diff(replica_mean_losses(res), truth["losses"]) < 2e-2

    # Model-state bytes per rank, as parabench.theory lays them out (the ps server is rank 0).
    exp = expected(case, model_config(case.model), case.world_size)
    psi = sum(p.numel() for p in res["params"].values())
    for rank, r in enumerate(res["per_rank"]):
        want = exp["state_bytes"][rank] if isinstance(exp["state_bytes"], list) else exp["state_bytes"]
        assert r["state"] == want, (rank, r["state"], want)
        if case.strategy == "ref.ps" and rank > 0:  # a worker: no optimizer, one gradient buffer
            b = 4 if case.precision == "fp32" else 2
            assert want == {"params": b * psi, "grads": b * psi, "optimizer": 0}

    # Communication payload per step by kind, within 1% of the theory (scalar ops excluded).
    for rank, r in enumerate(res["per_rank"]):
        per_rank_exp = exp.get("comm_payload_bytes_per_rank")
        want = dict(per_rank_exp[rank] if per_rank_exp else exp["comm_payload_bytes"])
        comm = payload_by_kind(r["comm"])
        assert comm.keys() == want.keys(), (rank, comm, want)
        for kind, v in want.items():
            assert abs(comm[kind] - v) <= 0.01 * v, (rank, kind, comm[kind], v)
        wire = "torch.float32" if case.precision == "fp32" else "torch.bfloat16"
        dtypes = {d for v in r["comm"]["by_kind"].values() for d in v["dtypes"]}
        assert wire in dtypes, dtypes


@pytest.mark.parametrize("name", [n for n in CASES_2 if "broken" not in CASES_2[n].options])
def test_world2(group2, name):
    _check(group2, CASES_2, name)


@pytest.mark.parametrize("name", list(CASES_4))
def test_world4(group4, name):
    _check(group4, CASES_4, name)


@pytest.mark.parametrize("name", list(CASES_3))
def test_world3_with_padding(group3, name):
    case = CASES_3[name]
    exp = expected(case, model_config(case.model), 3)
    psi = sum(p.numel() for p in group3[name]["params"].values())
    padded = 3 * exp["state_bytes"]["grads"] // 4  # the fp32 main-gradient shard is Ψp / N elements
    assert padded > psi  # the padding is real, and the exact byte checks below include it
    _check(group3, CASES_3, name)


@pytest.mark.parametrize("strategy", ["ref.ddp", "ref.zero1", "ref.zero2"])
def test_bucket_collectives_overlap_backward(group2, strategy):
    """Every bucket's all-reduce / reduce-scatter is launched from a gradient hook, inside backward."""
    flags = group2[f"{strategy}-w2-fp32-ga2"]["per_rank"][0]["in_backward"]
    assert len(flags) > 1 and all(flags)


@pytest.mark.parametrize("name", [n for n in CASES_2 if "broken" in CASES_2[n].options])
def test_broken_variant_is_caught(group2, name):
    loss_diff, bad = _mismatch(group2[name], CASES_2[name])
    # The equivalence check of _check fails. A missing average shows in the parameters more than in
    # the loss: Adam is invariant to a constant gradient scale except through eps.
    assert loss_diff >= TOL or len(bad) > 0, (loss_diff, bad)
    assert len(bad) > 0


def test_theory_next_to_paper():
    """fp32 ZeRO-3 holds the paper's 16Ψ/N; bf16 ZeRO-2 holds 2Ψ + 16Ψ/N (the paper's 2Ψ + 14Ψ/N plus the
    fp32 gradient shard); the only other difference is padding (a few elements per unit or bucket)."""
    cfg = model_config("gpt-125m")
    psi = parameter_count(cfg)["total"]
    z3 = expected(Case(model="gpt-125m", strategy="ref.zero3", world_size=8), cfg, 8)
    assert sum(z3["state_bytes"].values()) == pytest.approx(z3["paper_state_bytes"], rel=1e-6)
    z2 = expected(Case(model="gpt-125m", strategy="ref.zero2", world_size=8, precision="bf16"), cfg, 8)
    assert sum(z2["state_bytes"].values()) == pytest.approx(2 * psi + 16 * psi / 8, rel=1e-6)
    assert z2["paper_state_bytes"] == 2 * psi + 14 * psi / 8
