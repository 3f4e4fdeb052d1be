"""The fp8 precision recipe (``parabench.fp8``): naming and hashing, where it is declared, why a
case is skipped without an sm_89+ GPU or without torchao, and which linears the conversion swaps.
Pure CPU: no float8 matmul runs here (torchao's Float8Linear is constructed, never called)."""

from __future__ import annotations

import pytest
import torch

import parabench.fp8 as fp8
from parabench.case import Case
from parabench.models import MODEL_LADDER, build_model
from parabench.recipes import recipe_name, recipe_of
from parabench.runner import LaunchOptions, skip_reason
from parabench.strategies import STRATEGIES, TrainSpec
from parabench.suite import SuiteError, load_suite, validate_case
from parabench.theory import expected
from parabench.topology import Topology

BLOCK_LINEARS = ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")


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
    declared = {n for n, s in STRATEGIES.items() if "fp8" in s.recipes_for("bf16")}
    assert declared == {
        "single",
        "torch.ddp",
        "torch.fsdp2",
        "ref.ddp",
        "ref.zero1",
        "ref.zero2",
        "ref.zero3",
        "ref.fsdp",
    }
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
    from parabench.families.data_parallel import DataParallelOptions, reference_model
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

    def record(recipe, tps, peak, losses, strategy="ref.ddp"):
        case = mk(strategy, recipe).to_dict()
        metrics = {"tokens_per_s_per_device": tps, "peak_alloc_bytes": peak, "losses": losses}
        return {"status": "ok", "case": case, "metrics": metrics}

    tail = [3.0] * 20
    records = [
        record("amp", 100.0, 2**31, [9.0] * 5 + tail),
        record("master", 120.0, 2**30, [9.0] * 5 + [2.9] * 20),
        record("fp8", 150.0, 2**31, [9.0] * 5 + [3.1] * 20),
        record("fp8", 150.0, 2**31, tail, strategy="torch.ddp"),  # no bf16 recipe beside it: no row
    ]
    rows = fp8_rows([({"suite": "s", "run_id": "r"}, records)])
    assert [(r["strategy"], r["base"]) for r in rows] == [("ref.ddp", "bf16-amp"), ("ref.ddp", "bf16-master")]
    amp, master = rows
    assert amp["tps_ratio"] == 1.5 and amp["mem_ratio"] == 1.0 and master["mem_ratio"] == 2.0
    assert amp["loss_diff"] == pytest.approx(0.1) and master["loss_diff"] == pytest.approx(0.2)  # last 10 steps
    assert [s["id_"] for s in table_specs([({"suite": "s", "run_id": "r"}, records)], [])] == [
        "recipe-effect",
        "fp8-effect",
    ]
