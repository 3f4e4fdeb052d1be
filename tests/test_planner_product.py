"""``parabench plan`` as a product: it recommends libraries, refuses what cannot work and says where it
would, lists only the GPU kinds it can plan, and closes the loop plan -> run suite -> check."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from parabench.cli import main
from parabench.plan import calibrate as C
from parabench.plan import model as M
from parabench.plan import search as S
from parabench.registry import STRATEGIES
from parabench.shapes import model_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def h100():
    return C.load_kind("h100")


def test_default_ranking_holds_no_reference_and_references_come_labelled(h100):
    cfg = model_config("tiny")
    # one GPU, as the loop's test below plans: the theory of each configuration is computed once
    libraries, _ = S.plan("tiny", cfg, 1, "h100-80g", h100, include_references=False)
    everything, _ = S.plan("tiny", cfg, 1, "h100-80g", h100, include_references=True)
    assert libraries and all(STRATEGIES[c.strategy].kind == "peer" for c in libraries)
    references = [c for c in everything if STRATEGIES[c.strategy].kind == "reference"]
    assert references, "the tiny model fits every reference"
    table = S.table(references[:1] + libraries[:1], 2).splitlines()
    assert table[2].split()[1:3] == [references[0].strategy, "[reference]"]
    assert "[reference]" not in table[3]


def test_a_five_trillion_parameter_model_is_refused_with_the_smallest_gpu_count(capsys):
    """About 5e12 parameters: on one GPU nothing fits the card, and CPU offload would need 77 TiB of
    host memory. With 8 GPUs of 126 GiB each per host, offload first fits the host at 768 GPUs
    (8 ranks x 16 B x params / 768 under 80 % of 1008 GiB; at 760 it does not)."""
    assert main(["plan", "--model", "custom-L400-d32768-h256", "--gpus", "1", "--dropped", "0"]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("Nothing works for custom-L400-d32768-h256 on 1x h100-80g (")
    assert "host memory" in first and "does not fit" in first
    assert re.search(r"the smallest count of h100-80g at which a configuration works is 768 \(\S*offload", first)
    params = 12 * 400 * 32768**2
    assert 8 * 16 * params / 760 > S.HOST_USABLE * 8 * S.DEFAULT_HOST_RAM_PER_GPU >= 8 * 16 * params / 768 * 0.99


def test_offload_beyond_the_hosts_ram_or_nvme_is_refused(h100):
    cfg = model_config("gpt-1.3b")
    offload = next(name for name, row in STRATEGIES.items() if row.plan.offload == "cpu" and row.plan.search)

    def on_host(ram_gib: float, gpus_per_host: int = 1) -> str | None:
        c = S.Candidate(offload, 1, 16, 1, {"activation_checkpointing": True}, "master")
        limits = S.HostLimits(ram_gib * M.GIB, gpus_per_host, None, "--host-ram-gib")
        return S.evaluate(c, "gpt-1.3b", cfg, h100, 79.2 * M.GIB, limits).dropped

    need = 16 * 1.3e9 / M.GIB  # fp32 master, gradients and two moments per parameter, about 19 GiB
    assert on_host(need / S.HOST_USABLE * 0.8).startswith("host memory: 1 rank x ")
    assert on_host(need / S.HOST_USABLE * 1.3) is None
    nvme = next(name for name, row in STRATEGIES.items() if row.plan.offload == "nvme")
    c = S.Candidate(nvme, 1, 1, 1, {}, "master")
    without = S.evaluate(c, "gpt-1.3b", cfg, h100, 79.2 * M.GIB, S.HostLimits(1e15, 1)).dropped
    assert "--nvme-gib" in without
    small = S.evaluate(c, "gpt-1.3b", cfg, h100, 79.2 * M.GIB, S.HostLimits(1e15, 1, 1 * M.GIB)).dropped
    assert small.startswith("NVMe: 1 rank x ")
    roomy = S.evaluate(c, "gpt-1.3b", cfg, h100, 79.2 * M.GIB, S.HostLimits(1e15, 1, 1e15)).dropped
    assert roomy == "not modelled by the planner"


def test_every_listed_gpu_kind_plans_and_an_uncalibrated_one_is_refused_in_one_line(tmp_path, capsys):
    accepted = S.accepted_gpus()
    assert accepted == {"h100-80g": "calibrated", "h200-141g": "derived from h100"}
    assert all(C.load_kind(S.GPUS[name][0]) is not None for name in accepted)
    assert main(["plan", "--model", "tiny", "--gpus", "1", "--gpu", "a100-80g"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'a100-80g'" in err
    assert "accepted: h100-80g (calibrated), h200-141g (derived from h100)" in err
    # a folder holding the H100 calibration only: H200 is derived from it, and still listed
    (tmp_path / "h100.json").write_text((ROOT / "results" / "calibration" / "h100.json").read_text())
    assert S.accepted_gpus(tmp_path) == accepted
    assert S.accepted_gpus(tmp_path / "empty") == {}


def test_plan_write_suite_run_suite_and_check_close_the_loop(tmp_path, capsys):
    """The planned suite's predictions lie beside it. This machine has no GPU, so the suite's case runs
    on a CPU process, timing 2 steps instead of 10, and check matches its record to its prediction by
    configuration (``validate.UNPREDICTED_FIELDS``)."""
    suite = tmp_path / "planned.toml"
    argv = ["plan", "--model", "tiny", "--gpus", "1", "--top", "1", "--write-suite", str(suite)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("Recommended for tiny on 1x h100-80g: ") and "tokens/s per GPU, peak" in out
    predictions = json.loads((tmp_path / "planned.predictions.json").read_text())
    assert predictions["device_kind"] == "h100" and len(predictions["predictions"]) == 1
    text = suite.read_text().replace('device = "cuda"', 'device = "cpu"')
    suite.write_text(text.replace("steps = 10", "steps = 2").replace("warmup = 3", "warmup = 1"))
    runs = tmp_path / "runs"
    assert main(["run", "suite", str(suite), "--out", str(runs), "--run-id", "r", "--no-report"]) == 0
    capsys.readouterr()
    assert main(["check", str(runs / "planned" / "r")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("note: predicted for h100, measured on ") and "different machines" in lines[0]
    assert any(line.startswith(predictions["predictions"][0]["label"]) for line in lines)
    assert "1 cases predicted and measured" in lines and any("no retest" in line for line in lines)
    assert main(["check", str(runs / "planned" / "r"), "--predictions", str(tmp_path / "none.json")]) == 2


def test_check_sets_each_metric_beside_the_runs_own_retest():
    """A run launched 2-3 times per case: check scores the predictions committed before it and, beside
    each metric, the run's second launch of each case set against its first."""
    from parabench.plan.check import check, check_lines

    run = ROOT / "results/studies/plan-retest-pipelines-h100x4/20261127-161154"  # 23 configurations
    rep = check(run, ROOT / "results/predictions/plan-retest-pipelines-h100x4.json")
    rt = rep["retest"]
    assert rt["configurations"] == 23 and 0 < rt["step_median_pct"] < rt["step_p90_pct"]
    assert rt["peak_median_pct"] < 0.1  # allocated bytes repeat between launches
    lines = check_lines(rep)
    step = next(line for line in lines if line.startswith("  step time error: median"))
    assert f"; retest {rt['step_median_pct']:.1f} %" in step
    assert any(
        line.startswith("  pairs more than 5 % apart ordered correctly: ") and "retest" in line for line in lines
    )


def test_this_machines_gpus_are_read_from_the_driver_without_torch(tmp_path, monkeypatch):
    from parabench.plan import cli as plan_cli

    for i in range(2):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
        (tmp_path / f"0000:0{i}:00.0" / "information").write_text("Model: \t NVIDIA H100 80GB HBM3\nIRQ: 1\n")
    monkeypatch.setattr(plan_cli, "NVIDIA_GPUS", tmp_path)
    gpus, ram = plan_cli.this_machine("h100")
    assert gpus == 2 and ram > 0
    assert plan_cli.this_machine("h200") is None
    monkeypatch.setattr(plan_cli, "NVIDIA_GPUS", tmp_path / "absent")
    assert plan_cli.this_machine("h100") is None
