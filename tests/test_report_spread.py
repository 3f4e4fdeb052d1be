"""The report's run-to-run spread section, from the committed 2-GPU run (which repeats
ref.zero3 and torch.fsdp2 at gpt-1.3b under seeds 1 and 2 beside the default seed)."""

from __future__ import annotations

import statistics
from pathlib import Path

from parabench.report.html import render_report
from parabench.report.spread import spread_rows
from parabench.results import load_run

H100X2 = Path(__file__).resolve().parent.parent / "results" / "h100x2" / "20261126-025621"


def test_spread_groups_repeats_across_seeds_and_computes_from_records():
    manifest, records = load_run(H100X2)
    rows = {r["label"]: r for r in spread_rows([(manifest, records)])}
    assert set(rows) == {"ref.zero3 gpt-1.3b w2 bf16 mb4", "torch.fsdp2 gpt-1.3b w2 bf16 mb4"}
    for label, row in rows.items():
        tps = [r["metrics"]["tokens_per_s"] for r in records if r["label"] == label and r["status"] == "ok"]
        assert row["n"] == len(tps) == 3
        assert row["spread_pct"] == (max(tps) - min(tps)) / statistics.fmean(tps) * 100
        assert 0 < row["spread_pct"] < 5  # measured: about 1.2 % on 2x H100


def test_same_case_in_two_runs_counts_as_a_repeat_and_single_cases_do_not():
    manifest, records = load_run(H100X2)
    one = [r for r in records if r["label"] == "ref.ddp gpt-1.3b w2 bf16 mb4"]
    assert len(one) == 1
    assert spread_rows([(manifest, one)]) == []
    rows = spread_rows([(manifest, one), ({"suite": "again", "run_id": "2"}, one)])
    assert len(rows) == 1 and rows[0]["n"] == 2 and rows[0]["spread_pct"] == 0


def test_report_shows_the_section():
    html = render_report([H100X2], with_figures=False)
    assert "Run-to-run spread of repeated cases" in html


def test_spread_row_sets_the_launches_host_speed_beside_their_spread():
    manifest, records = load_run(H100X2)
    [one] = [r for r in records if r["label"] == "ref.ddp gpt-1.3b w2 bf16 mb4"]

    def launch(host_us: float | None, tokens_per_s: float) -> dict:
        return {**one, "metrics": {**one["metrics"], "host_dispatch_us_max": host_us, "tokens_per_s": tokens_per_s}}

    fast, slow = launch(2.4, 100.0), launch(6.9, 80.0)
    [row] = spread_rows([(manifest, [fast]), ({"suite": "again", "run_id": "2"}, [slow])])
    assert row["host_dispatch_us_range"] == "2.4 – 6.9" and row["spread_pct"] > 20
    # records made before the probe existed: no host column value, the rest as before
    [old] = spread_rows([(manifest, [one]), ({"suite": "again", "run_id": "2"}, [one])])
    assert old["host_dispatch_us_range"] is None and old["spread_pct"] == 0


def test_spread_row_sets_the_launches_gpu_busy_share_and_cpu_contention_beside_their_spread():
    manifest, records = load_run(H100X2)
    [one] = [r for r in records if r["label"] == "ref.ddp gpt-1.3b w2 bf16 mb4"]

    def launch(busy_pct: float, switches: float, gc_s: float, tokens_per_s: float) -> dict:
        extra = {
            "gpu_util_pct_mean_min": busy_pct,
            "host_involuntary_switches_per_step_max": switches,
            "host_gc_pause_s_per_step_max": gc_s,
        }
        return {**one, "metrics": {**one["metrics"], **extra, "tokens_per_s": tokens_per_s}}

    fast, slow = launch(98.7, 0.5, 0.0, 100.0), launch(75.8, 12.25, 0.0314, 80.0)
    [row] = spread_rows([(manifest, [fast]), ({"suite": "again", "run_id": "2"}, [slow])])
    assert row["gpu_busy_pct_range"] == "76 – 99"
    assert row["host_switches_range"] == "0.5 – 12.2"
    assert row["host_gc_ms_range"] == "0.0 – 31.4"
    html = render_report([H100X2], with_figures=False)
    assert "GPU busy %, min – max" in html and "forced switches/step" in html and "Python GC ms/step" in html
