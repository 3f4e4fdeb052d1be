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

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.record import build_record
from parabench.report import frames
from parabench.worker import run_case
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


def test_timeline_step_ratio_reads_the_timeline_steps_own_length():
    def record(pipeline: dict) -> dict:
        per_rank = [{"rank": r, "step_times_s": [0.1, 0.2, 0.3], "pipeline": pipeline} for r in range(2)]
        return {"device": {"type": "cuda"}, "per_rank": per_rank}

    stages = [{"measured": 0.2}]
    assert frames._timeline_step_ratio(record({"step_s": 0.3, "timeline_step_s": 0.5}), stages) == pytest.approx(2.5)
    # older records: the instrumented step's pipeline part
    assert frames._timeline_step_ratio(record({"step_s": 0.3}), stages) == pytest.approx(1.5)


def _run_cases(cases: list[dict]) -> list[dict | None]:
    return [run_case(Case.from_dict(d), CPU) for d in cases]


def test_the_timeline_comes_from_its_own_untimed_step():
    """With record_timeline the worker runs one more step after the instrumented one: its loss is
    not recorded, its stats (with the step's length) replace the instrumented step's, and the
    instrumented step's communication meter counts the same bytes as without the option."""
    cases = [
        Case(
            model="tiny",
            strategy="ref.pp_1f1b",
            world_size=2,
            micro_batch=4,
            steps=2,
            warmup=1,
            lr=1e-3,
            device="cpu",
            options={"pp": 2, "microbatches": 4, "roofline": False, "telemetry": False, "record_timeline": timeline},
        )
        for timeline in (False, True)
    ]
    raws = run_on_gloo(_run_cases, 2, [c.to_dict() for c in cases])[0]
    plain, timed = (build_record(c, "ok", raw) for c, raw in zip(cases, raws))
    for rec in (plain, timed):
        assert len(rec["per_rank"][0]["losses"]) == 1 + 2 + 1  # warm-up, timed, instrumented
    for before, after in zip(plain["per_rank"], timed["per_rank"]):
        assert after["comm"]["by_kind"] == before["comm"]["by_kind"]
        assert "send" in after["comm"]["by_kind"] or "recv" in after["comm"]["by_kind"]
        assert "timeline_step_s" not in before["pipeline"]
        p = after["pipeline"]
        assert p["timeline_clock"] == "host" and p["timeline"]
        assert p["step_s"] <= p["timeline_step_s"]  # the pipeline is part of the whole step
        assert p["bubble_fraction_measured"] == pytest.approx(p["wait_s"] / p["step_s"])
    stages = frames.pipeline_rows(timed)
    ratio = frames._timeline_step_ratio(timed, stages)
    median = sorted(timed["per_rank"][0]["step_times_s"])
    median = (median[0] + median[-1]) / 2
    assert ratio == pytest.approx(max(pr["pipeline"]["timeline_step_s"] for pr in timed["per_rank"]) / median)
