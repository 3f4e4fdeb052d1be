"""Attention priced at its own measured rate (parabench.plan.attention): the fit recovers the rate
law it assumes, and the step model moves exactly the attention FLOPs off the matmul rate."""

import json

import pytest

from parabench.models import model_config
from parabench.plan import attention as A
from parabench.plan import calibrate as C
from parabench.plan import model as M
from parabench.plan.workload import for_config
from tests.test_plan import COLLECTIVES

TRUE = {"t0_s": 2.5e-4, "seq_half": 640, "rate_inf_flops": {"64": 420e12, "128": 470e12}}


def _timings(table=TRUE):
    """A synthetic sdpa-head-width grid made by the law itself, 2 % apart from it either way."""
    rows = []
    for i, (hd, heads) in enumerate(((64, 16), (128, 16))):
        for seq in (2048, 4096):
            for batch in (1, 2, 4, 8):
                rate = table["rate_inf_flops"][str(hd)] * seq / (seq + table["seq_half"])
                t = table["t0_s"] + A.attention_flops(batch, heads, seq, hd) / rate
                t *= 1.02 if (batch + i) % 2 else 0.98
                rows.append({"batch": batch, "seq_len": seq, "heads": heads, "head_width": hd, "attention_ms": t * 1e3})
    return rows


def test_the_fit_recovers_the_rate_law_it_assumes():
    pts = A._points({"rows": _timings()})
    fit = A.fit(pts)
    assert fit["t0_s"] == pytest.approx(TRUE["t0_s"], rel=0.15)
    assert fit["seq_half"] == pytest.approx(TRUE["seq_half"], abs=256)
    for hd, r in TRUE["rate_inf_flops"].items():
        assert fit["rate_inf_flops"][hd] == pytest.approx(r, rel=0.05)
    assert fit["fit_median_pct"] <= 2.5  # no worse than the noise put in


def test_rate_rises_with_the_sequence_and_takes_the_nearest_head_width():
    assert A.rate(TRUE, 64, 2048) < A.rate(TRUE, 64, 4096) < TRUE["rate_inf_flops"]["64"]
    assert A.rate(TRUE, 80, 2048) == A.rate(TRUE, 64, 2048)  # 80 is nearer 64 than 128
    assert A.rate(TRUE, 96, 2048) == A.rate(TRUE, 128, 2048)  # a tie goes to the wider
    # a call's seconds are its FLOPs at that rate, without the isolated call's t0
    assert A.flops_s(TRUE, 4, 16, 2048, 128) == pytest.approx(
        A.attention_flops(4, 16, 2048, 128) / A.rate(TRUE, 128, 2048)
    )


def test_calibration_reads_the_timings_of_its_own_device_kind_only(tmp_path):
    run = tmp_path / "sdpa-head-width-h100x1"
    run.mkdir()
    doc = {"schema_version": 2, "kind": A.KIND, "torch": "x", "rows": _timings()}
    (run / "a.json").write_text(json.dumps({**doc, "device": "NVIDIA H100 80GB HBM3"}))
    (run / "b.json").write_text(json.dumps({**doc, "device": "NVIDIA A100-SXM4-80GB", "rows": _timings()[:3]}))
    h100 = C.fit_attention(tmp_path, "h100")
    assert h100["points"] == len(_timings()) and h100["source"].endswith("a.json")
    assert C.fit_attention(tmp_path, "h200") is None


@pytest.mark.parametrize("options", [{}, {"activation_checkpointing": True}, {"tp": 2}])
def test_attention_flops_leave_the_matmul_rate_for_their_own(options):
    """With a rate table the matmul features lose exactly the convention's attention FLOPs (12 s d
    per token and layer, 16 recomputed) and attn_s carries one call per block and pass of the
    rank's heads; without one nothing moves."""
    strategy = "ref.tp" if "tp" in options else "ref.ddp"
    w = for_config(
        model="gpt-350m", cfg=model_config("gpt-350m"), strategy=strategy, world_size=2, micro_batch=4, options=options
    )
    plain = M.time_features(w, COLLECTIVES, M.time_constants({}))
    priced = M.time_features(w, COLLECTIVES, M.time_constants({"attention": TRUE}))
    ck = 4 / 3 if w.checkpointing else 1.0
    flops = w.tokens_per_step / w.world_size * 12 * w.n_layers * w.seq_len * w.d_model * ck
    assert plain["attn_s"] == 0.0
    assert plain["inv_rate"] - priced["inv_rate"] == pytest.approx(flops)
    assert plain["inv_rate_x"] - priced["inv_rate_x"] == pytest.approx(flops / w.gemm_size)
    call = A.flops_s(TRUE, w.rows, w.n_heads / w.tp, w.seq_len, w.d_model // w.n_heads)
    assert priced["attn_s"] == pytest.approx(w.n_layers * w.passes * call * ck)
    # in a prediction the compute part trades the FLOPs' matmul-rate seconds for attention's own
    cal = {"peak_flops": 989.4e12, "time": {"attention": TRUE}, "memory": {}, "collectives": COLLECTIVES}
    c = M.time_constants({})
    moved = M.predict(w, cal).time_s["compute"] - M.predict(w, {**cal, "time": {}}).time_s["compute"]
    assert moved == pytest.approx(priced["attn_s"] - flops * c["inv_rate"] - flops / w.gemm_size * c["inv_rate_x"])


def test_a_pipeline_stage_prices_attention_as_the_step_does():
    """The stages' F/B costs hold the same attention seconds as the step's features: summed over
    stages and micro-batches, per-micro-batch work is the same with and without pipelining."""
    cfg = model_config("gpt-350m")
    w = for_config(
        model="gpt-350m",
        cfg=cfg,
        strategy="ref.pp_1f1b",
        world_size=2,
        micro_batch=8,
        options={"pp": 2, "microbatches": 4},
    )
    consts = M.time_constants({"inv_rate": 1 / 790e12, "attention": TRUE})
    without = M.time_constants({"inv_rate": 1 / 790e12})
    moved = sum(map(sum, M.pipeline_op_costs(w, consts))) - sum(map(sum, M.pipeline_op_costs(w, without)))
    attn_flops, attn_s = M.attention_per_block(w, consts)
    per_microbatch_stage_sum = (attn_s - attn_flops / 790e12) * w.n_layers
    assert moved == pytest.approx(per_microbatch_stage_sum, rel=1e-9)
