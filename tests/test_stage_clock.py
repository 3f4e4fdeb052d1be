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
from parabench.models import model_config
from parabench.record import build_record
from parabench.report import frames
from parabench.strategies import get_strategy
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
