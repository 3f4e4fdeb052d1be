"""The pipeline engines' clock (``reference_impls.pipeline.StageClock``) and the worker's timeline step.

The clock hands out marks as tokens and resolves them once, at ``finish``: on the host clock here
(CPU); on a GPU with ``record_timeline`` the same tokens are CUDA events, which CPU tests cannot
reach. The worker records a pipeline's timeline on a step of its own (option ``record_timeline``),
so the instrumented step keeps its communication meter and the timeline's ops are not stretched by it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.models import model_config
from parabench.record import build_record
from parabench.registry import get_strategy
from parabench.report import frames
from parabench.worker import local_batches, make_spec, run_case
from reference_impls.pipeline import StageClock

CPU = torch.device("cpu")


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_clock_resolves_tokens_into_the_step_record():
    clock = StageClock(CPU, device_timed=True)  # no GPU: the host clock, whatever is asked
    t0 = clock.mark()
    _busy(0.01)
    clock.computed("F", 0, t0, clock.mark())
    _busy(0.005)  # between ops: neither compute nor wait
    t0 = clock.mark()
    _busy(0.01)
    t1 = clock.mark()
    clock.computed("B", 0, t0, t1, 7)  # extra detail travels with the entry
    assert all(isinstance(t, int) for t in (t0, t1))
    with pytest.raises(RuntimeError, match="before drain"):
        clock.finish()
    send = torch.futures.Future()  # an outstanding send, completed 20 ms into the drain
    threading.Timer(0.02, send.set_result, (None,)).start()
    clock.drain([(send, None)])
    rec = clock.finish()

    assert rec["timeline_clock"] == "host"
    (f, b) = rec["timeline"]
    assert f[:2] == ("F", 0) and b[:2] == ("B", 0) and b[4:] == (7,)
    assert 0 <= f[2] < f[3] < b[2] < b[3] <= rec["step_s"]
    assert f[3] - f[2] >= 0.01 and b[3] - b[2] >= 0.01
    assert rec["compute_s_by_kind"] == {"F": f[3] - f[2], "B": b[3] - b[2]}
    assert rec["compute_s"] == pytest.approx(sum(rec["compute_s_by_kind"].values()))
    assert rec["wait_s"] >= 0.015
    assert rec["host_gap_s"] >= 0.005
    assert rec["compute_s"] + rec["wait_s"] + rec["host_gap_s"] == pytest.approx(rec["step_s"])
    assert rec["bubble_fraction_measured"] == pytest.approx(rec["wait_s"] / rec["step_s"])


class _DeviceEvent:
    """Stands in for torch.cuda.Event where no GPU runs the test: each record lands on the device
    timeline that ``device_ms`` sets, and reading a time before any synchronisation fails."""

    device_ms = 0.0
    synchronized = False

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.stream = self.at = None

    def record(self, stream=None):
        self.stream, self.at = stream, _DeviceEvent.device_ms

    def synchronize(self):
        _DeviceEvent.synchronized = True

    def elapsed_time(self, end) -> float:
        assert _DeviceEvent.synchronized, "read before the events completed"
        return end.at - self.at


def test_cuda_clock_records_events_on_the_stream_and_reads_them_once(monkeypatch):
    """The device-timed path (no GPU here): one event per mark on the current stream, nothing
    read before finish, every mark in seconds from the start event; the idle time between an
    op's end and the next mark (the device waiting for the host) is host_gap_s."""
    monkeypatch.setattr(torch.cuda, "Event", _DeviceEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("a host sync per mark"))
    at = {"F0": 1.0, "F1": 4.0, "recv": 5.0, "B0": 7.0, "B1": 10.0}

    def mark(name: str) -> int:
        _DeviceEvent.device_ms = at[name]
        return clock.mark()

    class _Arrival:  # the stream's wait for a transfer: the device clock moves on meanwhile
        def __init__(self, until_ms: float):
            self.until_ms = until_ms

        def wait(self, *args, **kwargs):
            _DeviceEvent.device_ms = self.until_ms

    monkeypatch.setattr(dist, "recv", lambda *args, **kwargs: _Arrival(7.0).wait())
    _DeviceEvent.device_ms = 0.0
    clock = StageClock(torch.device("cuda", 0), device_timed=True)
    clock.computed("F", 0, mark("F0"), mark("F1"))
    _DeviceEvent.device_ms = at["recv"]
    clock.recv(torch.empty(1), 1, None, 0)
    clock.computed("B", 0, mark("B0"), mark("B1"))
    clock.drain([(_Arrival(11.0), None)])
    assert all(e.stream == "stream" for e in clock._marks) and not _DeviceEvent.synchronized
    rec = clock.finish()
    assert rec["timeline_clock"] == "cuda_events"
    assert rec["timeline"] == [("F", 0, 1e-3, 4e-3), ("wait", -1, 5e-3, 7e-3), ("B", 0, 7e-3, 10e-3)]
    assert rec["step_s"] == pytest.approx(11e-3) and rec["wait_s"] == pytest.approx(3e-3)
    assert rec["compute_s"] == pytest.approx(6e-3) and rec["host_gap_s"] == pytest.approx(2e-3)
    assert rec["bubble_fraction_measured"] == pytest.approx(3 / 11) and rec["bubble_fraction_host_clock"] is None


def test_timeline_step_ratio_reads_the_timeline_steps_own_length():
    def record(pipeline: dict) -> dict:
        per_rank = [{"rank": r, "step_times_s": [0.1, 0.2, 0.3], "pipeline": pipeline} for r in range(2)]
        return {"device": {"type": "cuda"}, "per_rank": per_rank}

    stages = [{"measured": 0.2}]
    assert frames._timeline_step_ratio(record({"step_s": 0.3, "timeline_step_s": 0.5}), stages) == pytest.approx(2.5)
    # older records: the instrumented step's pipeline part
    assert frames._timeline_step_ratio(record({"step_s": 0.3}), stages) == pytest.approx(1.5)


def _engine_timeline_flags(case: Case) -> list[bool]:
    """The engine's record_timeline over a timed step, the instrumented one and the timeline step."""
    spec = make_spec(case, CPU)
    trainer = get_strategy(case.strategy).build(spec)
    batches = local_batches(case, spec, 3)
    seen = []
    for step, (measure, timeline) in enumerate(((False, False), (True, False), (False, True))):
        trainer.measure_state, trainer.record_timeline = measure, timeline
        trainer.train_step(*batches[step])
        seen.append(trainer.par.engine.record_timeline)
    trainer.close()
    return seen


def _run_case(case_dict: dict) -> tuple[list[bool], dict | None]:
    case = Case.from_dict(case_dict)
    return _engine_timeline_flags(case), run_case(case, CPU)


def test_the_timeline_comes_from_its_own_untimed_step():
    """With record_timeline the worker runs one more step after the instrumented one: its loss is
    not recorded, its stats (with the step's length) replace the instrumented step's, and the
    instrumented step's communication meter still counts every activation and gradient sent.
    The engine's timeline is on for the step the worker marks (``trainer.record_timeline``) only:
    neither the timed steps nor the instrumented one carry it."""
    m = 4
    case = Case(
        model="tiny",
        strategy="ref.pp_1f1b",
        world_size=2,
        micro_batch=m,
        steps=2,
        warmup=1,
        lr=1e-3,
        device="cpu",
        options={"pp": 2, "microbatches": m, "roofline": False, "telemetry": False, "record_timeline": True},
    )
    results = run_on_gloo(_run_case, 2, case.to_dict())
    assert [flags for flags, _ in results] == [[False, False, True]] * 2
    rec = build_record(case, "ok", results[0][1])
    cfg = model_config("tiny")
    boundary_bytes = (m // m) * cfg.seq_len * cfg.d_model * 4  # one micro-batch's fp32 activation
    for pr in rec["per_rank"]:
        assert len(pr["losses"]) == 1 + 2 + 1  # warm-up, timed, instrumented: not the timeline step's
        sent = pr["comm"]["by_kind"]["send"]  # rank 0 activations, rank 1 gradients
        assert (sent["calls"], sent["payload_bytes"]) == (m, m * boundary_bytes)
        p = pr["pipeline"]
        assert p["timeline_clock"] == "host" and len(p["timeline"]) >= 2 * m
        assert 0 < p["step_s"] <= p["timeline_step_s"]  # the pipeline is part of the whole step
        assert p["bubble_fraction_measured"] == pytest.approx(p["wait_s"] / p["step_s"])
    timed = sorted(rec["per_rank"][0]["step_times_s"])
    median = (timed[0] + timed[-1]) / 2
    longest = max(pr["pipeline"]["timeline_step_s"] for pr in rec["per_rank"])
    assert frames._timeline_step_ratio(rec, frames.pipeline_rows(rec)) == pytest.approx(longest / median)
