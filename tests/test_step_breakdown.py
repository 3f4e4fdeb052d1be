"""The step-time breakdown meter (parabench/meters/step_breakdown.py) and the worker's ``step_breakdown`` option.

* interval arithmetic (union, difference, clipping) on synthetic intervals, nested and overlapping;
* classification on synthetic events: CPU operator events on several threads (a collective enqueued
  inside an autograd node, gloo's copies inside its collective, an asynchronous send in flight, an
  all-reduce blocking inside a custom autograd function, whole-phase annotations), and GPU
  kernels (NCCL on its own stream, memcpy), including the name-based fallback for builds whose
  kineto events have no ``activity_type()``;
* the worker on 2 gloo ranks: every rank of ref.ddp and torch.fsdp2 gets a breakdown with compute and
  communication, ``single`` communicates nothing, and the option runs on an extra step only (same
  timed steps, same recorded losses as the case without it).
"""

from __future__ import annotations

import math

import pytest
import torch

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.meters.step_breakdown import STEP_MARK, Span, _kind, breakdown, clip, length, merge, subtract

# --- interval arithmetic --------------------------------------------------------------------------


def test_merge_nested_overlapping_touching_and_empty():
    assert merge([]) == []
    assert merge([(0, 10), (2, 3), (4, 5)]) == [(0, 10)]  # nested
    assert merge([(5, 8), (0, 3), (2, 6)]) == [(0, 8)]  # overlapping, unsorted
    assert merge([(0, 1), (1, 2), (3, 4)]) == [(0, 2), (3, 4)]  # touching joins, a gap stays
    assert merge([(2, 2), (5, 4), (6, 7)]) == [(6, 7)]  # empty and reversed dropped
    assert length(merge([(0, 10), (2, 3), (9, 12), (20, 21)])) == 13


def test_subtract():
    a = merge([(0, 10), (20, 30)])
    assert subtract(a, []) == a
    assert subtract([], a) == []
    assert subtract(a, [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10), (20, 30)]  # holes inside
    assert subtract(a, [(-5, 1), (8, 22), (29, 40)]) == [(1, 8), (22, 29)]  # across both ends and a gap
    assert subtract(a, [(-1, 100)]) == []
    assert subtract([(0, 4)], [(4, 5)]) == [(0, 4)]  # touching removes nothing
    # |A \ B| = |A ∪ B| - |B| for merged sets
    b = merge([(3, 7), (9, 25), (27, 28)])
    assert math.isclose(length(subtract(a, b)), length(merge(a + b)) - length(b))


def test_clip():
    assert clip([(0, 5), (6, 9), (12, 15)], 3, 13) == [(3, 5), (6, 9), (12, 13)]
    assert clip([(0, 2)], 3, 4) == []


# --- classification on synthetic events ---------------------------------------------------------

MAIN, GLOO = 1, 2


def _cpu_step():
    mark = Span(STEP_MARK, 0, 12, "annotation", MAIN)
    return mark, [
        Span("Optimizer.step#AdamW.step", 0, 12, "annotation", MAIN),  # spans everything: not an interval
        Span("autograd::engine::evaluate_function: AddmmBackward0", 0, 10, "cpu_op", MAIN),  # a wrapper
        Span("aten::mm", 0, 4, "cpu_op", MAIN),
        Span("aten::resolve_conj", 1, 2, "cpu_op", MAIN),  # nested: counted once
        Span("c10d::allreduce_", 4, 5, "cpu_op", MAIN),  # enqueued from a hook inside the node
        Span("aten::copy_", 4.2, 4.4, "cpu_op", MAIN),  # inside the enqueue: communication
        Span("aten::add_", 5, 10, "cpu_op", MAIN),
        Span("gloo:all_reduce", 3, 8, "annotation", GLOO, asynchronous=True),
        Span("aten::copy_", 3, 4, "cpu_op", GLOO),  # gloo's copy inside its collective
        Span("gloo:send", 6, 9, "annotation", MAIN, asynchronous=True),  # in flight: the main thread computes on
        # A tensor-parallel all-reduce blocking inside its autograd function: no operator runs.
        Span("_ReduceFromTP", 10, 11.5, "cpu_op", MAIN),
        Span("c10d::allreduce_", 10, 10.2, "cpu_op", MAIN),
        Span("gloo:all_reduce", 10.1, 11.4, "annotation", GLOO, asynchronous=True),
    ]


def test_cpu_ops_breakdown():
    mark, spans = _cpu_step()
    r = breakdown(spans, "cpu_ops", mark)
    assert r["source"] == "cpu_ops" and r["step_s"] == 12
    assert r["compute_s"] == pytest.approx(9)  # [0, 4) and [5, 10)
    assert r["comm_s"] == pytest.approx(7.4)  # [3, 9) and [10, 11.4)
    assert r["exposed_comm_s"] == pytest.approx(2.4)  # [4, 5) in the enqueue, [10, 11.4) blocked
    assert r["overlapped_comm_s"] == pytest.approx(5)
    assert r["overlap_fraction"] == pytest.approx(5 / 7.4)
    assert r["idle_s"] == pytest.approx(0.6)  # [11.4, 12): nothing but wrappers and annotations
    assert r["memcpy_s"] is None
    # On a CPU the step is compute + exposed communication + idle, exactly.
    assert r["compute_s"] + r["exposed_comm_s"] + r["idle_s"] == pytest.approx(r["step_s"])
    assert [(t["name"], t["calls"]) for t in r["top_comm"]] == [
        ("gloo:all_reduce", 2),
        ("gloo:send", 1),
        ("c10d::allreduce_", 2),
    ]
    assert r["top_comm"][0]["total_s"] == pytest.approx(6.3)


def test_cpu_window_clips_and_no_comm():
    _, spans = _cpu_step()
    r = breakdown(spans, "cpu_ops", Span(STEP_MARK, 9, 11, "annotation", MAIN))
    assert r["compute_s"] == pytest.approx(1) and r["comm_s"] == pytest.approx(1)
    assert r["exposed_comm_s"] == pytest.approx(1) and r["overlap_fraction"] == pytest.approx(0)
    single = breakdown([Span("aten::mm", 0, 3, "cpu_op"), Span("aten::add", 2, 4, "cpu_op")], "cpu_ops")
    assert single["step_s"] == 4 and single["compute_s"] == 4 and single["comm_s"] == 0
    assert single["exposed_comm_s"] == 0 and single["overlap_fraction"] is None and single["top_comm"] == []
    assert single["top_compute"] is None  # host ops nest: no per-name sums on CPUs


def test_cuda_kernels_breakdown():
    spans = [
        Span("ampere_sgemm_128x64_nn", 0, 2, "kernel"),
        Span("void at::native::vectorized_elementwise_kernel<4>", 1, 3, "kernel"),  # another stream
        Span("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 2.5, 5, "kernel"),
        Span("Memcpy DtoD (Device -> Device)", 5, 6, "memcpy"),
        Span("aten::mm", 0, 7, "cpu_op"),  # host events do not count on a GPU
        Span("c10d::allreduce_", 0, 7, "cpu_op"),
    ]
    r = breakdown(spans, "cuda_kernels", Span(STEP_MARK, 0, 7, "annotation"))
    assert r["compute_s"] == pytest.approx(3)
    assert r["comm_s"] == pytest.approx(2.5)
    assert r["exposed_comm_s"] == pytest.approx(2)  # [3, 5)
    assert r["overlap_fraction"] == pytest.approx(0.2)
    assert r["memcpy_s"] == pytest.approx(1)
    assert r["idle_s"] == pytest.approx(1)
    assert r["top_comm"][0]["name"].startswith("ncclDevKernel_AllReduce") and len(r["top_comm"]) == 1
    assert [(t["name"][:12], t["calls"], t["total_s"]) for t in r["top_compute"]] == [
        ("ampere_sgemm", 1, pytest.approx(2)),
        ("void at::nat", 1, pytest.approx(2)),
    ]


class _FakeEvent:
    """A kineto event of a build without ``activity_type()``."""

    def __init__(self, name, annotation=False):
        self._name, self._annotation = name, annotation

    def name(self):
        return self._name

    def is_user_annotation(self):
        return self._annotation


def test_device_event_kinds_by_name_without_activity_type():
    marks = {"parabench::step_breakdown", "FSDP::pre_forward"}
    assert _kind(_FakeEvent("ncclDevKernel_AllGather_RING_LL"), True, marks) == "kernel"
    assert _kind(_FakeEvent("sm90_xmma_gemm_bf16bf16_bf16f32"), True, marks) == "kernel"
    assert _kind(_FakeEvent("Memcpy HtoD (Pageable -> Device)"), True, marks) == "memcpy"
    assert _kind(_FakeEvent("Memset (Device)"), True, marks) == "memcpy"
    assert _kind(_FakeEvent("Stream Sync"), True, marks) == "other"
    assert _kind(_FakeEvent("FSDP::pre_forward"), True, marks) == "other"  # an annotation's GPU projection
    assert _kind(_FakeEvent("gloo:all_reduce", annotation=True), False, marks) == "annotation"
    assert _kind(_FakeEvent("aten::mm"), False, marks) == "cpu_op"


# --- the worker option on 2 gloo ranks -------------------------------------------------------------


def _case(strategy, world_size=2, **options):
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=world_size,
        micro_batch=4,
        steps=2,
        warmup=1,
        device="cpu",
        options=options,
    )


def _run_cases(case_dicts):
    from parabench.worker import run_case

    return [run_case(Case.from_dict(cd), torch.device("cpu")) for cd in case_dicts]


def _check_rank(sb, communicates: bool):
    assert sb["source"] == "cpu_ops" and sb["classified_by"] == "activity_type" and sb["window"] == "step_mark"
    assert sb["step_s"] > 0 and 0 < sb["compute_s"] <= sb["step_s"]
    assert 0 <= sb["exposed_comm_s"] <= sb["comm_s"] + 1e-12
    assert sb["compute_s"] + sb["exposed_comm_s"] + sb["idle_s"] == pytest.approx(sb["step_s"], rel=1e-9, abs=1e-9)
    if communicates:
        assert sb["comm_s"] > 0 and 0 <= sb["overlap_fraction"] <= 1
        assert sb["top_comm"] and all(t["name"].startswith(("gloo:", "c10d::")) for t in sb["top_comm"])
    else:
        assert sb["comm_s"] == 0 and sb["overlap_fraction"] is None and sb["top_comm"] == []


def test_worker_step_breakdown_on_gloo():
    cases = [_case("ref.ddp", step_breakdown=True), _case("ref.ddp"), _case("torch.fsdp2", step_breakdown=True)]
    out = run_on_gloo(_run_cases, 2, [c.to_dict() for c in cases])[0]  # rank 0 returns the gathered records
    with_sb, without, fsdp = out
    for res, case in zip(out, cases):
        for r in res["per_rank"]:
            assert len(r["step_times_s"]) == case.steps  # the profiled step is not a timed one
            assert len(r["losses"]) == case.warmup + case.steps + 1  # nor a recorded one
    # The option adds a step after everything recorded: same losses to the bit, same timed-step count.
    assert [r["losses"] for r in with_sb["per_rank"]] == [r["losses"] for r in without["per_rank"]]
    assert all("step_breakdown" not in r for r in without["per_rank"])
    for res, names in ((with_sb, {"gloo:all_reduce"}), (fsdp, {"gloo:all_gather", "gloo:all_reduce"})):
        for r in res["per_rank"]:
            _check_rank(r["step_breakdown"], communicates=True)
            assert names <= {t["name"] for t in r["step_breakdown"]["top_comm"]}, r["step_breakdown"]["top_comm"]


def test_worker_step_breakdown_single_communicates_nothing():
    (res,) = run_on_gloo(_run_cases, 1, [_case("single", world_size=1, step_breakdown=True).to_dict()])[0]
    (r,) = res["per_rank"]
    _check_rank(r["step_breakdown"], communicates=False)


def test_suite_rejects_a_non_boolean_flag():
    from parabench.suite import SuiteError, validate_case

    validate_case(_case("ref.ddp", step_breakdown=True))
    with pytest.raises(SuiteError, match="option step_breakdown must be true or false"):
        validate_case(_case("ref.ddp", step_breakdown="yes"))


def test_profiled_gpu_cases_get_a_launch_of_their_own():
    """CUPTI may stay attached after a CUDA profile: no later case may share that launch. On CPUs
    the profiled cases batch like any other."""
    from types import SimpleNamespace

    from parabench.launch import LaunchOptions
    from parabench.runner import Runner

    def batches(device):
        pending = [
            Case(model="tiny", strategy=s, world_size=2, device=device, options=o)
            for s, o in (
                ("ref.ddp", {}),
                ("torch.ddp", {"step_breakdown": True}),
                ("ref.zero1", {}),
                ("torch.fsdp2", {}),
            )
        ]
        runner, out = SimpleNamespace(launch=LaunchOptions()), []
        while pending:
            out.append([c.strategy for c in Runner._next_batch(runner, pending)])
        return out

    assert batches("cuda") == [["ref.ddp", "ref.zero1", "torch.fsdp2"], ["torch.ddp"]]
    assert batches("cpu") == [["ref.ddp", "torch.ddp", "ref.zero1", "torch.fsdp2"]]


# --- through the CLI, into the record and the report ------------------------------------------------


def _has_breakdown(record: dict) -> bool:
    return bool(record["case"]["options"].get("step_breakdown"))


def test_records_and_report_section(smoke_run, tmp_path):
    """The smoke suite's step-breakdown cases (ref.ddp, torch.ddp, torch.fsdp2; tiny, fp32, 2 ranks),
    read from the session's one smoke run (conftest.py) rather than a launch of their own."""
    import json
    import shutil

    from parabench.report.html import render_report
    from parabench.report.step_breakdown import breakdown_rows
    from parabench.results import load_run

    manifest, everything = load_run(smoke_run)
    records = [r for r in everything if _has_breakdown(r)]
    assert all("step_breakdown" not in pr for r in everything if not _has_breakdown(r) for pr in r["per_rank"])
    assert sorted(r["case"]["strategy"] for r in records) == ["ref.ddp", "torch.ddp", "torch.fsdp2"]
    for r in records:
        assert r["status"] == "ok" and len(r["metrics"]["step_times_s"]) == r["case"]["steps"]
        for pr in r["per_rank"]:
            _check_rank(pr["step_breakdown"], communicates=True)
    rows = breakdown_rows([(manifest, everything)])  # only the profiled cases make rows
    assert len(rows) == 3 and all(r["source"] == "CPU operator events (threads)" and r["ranks"] == 2 for r in rows)
    assert all(0 < r["compute_pct"] <= 100 and 0 <= r["exposed_pct"] <= 100 for r in rows)
    # A crafted kernel name is shown as text (in a copy holding the profiled cases alone).
    crafted = tmp_path / "run"
    shutil.copytree(smoke_run, crafted)
    profiled = []
    for p in sorted((crafted / "cases").glob("*.json")):
        if _has_breakdown(json.loads(p.read_text())):
            profiled.append(p)
        else:
            p.unlink()
    path = profiled[0]
    rec = json.loads(path.read_text())
    rec["per_rank"][0]["step_breakdown"]["top_comm"][0]["name"] = "<script>document.body.dataset.pwned=1</script>"
    path.write_text(json.dumps(rec))
    html = render_report([crafted], with_figures=True)
    assert 'id="tbl-step-breakdown"' in html and 'id="fig-step-breakdown"' in html
    assert "<script>document.body" not in html and "&lt;script&gt;document.body" in html
