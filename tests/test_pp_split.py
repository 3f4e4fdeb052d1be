"""Option ``stage_layers``: an uneven split of the transformer blocks over pipeline stages (fewer
on the stage that also runs the head and loss, as Megatron-LM's
``--decoder-last-pipeline-num-layers`` and torchtitan's ``pipeline_parallel_last_stage_less_layers``
do). The reference pipelines and the torch and DeepSpeed peers cut the same stages, still train
to single-process losses and parameters, and hold the model states and move the bytes the theory
computes on that split; the planner sees the split too. CPU, gloo, fp32, ``small`` (4 layers)
at seq_len 32 on 2 ranks, [3, 1] (and [1, 3] once); tolerances as ``test_reference_mp.py``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
from harness import assert_matches_single, payload_by_kind, run_cases

from parabench.case import Case
from parabench.metrics import pipeline_stage_imbalance
from parabench.models import model_config
from parabench.plan import model as M
from parabench.plan.workload import for_config
from parabench.registry import expected
from parabench.report.frames import pipeline_rows
from parabench.suite import SuiteError, load_suite, validate_case
from reference_impls.pipeline import partition_layers
from reference_impls.pipeline_balance import (
    balance_counts,
    block_flops_per_token,
    flop_balanced_layers,
    head_flops_per_token,
)

ROOT = Path(__file__).resolve().parent.parent
N_STEPS = 3
TOL = 1e-5
PARAM_ATOL = 1e-5


def mk(strategy, stage_layers=(3, 1), model="small", **options):
    opts = {"optim": {"eps": 1e-6}, "pp": 2, **options}
    if stage_layers is not None:
        opts["stage_layers"] = list(stage_layers)
    return Case(model=model, strategy=strategy, world_size=2, micro_batch=4, seq_len=32, lr=1e-3, options=opts)


CASES = {
    "ref.pp_1f1b": mk("ref.pp_1f1b"),
    "ref.pp_gpipe_1_3": mk("ref.pp_gpipe", stage_layers=(1, 3)),
    "ref.pp_zb": mk("ref.pp_zb"),
    "torch.pp_1f1b": mk("torch.pp_1f1b"),
    "torch.pp_zb": mk("torch.pp_zb"),
    "deepspeed.pp": mk("deepspeed.pp"),
}


def _held_blocks(trainer, case, record):
    """The global indices of the blocks this rank's stage holds, from its own parameters."""
    if hasattr(trainer, "par"):  # references
        names = [n for n, _ in trainer.par.module.named_parameters()]
    elif hasattr(trainer, "modules"):  # torch.distributed.pipelining
        names = [n for m in trainer.modules for n, _ in m.named_parameters()]
    else:  # DeepSpeed: its parameters under their GPT names
        names = list(trainer._names.values())
    record["blocks"] = sorted({int(n.split(".")[1]) for n in names if n.startswith("blocks.")})
    record["pipeline"] = trainer.pipeline_stats()


@pytest.fixture(scope="module")
def group():
    """One spawned gloo group for every case; the comm meter and state sampling on one step after
    the recorded ones (DeepSpeed's one-off tensor-meta message is on its first step)."""
    return run_cases(
        2,
        CASES,
        N_STEPS,
        with_truth=True,
        meter_steps=(N_STEPS,),
        extra_step=True,
        measure_state_from=N_STEPS,
        on_end=_held_blocks,
    )


# --- the split -----------------------------------------------------------------------------------


def test_partition_takes_the_given_counts_and_keeps_the_equal_default():
    assert partition_layers(24, 4, [7, 6, 6, 5]) == [(0, 7), (7, 13), (13, 19), (19, 24)]
    assert partition_layers(4, 2, (3, 1)) == [(0, 3), (3, 4)]
    assert partition_layers(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]  # the first stages take the remainder
    assert partition_layers(10, 4, None) == partition_layers(10, 4)


@pytest.mark.parametrize(
    "bad",
    [[3], [2, 1, 1], [2, 1], [3, 2], [4, 0], [5, -1], [2.5, 1.5], [True, 3]],
)
def test_partition_refuses_a_split_that_does_not_fit(bad):
    with pytest.raises(
        ValueError, match=r"stage_layers=.*2 pipeline stages: 2 integers, each >= 1, summing to .*4 layers"
    ):
        partition_layers(4, 2, bad)


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy", ["ref.pp_1f1b", "ref.pp_gpipe", "ref.pp_zb", "torch.pp_1f1b", "torch.pp_gpipe", "deepspeed.pp"]
)
def test_validation_names_the_option_the_stage_count_and_the_sum(strategy):
    for bad in ([4], [2, 1], [4, 0], [1, 1, 2]):
        with pytest.raises(
            SuiteError, match=r"stage_layers=.*of the 2 pipeline stages.*summing to the model's 4 layers"
        ):
            validate_case(mk(strategy, stage_layers=bad))
    with pytest.raises(SuiteError, match="stage_layers must be"):  # not a list at all: the option's type
        validate_case(dataclasses.replace(mk(strategy), options={"pp": 2, "stage_layers": 3}))
    validate_case(mk(strategy))


@pytest.mark.parametrize("strategy", ["ref.pp_interleaved", "torch.pp_interleaved"])
def test_interleaved_strategies_refuse_the_option(strategy):
    with pytest.raises(SuiteError, match=r"stage_layers .*interleaving cuts pp x virtual_stages = 4 chunks"):
        validate_case(mk(strategy, model="small", microbatches=2))
    validate_case(mk(strategy, stage_layers=None, microbatches=2))


def test_absent_option_keeps_the_case_hash():
    """The equal split is the default: a case without the option is the case it always was, and
    one with it is a different case."""
    plain = mk("ref.pp_1f1b", stage_layers=None)
    assert "stage_layers" not in plain.options
    assert mk("ref.pp_1f1b").case_hash != plain.case_hash
    assert mk("ref.pp_1f1b", stage_layers=(2, 2)).case_hash != plain.case_hash


# --- training over gloo --------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_uneven_split_matches_single_process(group, name):
    res = group[name]
    assert_matches_single(res, res["single"], loss_rtol=TOL, rtol=TOL, atol=PARAM_ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_each_stage_holds_its_blocks(group, name):
    split = CASES[name].options["stage_layers"]
    want = [list(range(lo, hi)) for lo, hi in partition_layers(4, 2, split)]
    assert [r["blocks"] for r in group[name]["per_rank"]] == want


@pytest.mark.parametrize("name", list(CASES))
def test_measured_state_and_comm_equal_theory_on_the_split(group, name):
    case = CASES[name]
    cfg = model_config(case.model, case.seq_len)
    exp = expected(case, cfg, 1)
    equal = expected(mk(case.strategy, stage_layers=None), cfg, 1)
    for rank, r in enumerate(group[name]["per_rank"]):
        assert r["state"] == exp["state_bytes"][rank], rank
        assert payload_by_kind(r["comm"]) == exp["comm_payload_bytes_per_rank"][rank], rank
    # the theory follows the split: [3, 1] is not the equal split's state
    assert exp["state_bytes"] != equal["state_bytes"]


# --- the planner -----------------------------------------------------------------------------------


def test_planner_replays_the_split():
    """The planner's stages carry the split: per-stage costs, activation peaks and the heaviest
    rank's states follow it, and taking a block off a last stage that also runs a heavy head
    shortens the replayed step."""
    cfg = dataclasses.replace(model_config("tiny"), n_layers=8)

    def w(split):
        opts = {"pp": 2, "microbatches": 4, **({"stage_layers": split} if split else {})}
        return for_config(model="tiny", cfg=cfg, strategy="ref.pp_1f1b", world_size=2, micro_batch=4, options=opts)

    equal, uneven = w(None), w([5, 3])
    assert equal.stage_layers is None and uneven.stage_layers == (5, 3)
    assert M._chunk_layers(uneven) == [5, 3]
    layer = M.activation_layer_bytes(uneven)
    # 1F1B: stage 0 holds p = 2 micro-batches of its 5 blocks, stage 1 one micro-batch of its 3
    assert [act for act, _, _ in M.pipeline_stage_peaks(uneven)] == pytest.approx([2 * 5 * layer, 3 * layer])
    assert [act for act, _, _ in M.pipeline_stage_peaks(equal)] == pytest.approx([2 * 4 * layer, 4 * layer])
    assert uneven.state_bytes > equal.state_bytes  # the heaviest rank now holds 5 blocks and the embedding
    heavy_head = {"inv_rate": 1e-12, "logit_s": 1e-9}
    assert M.pipeline_factor(uneven, heavy_head) < M.pipeline_factor(equal, heavy_head)


# --- option stage_layers = "balanced" --------------------------------------------------------------


def _max_stage_cost(split, extras):
    return max(n + e for n, e in zip(split, extras))


def _compositions(n, parts):
    """Every split of n blocks into ``parts`` stages of at least one block."""
    if parts == 1:
        yield [n]
        return
    for first in range(1, n - parts + 2):
        for rest in _compositions(n - first, parts - 1):
            yield [first, *rest]


@pytest.mark.parametrize(
    "n, extras",
    [(6, [0.0, 0.0]), (7, [0.0, 0.0, 0.0]), (12, [0.0, 0.0, 0.0, 1.9]), (9, [0.4, 0.0, 2.6]), (24, [0.3, 0, 0, 3.5])],
)
def test_balance_counts_minimises_the_largest_stage(n, extras):
    """Against every split: no other split has a smaller largest stage (blocks plus the stage's extra),
    and with equal extras the split is partition_layers' equal one."""
    split = balance_counts(n, extras)
    assert sum(split) == n and min(split) >= 1
    best = min(_max_stage_cost(c, extras) for c in _compositions(n, len(extras)))
    assert _max_stage_cost(split, extras) == pytest.approx(best)
    if not any(extras):
        assert [hi - lo for lo, hi in partition_layers(n, len(extras))] == split


def test_balanced_split_takes_blocks_off_the_head_stage():
    """gpt-1.3b at sequence 2048: the head (2 d V = 2.1e8 FLOPs a token) weighs 1.9 blocks
    (24 d^2 + 2 s d = 1.09e8). Of the 4-stage splits whose largest stage is 7 blocks, the middle
    stages take 7 and the ends share the rest; gpt-350m's head is 3.5 blocks."""
    cfg = model_config("gpt-1.3b", 2048)
    assert head_flops_per_token(cfg.d_model, cfg.vocab_size) / block_flops_per_token(cfg.d_model, 2048) == (
        pytest.approx(1.89, abs=0.01)
    )
    assert flop_balanced_layers(24, 4, cfg.d_model, 2048, cfg.vocab_size) == [6, 7, 7, 4]
    assert flop_balanced_layers(24, 4, 1024, 2048, 50304) == [7, 7, 7, 3]
    assert flop_balanced_layers(24, 1, 1024, 2048, 50304) == [24]


@pytest.mark.parametrize("n_stages", [2, 3, 4, 5])
@pytest.mark.parametrize("model", ["small", "gpt-350m", "gpt-1.3b"])
def test_balanced_split_is_a_best_split_by_flops(model, n_stages):
    """No split of 12 blocks has a smaller largest stage under the same FLOP costs."""
    cfg = model_config(model, 2048)
    extras = [0.0] * n_stages
    extras[-1] = head_flops_per_token(cfg.d_model, cfg.vocab_size) / block_flops_per_token(cfg.d_model, 2048)
    split = flop_balanced_layers(12, n_stages, cfg.d_model, 2048, cfg.vocab_size)
    assert sum(split) == 12 and min(split) >= 1
    best = min(_max_stage_cost(c, extras) for c in _compositions(12, n_stages))
    assert _max_stage_cost(split, extras) == pytest.approx(best)


def test_balanced_split_is_the_best_on_measured_stage_costs():
    """The committed gpt-1.3b pp 4 timelines (ref.pp_1f1b, 8 micro-batches, equal / [7, 7, 6, 4] /
    [7, 7, 7, 3], medians of five launches) give a block's cost and each end stage's excess over a
    middle stage; on those costs no split has a smaller largest stage than the FLOP-balanced one,
    and the study's hand-made [7, 7, 6, 4] is at least 3 % worse."""
    run = ROOT / "results" / "studies" / "plan-retest-pipelines-h100x4" / "20261127-161154"
    by_split: dict[tuple, list] = {}
    for path in sorted((run / "cases").glob("*.json")):
        rec = json.loads(path.read_text())
        opts = rec["case"]["options"]
        if rec["status"] != "ok" or rec["case"]["strategy"] != "ref.pp_1f1b" or opts.get("microbatches") != 8:
            continue
        stages = sorted((pr["pipeline"]["stage"], pr["pipeline"]["compute_s"]) for pr in rec["per_rank"])
        by_split.setdefault(tuple(opts.get("stage_layers") or (6, 6, 6, 6)), []).append([c for _, c in stages])
    assert set(by_split) == {(6, 6, 6, 6), (7, 7, 6, 4), (7, 7, 7, 3)}
    median = {k: [statistics.median(col) for col in zip(*v)] for k, v in by_split.items()}
    equal = median[(6, 6, 6, 6)]
    block = median[(7, 7, 6, 4)][1] - equal[1]  # stage 1: one block more
    # each stage's excess over a middle stage of the same blocks, in blocks: the embedding and the head
    extras = [(equal[s] - (equal[1] + equal[2]) / 2) / block for s in range(4)]
    assert 0.2 < extras[0] < 0.8 and 1.9 < extras[3] < 2.8
    split = flop_balanced_layers(24, 4, 2048, 2048, 50304)
    best = min(_max_stage_cost(c, extras) for c in _compositions(24, 4))
    assert _max_stage_cost(split, extras) == pytest.approx(best, rel=0.02)
    assert _max_stage_cost(split, extras) < 0.97 * _max_stage_cost([7, 7, 6, 4], extras)


def test_balanced_option_resolves_into_the_case():
    """The case names the split that runs: the same hash and label as the explicit counts, and a
    misspelt value refused with its file and line."""
    cfg = model_config("gpt-1.3b", 2048)
    kw = dict(model="gpt-1.3b", strategy="ref.pp_1f1b", world_size=4, micro_batch=8, seq_len=2048)
    balanced = Case(**kw, options={"pp": 4, "stage_layers": "balanced"})
    explicit = Case(**kw, options={"pp": 4, "stage_layers": [6, 7, 7, 4]})
    assert balanced.options["stage_layers"] == [6, 7, 7, 4] == flop_balanced_layers(24, 4, cfg.d_model, 2048, 50304)
    assert balanced.case_hash == explicit.case_hash and balanced.label == explicit.label
    validate_case(balanced)
    with pytest.raises(ValueError, match="'balanced' for the split that evens"):
        Case(**kw, options={"pp": 4, "stage_layers": "balance"})


def test_misspelt_balanced_names_file_and_line(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(
        '[suite]\nname = "s"\ndevice = "cpu"\n\n[[matrix]]\nmodel = "small"\nstrategy = "ref.pp_1f1b"\n'
        'world_size = 2\nmicro_batch = 4\noptions = { pp = 2, stage_layers = "balance" }\n'
    )
    with pytest.raises(SuiteError, match=r"s\.toml:10: field 'options'.*stage_layers='balance'"):
        load_suite(str(path))


def test_stage_imbalance_metric_reads_the_device_timed_stages():
    """The slowest stage over the mean stage, each stage's slowest rank; None where a stage's
    clock timed launches only (its measured bubble is None)."""

    def rank(stage, compute_s, bubble=0.1):
        return {"pipeline": {"stage": stage, "compute_s": compute_s, "bubble_fraction_measured": bubble}}

    assert pipeline_stage_imbalance([rank(0, 1.0), rank(1, 1.5), rank(1, 1.4), rank(0, 0.9)]) == pytest.approx(1.2)
    assert pipeline_stage_imbalance([rank(0, 1.0), rank(1, 1.5, bubble=None)]) is None
    assert pipeline_stage_imbalance([{"pipeline": None}, rank(1, 1.0)]) is None
    assert pipeline_stage_imbalance([rank(0, 1.0), rank(0, 1.0)]) is None  # one stage


@pytest.mark.parametrize("name", ["ref.pp_1f1b", "ref.pp_zb"])
def test_report_rows_show_each_stage_and_its_load(group, name):
    """On a CPU the stage clock is the host's, exact: each stage's forward and backward time and its
    compute over the mean, the [3, 1] split loading the first stage more."""
    record = {
        "device": {"type": "cpu"},
        "per_rank": [{"rank": i, "pipeline": r["pipeline"]} for i, r in enumerate(group[name]["per_rank"])],
    }
    rows = pipeline_rows(record)
    assert [row["stage"] for row in rows] == [0, 1]
    assert all(row["forward_ms"] > 0 and row["backward_ms"] > 0 for row in rows)
    assert rows[0]["load"] > 1 > rows[1]["load"]
    assert sum(row["load"] for row in rows) == pytest.approx(2)


@pytest.mark.parametrize("name", list(CASES))
def test_theory_states_the_splits_flop_imbalance(name):
    """Every one-stage-per-rank pipeline's expectation carries its split's FLOP imbalance: the
    largest stage's blocks (the head counted on the last) over the mean stage's."""
    case = CASES[name]
    cfg = model_config(case.model, case.seq_len)
    head = head_flops_per_token(cfg.d_model, cfg.vocab_size) / block_flops_per_token(cfg.d_model, case.seq_len)
    counts = case.options["stage_layers"]
    costs = [counts[0], counts[1] + head]
    assert expected(case, cfg, 1)["pipeline"]["stage_imbalance_flops"] == pytest.approx(max(costs) / (sum(costs) / 2))


def test_balanced_split_lowers_the_flop_imbalance():
    """gpt-1.3b on 4 stages: equal blocks leave the head's stage 1.22x the mean, [6, 7, 7, 4] 1.08x."""
    cfg = model_config("gpt-1.3b", 2048)
    kw = dict(model="gpt-1.3b", strategy="ref.pp_1f1b", world_size=4, micro_batch=8, seq_len=2048)
    equal = expected(Case(**kw, options={"pp": 4}), cfg, 1)["pipeline"]["stage_imbalance_flops"]
    balanced = expected(Case(**kw, options={"pp": 4, "stage_layers": "balanced"}), cfg, 1)["pipeline"]
    assert equal == pytest.approx(1.219, abs=0.002)
    assert balanced["stage_imbalance_flops"] == pytest.approx(1.081, abs=0.002)
