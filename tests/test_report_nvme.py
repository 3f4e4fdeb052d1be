"""The report's ZeRO-Infinity section: each NVMe case's disk bytes against its theory and its rates
against the disk probe, read from the committed 1- and 2-GPU runs at gpt-6.7b."""

from __future__ import annotations

from pathlib import Path

import pytest

from parabench.report.html import render_report
from parabench.report.nvme import nvme_rows
from parabench.results import load_run

ROOT = Path(__file__).resolve().parent.parent
RUNS = [
    ROOT / "results/zero-infinity-nvme-gpu/20261127-042116",
    ROOT / "results/zero-infinity-nvme-gpu/20261127-062328",
]


def test_rows_set_bytes_beside_theory_and_rates_beside_the_probe():
    one, two = (nvme_rows([load_run(r)])[0] for r in RUNS)
    # 1 GPU: 135.7 GB read and 123.5 GB written a step, within the theory; 0.72 / 0.65 GB/s
    assert one["read_gb"] == pytest.approx(135.7, abs=0.05) and one["theory_read"] == "109.8-137.2"
    assert one["write_gb"] == pytest.approx(123.5, abs=0.05) and one["check"] == "yes"
    assert one["read_gbps"] == pytest.approx(0.72, abs=0.005) and one["of_probe"] == "46 / 32"
    # 2 GPUs: half the bytes per rank; the disk's rate is the two ranks' sum
    assert two["read_gb"] == pytest.approx(one["read_gb"] / 2, rel=1e-3)
    assert two["read_gbps"] == pytest.approx(0.976, abs=0.005) and two["probe"] == "0.83 / 0.96"


def test_report_shows_the_section_only_where_nvme_cases_are():
    html = render_report(RUNS, with_figures=False)
    assert 'id="tbl-nvme-io"' in html and "ZeRO-Infinity: disk traffic" in html
    other = render_report([ROOT / "results/studies/tp-compile-gpu/20261127-043817"], with_figures=False)
    assert 'id="tbl-nvme-io"' not in other
