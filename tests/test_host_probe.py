"""The host probe (``parabench.meters.host``): a record carries each rank's host speed, measured
off the clock before the warm-up and after the timed steps, and the probe sees a slower host."""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.meters import host
from parabench.record import build_record
from parabench.worker import run_case


class SlowHost(TorchDispatchMode):
    """Every op costs the host ``delay_s`` more, as on a contended or throttled CPU."""

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        end = time.perf_counter() + self.delay_s
        while time.perf_counter() < end:
            pass
        return func(*args, **(kwargs or {}))


def test_probe_sees_a_slower_host():
    cpu = torch.device("cpu")
    quick = host.probe(cpu)
    with SlowHost(100e-6):
        slow = host.probe(cpu)
    assert 0 < quick["dispatch_us"] < 100
    assert slow["dispatch_us"] > quick["dispatch_us"] + 90
    assert isinstance(quick["cpu"], int) and quick["cpu"] >= 0


def _run(case: dict) -> dict | None:
    return run_case(Case.from_dict(case), torch.device("cpu"))


def test_every_rank_records_its_host_before_and_after_the_timed_steps():
    case = Case(
        model="tiny",
        strategy="ref.ddp",
        world_size=2,
        micro_batch=2,
        steps=2,
        warmup=1,
        device="cpu",
        options={"roofline": False, "telemetry": False},
    )
    raw = run_on_gloo(_run, 2, case.to_dict())[0]
    record = build_record(case, "ok", raw)
    probes = [r["host_probe"] for r in record["per_rank"]]
    assert [sorted(p) for p in probes] == [["after", "before"]] * 2
    values = [p[when]["dispatch_us"] for p in probes for when in ("before", "after")]
    assert all(v > 0 for v in values)
    assert record["metrics"]["host_dispatch_us_max"] == max(values)
