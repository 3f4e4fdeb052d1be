"""The pipeline replay (``parabench.pipeline_sim``) reproduces each schedule's closed-form bubble at
equal stage times (GPipe and 1F1B (p−1)/(m+p−1), interleaved (p−1)/(vm+p−1), ZB-H1
(p−1)·max(T_F, T_B, T_F+T_B−T_W) over the step), the known larger bubble of a slow last stage,
each stage's peak live activations, and, on committed 4x H100 records, the measured bubble from
each op's measured time; it refuses an order whose untagged messages would cross; the report's
bubble row splits measured − theory into op ratio, imbalance and residual. In-process, no
launches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parabench.pipeline_sim import Op, check_untagged_channels, equalized, ops_from_stats, replay, simulate
from parabench.report import frames
from parabench.results import load_run
from reference_impls.pipeline import bubble_fraction_theory, gpipe_order, one_f_one_b_order
from reference_impls.pipeline_interleaved import bubble_fraction_theory as interleaved_theory
from reference_impls.pipeline_interleaved import interleaved_order
from reference_impls.pipeline_zb import bubble_fraction_theory as zb_theory
from reference_impls.pipeline_zb import peak_live_theory as zb_peak_live
from reference_impls.pipeline_zb import zb_h1_order

RUN = Path(__file__).resolve().parent.parent / "results" / "h100x4" / "20261126-203946"


def plain(order_fn, p, m, times):
    """Every stage's ops of a one-chunk schedule; ``times(stage, kind)`` gives each op's length."""
    return [[Op(k, i, s, times(s, k)) for k, i in order_fn(s, p, m)] for s in range(p)]


@pytest.mark.parametrize("order_fn", [gpipe_order, one_f_one_b_order])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_equal_stages_give_p_minus_1_over_m_plus_p_minus_1(order_fn, p):
    for m in (1, p, 2 * p + 1):
        sim = simulate(plain(order_fn, p, m, lambda s, k: {"F": 1.0, "B": 2.0}[k]))
        assert sim["bubble"] == pytest.approx([bubble_fraction_theory(p, m)] * p), (p, m)
        assert sim["step_s"] == pytest.approx((m + p - 1) * 3.0)


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 3)])
def test_interleaved_equal_chunks_give_megatrons_bubble(p, v):
    for m in (p, 2 * p, 4 * p):
        ops = [
            [Op(k, i, s + c * p, {"F": 1.0, "B": 2.0}[k]) for k, c, i in interleaved_order(s, p, v, m)]
            for s in range(p)
        ]
        assert simulate(ops)["bubble_mean"] == pytest.approx(interleaved_theory(p, v, m)), (p, v, m)


@pytest.mark.parametrize("times", [(1, 1, 1), (1, 1.5, 0.5), (1, 1, 3), (3, 1, 2)])
def test_zb_h1_equal_stages_give_the_papers_bubble(times):
    cost = dict(zip("FBW", times))
    for p in (2, 4):
        for m in (p, 3 * p):
            sim = simulate(plain(zb_h1_order, p, m, lambda s, k: cost[k]))
            assert sim["bubble"] == pytest.approx([zb_theory(p, m, *times)] * p), (p, m, times)


@pytest.mark.parametrize("order_fn", [gpipe_order, one_f_one_b_order])
def test_a_slow_last_stage_sets_the_step_and_equalizing_removes_it(order_fn):
    """Last stage a times slower (the head and loss): it is the bottleneck once its first forward
    arrives, so step = (p−1)(T_F+T_B) + m·a·(T_F+T_B); the others idle 1 − m(T_F+T_B)/step."""
    p, m, a, t_f, t_b = 4, 8, 1.5, 1.0, 2.0
    ops = plain(order_fn, p, m, lambda s, k: (t_f if k == "F" else t_b) * (a if s == p - 1 else 1))
    sim = simulate(ops)
    step = (p - 1) * (t_f + t_b) + m * a * (t_f + t_b)
    assert sim["step_s"] == pytest.approx(step)
    assert sim["bubble"][:-1] == pytest.approx([1 - m * (t_f + t_b) / step] * (p - 1))
    assert sim["bubble"][-1] == pytest.approx(1 - m * a * (t_f + t_b) / step)
    assert sim["bubble_mean"] > bubble_fraction_theory(p, m) + 0.05
    assert simulate(equalized(ops))["bubble_mean"] == pytest.approx(bubble_fraction_theory(p, m))


def test_a_schedule_that_cannot_run_is_refused():
    with pytest.raises(ValueError, match="deadlocks"):  # stage 1 waits on a backward queued behind it
        simulate([[Op("F", 0, 0, 1), Op("B", 0, 0, 1)], [Op("B", 0, 1, 1), Op("F", 0, 1, 1)]])
    with pytest.raises(ValueError, match="no stage runs"):  # a forward whose input nobody computes
        simulate([[Op("F", 0, 1, 1), Op("B", 0, 1, 1)]])
    with pytest.raises(ValueError, match="not in the timeline"):
        ops_from_stats([{"stage": 0, "order": ["F0", "B0"], "timeline": [["F", 0, 0.0, 1.0]]}])


def test_peak_live_counts_activations_from_f_to_their_last_backward():
    """GPipe holds all m, 1F1B p − s on stage s, ZB-H1 p (to W, not B); a W, where the schedule
    has one, not the B, frees the activation."""
    p, m = 4, 8
    peaks = {fn: simulate(plain(fn, p, m, lambda s, k: 1.0))["peak_live"] for fn in (gpipe_order, one_f_one_b_order)}
    assert peaks[gpipe_order] == [m] * p
    assert peaks[one_f_one_b_order] == [p - s for s in range(p)]
    assert simulate(plain(zb_h1_order, p, m, lambda s, k: 1.0))["peak_live"] == [zb_peak_live(p, m)] * p
    one_stage = [Op("F", 0, 0, 1), Op("B", 0, 0, 1), Op("F", 1, 0, 1), Op("B", 1, 0, 1)]
    assert simulate([one_stage])["peak_live"] == [1]
    assert simulate([one_stage + [Op("W", 0, 0, 1), Op("W", 1, 0, 1)]])["peak_live"] == [2]


def test_untagged_channels_accept_the_schedules_and_refuse_a_crossed_message():
    """Every schedule here pairs its sends and receives in order; stage 1 taking micro-batch 1
    before 0 still replays (each op waits for its own input), but without tags its first receive
    would take micro-batch 0's activation."""
    for order_fn in (gpipe_order, one_f_one_b_order, zb_h1_order):
        check_untagged_channels(plain(order_fn, 4, 8, lambda s, k: 1.0))
    p, v, m = 2, 2, 4  # rank 0 -> rank 1 carries activations and gradients, interleaved
    check_untagged_channels([[Op(k, i, r + c * p, 1.0) for k, c, i in interleaved_order(r, p, v, m)] for r in range(p)])
    first = [Op("F", 0, 0, 1), Op("F", 1, 0, 1), Op("B", 0, 0, 1), Op("B", 1, 0, 1)]
    crossed = [Op("F", 1, 1, 1), Op("F", 0, 1, 1), Op("B", 0, 1, 1), Op("B", 1, 1, 1)]
    assert simulate([first, crossed])["step_s"] > 0
    with pytest.raises(ValueError, match=r"stage 0 -> stage 1, message 0: the receive for \('F', 0, 1\) takes"):
        check_untagged_channels([first, crossed])
    twice = [Op("F", 0, 0, 1), Op("F", 0, 0, 1), Op("B", 0, 0, 1)]
    with pytest.raises(ValueError, match="sent but never received"):
        check_untagged_channels([twice, [Op("F", 0, 1, 1), Op("B", 0, 1, 1)]])


def _stages(case_id):
    rec = json.loads((RUN / "cases" / f"{case_id}.json").read_text())
    return rec, [pr["pipeline"] for pr in rec["per_rank"]]


def test_committed_h100_records_replay_to_their_measured_bubble():
    """1F1B, p 4, m 4 on 4x H100: the last stage (head and loss) takes 1.5x the others per op, which
    the replay turns into the measured bubble (49.4 %), against 42.9 % at equal stages. ZB-H1: the
    equal-stage replay is the paper's formula at the mean measured T_F, T_B, T_W."""
    _, stats = _stages("eaf41ccac8eb0d2b")
    got = replay(stats)
    measured = sum(p["bubble_fraction_measured"] for p in stats) / len(stats)
    assert got["equal"]["bubble_mean"] == pytest.approx(bubble_fraction_theory(4, 4))
    assert got["simulated"]["bubble_mean"] - got["equal"]["bubble_mean"] > 0.05
    assert got["simulated"]["bubble_mean"] == pytest.approx(measured, abs=0.01)
    assert got["simulated"]["step_s"] == pytest.approx(max(p["step_s"] for p in stats), rel=0.03)

    _, stats = _stages("1b5a36953df3951a")
    ops = ops_from_stats(stats)
    mean = {k: [op.duration_s for s in ops for op in s if op.kind == k] for k in "FBW"}
    t_f, t_b, t_w = (sum(v) / len(v) for v in mean.values())
    assert replay(stats)["equal"]["bubble_mean"] == pytest.approx(zb_theory(4, 4, t_f, t_b, t_w))


def test_bubble_row_decomposes_measured_minus_theory():
    """measured = theory + op ratio + imbalance + residual; pp 2 x dp 2 replays each replica apart."""
    manifest, records = load_run(RUN)
    keep = {"eaf41ccac8eb0d2b", "1b5a36953df3951a", "f0e177c7cdd5c05f"}
    rows = frames.bubble_rows([(manifest, [r for r in records if r["case_hash"] in keep])])
    assert len(rows) == 3
    for row in rows:
        parts = row["theory_pct"] + row["op_ratio_pct"] + row["imbalance_pct"] + row["residual_pct"]
        assert parts == pytest.approx(row["measured_pct"])
        assert row["agrees_simulated"] is True
        assert row["timeline_step_ratio"] > 1
    (two_by_two,) = [row for row in rows if row["stages"] == 2]
    rec, stats = _stages("f0e177c7cdd5c05f")
    per_replica = [replay(stats[:2]), replay(stats[2:])]
    assert [p["coords"]["dp"] for p in rec["per_rank"]] == [0, 0, 1, 1]
    expected = sum(b for rep in per_replica for b in rep["simulated"]["bubble"]) / 4
    assert two_by_two["simulated_pct"] == pytest.approx(100 * expected)
