"""Precision recipes ("master", "amp") as a case axis: each strategy trains as its recipe says
(parameter dtype, master copies, what travels), close to the single-process run of the same
recipe, with the state and traffic its theory expects; and the axis in cases, suites and records."""

from __future__ import annotations

import pytest
from harness import max_rel_diff, payload_by_kind, replica_mean_losses, run_cases

from parabench.case import Case
from parabench.record import theory_for
from parabench.suite import SuiteError, load_suite, validate_case

N_STEPS = 3
OPTIM = {"weight_decay": 0.0}


def mk(strategy, recipe, world=2, micro_batch=2, **options):
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=world,
        precision="bf16",
        recipe=recipe,
        micro_batch=micro_batch,
        lr=1e-3,
        device="cpu",
        options={"optim": OPTIM, **options},
    )


STRATEGIES = [
    ("ref.ddp", {}),
    ("torch.ddp", {}),
    ("ref.zero3", {}),
    ("torch.fsdp2", {}),
    ("ref.tp", {"tp": 2}),
    ("torch.tp", {"tp": 2}),
    ("ref.pp_1f1b", {"pp": 2}),
    ("torch.pp_1f1b", {"pp": 2}),
]
CASES = {f"{s}-{r}": mk(s, r, micro_batch=4 if "pp" in o else 2, **o) for s, o in STRATEGIES for r in ("master", "amp")}


@pytest.fixture(scope="module")
def group2():
    return run_cases(2, CASES, N_STEPS, meter_steps=(N_STEPS - 1,), measure_state_from=N_STEPS - 1, with_truth=True)


@pytest.mark.parametrize("name", list(CASES))
def test_recipe_trains_like_one_process_of_the_same_recipe(group2, name):
    res = group2[name]
    truth = res["single"]
    assert truth["losses"][-1] < truth["losses"][0]
    assert max_rel_diff(replica_mean_losses(res), truth["losses"]) < 1e-2
    # Parameters after the steps: the same update, bf16 rounding apart. Adam turns a gradient
    # element near zero into a step of about lr whose sign rounding may flip, so single elements
    # may differ by up to 2 lr per step, plus a bf16 spacing (2^-7 relative); on average they
    # agree far closer.
    for n, p in res["params"].items():
        t = truth["params"][n]
        diff = (p - t).abs()
        assert (diff <= 2 * N_STEPS * 1e-3 + t.abs() * 2**-7).all(), (n, diff.max())
        assert diff.mean() < 2e-4 + t.abs().mean() * 2**-8, (n, diff.mean())


@pytest.mark.parametrize("name", list(CASES))
def test_recipe_state_and_traffic_match_theory(group2, name):
    res, case = group2[name], CASES[name]
    exp = theory_for(case)
    for rank, r in enumerate(res["per_rank"]):
        want = exp["state_bytes"][rank] if isinstance(exp["state_bytes"], list) else exp["state_bytes"]
        if want is not None:  # FSDP2's per-parameter shards: checked by the worker's record
            assert r["state"] == want, (rank, r["state"], want)
        per_rank = exp.get("comm_payload_bytes_per_rank")
        want_comm = dict(per_rank[rank] if per_rank else exp["comm_payload_bytes"])
        got = payload_by_kind(r["comm"])
        for kind, b in want_comm.items():
            lo, hi = (b, b) if not isinstance(b, list) else b
            assert lo * 0.99 <= got.get(kind, 0) <= hi * 1.01, (rank, kind, got, want_comm)


def test_master_keeps_bf16_parameters_and_amp_fp32(group2):
    """The recipe is what the state holds: bf16 parameters + an fp32 master under "master", fp32
    parameters and no master under "amp" (ref.ddp's flat buffers, torch.ddp's module). ref.ddp's
    master recipe adds an fp32 main gradient beside the bf16 one (Megatron's layout)."""
    for s in ("ref.ddp", "torch.ddp"):
        master = group2[f"{s}-master"]["per_rank"][0]["state"]
        amp = group2[f"{s}-amp"]["per_rank"][0]["state"]
        assert amp["params"] == 2 * master["params"]
        assert master["grads"] == (amp["grads"] // 2) * (3 if s == "ref.ddp" else 1)
        assert master["optimizer"] == amp["optimizer"] + amp["params"]  # + the fp32 master copy


def test_recipe_is_in_case_hash_label_and_defaults():
    master, amp = mk("ref.ddp", "master"), mk("ref.ddp", "amp")
    assert master.case_hash != amp.case_hash
    assert "bf16-master" in master.label and "bf16-amp" in amp.label
    assert mk("ref.ddp", None).recipe == "master"  # the default: master where the strategy has it
    assert mk("deepspeed.zero2", None).recipe == "master"
    assert mk("ref.cp_ring", None).recipe == "amp"  # context parallelism: autocast only
    fp32 = Case(model="tiny", strategy="ref.ddp", world_size=2, recipe="amp")
    assert fp32.recipe is None and "fp32" in fp32.label  # nothing to choose in fp32
    assert fp32.case_hash == Case(model="tiny", strategy="ref.ddp", world_size=2).case_hash
    # fp16 torch peers train as torch.amp documents it (GradScaler unscales fp32 gradients)
    assert Case(model="tiny", strategy="torch.ddp", world_size=2, precision="fp16").recipe == "amp"
    with pytest.raises(SuiteError, match="supported: amp"):
        validate_case(Case(model="tiny", strategy="torch.ddp", world_size=2, precision="fp16", recipe="master"))
    with pytest.raises(SuiteError, match="supported: master"):
        validate_case(mk("deepspeed.zero2", "amp"))
    with pytest.raises(ValueError, match="valid recipes: master, amp, fp8"):
        mk("ref.ddp", "fp4")


def test_records_made_before_recipes_read_as_what_ran_then():
    """A stored case without ``recipe`` gets its strategy's recipe of the time: the references'
    and DeepSpeed's bf16 kept bf16 parameters, the torch peers trained under autocast."""
    old = {"model": "tiny", "world_size": 2, "precision": "bf16"}
    assert Case.from_dict({**old, "strategy": "ref.zero2"}).recipe == "master"
    assert Case.from_dict({**old, "strategy": "torch.ddp"}).recipe == "amp"
    assert Case.from_dict({**old, "strategy": "ref.tp", "options": {"tp": 2}}).recipe == "amp"
    assert Case.from_dict({**old, "strategy": "torch.fsdp2"}).recipe == "master"


def test_suite_recipe_axis_runs_each_strategy_in_what_it_supports(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text(
        '[suite]\nname = "r"\n\n[[matrix]]\nmodel = "tiny"\nstrategy = ["ref.zero2", "deepspeed.zero2"]\n'
        'world_size = 2\nprecision = ["fp32", "bf16"]\nrecipe = ["master", "amp"]\n'
    )
    labels = sorted(c.label.split(" [")[0] for c in load_suite(str(path)).cases)
    assert labels == [
        "deepspeed.zero2 tiny w2 bf16-master mb2",
        "deepspeed.zero2 tiny w2 fp32 mb2",
        "ref.zero2 tiny w2 bf16-amp mb2",
        "ref.zero2 tiny w2 bf16-master mb2",
        "ref.zero2 tiny w2 fp32 mb2",
    ]
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[suite]\nname = "b"\n\n[[matrix]]\nmodel = "tiny"\nstrategy = "ref.ddp"\nworld_size = 2\nrecipe = "fp4"\n'
    )
    with pytest.raises(SuiteError, match=r"bad.toml:\d+: field 'recipe'.*valid recipes"):
        load_suite(str(bad))


def test_a_record_without_a_recipe_reads_its_rows_legacy_recipe():
    """A bf16 record made before cases named their recipe ran what its strategy's row says."""
    from parabench.registry import recipe_of

    assert recipe_of({"strategy": "torch.ddp", "precision": "bf16"}) == "amp"
    assert recipe_of({"strategy": "ref.zero1", "precision": "bf16"}) == "master"
    assert recipe_of({"strategy": "ref.zero1", "precision": "bf16", "recipe": "amp"}) == "amp"
    assert recipe_of({"strategy": "torch.ddp", "precision": "fp32"}) is None


def test_report_sets_one_strategy_in_both_recipes_apart():
    """The committed 1-GPU run has every strategy but DeepSpeed in both recipes: the recipe-effect
    table pairs each with itself (never with another strategy), and DeepSpeed, master only, is absent."""
    from pathlib import Path

    from parabench.report.recipe_effect import effect_rows
    from parabench.results import load_run

    run = Path(__file__).resolve().parent.parent / "results" / "h100x1" / "20261126-153915"
    rows = effect_rows([load_run(run)])
    pairs = {(r["strategy"], r["model"]) for r in rows}
    assert ("ref.ddp", "gpt-1.3b") in pairs and ("torch.ddp", "gpt-350m") in pairs
    assert not any(s.startswith("deepspeed.") for s, _ in pairs)
    assert len(rows) == len(pairs)  # one row per strategy and shape
    ddp = next(r for r in rows if (r["strategy"], r["model"]) == ("ref.ddp", "gpt-1.3b"))
    assert ddp["tps_ratio"] == ddp["master_tps"] / ddp["amp_tps"] and 1.0 < ddp["tps_ratio"] < 1.5
