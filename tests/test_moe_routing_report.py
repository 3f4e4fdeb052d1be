"""The report's expert-routing section (``parabench.report.moe_routing``): expert load imbalance per
layer from the routing every rank recorded, drops, padding, the all-to-all, the collapse flag, and the
failed MoE cases with their diagnosis; from synthetic records and from the committed 2-GPU run
(deepspeed.moe on gpt-350m-moe, whose routing collapsed)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from markupsafe import escape

from parabench.report import moe_routing
from parabench.report.html import render_report
from parabench.results import load_run

ROOT = Path(__file__).resolve().parent.parent
GPU_RUN = ROOT / "results" / "cp-ep-gpu" / "20261126-064921"


def _record(
    strategy,
    model,
    per_rank_layers,
    *,
    n_experts,
    top_k,
    capacity_factor=None,
    status="ok",
    error=None,
    a2a=(1000, 4),
    tokens_per_s=1234.5,
    step_s=0.02,
):
    """A result record as the runner writes it, with ``per_rank_layers[rank][layer]`` as the routing stats."""
    label = f"{strategy} {model} w2 fp32 mb2"
    case = {
        "model": model,
        "strategy": strategy,
        "world_size": 2,
        "precision": "fp32",
        "micro_batch": 2,
        "grad_accum": 1,
        "steps": 2,
        "seq_len": 64,
        "options": {},
    }
    rec = {
        "schema_version": 1,
        "kind": "case",
        "case": case,
        "case_hash": hashlib.sha256(label.encode()).hexdigest()[:16],
        "label": label,
        "status": status,
        "error": error,
        "model": {
            "name": model,
            "config": {
                "n_layers": 4,
                "d_model": 32,
                "n_heads": 4,
                "vocab_size": 256,
                "seq_len": 64,
                "n_experts": n_experts,
                "top_k": top_k,
                "capacity_factor": capacity_factor,
            },
        },
    }
    if status == "ok":
        rec["metrics"] = {"tokens_per_s": tokens_per_s, "step_time_s_median": step_s}
        rec["per_rank"] = [
            {
                "rank": i,
                "strategy_stats": {"ep": len(per_rank_layers), "moe_layers": layers},
                "comm": {"by_kind": {"all_to_all": {"payload_bytes": a2a[0] + 8 * i, "calls": a2a[1]}}},
            }
            for i, layers in enumerate(per_rank_layers)
        ]
    return rec


def _write_run(root: Path, run_id: str, records: list[dict]) -> Path:
    run = root / run_id
    (run / "cases").mkdir(parents=True)
    (run / "manifest.json").write_text(
        json.dumps({"schema_version": 1, "kind": "manifest", "suite": "moe-test", "run_id": run_id, "devices": []})
    )
    for r in records:
        (run / "cases" / f"{r['case_hash']}.json").write_text(json.dumps(r))
    return run


def _ds(tokens, dropped, padding, sent=48):
    return {
        "tokens_per_expert": tokens,
        "routed_per_expert": tokens,
        "capacity": 12,
        "dropped": dropped,
        "sent_rows": sent,
        "received_rows": sent,
        "padding_rows": padding,
    }


def _ep(tokens, dropped=0):
    return {
        "tokens_per_expert": tokens,
        "received_per_local_expert": [0, 0],
        "sent_rows": sum(tokens),
        "received_rows": sum(tokens),
        "dropped": dropped,
    }


BALANCED = _record(
    "deepspeed.moe",
    "tiny-moe-cap1",
    [
        {"1": _ds([10, 10, 10, 10], 2, 3), "3": _ds([12, 8, 10, 10], 1, 5)},
        {"1": _ds([10, 10, 10, 10], 0, 2), "3": _ds([12, 8, 10, 10], 3, 4)},
    ],
    n_experts=4,
    top_k=2,
    capacity_factor=1.0,
    a2a=(196608, 4),
)
COLLAPSED = _record(
    "ref.ep",
    "wide-moe",
    [  # layer 1: every token to experts 6 and 7, both on rank 1
        {"1": _ep([0, 0, 0, 0, 0, 0, 30, 30]), "3": _ep([5] * 8)},
        {"1": _ep([0, 0, 0, 0, 0, 0, 34, 34]), "3": _ep([5] * 8)},
    ],
    n_experts=8,
    top_k=2,
)
STARVED = _record(
    "ref.ep",
    "top1-moe",
    [  # 2.0 is far below E/k = 4, but rank 0's experts got nothing
        {"1": _ep([0, 0, 6, 4])},
        {"1": _ep([0, 0, 4, 6])},
    ],
    n_experts=4,
    top_k=1,
)
UNEVEN = _record(
    "ref.ep",
    "uneven-moe",
    [  # 3.5 < 0.9 * 8/2 = 3.6 and no rank starved: not collapsed
        {"1": _ep([14, 2, 0, 0, 2, 0, 0, 14])},
        {"1": _ep([14, 2, 0, 0, 2, 0, 0, 14])},
    ],
    n_experts=8,
    top_k=2,
)
FAILED = _record(
    "ref.ep",
    "tiny-moe",
    [],
    n_experts=4,
    top_k=2,
    status="crashed",
    error={
        "message": "launcher exited with status -6 <SIGABRT> & no exception",
        "diagnosis": "A deadlock: rank 0's experts got <no rows> in layer 5.",
    },
)
DENSE = {
    "schema_version": 1,
    "kind": "case",
    "label": "ref.ddp tiny w2 fp32 mb2",
    "case_hash": hashlib.sha256(b"ref.ddp tiny w2 fp32 mb2").hexdigest()[:16],
    "status": "ok",
    "case": {
        "model": "tiny",
        "strategy": "ref.ddp",
        "world_size": 2,
        "precision": "fp32",
        "micro_batch": 2,
        "grad_accum": 1,
        "steps": 2,
    },
    "metrics": {"tokens_per_s": 1000.0, "step_time_s_median": 0.01},
    "per_rank": [{"rank": 0, "strategy_stats": {"ep": 2, "moe_layers": {"1": _ep([1, 0])}}}],
}


@pytest.fixture()
def synthetic_run(tmp_path) -> Path:
    return _write_run(tmp_path, "synthetic", [BALANCED, COLLAPSED, STARVED, UNEVEN, FAILED, DENSE])


def test_rows_from_synthetic_routing(synthetic_run):
    cases, layers, failed = moe_routing.routing_rows([load_run(synthetic_run)])
    by = {r["model"]: r for r in cases}
    assert sorted(by) == ["tiny-moe-cap1", "top1-moe", "uneven-moe", "wide-moe"]  # DENSE and FAILED are not rows

    b = by["tiny-moe-cap1"]  # global loads [20]*4 (1.0) and [24, 16, 20, 20] (24/20 = 1.2)
    assert [lay["load"] for lay in b["per_layer"]] == [[20, 20, 20, 20], [24, 16, 20, 20]]
    assert [lay["imbalance"] for lay in b["per_layer"]] == [1.0, pytest.approx(1.2)]
    assert (b["worst_layer"], b["worst_imbalance"], b["worst_zero_experts"]) == ("3", pytest.approx(1.2), 0)
    assert (b["dropped"], b["padding_rows"]) == (2 + 1 + 0 + 3, 3 + 5 + 2 + 4)
    assert b["padding_pct"] == pytest.approx(14 / (4 * 48) * 100)
    assert (b["a2a_bytes"], b["a2a_calls"], b["a2a_MiB"]) == (196608, 4, 0.1875)  # rank 0's, not rank 1's
    assert (b["ceiling"], b["collapsed_layers"], b["starved_layers"], b["collapsed"]) == (2.0, 0, 0, "no")
    assert (b["shape"], b["experts"], b["capacity"], b["step_time_ms"]) == (
        "2 x 64",
        "4 (top-2, ep 2)",
        "factor 1.0",
        20.0,
    )

    c = by["wide-moe"]  # layer 1: [0]*6 + [64, 64] over 128 assignments: max/mean = 64/16 = 4.0 = E/k
    assert c["per_layer"][0]["load"] == [0, 0, 0, 0, 0, 0, 64, 64]
    assert (c["worst_layer"], c["worst_imbalance"], c["worst_zero_experts"]) == ("1", 4.0, 6)
    assert c["per_layer"][0]["starved_ranks"] == [0] and c["per_layer"][1]["starved_ranks"] == []
    assert (c["dropped"], c["padding_rows"], c["padding_pct"]) == (0, None, None)  # ref.ep pads nothing
    assert (c["collapsed_layers"], c["starved_layers"], c["collapsed"], c["capacity"]) == (1, 1, "yes", "dropless")

    s = by["top1-moe"]  # [0, 0, 10, 10]: 2.0, below 0.9 * 4/1, but rank 0 starved
    assert (s["worst_imbalance"], s["worst_zero_experts"], s["collapsed_layers"], s["starved_layers"]) == (2.0, 2, 0, 1)
    assert s["collapsed"] == "yes"

    u = by["uneven-moe"]  # [28, 4, 0, 0, 4, 0, 0, 28]: 28/8 = 3.5 < 3.6, both ranks hold a busy expert
    assert (u["worst_imbalance"], u["worst_zero_experts"], u["collapsed"]) == (3.5, 4, "no")

    assert [(r["model"], r["layer"], r["load"], r["starved_ranks"]) for r in layers if r["model"] == "wide-moe"] == [
        ("wide-moe", 1, "0 0 0 0 0 0 64 64", "0"),
        ("wide-moe", 3, "10 10 10 10 10 10 10 10", "none"),
    ]
    assert [(f["label"], f["status"]) for f in failed] == [("ref.ep tiny-moe w2 fp32 mb2", "crashed")]
    assert failed[0]["diagnosis"] == "A deadlock: rank 0's experts got <no rows> in layer 5."


def test_section_flags_collapse_and_escapes_text(synthetic_run):
    page = render_report([synthetic_run], with_figures=False)
    for id_ in ("moe-routing", "moe-routing-layers", "moe-routing-failed"):
        assert f'id="tbl-{id_}"' in page
    assert (
        "Routing collapsed at initialisation on this synthetic data in ref.ep top1-moe w2 fp32 mb2; "
        "ref.ep wide-moe w2 fp32 mb2:" in page
    )  # the collapsed cases only, in row order
    assert (
        page.index('id="tbl-moe-routing"')
        < page.index("Routing collapsed at initialisation")
        < page.index('id="tbl-moe-routing-layers"')
    )  # under its table
    assert "<SIGABRT>" not in page and "&lt;SIGABRT&gt; &amp; no exception" in page
    assert "got &lt;no rows&gt; in layer 5" in page and "<no rows>" not in page
    table = page[page.index('id="tbl-moe-routing"') : page.index('id="tbl-moe-routing-layers"')]
    assert 'data-v="4.0">4.000<' in table and 'data-v="3.5">3.500<' in table and "ref.ddp" not in table


def test_section_absent_without_moe_records(tmp_path):
    run = _write_run(tmp_path, "dense", [DENSE])
    assert moe_routing.routing_rows([load_run(run)]) == ([], [], [])
    assert moe_routing.table_specs([load_run(run)], []) == []
    page = render_report([run], with_figures=False)
    assert "moe-routing" not in page and "Expert routing" not in page


def test_balanced_runs_carry_no_collapse_note(tmp_path):
    run = _write_run(tmp_path, "balanced", [BALANCED])
    (spec, _) = moe_routing.table_specs([load_run(run)], [])
    assert spec["footer"] == ""
    assert "Routing collapsed" not in render_report([run], with_figures=False)


def test_committed_gpu_run_shows_the_collapse():
    cases, layers, failed = moe_routing.routing_rows([load_run(GPU_RUN)])
    by = {r["model"]: r for r in cases}
    assert sorted(by) == ["gpt-350m-moe", "gpt-350m-moe-cap1"] and {r["strategy"] for r in cases} == {"deepspeed.moe"}

    d = by["gpt-350m-moe"]  # dropless
    assert d["per_layer"][0]["load"] == [9233, 0, 0, 4627, 2692, 4, 16003, 209]
    assert d["per_layer"][0]["imbalance"] == pytest.approx(16003 * 8 / 32768)  # 3.907
    assert [lay["imbalance"] for lay in d["per_layer"][1:]] == [4.0] * 11  # the ceiling, E/k = 8/2
    assert (d["worst_layer"], d["worst_imbalance"], d["worst_zero_experts"]) == ("3", 4.0, 6)
    assert (d["collapsed"], d["collapsed_layers"], d["starved_layers"], d["moe_layers"]) == ("yes", 12, 9, 12)
    assert [lay["starved_ranks"] for lay in d["per_layer"][:3]] == [[], [0], [0]]
    assert (d["dropped"], d["padding_rows"], d["a2a_bytes"], d["a2a_calls"]) == (0, 1176720, 6430457856, 48)

    c = by["gpt-350m-moe-cap1"]  # capacity factor 1: 2048 slots per expert and rank, most assignments dropped
    assert [round(lay["imbalance"], 4) for lay in c["per_layer"]] == [
        3.8478,
        3.2009,
        4.0,
        3.9304,
        4.0,
        4.0,
        3.999,
        2.9627,
        4.0,
        3.9907,
        3.9743,
        3.9098,
    ]
    assert (c["worst_layer"], c["worst_imbalance"], c["worst_zero_experts"]) == ("5", 4.0, 6)
    assert (c["dropped"], c["padding_rows"], c["a2a_bytes"], c["collapsed"]) == (289267, 289267, 1610612736, "yes")

    assert [(f["label"], f["status"]) for f in failed] == [("ref.ep gpt-350m-moe w2 bf16 mb4", "crashed")]
    assert failed[0]["diagnosis"].startswith("Not a crash of its own: a deadlock")

    page = render_report([GPU_RUN], with_figures=False)
    assert (
        "Routing collapsed at initialisation on this synthetic data in deepspeed.moe gpt-350m-moe w2 bf16 mb4;" in page
    )
    assert str(escape(failed[0]["diagnosis"])) in page  # as Jinja's autoescape writes it
