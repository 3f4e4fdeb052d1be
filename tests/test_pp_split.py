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

import pytest
from harness import assert_matches_single, payload_by_kind, run_cases

from parabench.case import Case
from parabench.models import model_config
from parabench.plan import model as M
from parabench.plan.workload import for_config
from parabench.registry import expected
from parabench.suite import SuiteError, validate_case
from reference_impls.pipeline import partition_layers

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
