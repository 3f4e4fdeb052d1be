"""Launch-level repeats: the statistics on synthetic samples with known answers (no false alarm on
identical distributions, detection of a 5 % shift, "not enough repeats to judge", interval
coverage), the combination of launch records, and one small real run with repeats = 2."""

from __future__ import annotations

import json
import math
import random
import textwrap

import pytest
from helpers import parabench

from parabench.case import Case, launch_key
from parabench.cli import main as cli_main
from parabench.compare import compare_metric, compare_runs
from parabench.record import build_record
from parabench.report.html import render_report
from parabench.report.spread import ratio_rows, spread_rows
from parabench.results import load_run
from parabench.stats import combine_launches, mann_whitney_greater, median_ci, ratio_ci, smallest_p
from parabench.suite import SuiteError, load_suite
from parabench.worker import debug_slowdown

TRIALS = 2000


def _case_record(samples: list[float]) -> dict:
    """A combined record of tokens/s launch samples, as ``combine_launches`` leaves it."""
    return {
        "metrics": {
            "tokens_per_s": sorted(samples)[len(samples) // 2]
            if len(samples) % 2
            else sum(sorted(samples)[len(samples) // 2 - 1 : len(samples) // 2 + 1]) / 2
        },
        "launches": [{"status": "ok", "tokens_per_s": s} for s in samples],
    }


def _verdict(base: list[float], cand: list[float], **kw) -> str:
    return compare_metric(
        "tokens_per_s",
        +1,
        "timing",
        _case_record(base),
        _case_record(cand),
        threshold=kw.get("threshold", 0.03),
        mem_threshold=0.05,
        alpha=kw.get("alpha", 0.05),
    ).verdict


def _draws(rng: random.Random, n: int, cv: float, scale: float = 1.0) -> list[float]:
    return [scale * 1000 * math.exp(rng.gauss(0, cv)) for _ in range(n)]


def _rate(n: int, cv: float, slowdown: float, seed: int) -> float:
    """Fraction of TRIALS in which the gate calls a regression (tokens/s down by ``slowdown``)."""
    rng = random.Random(seed)
    return (
        sum(_verdict(_draws(rng, n, cv), _draws(rng, n, cv, 1 - slowdown)) == "regression" for _ in range(TRIALS))
        / TRIALS
    )


@pytest.mark.parametrize("cv", [0.01, 0.05, 0.3])
def test_no_false_alarm_beyond_alpha_on_identical_distributions(cv):
    # the Mann-Whitney level is exact (0.05 for 3 vs 3) and the threshold only lowers it;
    # 3 binomial standard deviations of 2000 draws at 0.05 is 0.015
    rate = _rate(3, cv, 0.0, seed=11)
    assert rate <= 0.05 + 0.015
    if cv == 0.01:
        assert rate <= 0.005  # documented: 0.03 % (a 3 % move is 3 sigma of 1 % launch noise)


@pytest.mark.parametrize("n, floor", [(3, 0.9), (5, 0.95)])
def test_a_five_percent_slowdown_is_caught_with_one_percent_launch_noise(n, floor):
    assert _rate(n, 0.01, 0.05, seed=12) >= floor  # documented: 98 % with 3 launches


def test_too_few_repeats_are_not_judged():
    slow = [900.0, 901.0, 899.0, 902.0, 898.0]
    fast = [1000.0, 1001.0, 999.0, 1002.0, 998.0]
    assert _verdict(fast[:1], slow[:1]) == "unjudged"  # single launches: every run before repeats
    assert _verdict(fast[:2], slow[:2]) == "unjudged"  # smallest p 1/6
    assert _verdict(fast[:1], slow[:5]) == "unjudged"  # smallest p 1/6
    assert _verdict(fast[:3], slow[:3]) == "regression"  # smallest p 1/20 = 0.05
    assert _verdict(fast[:2], slow[:5]) == "regression"  # smallest p 1/21
    assert _verdict(fast[:3], slow[:3], alpha=0.01) == "unjudged"  # 0.05 cannot meet 0.01
    assert _verdict(fast[:1], [990.0]) == "same"  # within the threshold: no regression, whatever the launches
    assert smallest_p(3, 3) == pytest.approx(0.05) and smallest_p(4, 4) == pytest.approx(1 / 70)
    assert mann_whitney_greater([4, 5, 6], [1, 2, 3]) == pytest.approx(0.05)


def test_median_interval_has_the_coverage_it_claims():
    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0, 0.75)
    low, high, cover = median_ci(list(range(10)))
    assert (low, high) == (1, 8) and cover == pytest.approx(1 - 2 * 11 / 1024)
    assert median_ci([5.0]) == (5.0, 5.0, 0.0)
    rng = random.Random(3)
    _, _, claimed = median_ci([0.0] * 5)
    hits = 0
    for _ in range(TRIALS):
        low, high, _ = median_ci(_draws(rng, 5, 0.1))
        hits += low <= 1000 <= high  # the lognormal's median
    assert claimed == pytest.approx(0.9375)
    assert abs(hits / TRIALS - claimed) < 0.02


def test_ratio_interval_has_the_coverage_it_claims():
    est, low, high, cover = ratio_ci([2.0, 2.2, 2.1], [1.0, 1.1, 0.9])
    assert est == pytest.approx(2.1) and cover == pytest.approx(0.9)
    assert (low, high) == (pytest.approx(2.0 / 1.1), pytest.approx(2.2 / 0.9))
    rng = random.Random(5)
    claimed = ratio_ci([1.0] * 5, [1.0] * 5)[3]
    assert claimed >= 0.95
    hits = 0
    for _ in range(TRIALS):
        _, low, high, _ = ratio_ci(_draws(rng, 5, 0.05, 1.05), _draws(rng, 5, 0.05))
        hits += low <= 1.05 <= high
    assert abs(hits / TRIALS - claimed) < 0.02


def _launch(hash_: str, k: int, step_s: float, status: str = "ok") -> dict:
    return {
        "case_hash": hash_,
        "label": "x",
        "status": status,
        "case": {"repeat": k, "repeats": 3},
        "metrics": {
            "step_time_s_median": step_s,
            "tokens_per_s": 100 / step_s,
            "tokens_per_s_per_device": 50 / step_s,
            "peak_alloc_bytes": k,
            "peak_reserved_bytes": (50, 10, 90)[k],
            "host_dispatch_us_max": 2.0 + k,
        }
        if status == "ok"
        else None,
        "error": None if status == "ok" else {"message": "boom"},
    }


def test_launches_combine_into_one_case_record():
    recs = [_launch("a", 0, 1.0), _launch("a", 2, 1.2), _launch("a", 1, 1.1), _launch("b", 0, 2.0)]
    a, b = combine_launches(recs)
    assert a["metrics"]["step_time_s_median"] == 1.1 and a["metrics"]["tokens_per_s"] == pytest.approx(100 / 1.1)
    assert a["launch_stats"]["representative_repeat"] == 1 and a["metrics"]["peak_alloc_bytes"] == 1
    assert a["metrics"]["peak_reserved_bytes"] == 50  # noisy memory: median of 50, 10, 90 (not the representative's)
    assert [r["repeat"] for r in a["launches"]] == [0, 1, 2]
    assert [r["host_dispatch_us_max"] for r in a["launches"]] == [2.0, 3.0, 4.0]  # each launch's host, kept
    assert a["launch_stats"]["tokens_per_s"]["samples"] == [100 / 1.0, 100 / 1.1, 100 / 1.2]
    assert a["launch_stats"]["tokens_per_s"]["ci_coverage"] == 0.75
    assert b["launch_stats"]["n"] == 1 and b["launch_stats"]["tokens_per_s"]["cv"] is None
    assert combine_launches([a]) == [a]  # already combined: unchanged
    (flaky,) = combine_launches([_launch("a", 0, 1.0), _launch("a", 1, 0, "crashed"), _launch("a", 2, 1.2)])
    assert flaky["status"] == "crashed" and flaky["launch_stats"]["n"] == 2
    assert "1 of 3 launches did not finish ok" in flaky["caveats"][-1]
    assert flaky["metrics"]["step_time_s_median"] == pytest.approx(1.1)


def test_reference_peer_ratio_rows_need_two_launches_each():
    def rec(strategy, tps):
        return {
            "status": "ok",
            "case": {
                "strategy": strategy,
                "model": "m",
                "world_size": 2,
                "precision": "bf16",
                "micro_batch": 4,
                "repeats": len(tps),
            },
            "label": strategy,
            "metrics": {"tokens_per_s": tps[0]},
            "launches": [{"status": "ok", "tokens_per_s": t} for t in tps],
        }

    run = (
        {"suite": "s", "run_id": "1"},
        [
            rec("ref.zero3", [90, 92, 91]),
            rec("deepspeed.zero3", [100, 101, 99]),
            rec("torch.fsdp2", [95, 96, 94]),
            rec("torch.ddp", [200]),
        ],
    )
    rows = {(r["reference"], r["peer"]): r for r in ratio_rows([run])}
    assert set(rows) == {("ref.zero3", "deepspeed.zero3"), ("ref.zero3", "torch.fsdp2")}
    r = rows[("ref.zero3", "deepspeed.zero3")]
    assert r["ratio"] == pytest.approx(0.91) and r["ratio_high"] < 1 and r["coverage_pct"] == pytest.approx(90)
    spread = {s["label"]: s for s in spread_rows([run])}
    assert spread["ref.zero3"]["n"] == 3 and spread["ref.zero3"]["tokens_per_s_median"] == 91


def test_suite_repeats_field_is_validated_and_not_in_the_hash(tmp_path):
    one = Case(model="tiny", strategy="single", world_size=1)
    three = Case(model="tiny", strategy="single", world_size=1, repeats=3)
    assert one.case_hash == three.case_hash
    assert launch_key(one.case_hash, 0) == one.case_hash and launch_key(one.case_hash, 2) == one.case_hash + ".r2"
    bad = tmp_path / "bad.toml"
    bad.write_text('[suite]\nrepeats = 0\n[[matrix]]\nmodel = "tiny"\nstrategy = "single"\nworld_size = 1\n')
    with pytest.raises(SuiteError, match="repeats"):
        load_suite(str(bad))
    bad.write_text('[[matrix]]\nmodel = "tiny"\nstrategy = "single"\nworld_size = 1\nrepeat = 1\n')
    with pytest.raises(SuiteError, match="unknown key"):
        load_suite(str(bad))


def test_debug_slowdown_is_read_from_the_environment_and_recorded(monkeypatch):
    monkeypatch.delenv("PARABENCH_DEBUG_SLOWDOWN", raising=False)
    assert debug_slowdown() == 0.0
    monkeypatch.setenv("PARABENCH_DEBUG_SLOWDOWN", "0.05")
    assert debug_slowdown() == 0.05
    monkeypatch.setenv("PARABENCH_DEBUG_SLOWDOWN", "-1")
    with pytest.raises(ValueError, match="PARABENCH_DEBUG_SLOWDOWN"):
        debug_slowdown()
    case = Case(model="tiny", strategy="single", world_size=1, device="cpu", steps=2)
    raw = {
        "per_rank": [
            {
                "rank": 0,
                "step_times_s": [0.1, 0.1],
                "losses": [5.0, 5.0, 5.0],
                "setup_s": 0.1,
                "memory": {"peak_rss_bytes": 1},
                "state_bytes": {"params": 1},
                "comm": None,
            }
        ],
        "device_name": "cpu",
        "device_type": "cpu",
        "topology": {"dp": 1, "pp": 1, "tp": 1},
        "debug_slowdown": 0.05,
    }
    rec = build_record(case, "ok", raw=raw)
    assert rec["debug_slowdown"] == 0.05 and "PARABENCH_DEBUG_SLOWDOWN" in rec["caveats"][-1]


REPEATED = """
[suite]
name = "repeated"
device = "cpu"
steps = 2
warmup = 1
timeout_s = 120
repeats = 2

[[matrix]]
model = "tiny"
strategy = "single"
world_size = 1
micro_batch = [2, 4]
"""


def test_a_suite_with_repeats_runs_interleaved_launches_and_passes_against_itself(tmp_path, capsys):
    suite = tmp_path / "repeated.toml"
    suite.write_text(textwrap.dedent(REPEATED))

    proc = parabench("run", "suite", suite, "--out", tmp_path, "--run-id", "a", "--no-report")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = tmp_path / "repeated" / "a"
    _, records = load_run(run)
    assert len(records) == 4 and all(r["status"] == "ok" for r in records)
    names = sorted(p.name for p in (run / "cases").glob("*.json"))
    hashes = sorted({r["case_hash"] for r in records})
    assert names == sorted([f"{h}.json" for h in hashes] + [f"{h}.r1.json" for h in hashes])
    # round-robin: both cases' first launches, then both second launches, each in its own launch
    order = [(r["case"]["repeat"], r["label"]) for r in sorted(records, key=lambda r: r["started_at"])]
    assert [k for k, _ in order] == [0, 0, 1, 1] and order[0][1] == order[2][1] and order[1][1] == order[3][1]
    assert len({r["launch"]["log"] for r in records}) == 4 and all(r["launch"]["batch_size"] == 1 for r in records)
    combined = combine_launches(records)
    assert len(combined) == 2
    for c in combined:
        assert c["launch_stats"]["n"] == 2 and len(c["launch_stats"]["tokens_per_s"]["samples"]) == 2
    # compare against itself passes (nothing moved; two launches a side could not judge a move anyway)
    assert cli_main(["compare", str(run), str(run)]) == 0
    assert compare_runs(load_run(run), load_run(run))["counts"] == {"same": 2}
    assert "launches 2 vs 2" in capsys.readouterr().out
    # --resume finds every launch recorded and runs nothing
    assert (
        cli_main(["run", "suite", str(suite), "--out", str(tmp_path), "--run-id", "a", "--resume", "--no-report"]) == 0
    )
    assert "4 kept" in capsys.readouterr().out
    html = render_report([run], with_figures=False)
    assert "launch CV %" in html and "Run-to-run spread of repeated cases" in html
    assert json.loads((run / "cases" / f"{hashes[0]}.r1.json").read_text())["case"]["repeat"] == 1
