"""The bf16 matmul ceiling (``parabench.matmul_ceiling``): a run records why no probe ran where there
is no GPU, and the report gives each case's MFU against a recorded ceiling beside its MFU against the
datasheet peak. The probe itself runs on a GPU only; here its recorded result is written by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from parabench.case import Case
from parabench.matmul_ceiling import for_run, fraction_of_ceiling
from parabench.report import frames
from parabench.report.html import render_report
from parabench.results import load_run
from parabench.stats import combine_launches

ROOT = Path(__file__).resolve().parent.parent
GPU_RUN = ROOT / "results" / "gpu-spine" / "20261126-020214"  # bf16 on H100s
H100 = "NVIDIA H100 80GB HBM3"
CEILING = {
    "flops_per_s": 791.5e12,
    "dtype": "bf16",
    "device_name": H100,
    "datasheet_flops_per_s": 989.4e12,
    "by_size_flops_per_s": {"4096": 650e12, "8192": 780e12, "16384": 791.5e12},
}


def test_a_cpu_run_records_why_no_probe_ran(tmp_path):
    from parabench.launch import LaunchOptions
    from parabench.runner import Runner
    from parabench.suite import Suite

    cpu = Case(model="tiny", strategy="single", world_size=1, device="cpu")
    assert for_run([cpu]) == {"skipped": "every case runs on the CPU: the ceiling is a GPU's bf16 matmul rate"}
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine probes")
    auto = Case(model="tiny", strategy="single", world_size=1)
    suite = Suite(name="t", path=Path(__file__), description="", cases=[auto])
    manifest = Runner(suite, tmp_path / "run", LaunchOptions())._manifest()
    assert manifest["matmul_ceiling"] == {
        "skipped": "no CUDA device on this machine: the ceiling is a GPU's bf16 matmul rate"
    }


def _run_with_ceiling(tmp_path: Path, ceiling: dict | None) -> Path:
    run = tmp_path / "run"
    shutil.copytree(GPU_RUN, run, ignore=shutil.ignore_patterns("report.html", "logs"))
    manifest = json.loads((run / "manifest.json").read_text())
    if ceiling is not None:
        manifest["matmul_ceiling"] = ceiling
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_each_case_gets_its_mfu_against_the_measured_ceiling(tmp_path):
    manifest, records = load_run(_run_with_ceiling(tmp_path, CEILING))
    rows = [r for r in frames.case_rows([(manifest, combine_launches(records))]) if r["status"] == "ok"]
    assert len(rows) == 7
    for r in rows:
        # the same achieved FLOP/s over two denominators: datasheet 989.4, measured 791.5 TFLOP/s
        assert r["mfu_ceiling_pct"] == pytest.approx(r["mfu_pct"] * 989.4 / 791.5)
        assert r["mfu_ceiling_pct"] > r["mfu_pct"]


@pytest.mark.parametrize(
    "ceiling",
    [
        {**CEILING, "device_name": "NVIDIA H200"},  # another GPU model's ceiling says nothing of an H100
        {**CEILING, "dtype": "fp16"},
        {"skipped": "no CUDA device on this machine"},
        {**CEILING, "flops_per_s": float("nan")},
    ],
)
def test_no_fraction_without_a_ceiling_of_that_gpu_and_precision(ceiling):
    manifest, records = load_run(GPU_RUN)
    assert all(fraction_of_ceiling({**manifest, "matmul_ceiling": ceiling}, r) is None for r in records)


def test_the_report_shows_both_mfus_and_the_ceiling_only_where_one_was_measured(tmp_path):
    html = render_report([_run_with_ceiling(tmp_path, CEILING)], with_figures=False)
    assert "MFU of measured ceiling %" in html and "MFU %" in html
    assert "NVIDIA H100 80GB HBM3 792 TFLOP/s measured, 80% of the datasheet&#39;s 989" in html
    shutil.rmtree(tmp_path / "run")
    html = render_report([_run_with_ceiling(tmp_path, None)], with_figures=False)
    assert "MFU of measured ceiling" not in html
