"""The model-layout axis: the fused-qkv GPT computes what the separate one does, trains to the
single-process truth under the data-parallel references, moves the bytes the theory says, leaves
every old case hash alone, and is refused by the strategies that split q, k, v by heads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import assert_matches_single, payload_by_kind, run_cases, single_truth

from parabench.case import Case
from parabench.metrics import model_section
from parabench.models import build_model, model_config, parameter_count
from parabench.registry import expected
from parabench.suite import SuiteError, load_suite, validate_case

ROOT = Path(__file__).resolve().parent.parent
N_STEPS = 4
TOL = 1e-5


def test_fused_forward_is_the_separate_computation_on_the_split_weights():
    """q, k, v are the row blocks of qkv in that order. The key bias (which the separate layout
    lacks) is set non-zero: softmax cancels it, so the outputs still agree."""
    fused = build_model(model_config("tiny", layout="fused"), seed=3)
    separate = build_model(model_config("tiny"), seed=5)
    d = fused.cfg.d_model
    with torch.no_grad():
        for p in fused.parameters():  # every bias and LayerNorm non-trivial, so a misplaced one shows
            p.add_(0.05 * torch.randn_like(p))
        mine = dict(fused.named_parameters())
        for name, p in separate.named_parameters():
            block, _, rest = name.partition(".attn.")
            if rest[:2] in ("q.", "k.", "v."):
                i = "qkv".index(rest[0])
                p.copy_(mine[f"{block}.attn.qkv.{rest[2:]}"][i * d : (i + 1) * d])
            else:
                p.copy_(mine[name])
    assert mine["blocks.0.attn.qkv.bias"][d : 2 * d].abs().min() > 0  # the cancelled key bias
    tokens = torch.randint(0, fused.cfg.vocab_size, (2, fused.cfg.seq_len), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fused(tokens), separate(tokens), rtol=1e-5, atol=1e-5)


def test_tensor_counts_and_parameter_count():
    for layout, tensors in (("separate", 15), ("fused", 12)):
        cfg = model_config("tiny", layout=layout)
        model = build_model(cfg, 1)
        assert len(list(model.blocks[0].parameters())) == tensors
        assert sum(p.numel() for p in model.parameters()) == parameter_count(cfg)["total"]
    sep, fus = parameter_count(model_config("gpt-1.3b")), parameter_count(model_config("gpt-1.3b", layout="fused"))
    assert fus["total"] - sep["total"] == 24 * 2048  # one key bias per block
    assert fus["matmul"] == sep["matmul"]  # the same matmuls, so the same FLOPs per token


OPTIM = {"eps": 1e-6}  # as tests/test_reference_dp.py: keeps Adam from amplifying summation-order noise


def _case(strategy):
    return Case(model="tiny", strategy=strategy, world_size=2, layout="fused", micro_batch=2, lr=1e-3,
                device="cpu", options={"optim": OPTIM, "bucket_mb": 0.05})  # fmt: skip


CASES = {s: _case(s) for s in ("ref.ddp", "ref.zero3")}


@pytest.fixture(scope="module")
def trained():
    return run_cases(2, CASES, N_STEPS, meter_steps=(N_STEPS - 1,), measure_state_from=N_STEPS - 1)


@pytest.mark.parametrize("strategy", list(CASES))
def test_fused_layout_trains_as_one_process_and_moves_the_expected_bytes(trained, strategy):
    case, res = CASES[strategy], trained[strategy]
    truth = single_truth(case, N_STEPS)
    assert "blocks.0.attn.qkv.weight" in truth["params"] and "blocks.0.attn.q.weight" not in truth["params"]
    assert_matches_single(res, truth, loss_rtol=TOL, rtol=TOL, atol=1e-6)
    exp = expected(case, case.model_config(), 2)  # the fused model's parameter count and shapes
    for r in res["per_rank"]:
        assert r["state"] == exp["state_bytes"]
        got, want = payload_by_kind(r["comm"]), exp["comm_payload_bytes"]
        assert got.keys() == want.keys() and all(abs(got[k] - v) <= 0.01 * v for k, v in want.items()), (got, want)


def test_separate_layout_keeps_the_committed_hashes_labels_and_model_records():
    path = ROOT / "results/h100x2/20261126-180901/cases/552549841e549d52.json"  # ref.zero3 gpt-1.3b
    record = json.loads(path.read_text())
    case = Case.from_dict(record["case"])
    assert case.layout == "separate" and "layout" not in case.to_dict()
    assert case.case_hash == record["case_hash"] == path.stem
    assert case.label == record["label"]
    assert model_section(case) == {k: record["model"][k] for k in model_section(case)}
    fused = replace(case, layout="fused")
    assert fused.case_hash != case.case_hash and " fused " in fused.label
    assert Case.from_dict(fused.to_dict()).case_hash == fused.case_hash


def test_strategies_that_split_heads_refuse_the_fused_layout(tmp_path):
    tp = Case(model="tiny", strategy="ref.tp", world_size=2, layout="fused", options={"tp": 2})
    with pytest.raises(SuiteError, match=r"ref\.tp does not train the 'fused' model layout.*not a split by heads") as e:
        validate_case(tp)
    assert "ref.zero3" in str(e.value) and "torch.fsdp2" in str(e.value) and "ref.tp," not in str(e.value)
    with pytest.raises(ValueError, match="unknown model layout 'qkv'"):
        Case(model="tiny", strategy="ref.ddp", world_size=2, layout="qkv")
    # A layout list is an axis: each strategy runs in the layouts it takes.
    suite = tmp_path / "axis.toml"
    axis = 'model = "tiny"\nworld_size = 2\nlayout = ["separate", "fused"]\n'
    suite.write_text(
        f'[[matrix]]\nstrategy = "ref.zero3"\n{axis}[[matrix]]\nstrategy = "torch.tp"\noptions = {{tp = 2}}\n{axis}'
    )
    labels = sorted(c.label for c in load_suite(str(suite)).cases)
    assert labels == [
        "ref.zero3 tiny fused w2 fp32 mb2",
        "ref.zero3 tiny w2 fp32 mb2",
        "torch.tp tiny w2 fp32 mb2 [tp=2]",
    ]
    # A single value a strategy lacks is an error naming the file and the line.
    suite.write_text(
        '[[matrix]]\nmodel = "tiny"\nstrategy = "torch.tp"\nworld_size = 2\noptions = {tp = 2}\nlayout = "fused"\n'
    )
    with pytest.raises(SuiteError, match=r"axis\.toml:\d+: .*torch\.tp does not train the 'fused'"):
        load_suite(str(suite))
