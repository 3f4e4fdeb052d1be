"""Ring attention's causal load balance: the analytic imbalance (``parabench.report.cp_balance``)
equals what real 2- and 4-rank CPU runs count, ``RingStats`` times CUDA work with CUDA events read
after the step, and the report section shows contiguous beside zig-zag from real records (a tiny
CPU run through the CLI, and the committed GPU run, whose compute times came from host clocks).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from helpers import run_suite_cli

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.models import model_config
from parabench.registry import get_strategy
from parabench.report import cp_balance
from parabench.report.html import render_report
from parabench.results import load_run
from parabench.worker import local_batches, make_spec
from reference_impls.context_parallel import RingStats, chunks_of

ROOT = Path(__file__).resolve().parent.parent
GPU_RUN = ROOT / "results" / "cp-ep-gpu" / "20261126-031027"


def test_chunks_mirror_the_implementation_and_closed_forms():
    for cp in range(1, 9):
        for split in ("contiguous", "zigzag"):
            assert [cp_balance.chunks_held(r, cp, split) for r in range(cp)] == [
                chunks_of(r, cp, split) for r in range(cp)
            ]
        assert cp_balance.analytic_imbalance(cp, "contiguous") == pytest.approx(2 * cp / (cp + 1))
        assert cp_balance.analytic_imbalance(cp, "contiguous", masked_half_skipped=True) == pytest.approx(
            (2 * cp - 1) / cp
        )
        assert cp_balance.analytic_imbalance(cp, "zigzag") == 1.0
        assert cp_balance.analytic_imbalance(cp, "zigzag", masked_half_skipped=True) == 1.0
        # zig-zag: 2 pairs per foreign block + 3 on its own (2 diagonal); contiguous: r + diagonal
        assert cp_balance.chunk_pairs(cp, "zigzag") == [(2 * cp - 1, 2)] * cp
        assert cp_balance.chunk_pairs(cp, "contiguous") == [(r, 1) for r in range(cp)]


def _ring_stats(cases: dict) -> dict:
    """One training step of each case on this rank; every rank's RingStats."""
    import torch.distributed as dist

    out = {}
    for name, cd in cases.items():
        case = Case.from_dict(cd)
        spec = make_spec(case, torch.device("cpu"))
        trainer = get_strategy(case.strategy).build(spec)
        trainer.train_step(*local_batches(case, spec, 1)[0])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, trainer.strategy_stats())
        trainer.close()
        out[name] = everyone
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_analytic_imbalance_matches_measured_flops(world):
    cases = {
        split: Case(
            model="tiny",
            strategy="ref.cp_ring",
            world_size=world,
            micro_batch=2,
            grad_accum=2,
            options={"cp_split": split},
        )
        for split in ("contiguous", "zigzag")
    }
    measured = run_on_gloo(_ring_stats, world, {s: c.to_dict() for s, c in cases.items()})[0]
    config = asdict(model_config("tiny"))
    for split, per_rank in measured.items():
        flops = [s["attn_flops_fwd"] for s in per_rank]
        assert flops == cp_balance.analytic_flops_per_rank(world, split, config, micro_batch=2, grad_accum=2)
        assert max(flops) / (sum(flops) / world) == pytest.approx(cp_balance.analytic_imbalance(world, split))
        layers = config["n_layers"]
        assert [(s["attn_pairs_full"], s["attn_pairs_diagonal"]) for s in per_rank] == [
            (layers * 2 * f, layers * 2 * d) for f, d in cp_balance.chunk_pairs(world, split)
        ]  # x2 micro-batches
        assert all(s["attn_compute_clock"] == "host" and s["attn_compute_s_fwd"] > 0 for s in per_rank)
    ct = [s["attn_flops_fwd"] for s in measured["contiguous"]]
    assert ct == sorted(ct) and max(ct) / (sum(ct) / world) == pytest.approx(2 * world / (world + 1))


class _FakeCudaEvent:
    """Stands in for torch.cuda.Event on a machine without a GPU: a clock that advances 2 ms per
    record, and a flag showing whether anyone read a time before the step synchronised."""

    now_ms = 0.0
    synchronized = False

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at = None

    def record(self):
        _FakeCudaEvent.now_ms += 2.0
        self.at = _FakeCudaEvent.now_ms

    def synchronize(self):
        _FakeCudaEvent.synchronized = True

    def elapsed_time(self, end) -> float:
        assert _FakeCudaEvent.synchronized, "read before the events completed"
        return end.at - self.at


def test_cuda_compute_time_comes_from_events_read_lazily(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    stats = RingStats()
    for _ in range(3):  # three hops
        started = stats.compute_started(torch.device("cuda", 0))
        stats.compute_ended(started)
    assert len(stats.event_pairs) == 3 and not _FakeCudaEvent.synchronized  # nothing resolved inside the step
    d = stats.as_dict()
    assert d["attn_compute_clock"] == "cuda_event"
    assert d["attn_compute_s_fwd"] == pytest.approx(3 * 2e-3)
    stats.reset()
    assert stats.as_dict()["attn_compute_s_fwd"] == 0.0

    cpu = RingStats()
    cpu.compute_ended(cpu.compute_started(torch.device("cpu")))
    assert cpu.as_dict()["attn_compute_clock"] == "host" and cpu.event_pairs == []


@pytest.fixture(scope="module")
def cpu_ring_run(tmp_path_factory) -> Path:
    """The cp-ep suite's two ring cases (contiguous, zig-zag; tiny, 2 ranks) through the real CLI."""
    return run_suite_cli("cp-ep", tmp_path_factory.mktemp("cp-balance"), "--filter", "ref.cp_ring", "--no-report")


def test_section_puts_contiguous_beside_zigzag_from_a_cpu_run(cpu_ring_run):
    cases, ranks, untrusted = cp_balance.balance_rows([load_run(cpu_ring_run)])
    assert [(r["split"], r["status"]) for r in cases] == [("contiguous", "ok"), ("zigzag", "ok")]
    assert cases[0]["group"] == cases[1]["group"]
    assert untrusted == []
    for r in cases:
        assert r["flops_match"] is True and r["time_trusted"] is True and r["tokens_per_s"] > 0
        assert r["flops_ratio"] == pytest.approx(r["flops_ratio_analytic"])
        assert r["time_ratio"] is not None and r["time_ratio"] >= 1.0
    assert cases[0]["flops_ratio"] == pytest.approx(4 / 3) and cases[1]["flops_ratio"] == 1.0
    assert [(r["split"], r["rank"]) for r in ranks] == [
        ("contiguous", 0),
        ("contiguous", 1),
        ("zigzag", 0),
        ("zigzag", 1),
    ]
    html = render_report([cpu_ring_run], with_figures=False)
    assert 'id="tbl-cp-balance"' in html and 'id="tbl-cp-balance-ranks"' in html
    assert "Not trusted" not in html


def test_section_flags_host_clock_gpu_times_of_the_committed_run():
    cases, ranks, untrusted = cp_balance.balance_rows([load_run(GPU_RUN)])
    assert untrusted == ["cp-ep-gpu/20261126-031027"]
    by = {(r["group"].split()[2], r["split"]): r for r in cases}  # "<strategy> <model> s=<seq> ..."
    four_k = [by[("s=4096", "contiguous")], by[("s=4096", "zigzag")]]
    assert cases.index(four_k[1]) == cases.index(four_k[0]) + 1  # side by side
    assert [r["flops_ratio"] for r in four_k] == [pytest.approx(4 / 3), 1.0]
    assert all(r["flops_match"] is True and r["time_trusted"] is False and r["time_ratio"] is None for r in four_k)
    assert four_k[1]["tokens_per_s"] > four_k[0]["tokens_per_s"]
    assert by[("s=8192", "contiguous")]["status"] == "oom"
    assert all(r["time_vs_mean"] is None and r["compute_ms"] is not None for r in ranks)
    html = render_report([GPU_RUN], with_figures=False)
    assert "Not trusted: the GPU compute times of cp-ep-gpu/20261126-031027" in html
