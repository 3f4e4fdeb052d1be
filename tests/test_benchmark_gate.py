"""The benchmark gate's verdict (tests/benchmarks/gate_check.py): a machine that is slower all over
passes, code that got slower fails, and the committed baseline carries the yardstick the gate needs."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "tests" / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_gate_{name}", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gate_check = _load("gate_check")
yardsticks = _load("yardsticks")
Timing = gate_check.Timing


def _record(machine: dict, **timings: tuple[float, str | None, float | None]) -> dict:
    benchmarks = []
    for name, (min_s, stick, stick_min_s) in timings.items():
        extra = {} if stick is None else {"yardstick": stick, "yardstick_min_s": stick_min_s}
        benchmarks.append({"name": name, "stats": {"min": min_s}, "extra_info": extra})
    return {"machine_info": machine, "benchmarks": benchmarks}


MACHINE = {"cpu": {"brand_raw": "AMD EPYC", "family": 25, "model": 1, "count": 2}, "python_version": "3.11.7"}
OTHER = {"cpu": {"brand_raw": "Intel(R) Xeon(R)", "family": 6, "model": 167, "count": 2}, "python_version": "3.11.7"}


def test_a_machine_slower_all_over_passes():
    base = {"parse": Timing(3.3e-3, "y", 2.5e-3)}
    now = {"parse": Timing(3.3e-3 * 1.6, "y", 2.5e-3 * 1.6)}
    (verdict,) = gate_check.judge(base, now, 40)
    assert verdict.normalised and not verdict.failed
    assert verdict.change == pytest.approx(0.0, abs=1e-12)


def test_code_slower_on_the_same_machine_speed_fails():
    base = {"parse": Timing(3.3e-3, "y", 2.5e-3)}
    now = {"parse": Timing(3.3e-3 * 1.5, "y", 2.5e-3)}
    (verdict,) = gate_check.judge(base, now, 40)
    assert verdict.failed and verdict.change == pytest.approx(0.5)


def test_code_slower_on_a_faster_machine_still_fails():
    # 1.5x the work on a machine 1.2x faster: the raw min moved only 25 %, under a 40 % gate.
    base = {"parse": Timing(3.3e-3, "y", 2.5e-3)}
    now = {"parse": Timing(3.3e-3 * 1.5 / 1.2, "y", 2.5e-3 / 1.2)}
    (verdict,) = gate_check.judge(base, now, 40)
    assert verdict.failed and verdict.change == pytest.approx(0.5)


def test_another_yardstick_falls_back_to_raw_mins():
    base = {"parse": Timing(2e-3, "old-yardstick", 1e-3)}
    now = {"parse": Timing(2.5e-3, "y", 5e-3)}
    (verdict,) = gate_check.judge(base, now, 40)
    assert not verdict.normalised and "raw min" in verdict.why
    assert verdict.change == pytest.approx(0.25) and not verdict.failed


def test_a_benchmark_missing_from_the_run_fails_and_a_new_one_does_not():
    base = {"gone": Timing(1e-3, "y", 1e-3)}
    now = {"added": Timing(1e-3, "y", 1e-3)}
    verdicts = {v.name: v for v in gate_check.judge(base, now, 40)}
    assert verdicts["gone"].failed and "--update" in verdicts["gone"].why
    assert not verdicts["added"].failed and verdicts["added"].change is None


def test_threshold_is_tight_only_on_the_baselines_kind_of_machine(monkeypatch):
    monkeypatch.delenv("PARABENCH_BENCH_THRESHOLD", raising=False)
    same = _record(MACHINE)
    assert gate_check.threshold_pct(same, _record(MACHINE))[0] == gate_check.SAME_MACHINE_PCT
    assert gate_check.threshold_pct(same, _record(OTHER))[0] == gate_check.OTHER_MACHINE_PCT
    monkeypatch.setenv("PARABENCH_BENCH_THRESHOLD", "15")
    assert gate_check.threshold_pct(same, _record(OTHER))[0] == 15.0


def test_main_exits_1_and_names_the_failed_benchmark(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PARABENCH_BENCH_THRESHOLD", raising=False)
    base = tmp_path / "base.json"
    now = tmp_path / "now.json"
    base.write_text(json.dumps(_record(MACHINE, parse=(3e-3, "y", 2e-3), step=(10e-3, "y", 2e-3))))
    now.write_text(json.dumps(_record(MACHINE, parse=(6e-3, "y", 2e-3), step=(16e-3, "y", 3.2e-3))))
    assert gate_check.main(str(base), [str(now)]) == 1
    out = capsys.readouterr().out
    assert "FAILED (parse)" in out and "+100.0%" in out
    now.write_text(json.dumps(_record(MACHINE, parse=(4.8e-3, "y", 3.2e-3), step=(16e-3, "y", 3.2e-3))))
    assert gate_check.main(str(base), [str(now)]) == 0


def test_each_benchmark_is_judged_on_its_better_run(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PARABENCH_BENCH_THRESHOLD", raising=False)
    base = tmp_path / "base.json"
    first = tmp_path / "run1.json"
    again = tmp_path / "run2.json"
    base.write_text(json.dumps(_record(MACHINE, report=(20e-3, "y", 2.5e-3), parse=(3e-3, "y", 2.5e-3))))
    # report slowed by a neighbour in the first run (yardstick unmoved), parse regressed for real
    first.write_text(json.dumps(_record(MACHINE, report=(31.6e-3, "y", 2.5e-3), parse=(6e-3, "y", 2.5e-3))))
    assert gate_check.main(str(base), [str(first)], list_failed=True) == 1
    assert capsys.readouterr().out.split() == ["parse", "report"]
    again.write_text(json.dumps(_record(MACHINE, report=(21e-3, "y", 2.5e-3), parse=(6.1e-3, "y", 2.5e-3))))
    assert gate_check.main(str(base), [str(first), str(again)]) == 1
    out = capsys.readouterr().out
    assert "FAILED (parse)" in out and "better of 2 runs" in out
    best = gate_check.best_timings([json.loads(first.read_text()), json.loads(again.read_text())])
    assert best["report"].min_s == 21e-3 and best["parse"].min_s == 6e-3


def test_listing_failures_leaves_out_benchmarks_that_did_not_run(tmp_path, capsys):
    base = tmp_path / "base.json"
    now = tmp_path / "now.json"
    base.write_text(json.dumps(_record(MACHINE, gone=(1e-3, "y", 1e-3))))
    now.write_text(json.dumps(_record(MACHINE, other=(1e-3, "y", 1e-3))))
    assert gate_check.main(str(base), [str(now)], list_failed=True) == 1
    assert capsys.readouterr().out.strip() == ""


def test_committed_baseline_gauges_every_benchmark_with_the_current_yardstick():
    tree = ast.parse((BENCH_DIR / "test_bench.py").read_text())
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    record = json.loads((ROOT / "results" / "benchmarks" / "baseline.json").read_text())
    baseline = gate_check.timings(record)
    assert set(baseline) == names, "refresh the baseline: tests/benchmarks/gate.sh --update"
    for name, timing in baseline.items():
        assert timing.yardstick == yardsticks.YARDSTICK, name
        assert timing.yardstick_min_s and timing.yardstick_min_s > 0, name
