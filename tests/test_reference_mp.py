"""Model parallelism (reference TP / SP / pipelines and their compositions with DP, and the torch
peers) trains the same model to the same losses and parameters as one process, executes the
textbook schedules, and moves exactly the bytes the theory says. CPU, gloo, fp32, tiny shapes.

Cases of one world size share one spawned process group (``harness.run_cases``: spawning costs far
more than training these models); the single-process ground truth is computed on rank 0 of that
group, in-process, and checked once against ``helpers.single_reference``.

Tolerances: losses 1e-5 relative at every step; parameters rtol 1e-5 with atol 1e-5, i.e. 1% of
one Adam step at lr 1e-3. Adam normalises every update to about ``lr``, so fp32 rounding
differences between *any* two summation orders (micro-batching alone shows it) come out as
parameter differences of up to ~1e-6 where a gradient element is tiny. Adam's epsilon is 1e-6 here
(default 1e-8): at step one Adam moves each element by ``lr * g / (|g| + eps)``, and with 1e-8 an
element whose true gradient is ~1e-8 (a cancellation: one head weight in these runs) moves by
~lr/2 with a rounding-sized change of sign. Neither setting hides real errors: a broken operator
is still caught, see ``test_broken_operator_is_caught``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from harness import assert_matches_single, max_rel_diff, params_close, payload_by_kind, replica_mean_losses, run_cases
from helpers import single_reference

from parabench.case import Case
from parabench.models import model_config
from parabench.registry import expected
from parabench.suite import SuiteError, validate_case

N_STEPS = 5
OPTIM = {"eps": 1e-6}
TOL = 1e-5
PARAM_ATOL = 1e-5


def mk(name, strategy, world, model="tiny", micro_batch=4, grad_accum=1, seq_len=None, **options):
    return name, Case(
        model=model,
        strategy=strategy,
        world_size=world,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        seq_len=seq_len,
        lr=1e-3,
        options={"optim": OPTIM, **options},
    )


CASES_2 = dict(
    [
        mk("tp2", "ref.tp", 2, tp=2),
        mk("tp_sp2", "ref.tp_sp", 2, tp=2),
        mk("tp2_ga2", "ref.tp", 2, micro_batch=2, grad_accum=2, tp=2),
        mk("gpipe_p2_m4", "ref.pp_gpipe", 2, pp=2),
        mk("1f1b_p2_m4", "ref.pp_1f1b", 2, pp=2),
        mk("gpipe_p2_m8", "ref.pp_gpipe", 2, micro_batch=8, pp=2, microbatches=8),
        mk("1f1b_p2_m8", "ref.pp_1f1b", 2, micro_batch=8, pp=2, microbatches=8),
        mk("broken_f", "ref.tp", 2, tp=2, break_operator="f"),
        mk("torch.tp2", "torch.tp", 2, tp=2),
        mk("torch.tp_sp2", "torch.tp_sp", 2, tp=2),
        mk("torch.tp_sp2_ga2", "torch.tp_sp", 2, micro_batch=2, grad_accum=2, tp=2),
        mk("torch.gpipe2", "torch.pp_gpipe", 2, pp=2),
        mk("torch.1f1b2", "torch.pp_1f1b", 2, pp=2),
        mk("torch.interleaved2", "torch.pp_interleaved", 2, model="small", seq_len=32, pp=2),
        mk("tp_sp2_bf16", "ref.tp_sp", 2, tp=2),
        mk("1f1b_p2_bf16", "ref.pp_1f1b", 2, pp=2),
    ]
)
for _name in ("tp_sp2_bf16", "1f1b_p2_bf16"):
    CASES_2[_name] = dataclasses.replace(CASES_2[_name], precision="bf16")
CASES_4 = dict(
    [
        mk("tp4", "ref.tp", 4, model="small", seq_len=32, tp=4),
        mk("gpipe_p4_m4", "ref.pp_gpipe", 4, model="small", seq_len=32, pp=4, microbatches=4),
        mk("1f1b_p4_m4", "ref.pp_1f1b", 4, model="small", seq_len=32, pp=4, microbatches=4),
        mk("gpipe_p4_m8", "ref.pp_gpipe", 4, model="small", seq_len=32, micro_batch=8, pp=4),
        mk("1f1b_p4_m8", "ref.pp_1f1b", 4, model="small", seq_len=32, micro_batch=8, pp=4),
        mk("tp2xdp2", "ref.tp", 4, micro_batch=2, tp=2),
        mk("pp2xdp2", "ref.pp_1f1b", 4, pp=2),
        mk("sp2xpp2", "ref.pp_1f1b", 4, pp=2, tp=2, sp=True),
        mk("torch.tp2xdp2", "torch.tp", 4, micro_batch=2, tp=2),
        mk("torch.tp_sp2xdp2", "torch.tp_sp", 4, micro_batch=2, tp=2),
        mk("torch.1f1b_pp2xdp2", "torch.pp_1f1b", 4, pp=2),
        mk("torch.zb_pp2xdp2", "torch.pp_zb", 4, pp=2),
    ]
)
CASES_8 = dict(
    [
        mk("tp2xpp2xdp2", "ref.pp_1f1b", 8, pp=2, tp=2),
    ]
)
# Cases whose measured bytes are compared with parabench.theory.
METERED = {
    "tp2",
    "tp_sp2",
    "tp2_ga2",
    "gpipe_p2_m4",
    "1f1b_p2_m8",
    "tp4",
    "gpipe_p4_m4",
    "1f1b_p4_m8",
    "tp2xdp2",
    "pp2xdp2",
    "sp2xpp2",
    "tp2xpp2xdp2",
    "torch.interleaved2",
    "torch.tp2",
    "torch.tp_sp2",
    "torch.tp_sp2_ga2",
    "torch.tp2xdp2",
    "torch.tp_sp2xdp2",
    "torch.gpipe2",
    "torch.1f1b2",
    "torch.1f1b_pp2xdp2",
    "torch.zb_pp2xdp2",
}


@contextlib.contextmanager
def _broken_f():
    """Megatron's f operator without its backward all-reduce, for the duration of one case."""
    import reference_impls.tensor_parallel as tpm

    saved = tpm._CopyToTP.backward
    tpm._CopyToTP.backward = staticmethod(lambda ctx, grad: (grad, None))
    try:
        yield
    finally:
        tpm._CopyToTP.backward = staticmethod(saved)


def _stats(trainer, case, record):
    record["stats"] = trainer.pipeline_stats() if hasattr(trainer, "pipeline_stats") else None
    record["strategy_stats"] = trainer.strategy_stats() if hasattr(trainer, "strategy_stats") else None


def _plan(name: str, case: Case) -> dict:
    """Every case: N_STEPS steps, parameters gathered, schedule stats; METERED cases one more step
    under the comm meter with state sampled; broken_f under its broken operator."""
    plan = {"on_end": _stats}
    if name in METERED:
        plan.update(extra_step=True, meter_steps=(N_STEPS,), measure_state_from=N_STEPS)
    if case.options.get("break_operator") == "f":
        plan["patch"] = _broken_f
    return plan


def _launch(cases: dict, world: int) -> dict:
    return run_cases(world, cases, N_STEPS, plan=_plan, with_truth=True)


@pytest.fixture(scope="module")
def group2():
    return _launch(CASES_2, 2)


@pytest.fixture(scope="module")
def group4():
    return _launch(CASES_4, 4)


@pytest.fixture(scope="module")
def group8():
    return _launch(CASES_8, 8)


def _assert_matches_single(res):
    assert_matches_single(res, res["single"], loss_rtol=TOL, rtol=TOL, atol=PARAM_ATOL)


@pytest.mark.parametrize("name", [n for n in CASES_2 if n != "broken_f" and "bf16" not in n])
def test_world2_matches_single_process(group2, name):
    _assert_matches_single(group2[name])


@pytest.mark.parametrize("name", ["tp_sp2_bf16", "1f1b_p2_bf16"])
def test_bf16_runs_close_to_single_process_bf16(group2, name):
    """bf16 autocast: same recipe as the single-process bf16 run, up to bf16 rounding."""
    res = group2[name]
    assert max_rel_diff(replica_mean_losses(res), res["single"]["losses"]) < 1e-3


@pytest.mark.parametrize("name", list(CASES_4))
def test_world4_matches_single_process(group4, name):
    _assert_matches_single(group4[name])


def test_tp_pp_dp_world8_matches_single_process(group8):
    _assert_matches_single(group8["tp2xpp2xdp2"])


def test_broken_operator_is_caught(group2):
    res = group2["broken_f"]
    truth = res["single"]
    bad_loss = max_rel_diff(replica_mean_losses(res), truth["losses"]) >= TOL
    bad_params = params_close(res["params"], truth["params"], rtol=TOL, atol=PARAM_ATOL) != []
    assert bad_loss and bad_params


def test_inprocess_truth_is_helpers_single_reference(group2):
    ref = single_reference(CASES_2["tp2"], n_steps=N_STEPS)
    assert max_rel_diff(group2["tp2"]["single"]["losses"], ref["losses"]) == 0
    assert params_close(group2["tp2"]["single"]["params"], ref["params"], rtol=0, atol=0) == []


# --- schedules ---------------------------------------------------------------------------------


def textbook_order(schedule: str, stage: int, p: int, m: int) -> list[str]:
    """Written from the papers, independently of reference_impls.pipeline."""
    if schedule == "gpipe":  # Huang et al. 2019 Fig. 2c: all forwards, then all backwards
        return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
    # Narayanan et al. 2021 Fig. 4 (PipeDream-Flush): fill the pipe to depth p - stage, then
    # strictly alternate, taking the oldest micro-batch's backward; drain at the end.
    order, next_f, next_b = [], 0, 0
    while next_f < m and next_f < p - stage:
        order.append(f"F{next_f}")
        next_f += 1
    while next_b < m:
        order.append(f"B{next_b}")
        next_b += 1
        if next_f < m:
            order.append(f"F{next_f}")
            next_f += 1
    return order


def test_textbook_1f1b_by_hand():
    assert textbook_order("1f1b", 0, 2, 4) == "F0 F1 B0 F2 B1 F3 B2 B3".split()
    assert textbook_order("1f1b", 1, 2, 4) == "F0 B0 F1 B1 F2 B2 F3 B3".split()
    assert textbook_order("1f1b", 0, 4, 4) == "F0 F1 F2 F3 B0 B1 B2 B3".split()
    assert textbook_order("1f1b", 1, 4, 4) == "F0 F1 F2 B0 F3 B1 B2 B3".split()


@pytest.mark.parametrize(
    "name",
    [
        "gpipe_p2_m4",
        "1f1b_p2_m4",
        "gpipe_p2_m8",
        "1f1b_p2_m8",
        "gpipe_p4_m4",
        "1f1b_p4_m4",
        "gpipe_p4_m8",
        "1f1b_p4_m8",
    ],
)
def test_schedule_executes_textbook_order(group2, group4, name):
    res = (group2 if name in group2 else group4)[name]
    sched, p, m = name.split("_")[0], int(name.split("_")[1][1:]), int(name.split("_")[2][1:])
    for r in res["per_rank"]:
        st = r["stats"]
        stage = r["coords"][1]
        assert (st["stages"], st["microbatches"], st["stage"]) == (p, m, stage)
        assert st["order"] == textbook_order(sched, stage, p, m), (stage, st["order"])
        assert st["peak_live_microbatches"] == (m if sched == "gpipe" else min(p - stage, m))
        assert st["peak_live_microbatches"] == st["peak_live_microbatches_theory"]
        assert st["bubble_fraction_theory"] == pytest.approx((p - 1) / (m + p - 1))
        assert 0 <= st["bubble_fraction_measured"] < 1
        assert st["compute_s"] > 0 and st["wait_s"] >= 0


# --- communication vs theory -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(METERED))
def test_measured_comm_and_state_equal_theory(group2, group4, group8, name):
    cases = {**CASES_2, **CASES_4, **CASES_8}
    res = {**group2, **group4, **group8}[name]
    case = cases[name]
    cfg = model_config(case.model, case.seq_len)
    exp = expected(case, cfg, case.world_size // (case.options.get("tp", 1) * case.options.get("pp", 1)))
    p = case.options.get("pp", 1)
    for rank, r in enumerate(res["per_rank"]):
        want = exp["comm_payload_bytes_per_rank"][rank]
        got = payload_by_kind(r["comm"])
        assert set(got) == set(want), (rank, got, want)
        for kind in want:
            assert got[kind] == pytest.approx(want[kind], rel=0.01), (rank, kind, got, want)
        assert r["state"] == exp["state_bytes"][rank], (rank, r["state"], exp["state_bytes"][rank])
    assert exp["comm_payload_bytes"] == exp["comm_payload_bytes_per_rank"][0]
    if p > 1 and case.strategy != "torch.pp_zb":  # interleaving v chunks per rank divides the bubble by v
        v = case.options.get("virtual_stages", 2) if case.strategy == "torch.pp_interleaved" else 1
        m = case.options.get("microbatches", 2 * p)
        assert exp["pipeline"]["bubble_fraction"] == pytest.approx((p - 1) / (v * m + p - 1))


# --- validation ------------------------------------------------------------------------------


def test_validate_rejects_microbatches_not_dividing_micro_batch():
    with pytest.raises(SuiteError, match="micro-batches do not divide"):
        validate_case(Case(model="tiny", strategy="ref.pp_1f1b", world_size=2, micro_batch=2, options={"pp": 2}))
    with pytest.raises(SuiteError, match="micro-batches do not divide"):
        validate_case(
            Case(
                model="tiny", strategy="ref.pp_gpipe", world_size=2, micro_batch=6, options={"pp": 2, "microbatches": 4}
            )
        )
    validate_case(
        Case(model="tiny", strategy="ref.pp_gpipe", world_size=2, micro_batch=8, options={"pp": 2, "microbatches": 4})
    )
    with pytest.raises(SuiteError, match="sequence parallel"):
        validate_case(Case(model="tiny", strategy="ref.tp_sp", world_size=4, seq_len=30, options={"tp": 4}))


def test_torch_tp_sp_all_reduces_as_often_as_reference(group2):
    """torch.tp_sp sums its LayerNorms' Partial gradients in one all-reduce per step, as ref.tp_sp
    does with its flat buffer, not one collective (and DTensor redistribute) per tensor."""
    for rank in range(2):
        calls = [
            group2[n]["per_rank"][rank]["comm"]["by_kind"]["all_reduce"]["calls"] for n in ("tp_sp2", "torch.tp_sp2")
        ]
        assert calls[1] == calls[0], (rank, calls)


def test_torch_tp_averages_over_dp_in_buckets(group4):
    """tp 2 x dp 2: torch.tp averages its gradients over dp in DDP-style buckets (the tiny model's
    fit in one), so it all-reduces as often as ref.tp, whose dp average is one flat buffer, and as
    often as ``torch_tp_ops`` lists (the byte check above cannot tell one bucket from one
    all-reduce per parameter, which would add dozens)."""
    from parabench.families.model_parallel import torch_tp_ops
    from parabench.meters.comm import SCALAR_BYTES

    for name, ref_name, sp in (("torch.tp2xdp2", "tp2xdp2", False), ("torch.tp_sp2xdp2", None, True)):
        case = CASES_4[name]
        cfg = model_config(case.model, case.seq_len)
        for rank in range(4):
            peer = group4[name]["per_rank"][rank]
            ops = torch_tp_ops(cfg, case, (rank // 2, 0, rank % 2), sp)
            want = sum(1 for kind, n in ops if kind == "all_reduce" and n > SCALAR_BYTES)
            got = peer["comm"]["by_kind"]["all_reduce"]["calls"]
            assert got == want, (name, rank, got, want)
            assert peer["strategy_stats"]["dp_buckets"] == 1, peer["strategy_stats"]
            if ref_name:
                ref = group4[ref_name]["per_rank"][rank]["comm"]["by_kind"]["all_reduce"]["calls"]
                assert got == ref, (name, rank, got, ref)


@pytest.mark.parametrize(
    "name,sync", [("torch.1f1b_pp2xdp2", "ddp"), ("torch.zb_pp2xdp2", "bucketed_all_reduce_after_schedule")]
)
def test_torch_pipeline_averages_over_dp_in_buckets(group4, name, sync):
    """pp 2 x dp 2, in DDP's buckets (the tiny model's stage fits in one), as ``torch_pipeline_ops``
    lists, not one all-reduce per parameter (the byte check cannot tell the two apart):
    torch.pp_1f1b's stages are DDP modules that the pipelining runtime reduces in the last
    micro-batch's backward; torch.pp_zb's split backward writes weight gradients where DDP's hooks
    never fire, so it averages after the schedule (``common.average_over_dp``)."""
    from parabench.families.model_parallel import torch_pipeline_ops
    from parabench.meters.comm import SCALAR_BYTES

    case = CASES_4[name]
    cfg = model_config(case.model, case.seq_len)
    for rank, r in enumerate(group4[name]["per_rank"]):
        assert r["strategy_stats"] == {"dp_grad_sync": sync}, r["strategy_stats"]
        ops = torch_pipeline_ops(cfg, case, rank % 2, 2)
        want = sum(1 for kind, n in ops if kind == "all_reduce" and n > SCALAR_BYTES)
        assert r["comm"]["by_kind"]["all_reduce"]["calls"] == want == 1, (rank, r["comm"]["by_kind"])


def test_dp_buckets_close_at_the_cap():
    """DDP's rule: a bucket closes once it holds at least the cap, so a tensor larger than the cap
    is a bucket of its own and the rest stays in order."""
    from parabench.families.model_parallel import dp_bucket_payloads

    assert dp_bucket_payloads([3, 3, 10, 1], 1, cap=5) == [6, 10, 1]
    assert dp_bucket_payloads([5, 5], 1, cap=5) == [5, 5]
    assert dp_bucket_payloads([], 4) == []
