"""What a 2-core CI machine can time stably: suite parsing, the comm meter's cost on a small op
sequence, one training step of the tiny model on one process, building a report and a comparison
from the committed GPU results. Gated against results/benchmarks/baseline.json (gate.sh)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
GPU_RUN = ROOT / "results" / "gpu-spine" / "20261126-020214"


def test_suite_parse(gauged):
    from parabench.suite import load_suite

    suite = gauged(load_suite, args=("smoke",), rounds=50, warmup_rounds=2)
    assert len(suite.cases) >= 14


def test_comm_meter_small_ops(gauged, world_of_one):
    """The meter's own cost: 20 all-reduces of 4 KiB and 20 broadcasts under the dispatcher meter,
    issued on torch's fake process group (no transport), so that gloo's latency, which on a shared
    2-core machine drifts by more than the gate's threshold from hour to hour, is not what is timed."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend

    from parabench.meters.comm import CommMeter

    group = dist.new_group([0], backend="fake")
    t = torch.ones(1024)

    def ops():
        with CommMeter() as meter:
            for _ in range(20):
                dist.all_reduce(t, group=group)
                dist.broadcast(t, 0, group=group)
        return meter.summary()

    s = gauged(ops, rounds=30, warmup_rounds=3)
    assert s["payload_bytes"] == 40 * 4096
    assert s["by_kind"]["all_reduce"]["calls"] == 20 and s["by_kind"]["broadcast"]["calls"] == 20


def test_train_step_tiny_single(gauged, world_of_one):
    from parabench.case import Case
    from parabench.registry import get_strategy
    from parabench.worker import local_batches, make_spec

    case = Case(
        model="tiny", strategy="single", world_size=1, micro_batch=8, precision="fp32", steps=4, warmup=1, device="cpu"
    )
    spec = make_spec(case, torch.device("cpu"))
    trainer = get_strategy("single").build(spec)
    ((x, y),) = local_batches(case, spec, 1)
    loss = gauged(trainer.train_step, args=(x, y), rounds=20, warmup_rounds=3)
    trainer.close()
    assert float(loss) > 0


def test_report_tables_gpu_run(gauged):
    from parabench.report.html import render_report

    html = gauged(
        render_report,
        args=([GPU_RUN],),
        kwargs={"with_figures": False},
        rounds=10,
        warmup_rounds=1,
    )
    assert "tbl-overview" in html


def test_compare_gpu_run(gauged):
    from parabench.compare import compare_runs
    from parabench.results import load_run

    run = load_run(GPU_RUN)
    res = gauged(compare_runs, args=(run, run), rounds=100, warmup_rounds=5)
    assert not res["regression"]
