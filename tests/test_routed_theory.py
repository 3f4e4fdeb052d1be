"""Expert-parallel records carry a per-rank expectation made exact by the routing each rank
recorded (ref.ep: rows sent and received per MoE layer; deepspeed.moe: the gate's capacity), so
the record's own check, not only a test, holds the measured all-to-all bytes to theory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_suite_cli

from parabench.cli import main
from parabench.results import load_run


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Path:
    """The cp-ep suite's four routed cases (ref.ep, deepspeed.moe; dropless and capacity factor 1),
    without the one-process tiny-moe baseline (w1), whose launch nothing here reads."""
    return run_suite_cli(
        "cp-ep", tmp_path_factory.mktemp("moe"), "--filter", "moe", "--filter", " w2 ", "--no-report", run_id="r"
    )


def test_records_check_all_to_all_bytes_exactly_per_rank(moe_run):
    _, records = load_run(moe_run)
    routed = [r for r in records if r["case"]["strategy"] in ("ref.ep", "deepspeed.moe")]
    assert len(routed) == len(records) == 4  # both strategies, dropless and capacity factor 1
    for r in routed:
        assert r["status"] == "ok" and r["checks"]["comm_ok"] is True, r["label"]
        assert "routing" in r["theory"]["comm_exact_from"]
        for rank, rows in enumerate(r["checks"]["comm_per_rank"]):
            a2a = rows["all_to_all"]
            assert a2a["measured_bytes"] == a2a["expected_bytes"], (r["label"], rank, a2a)


def test_a_wrong_routing_record_fails_the_check(moe_run, tmp_path):
    """The exact expectation can fail: claim 100 more rows sent on rank 0 than were sent."""
    run = tmp_path / "run"
    import shutil

    shutil.copytree(moe_run, run)
    path = next(
        p for p in (run / "cases").glob("*.json") if json.loads(p.read_text())["label"] == "ref.ep tiny-moe w2 fp32 mb2"
    )
    rec = json.loads(path.read_text())
    layer = next(iter(rec["per_rank"][0]["strategy_stats"]["moe_layers"].values()))
    layer["sent_rows"] += 100
    path.write_text(json.dumps(rec))
    assert main(["recheck", str(run), "--strategy", "ref.ep"]) == 0
    rec = json.loads(path.read_text())
    assert rec["checks"]["comm_ok"] is False
    assert rec["checks"]["comm_per_rank"][1]["all_to_all"]["ok"] is True  # rank 1's record is untouched


def test_report_says_where_the_expectation_came_from(moe_run):
    from parabench.report.html import render_report

    assert "run + recorded routing" in render_report([moe_run], with_figures=False)
