"""Interleaved 1F1B (``ref.pp_interleaved``, Narayanan et al. 2021 Sec. 2.2.2) trains the same model
to the same losses and parameters as one process, runs Megatron's order, reaches the bubble
``(p - 1) / (v m + p - 1)`` in a zero-latency simulation, and moves exactly the bytes the theory
says. CPU, gloo, fp32, ``tiny-deep`` (8 layers: up to 8 one-layer chunks on 2 ranks).

The schedule checks run in-process on the order alone; the training cases share one spawned
group of 2 ranks (``harness.run_cases``). Tolerances as ``test_reference_mp.py``.
"""

from __future__ import annotations

import pytest
from harness import assert_matches_single, payload_by_kind, run_cases

from parabench import pipeline_sim
from parabench.case import Case
from parabench.models import model_config
from parabench.pipeline_sim import Op
from parabench.registry import expected
from parabench.suite import SuiteError, validate_case
from reference_impls.pipeline_interleaved import interleaved_order, peak_live_theory

N_STEPS = 3
TOL = 1e-5
PARAM_ATOL = 1e-5


def mk(strategy, micro_batch=4, **options):
    return Case(
        model="tiny-deep",
        strategy=strategy,
        world_size=2,
        micro_batch=micro_batch,
        lr=1e-3,
        options={"optim": {"eps": 1e-6}, "pp": 2, **options},
    )


CASES = {
    "p2_v2_m4": mk("ref.pp_interleaved", microbatches=4, virtual_stages=2),
    "p2_v4_m4": mk("ref.pp_interleaved", microbatches=4, virtual_stages=4),
    "p2_v2_m2": mk("ref.pp_interleaved", microbatches=2, virtual_stages=2),  # m == p: all forwards first
    "torch_p2_v2_m4": mk("torch.pp_interleaved", microbatches=4, virtual_stages=2),
}
REFERENCE = [n for n in CASES if not n.startswith("torch")]


def _stats(trainer, case, record):
    record["stats"] = trainer.pipeline_stats() if hasattr(trainer, "pipeline_stats") else None


def _plan(name: str, case: Case) -> dict:
    return {"on_end": _stats, "extra_step": True, "meter_steps": (N_STEPS,), "measure_state_from": N_STEPS}


@pytest.fixture(scope="module")
def group2():
    return run_cases(2, CASES, N_STEPS, plan=_plan, with_truth=True)


# --- the schedule, on paper ------------------------------------------------------------------------


def _as_text(order, stage, p):
    return [f"{kind}{i}c{stage + k * p}" for kind, k, i in order]


def test_megatron_order_by_hand():
    """p=2, v=2, m=4 (chunks 0, 2 on rank 0 and 1, 3 on rank 1), from Megatron-LM's rules: rank r
    warms up with 2(p-r-1) + (v-1)p forwards; units go chunk by chunk in groups of p micro-batches;
    backwards take the chunks in reverse."""
    assert _as_text(interleaved_order(0, 2, 2, 4), 0, 2) == (
        "F0c0 F1c0 F0c2 F1c2 F2c0 B0c2 F3c0 B1c2 F2c2 B0c0 F3c2 B1c0 B2c2 B3c2 B2c0 B3c0".split()
    )
    assert _as_text(interleaved_order(1, 2, 2, 4), 1, 2) == (
        "F0c1 F1c1 F0c3 B0c3 F1c3 B1c3 F2c1 B0c1 F3c1 B1c1 F2c3 B2c3 F3c3 B3c3 B2c1 B3c1".split()
    )


@pytest.mark.parametrize(
    "p, v, m, forwards_first",
    [(2, 2, 4, [5, 3]), (4, 2, 8, [11, 9, 7, 5]), (4, 3, 8, [15, 13, 11, 9]), (4, 2, 4, [8, 8, 8, 8])],
)
def test_forwards_before_the_first_backward_are_megatrons(p, v, m, forwards_first):
    """Megatron-LM's warm-up, 2(p-r-1) + (v-1)p forwards (all m*v when m == p), then the steady
    state opens with one more forward before its first backward; literal counts, so a warm-up one
    longer or shorter fails here even where the bubble would not show it."""
    counts = []
    for r in range(p):
        kinds = [kind for kind, _, _ in interleaved_order(r, p, v, m)]
        counts.append(kinds.index("B"))
    assert counts == forwards_first


def simulate(p: int, v: int, m: int, t_f: float = 1.0, t_b: float = 2.0) -> dict:
    """Every rank's order replayed against the others (``parabench.pipeline_sim``: a chunk's
    forward waits for the previous chunk's, its backward for the next chunk's and its own forward,
    messages free), after checking that each (sender, receiver) channel, matched without tags (as
    NCCL matches), hands every op the (kind, chunk, micro-batch) it needs, and that every chunk
    runs each micro-batch's F and B once; raises on a deadlock. Forwards of a chunk take t_f,
    backwards t_b. Gives ``step_s``, and per rank the ``bubble`` and the ``peak_live`` units."""
    ops = [
        [Op(k, i, r + c * p, t_f if k == "F" else t_b) for k, c, i in interleaved_order(r, p, v, m)] for r in range(p)
    ]
    units = sorted((op.kind, op.chunk, op.micro) for rank in ops for op in rank)
    assert units == sorted((k, c, i) for k in "FB" for c in range(p * v) for i in range(m)), (p, v, m)
    pipeline_sim.check_untagged_channels(ops)
    return pipeline_sim.simulate(ops)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_schedule_is_deadlock_free_ordered_and_reaches_the_bubble(p, v):
    for m in (p, 2 * p, 3 * p):
        sim = simulate(p, v, m)
        assert sim["bubble"] == pytest.approx([(p - 1) / (v * m + p - 1)] * p), (p, v, m)
        assert sim["peak_live"] == [peak_live_theory(r, p, v, m) for r in range(p)]


def test_interleaving_shrinks_the_bubble_of_1f1b():
    """Same p, m: plain 1F1B's bubble (p-1)/(m+p-1) against v=2 and v=4 chunks per rank."""
    one_chunk = (4 - 1) / (8 + 4 - 1)
    assert simulate(4, 2, 8)["bubble_mean"] < one_chunk
    assert simulate(4, 4, 8)["bubble_mean"] < simulate(4, 2, 8)["bubble_mean"]


# --- validation --------------------------------------------------------------------------------------


def test_validate_rejects_what_megatron_cannot_schedule():
    def case(**options):
        return Case(model="tiny-deep", strategy="ref.pp_interleaved", world_size=2, micro_batch=6, options=options)

    with pytest.raises(SuiteError, match="multiple of the pipeline stages"):
        validate_case(case(pp=2, microbatches=3))
    with pytest.raises(SuiteError, match="virtual_stages >= 2"):
        validate_case(case(pp=2, microbatches=2, virtual_stages=1))
    with pytest.raises(SuiteError, match="chunks for a model of 8 layers"):
        validate_case(case(pp=2, microbatches=2, virtual_stages=5))
    validate_case(case(pp=2, microbatches=6, virtual_stages=4))


# --- training over gloo --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(group2, name):
    assert_matches_single(group2[name], group2[name]["single"], loss_rtol=TOL, rtol=TOL, atol=PARAM_ATOL)


@pytest.mark.parametrize("name", REFERENCE)
def test_runs_megatron_order_and_records_the_bubble(group2, name):
    o = CASES[name].options
    p, v, m = o["pp"], o["virtual_stages"], o["microbatches"]
    for r in group2[name]["per_rank"]:
        st, stage = r["stats"], r["coords"][1]
        assert (st["schedule"], st["stages"], st["virtual_stages"], st["microbatches"]) == (
            "interleaved_1f1b",
            p,
            v,
            m,
        )
        assert st["chunks"] == list(range(stage, p * v, p))
        assert st["order"] == _as_text(interleaved_order(stage, p, v, m), stage, p)
        assert st["peak_live_microbatches"] == st["peak_live_microbatches_theory"] == peak_live_theory(stage, p, v, m)
        assert st["bubble_fraction_theory"] == pytest.approx((p - 1) / (v * m + p - 1))
        assert 0 <= st["bubble_fraction_measured"] < 1 and st["compute_s"] > 0


@pytest.mark.parametrize("name", list(CASES))
def test_measured_comm_and_state_equal_theory(group2, name):
    case = CASES[name]
    exp = expected(case, model_config(case.model, case.seq_len), 1)
    for rank, r in enumerate(group2[name]["per_rank"]):
        assert payload_by_kind(r["comm"]) == exp["comm_payload_bytes_per_rank"][rank], rank
        assert r["state"] == exp["state_bytes"][rank], rank
    o = case.options
    p, v, m = o["pp"], o["virtual_stages"], o["microbatches"]
    assert exp["pipeline"]["bubble_fraction"] == pytest.approx((p - 1) / (v * m + p - 1))


def test_boundary_volume_is_2v_minus_1_pairs_per_microbatch_on_the_end_ranks(group2):
    """p=2: each rank holds the chain's first or last chunk, so per micro-batch it crosses
    2v - 1 boundaries (activation one way, gradient the other), each b·s·h fp32; the reference
    and torch's ScheduleInterleaved1F1B move the same bytes."""
    cfg = model_config("tiny-deep")
    per_boundary = 1 * cfg.seq_len * cfg.d_model * 4  # b = micro_batch / microbatches = 1 sample
    for name, v in (("p2_v2_m4", 2), ("p2_v4_m4", 4)):
        each_way = 4 * (2 * v - 1) * per_boundary  # 4 micro-batches
        for r in group2[name]["per_rank"]:
            assert payload_by_kind(r["comm"]) == {"send": each_way, "recv": each_way}
    for ref, peer in zip(group2["p2_v2_m4"]["per_rank"], group2["torch_p2_v2_m4"]["per_rank"]):
        assert payload_by_kind(ref["comm"]) == payload_by_kind(peer["comm"])
