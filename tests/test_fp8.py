"""The fp8 precision recipe (``parabench.fp8``): naming and hashing, where it is declared, why a
case is skipped without an sm_89+ GPU or without torchao, and which linears the conversion swaps.
Pure CPU: no float8 matmul runs here (torchao's Float8Linear is constructed, never called)."""

from __future__ import annotations

import pytest
import torch

import parabench.fp8 as fp8
from parabench.case import Case
from parabench.families import ROWS
from parabench.launch import LaunchOptions
from parabench.models import MODEL_LADDER, build_model
from parabench.recipes import recipe_name
from parabench.registry import STRATEGIES, expected, recipe_of
from parabench.runner import skip_reason
from parabench.suite import SuiteError, load_suite, validate_case
from parabench.topology import Topology
from parabench.trainer import TrainSpec

BLOCK_LINEARS = ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")


# the strategies that declare the fp8 recipe
# parabench's own rows: a test may register a strategy of its own (tests/test_add_strategy.py does,
# when its module is collected) and the registry then holds it in every test of the session
BUILT_IN = {row.name: row for row in ROWS}
FP8_STRATEGIES = {"single", "torch.ddp", "torch.fsdp2", "ref.ddp", "ref.zero1", "ref.zero2", "ref.zero3", "ref.fsdp"}


def mk(strategy: str, recipe: str | None, precision: str = "bf16", **kw) -> Case:
    return Case(model="tiny", strategy=strategy, world_size=2, precision=precision, recipe=recipe, **kw)


def test_fp8_is_a_named_hashed_bf16_recipe_of_the_strategies_that_declare_it():
    f, amp, master = mk("ref.ddp", "fp8"), mk("ref.ddp", "amp"), mk("ref.ddp", "master")
    assert len({f.case_hash, amp.case_hash, master.case_hash}) == 3
    assert " bf16-fp8 " in f.label and recipe_name("bf16", "fp8") == "bf16-fp8"
    assert recipe_of(f.to_dict()) == "fp8" and Case.from_dict(f.to_dict()).case_hash == f.case_hash
    # amp's layout: fp32 parameters, gradients and Adam states, fp32 on the wire
    assert f.param_precision == "fp32"
    cfg = MODEL_LADDER["tiny"]
    assert expected(f, cfg, 2)["state_bytes"] == expected(amp, cfg, 2)["state_bytes"]
    assert expected(f, cfg, 2)["comm_payload_bytes"] == expected(amp, cfg, 2)["comm_payload_bytes"]
    spec = TrainSpec(cfg, 0, torch.device("cpu"), "bf16", Topology(2, 0, 2), 2, recipe="fp8")
    assert spec.param_dtype == torch.float32 and spec.autocast_on
    declared = {n for n, s in BUILT_IN.items() if "fp8" in s.recipes_for("bf16")}
    assert declared == FP8_STRATEGIES
    assert all("fp8" not in s.recipes_for("fp16") for s in STRATEGIES.values())
    with pytest.raises(SuiteError, match="does not train fp16 in the 'fp8' recipe"):
        validate_case(mk("ref.ddp", "fp8", precision="fp16"))
    with pytest.raises(SuiteError, match="does not train bf16 in the 'fp8' recipe"):
        validate_case(mk("deepspeed.zero2", "fp8"))
    with pytest.raises(SuiteError, match="fp8_all_gather needs strategy torch.fsdp2 and recipe fp8"):
        validate_case(mk("torch.fsdp2", "amp", options={"fp8_all_gather": True}))


def test_suite_recipe_axis_adds_fp8_only_where_declared(tmp_path):
    path = tmp_path / "f.toml"
    path.write_text(
        '[suite]\nname = "f"\n\n[[matrix]]\nmodel = "tiny"\nstrategy = ["ref.zero2", "deepspeed.zero2"]\n'
        'world_size = 2\nprecision = "bf16"\nrecipe = ["master", "amp", "fp8"]\n'
    )
    labels = sorted(c.label.split(" [")[0] for c in load_suite(str(path)).cases)
    assert labels == [
        "deepspeed.zero2 tiny w2 bf16-master mb2",
        "ref.zero2 tiny w2 bf16-amp mb2",
        "ref.zero2 tiny w2 bf16-fp8 mb2",
        "ref.zero2 tiny w2 bf16-master mb2",
    ]
    suite = load_suite("suites/fp8-gpu.toml")  # the committed GPU suite parses, fp8 in each matrix
    assert {c.strategy for c in suite.cases if c.recipe == "fp8"} == {
        "ref.ddp",
        "ref.zero2",
        "torch.ddp",
        "torch.fsdp2",
    }


def test_fp8_case_on_cpu_is_skipped_with_the_reason(monkeypatch):
    case = mk("ref.ddp", "fp8", device="cpu")
    assert skip_reason(mk("ref.ddp", "amp", device="cpu"), LaunchOptions()) is None
    monkeypatch.setattr(fp8, "torchao_available", lambda: True)
    reason = skip_reason(case, LaunchOptions())
    assert "compute capability >= 8.9" in reason and "runs on cpu" in reason
    assert "8.0" in fp8.skip_reason("cuda", (8, 0))  # A100: no float8 matmuls
    assert fp8.skip_reason("cuda", (9, 0)) is None  # H100
    monkeypatch.setattr(fp8, "torchao_available", lambda: False)
    reason = skip_reason(case, LaunchOptions())
    assert "install parabench[fp8]" in reason and fp8.TORCHAO_VERSION in reason
    with pytest.raises(RuntimeError, match=r"install parabench\[fp8\]"):
        fp8.convert(build_model(MODEL_LADDER["tiny"], 0))


def test_block_float8_numel_counts_the_block_linears():
    d = MODEL_LADDER["gpt-1.3b"].d_model
    assert fp8.block_float8_numel(MODEL_LADDER["gpt-1.3b"]) == 12 * d * d  # q, k, v, proj: d²; fc, proj: 4d²


def test_fp8_all_gather_expects_one_all_reduce_of_the_float8_scales():
    """torchao's precompute_float8_dynamic_scale_for_fsdp: one fp32 amax per float8 weight, one
    all-reduce a step (not per micro-batch), beside the float8 gathers."""
    cfg = MODEL_LADDER["tiny"]
    plain = expected(mk("torch.fsdp2", "fp8"), cfg, 2)["comm_payload_bytes"]
    gathered = expected(mk("torch.fsdp2", "fp8", options={"fp8_all_gather": True}), cfg, 2)["comm_payload_bytes"]
    accumulated = expected(mk("torch.fsdp2", "fp8", grad_accum=2, options={"fp8_all_gather": True}), cfg, 2)[
        "comm_payload_bytes"
    ]
    assert "all_reduce" not in plain
    assert fp8.block_float8_linears(cfg) == len(BLOCK_LINEARS)
    assert gathered["all_reduce"] == accumulated["all_reduce"] == 4 * cfg.n_layers * len(BLOCK_LINEARS)
    assert gathered["all_gather"] < plain["all_gather"]


def _float8_names(model) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear

    return {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}


@pytest.mark.parametrize("builder", ["peer", "reference"])
def test_conversion_swaps_exactly_the_block_linears(builder):
    pytest.importorskip("torchao.float8", reason="parabench[fp8] not installed")
    from parabench.builders.data_parallel import reference_model
    from parabench.families.data_parallel import DataParallelOptions
    from parabench.peers.common import recipe_module

    cfg = MODEL_LADDER["tiny"]
    spec = TrainSpec(cfg, 7, torch.device("cpu"), "bf16", Topology(1, 0), 2, recipe="fp8")
    before = {n: p.detach().clone() for n, p in build_model(cfg, 7).named_parameters()}
    if builder == "peer":
        model = recipe_module(build_model(cfg, 7), spec)
    else:
        model = reference_model(spec, DataParallelOptions())
    want = {f"blocks.{i}.{name}" for i in range(cfg.n_layers) for name in BLOCK_LINEARS}
    assert _float8_names(model) == want
    assert type(model.head) is torch.nn.Linear and type(model.tok_emb) is torch.nn.Embedding
    # the same parameters, values and names, in fp32 (amp's layout): nothing re-initialised or cast
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n], before[n]) for n in before)


def test_conversion_leaves_routers_and_odd_widths_alone():
    pytest.importorskip("torchao.float8", reason="parabench[fp8] not installed")
    moe = fp8.convert(build_model(MODEL_LADDER["tiny-moe"], 0))
    names = _float8_names(moe)
    routers = {n for n, _ in moe.named_modules() if n.endswith(".router")}
    assert routers and not routers & names  # the router's width is the expert count
    assert "blocks.1.mlp.experts.0.fc" in names and not any(n.startswith("head") for n in names)
    odd = torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.Linear(40, 64), torch.nn.Linear(64, 64))
    assert _float8_names(fp8.convert(odd)) == {"2"}  # 40 is no multiple of 16


def test_emulated_fp8_training_tracks_amp_on_the_same_data(monkeypatch):
    """torchao's emulation (real float8 casts and scales, high-precision product) on the CPU: the fp8
    recipe trains, stays within a few per mille of amp's loss and is not amp (the casts happened)."""
    pytest.importorskip("torchao.float8", reason="parabench[fp8] not installed")
    from tests.harness import single_truth

    monkeypatch.setattr(fp8, "EMULATE", True)
    f, a = (
        single_truth(Case(model="tiny", strategy="single", world_size=1, precision="bf16", recipe=r, lr=3e-3), 8)
        for r in ("fp8", "amp")
    )
    assert f["losses"][-1] < f["losses"][0] - 0.1  # it learns
    assert f["losses"] != a["losses"]
    assert max(abs(x - y) / y for x, y in zip(f["losses"], a["losses"])) < 5e-3


def test_report_sets_fp8_beside_each_bf16_recipe_of_the_same_case():
    from parabench.report.recipe_effect import fp8_rows, table_specs

    def record(recipe, tps, peak, losses, strategy="ref.ddp", **options):
        case = mk(strategy, recipe, options=options).to_dict()
        metrics = {"tokens_per_s_per_device": tps, "peak_alloc_bytes": peak, "losses": losses}
        return {"status": "ok", "case": case, "metrics": metrics}

    tail = [3.0] * 20
    records = [
        record("amp", 100.0, 2**31, [9.0] * 5 + tail),
        record("master", 120.0, 2**30, [9.0] * 5 + [2.9] * 20),
        record("fp8", 150.0, 2**31, [9.0] * 5 + [3.1] * 20),
        record("fp8", 150.0, 2**31, tail, strategy="torch.ddp"),  # no bf16 recipe beside it: no row
        record("fp8", 110.0, 2**31, tail, fp8_filter="auto"),  # an fp8 variant: its own row beside amp
    ]
    rows = fp8_rows([({"suite": "s", "run_id": "r"}, records)])
    assert [(r["strategy"], r["fp8_options"], r["base"]) for r in rows] == [
        ("ref.ddp", "", "bf16-amp"),
        ("ref.ddp", "", "bf16-master"),
        ("ref.ddp", "fp8_filter=auto", "bf16-amp"),
        ("ref.ddp", "fp8_filter=auto", "bf16-master"),
    ]
    amp, master, auto_amp, _ = rows
    assert auto_amp["tps_ratio"] == pytest.approx(1.1)
    assert amp["tps_ratio"] == 1.5 and amp["mem_ratio"] == 1.0 and master["mem_ratio"] == 2.0
    assert amp["loss_diff"] == pytest.approx(0.1) and master["loss_diff"] == pytest.approx(0.2)  # last 10 steps
    assert [s["id_"] for s in table_specs([({"suite": "s", "run_id": "r"}, records)], [])] == [
        "recipe-effect",
        "fp8-effect",
    ]


# --- option fp8_filter ---------------------------------------------------------------------------


def _torchao_tensorwise_keeps(cfg) -> set[str]:
    """The block linears torchao's own tensorwise auto filter converts, asked module by module."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_tensorwise

    from parabench.models import Block

    with torch.device("meta"):
        block = Block(cfg, 0)
    return {
        n
        for n, m in block.named_modules()
        if isinstance(m, torch.nn.Linear) and _auto_filter_for_tensorwise(m, f"blocks.0.{n}", filter_fqns=["head"])
    }


@pytest.mark.parametrize(("model", "auto_keeps"), [("gpt-350m", {"mlp.fc"}), ("gpt-1.3b", set(BLOCK_LINEARS))])
def test_auto_filter_is_torchaos_choice_and_the_theory_counts_follow_it(model, auto_keeps):
    """torchao's rule skips a linear of K <= 4096 and N <= 1024: at d 1024 every linear but mlp.fc
    (N 4096); at d 2048 none. The theory's float8 counts are those of the chosen filter."""
    pytest.importorskip("torchao.float8", reason="parabench[fp8] not installed")
    cfg = MODEL_LADDER[model]
    d = cfg.d_model
    assert _torchao_tensorwise_keeps(cfg) == auto_keeps
    assert set(fp8.block_float8_weights(cfg, "auto")) == auto_keeps
    assert set(fp8.block_float8_weights(cfg, "all")) == set(BLOCK_LINEARS)
    assert fp8.block_float8_numel(cfg, "all") == 12 * d * d and fp8.block_float8_linears(cfg, "all") == 6
    want_numel = 4 * d * d if model == "gpt-350m" else 12 * d * d
    assert fp8.block_float8_numel(cfg, "auto") == want_numel
    assert fp8.block_float8_linears(cfg, "auto") == len(auto_keeps)
    with pytest.raises(ValueError, match="valid values: all, auto"):
        fp8.module_filter("small")


def test_fsdp2_float8_gather_theory_follows_the_filter():
    """torch.fsdp2 with fp8_all_gather: only the converted weights travel in 1 byte and carry a scale."""
    pytest.importorskip("torchao.float8", reason="parabench[fp8] not installed")
    cfg = MODEL_LADDER["gpt-350m"]
    d, blocks = cfg.d_model, cfg.n_layers

    def comm(**opts):
        case = Case(
            model="gpt-350m", strategy="torch.fsdp2", world_size=2, precision="bf16", recipe="fp8", options=opts
        )
        return expected(case, cfg, 2)["comm_payload_bytes"]

    plain, every, auto = comm(), comm(fp8_all_gather=True), comm(fp8_all_gather=True, fp8_filter="auto")
    assert every["all_reduce"] == 4 * blocks * 6 and auto["all_reduce"] == 4 * blocks * 1
    # tuned FSDP2 reshards every block after forward (torchtitan): 2L block gathers, 3 bytes saved per element
    gathers = 2 * blocks
    assert plain["all_gather"] - every["all_gather"] == gathers * 12 * d * d * 3
    assert plain["all_gather"] - auto["all_gather"] == gathers * 4 * d * d * 3
    assert comm(fp8_filter="auto") == plain  # without the float8 all-gather the filter changes no traffic


def test_fp8_filter_option_is_validated_hashed_and_labelled():
    auto, every, default = (
        mk("ref.zero2", "fp8", options=o) for o in ({"fp8_filter": "auto"}, {"fp8_filter": "all"}, {})
    )
    for case in (auto, every, default):
        validate_case(case)
    assert len({auto.case_hash, every.case_hash, default.case_hash}) == 3
    assert "fp8_filter=auto" in auto.label and "fp8_filter" not in default.label
    with pytest.raises(SuiteError, match=r"option fp8_filter must be 'all' \| 'auto', got 'small'"):
        validate_case(mk("torch.fsdp2", "fp8", options={"fp8_filter": "small"}))
    for case in (
        mk("ref.zero2", "amp", options={"fp8_filter": "auto"}),
        mk("torch.ddp", "master", options={"fp8_filter": "all"}),
        mk("deepspeed.zero2", "master", options={"fp8_filter": "auto"}),
        mk("ref.ddp", None, precision="fp32", options={"fp8_filter": "auto"}),
    ):
        with pytest.raises(SuiteError, match=r"option fp8_filter \('all' or 'auto'\) picks the linears of the fp8"):
            validate_case(case)
    with pytest.raises(SuiteError, match="unknown option 'fp8_filter'"):  # a strategy without the fp8 recipe
        validate_case(mk("torch.tp", "amp", options={"fp8_filter": "auto"}))


def test_fp8_peers_suite_runs_auto_beside_all_and_amp_at_350m():
    cases = [c for c in load_suite("suites/studies/fp8-peers-gpu.toml").cases if c.model == "gpt-350m"]
    got = {(c.strategy, c.recipe, c.options.get("fp8_filter", "all")) for c in cases}
    assert got == {
        (s, r, f) for s in ("ref.zero2", "torch.fsdp2") for r, f in (("amp", "all"), ("fp8", "all"), ("fp8", "auto"))
    }
    assert all(c.world_size == 2 and c.micro_batch == 8 and c.options["compile"] for c in cases)


def _converted_by_every_fp8_strategy(fp8_filter: str) -> dict:
    """Rank-local, world 1: build every strategy that takes the fp8 recipe on a one-block model of
    gpt-350m's widths; per strategy, what ``convert`` recorded (the worker's ``strategy_stats.float8``)."""
    import dataclasses

    from parabench.topology import build_topology

    cfg = dataclasses.replace(MODEL_LADDER["gpt-350m"], n_layers=1, vocab_size=256, seq_len=16)
    topo = build_topology("cpu")
    out = {}
    for name in sorted(n for n, s in BUILT_IN.items() if "fp8" in s.recipes_for("bf16")):
        opts = {"fp8_filter": fp8_filter}
        spec = TrainSpec(cfg, 0, torch.device("cpu"), "bf16", topo, 1, options=opts, recipe="fp8")
        with fp8.recorded_conversions() as conversions:
            trainer = STRATEGIES[name].build(spec)
        (out[name],) = conversions
        trainer.close()
    return out, _recorded_float8()


def _recorded_float8() -> dict:
    """Rank-local: a tiny fp8 case (fp8_filter all) through the worker, float8 emulated; its rank's
    strategy_stats."""
    from parabench.worker import run_case

    fp8.EMULATE = True
    options = {"fp8_filter": "all", "roofline": False, "telemetry": False}
    case = Case(
        model="tiny",
        strategy="single",
        world_size=1,
        precision="bf16",
        recipe="fp8",
        device="cpu",
        steps=1,
        warmup=0,
        options=options,
    )
    return run_case(case, torch.device("cpu"))["per_rank"][0]["strategy_stats"]


def test_every_fp8_strategy_converts_what_the_filter_picks():
    pytest.importorskip("torchao.float8", reason="parabench[fp8] not installed")
    from parabench.distributed import run_on_gloo

    ((auto, recorded),) = run_on_gloo(_converted_by_every_fp8_strategy, 1, "auto")
    tiny = MODEL_LADDER["tiny"]
    assert recorded["float8"] == {  # the worker records what the builder converted, per rank
        "fp8_filter": "all",
        "float8_linears": 6 * tiny.n_layers,
        "float8_linears_per_block": [6] * tiny.n_layers,
        "block_modules": sorted(BLOCK_LINEARS),
        "float8_numel": tiny.n_layers * fp8.block_float8_numel(tiny),
    }
    assert set(auto) == FP8_STRATEGIES
    d = MODEL_LADDER["gpt-350m"].d_model
    want = {
        "fp8_filter": "auto",
        "float8_linears": 1,
        "float8_linears_per_block": [1],
        "block_modules": ["mlp.fc"],
        "float8_numel": 4 * d * d,
    }
    assert all(summary == want for summary in auto.values()), auto


def test_skipped_auto_case_without_torchao_is_recorded_without_theory(monkeypatch):
    """Which linears "auto" converts is torchao's answer: without torchao the case is skipped with
    the install hint and its record says no theory rather than failing to be written."""
    from parabench.record import build_record

    case = mk("torch.fsdp2", "fp8", device="cuda", options={"fp8_filter": "auto", "fp8_all_gather": True})
    monkeypatch.setattr(fp8, "torchao_available", lambda: False)
    reason = fp8.skip_reason("cuda", (9, 0))
    assert "install parabench[fp8]" in reason
    rec = build_record(case, "skipped", error={"message": reason})
    assert rec["theory"] is None and rec["status"] == "skipped"
    monkeypatch.setattr(fp8, "torchao_available", lambda: True)
    assert build_record(case, "skipped", error={"message": "x"})["theory"] is not None


def test_a_conversion_is_credited_to_the_scope_it_ran_in_only():
    pytest.importorskip("torchao.float8", reason="parabench[fp8] not installed")
    cfg = MODEL_LADDER["tiny"]
    fp8.convert(build_model(cfg, 0))  # outside any scope: reported nowhere
    with fp8.recorded_conversions() as outer:
        with fp8.recorded_conversions() as inner:
            fp8.convert(build_model(cfg, 0))
        assert len(inner) == 1 and inner[0]["float8_linears"] == 6 * cfg.n_layers
        assert outer == []
        fp8.convert(build_model(cfg, 0), "all")
    assert len(outer) == 1
