"""Zero-bubble ZB-H1 (``ref.pp_zb``, Qi et al. 2024 Sec. 2-3) trains the same model to the same
losses and parameters as one process with its backward split into B (input gradient) and W
(weight gradient); its order puts every F before its B and every B before its W, reaches the
bubble (p-1)(T_F+T_B-T_W) in a zero-latency simulation, and is the order torch's
ScheduleInterleavedZeroBubble runs with one stage per rank (``torch.pp_zb``); both move 1F1B's
point-to-point bytes. CPU, gloo, fp32, ``tiny-deep``.

The schedule checks run in-process on the order alone; the training cases share one spawned
group of 2 ranks (``harness.run_cases``). Tolerances as ``test_pp_interleaved.py``.
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
from reference_impls.pipeline import one_f_one_b_order
from reference_impls.pipeline_zb import bubble_fraction_theory, peak_live_theory, zb_h1_order

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
    "p2_m4": mk("ref.pp_zb", microbatches=4),
    "p2_m2": mk("ref.pp_zb", microbatches=2),  # m == p: the smallest ZB-H1 accepts
    "torch_p2_m4": mk("torch.pp_zb", microbatches=4),
}
REFERENCE = [n for n in CASES if not n.startswith("torch")]


def _record(trainer, case, record):
    record["stats"] = trainer.pipeline_stats() if hasattr(trainer, "pipeline_stats") else None
    schedule = getattr(trainer, "schedule", None)
    if hasattr(schedule, "pipeline_order"):  # torch: this rank's compute actions, idle slots dropped
        rank = trainer.pp_rank
        record["torch_order"] = [str(a) for a in schedule.pipeline_order[rank] if a is not None]


def _plan(name: str, case: Case) -> dict:
    return {"on_end": _record, "extra_step": True, "meter_steps": (N_STEPS,), "measure_state_from": N_STEPS}


@pytest.fixture(scope="module")
def group2():
    return run_cases(2, CASES, N_STEPS, plan=_plan, with_truth=True)


# --- the schedule, on paper ------------------------------------------------------------------------


def test_order_by_hand():
    """p=2, m=4: stage 0 warms up with one forward and runs F B W from its first backward; stage 1
    (the last) defers its first W, so its second B reaches stage 0 one W sooner."""
    text = [" ".join(f"{k}{i}" for k, i in zb_h1_order(s, 2, 4)) for s in range(2)]
    assert text == [
        "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3",
        "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3",
    ]


def simulate(p: int, m: int, t_f: float, t_b: float, t_w: float) -> dict:
    """Every stage's ZB-H1 order replayed against the others (``parabench.pipeline_sim``: F waits
    for the previous stage's F, B for the next stage's B, W for its own B, messages free); raises
    on a deadlock. Gives the step time ``step_s`` and, per stage, the ``bubble`` (idle share of
    the step) and ``peak_live`` micro-batches (between F and W)."""
    cost = {"F": t_f, "B": t_b, "W": t_w}
    return pipeline_sim.simulate([[Op(k, i, s, cost[k]) for k, i in zb_h1_order(s, p, m)] for s in range(p)])


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_order_is_f_before_b_before_w_each_once(p):
    for m in (p, 2 * p + 1):
        for s in range(p):
            order = zb_h1_order(s, p, m)
            for kind in "FBW":  # each micro-batch once per kind, in micro-batch order
                assert [i for k, i in order if k == kind] == list(range(m))
            at = {op: n for n, op in enumerate(order)}
            assert all(at["F", i] < at["B", i] < at["W", i] for i in range(m))
            # F and B alone are 1F1B's order: only W moves
            assert [op for op in order if op[0] != "W"] == one_f_one_b_order(s, p, m)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize(
    "times", [(1, 1, 1), (1, 1.5, 0.5), (2, 3, 2), (1, 2, 1), (1, 1, 3), (2, 3, 4), (3, 1, 2), (1, 3, 2)]
)
def test_idle_slots_equal_the_analytic_bubble(p, times):
    """Qi et al. Sec. 3.1: bubble (p-1)(T_F+T_B-T_W) for m >= p while T_W <= T_F, T_B (the first
    four), and (p-1) max(T_F, T_B, T_F+T_B-T_W) beyond; at most p micro-batches alive."""
    for m in (p, 2 * p, 4 * p):
        sim = simulate(p, m, *times)
        assert sim["bubble"] == pytest.approx([bubble_fraction_theory(p, m, *times)] * p), (p, m, times)
        t_f, t_b, t_w = times
        if t_w <= min(t_f, t_b):
            assert sim["step_s"] - m * sum(times) == pytest.approx((p - 1) * (t_f + t_b - t_w))
        assert sim["peak_live"] == [peak_live_theory(p, m)] * p


def test_bubble_is_a_third_of_1f1b_at_equal_times():
    """1F1B's bubble time (p-1)(T_F+T_B+T_W) against ZB-H1's (p-1)(T_F+T_B-T_W): a third at equal
    times, so the fraction (p-1)/(3m+p-1) against (p-1)/(m+p-1)."""
    for p, m in ((4, 8), (8, 16)):
        sim = simulate(p, m, 1, 1, 1)
        assert sim["step_s"] - 3 * m == pytest.approx((3 * (p - 1)) / 3)
        assert bubble_fraction_theory(p, m) == pytest.approx((p - 1) / (3 * m + p - 1))
        assert max(sim["bubble"]) < (p - 1) / (m + p - 1)


# --- validation --------------------------------------------------------------------------------------


def test_validate_rejects_what_zb_h1_cannot_run():
    def case(strategy="ref.pp_zb", **options):
        return Case(model="tiny-deep", strategy=strategy, world_size=2, micro_batch=4, options=options)

    with pytest.raises(SuiteError, match="at least as many micro-batches as pipeline stages"):
        validate_case(case(pp=2, microbatches=1))
    with pytest.raises(SuiteError, match="tp must be 1"):
        validate_case(
            Case(
                model="tiny-deep",
                strategy="ref.pp_zb",
                world_size=4,
                micro_batch=4,
                options={"pp": 2, "tp": 2, "microbatches": 2},
            )
        )
    with pytest.raises(SuiteError, match="compile"):
        validate_case(case(pp=2, microbatches=2, compile=True))
    with pytest.raises(SuiteError, match="compile"):
        validate_case(case("torch.pp_zb", pp=2, microbatches=2, compile=True))
    validate_case(case(pp=2, microbatches=4))
    validate_case(case("torch.pp_zb", pp=2, microbatches=4))


# --- training over gloo --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(group2, name):
    assert_matches_single(group2[name], group2[name]["single"], loss_rtol=TOL, rtol=TOL, atol=PARAM_ATOL)


@pytest.mark.parametrize("name", REFERENCE)
def test_runs_zb_h1_and_records_the_bubble(group2, name):
    p, m = 2, CASES[name].options["microbatches"]
    for r in group2[name]["per_rank"]:
        st, stage = r["stats"], r["coords"][1]
        assert (st["schedule"], st["stages"], st["microbatches"]) == ("zb_h1", p, m)
        assert st["order"] == [f"{k}{i}" for k, i in zb_h1_order(stage, p, m)]
        assert st["peak_live_microbatches"] == st["peak_live_microbatches_theory"] == p
        assert st["graphs_alive_after_last_w"] == 0  # each micro-batch's graph is freed at its W
        assert st["bubble_fraction_theory"] == pytest.approx((p - 1) / (3 * m + p - 1))
        assert st["bubble_fraction_theory_1f1b"] == pytest.approx((p - 1) / (m + p - 1))
        assert all(st["compute_s_by_kind"][k] > 0 for k in "FBW")
        assert 0 < st["bubble_fraction_theory_measured_times"] < 1
        assert 0 <= st["bubble_fraction_measured"] < 1


def test_torch_runs_the_same_order(group2):
    """ScheduleInterleavedZeroBubble with one stage per rank: F, I (input backward) and W actions
    in ZB-H1's order, stage index = rank."""
    letter = {"F": "F", "B": "I", "W": "W"}
    for r in group2["torch_p2_m4"]["per_rank"]:
        stage = r["coords"][1]
        assert r["torch_order"] == [f"{stage}{letter[k]}{i}" for k, i in zb_h1_order(stage, 2, 4)]


@pytest.mark.parametrize("name", list(CASES))
def test_measured_comm_and_state_equal_theory(group2, name):
    case = CASES[name]
    exp = expected(case, model_config(case.model, case.seq_len), 1)
    for rank, r in enumerate(group2[name]["per_rank"]):
        assert payload_by_kind(r["comm"]) == exp["comm_payload_bytes_per_rank"][rank], rank
        assert r["state"] == exp["state_bytes"][rank], rank
    m = case.options["microbatches"]
    assert exp["pipeline"]["schedule"] == "zb_h1"
    assert exp["pipeline"]["bubble_fraction"] == pytest.approx(1 / (3 * m + 1))


def test_point_to_point_bytes_are_1f1bs(group2):
    """W sends nothing: per micro-batch one b·s·h fp32 activation forward and one gradient back, as
    1F1B (its expectation) and torch's zero-bubble schedule."""
    cfg = model_config("tiny-deep")
    each_way = 4 * 1 * cfg.seq_len * cfg.d_model * 4  # 4 micro-batches of 1 sample
    one_f_one_b = expected(mk("ref.pp_1f1b", microbatches=4), cfg, 1)["comm_payload_bytes_per_rank"]
    for rank, (ref, peer) in enumerate(zip(group2["p2_m4"]["per_rank"], group2["torch_p2_m4"]["per_rank"])):
        assert payload_by_kind(ref["comm"]) == payload_by_kind(peer["comm"]) == {"send": each_way, "recv": each_way}
        assert payload_by_kind(ref["comm"]) == one_f_one_b[rank]


def test_bubble_table_compares_against_the_zero_bubble_theory(group2):
    """The report's bubble row takes the theory the stages recorded, (p-1)/(3m+p-1) here, not 1F1B's."""
    from parabench.report import frames

    case = CASES["p2_m4"]
    rec = {
        "status": "ok",
        "case": case.to_dict(),
        "device": {"type": "cpu"},
        "per_rank": [{"rank": n, "pipeline": r["stats"]} for n, r in enumerate(group2["p2_m4"]["per_rank"])],
    }
    (row,) = frames.bubble_rows([({"suite": "t", "run_id": "r"}, [rec])])
    assert (row["schedule"], row["stages"], row["microbatches"]) == ("zb_h1", 2, 4)
    assert row["theory_pct"] == pytest.approx(100 / 13)


def test_b_and_w_split_one_backward_without_doing_any_of_it_twice():
    """In one process: B computes no weight gradient and W no input gradient, so their matmul
    FLOPs add up to one full backward's, and W's gradients equal a full backward's bit for bit."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from parabench.models import build_model
    from reference_impls.pipeline import stage_head_loss
    from reference_impls.pipeline_zb import backward_input, backward_weight, record_split_backward

    cfg = model_config("tiny")
    model = build_model(cfg, 0)
    outputs: list = []
    record_split_backward(model, lambda mod, y, x: outputs.append((mod, y, x)))
    tokens, targets = (
        torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    )

    def forward():
        outputs.clear()
        x = model.embed(tokens)
        for block in model.blocks:
            x = block(x)
        return stage_head_loss(model, x, targets)

    loss = forward()
    with FlopCounterMode(display=False) as full:
        loss.backward()
    truth = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = forward()
    with FlopCounterMode(display=False) as b:
        _, deferred = backward_input(loss, None, None, list(outputs))
    assert all(p.grad is None for p in model.parameters())
    with FlopCounterMode(display=False) as w:
        backward_weight(deferred)
    assert b.get_total_flops() == w.get_total_flops() == full.get_total_flops() // 2 > 0
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, truth[n]), n


@pytest.mark.parametrize("recipe", ["fp32", "amp", "master"])
def test_w_of_linears_is_explicit_and_equals_autograds_bit_for_bit(recipe):
    """W over 3 micro-batches gives every parameter the gradient plain ``loss.backward()`` per
    micro-batch accumulates, bit for bit, in fp32, under autocast (fp32 parameters, bf16
    matmuls: the recorded input is autocast's bf16 cast) and with bf16 parameters ("master");
    autograd runs the backward of no nn.Linear in W, W builds no graph, and the
    recorded inputs die with the micro-batch's W list (no reference cycle keeps them)."""
    import contextlib
    import weakref

    import torch

    from parabench.models import build_model
    from reference_impls.pipeline import stage_head_loss
    from reference_impls.pipeline_zb import backward_input, backward_weight, record_split_backward

    cfg = model_config("tiny")
    model = build_model(cfg, 0)
    if recipe == "master":
        model = model.to(torch.bfloat16)
    outputs: list = []
    record_split_backward(model, lambda mod, y, x: outputs.append((mod, y, x)))
    n_linear = sum(type(mod) is torch.nn.Linear for mod in model.modules())
    n_other = sum(1 for mod in model.modules() if any(True for _ in mod.parameters(recurse=False))) - n_linear
    assert n_linear > n_other > 0
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if recipe == "amp" else contextlib.nullcontext()
    m = 3
    batches = [
        [
            torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(10 * i + k))
            for k in (1, 2)
        ]
        for i in range(m)
    ]

    def loss_of(tokens, targets):
        outputs.clear()
        with cast:
            x = model.embed(tokens)
            for block in model.blocks:
                x = block(x)
            return stage_head_loss(model, x, targets) / m

    for tokens, targets in batches:
        loss_of(tokens, targets).backward()
    truth = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    for tokens, targets in batches:
        loss = loss_of(tokens, targets)
        _, deferred = backward_input(loss, None, None, list(outputs))
        inputs = [x for _, _, x, _ in deferred if x is not None]
        assert len(inputs) == n_linear
        compute_dtype = torch.float32 if recipe == "fp32" else torch.bfloat16
        assert {x.dtype for x in inputs} == {compute_dtype}
        recorded = [weakref.ref(x) for x in inputs]
        del inputs
        ran: list = []  # the recorded outputs whose backward node autograd runs during W

        def note(kind):
            return lambda grads: ran.append(kind)

        for entry in deferred:
            entry[1].grad_fn.register_prehook(note(type(entry[0])))
        backward_weight(deferred)
        assert len(ran) == n_other and torch.nn.Linear not in ran
        del loss, deferred, entry
        outputs.clear()
        assert [r() for r in recorded] == [None] * n_linear
    for n, p in model.named_parameters():
        assert p.grad.grad_fn is None and p.grad.dtype == p.dtype, n
        assert torch.equal(p.grad, truth[n]), n
