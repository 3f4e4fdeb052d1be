"""The host probe (``parabench.meters.host``): a record carries each rank's host speed, measured
off the clock before the warm-up and after the timed steps, and the probe sees a slower host."""

from __future__ import annotations

import gc
import time

import torch
from harness import record_on_gloo
from torch.utils._python_dispatch import TorchDispatchMode

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.meters import host
from parabench.metrics import host_steal_max
from parabench.record import build_record
from parabench.stats import boot_ids
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


def test_cpu_use_tells_a_busy_thread_from_a_blocked_one():
    start = host.cpu_times()
    end = time.thread_time() + 0.2  # 0.2 s of this thread's CPU, however long a contended host takes
    while time.thread_time() < end:
        pass
    busy = host.cpu_use(start, host.cpu_times(), steps=2)
    start = host.cpu_times()
    time.sleep(0.2)
    blocked = host.cpu_use(start, host.cpu_times(), steps=2)
    # the busy loop's CPU seconds are its own; its share of the wall time depends on the machine's load
    assert busy["thread_cpu_share"] * busy["wall_s"] >= 0.19 and blocked["thread_cpu_share"] < 0.1
    assert busy["wall_s"] >= 0.2 and blocked["voluntary_switches_per_step"] >= 0.5  # the sleep blocked once
    assert all(isinstance(c, int) for c in busy["cpus"])
    assert host.cpu_use(None, host.cpu_times(), steps=2) is None


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
    record = record_on_gloo(case)
    probes = [r["host_probe"] for r in record["per_rank"]]
    assert [sorted(p) for p in probes] == [["after", "before"]] * 2
    values = [p[when]["dispatch_us"] for p in probes for when in ("before", "after")]
    assert all(v > 0 for v in values)
    assert record["metrics"]["host_dispatch_us_max"] == max(values)
    cpu = [r["host_cpu"] for r in record["per_rank"]]
    assert all(c["wall_s"] > 0 and 0 <= c["thread_cpu_share"] <= 1.5 for c in cpu)
    assert record["metrics"]["host_thread_cpu_share_max"] == max(c["thread_cpu_share"] for c in cpu)
    assert record["metrics"]["host_foreign_cpu_share_max"] is not None
    assert record["per_rank"][0]["host_process"]["cpus_allowed"] >= 1
    assert record["metrics"]["host_involuntary_switches_per_step_max"] == max(
        c["involuntary_switches_per_step"] for c in cpu
    )


def test_gc_pauses_count_collections_by_generation():
    pauses = host.GcPauses()
    pauses.start()
    gc.collect(0)
    gc.collect(2)
    pauses.stop()
    gc.collect(1)  # after stop: not counted
    summary = pauses.summary(steps=2)
    assert summary["collections_by_generation"][0] >= 1 and summary["collections_by_generation"][2] == 1
    assert summary["collections_by_generation"][1] == 0
    assert 0 < summary["max_pause_s"] <= summary["pause_s"] == 2 * summary["pause_s_per_step"]


def _run_collecting_often(case: dict) -> tuple[dict | None, bool]:
    gc.set_threshold(1)  # a collection at nearly every allocation, so the timed steps see some
    try:
        return run_case(Case.from_dict(case), torch.device("cpu")), gc.isenabled()
    finally:
        gc.set_threshold(700, 10, 10)


def test_scheduled_gc_keeps_collections_out_of_the_timed_steps():
    def case(policy: str) -> Case:
        return Case(
            model="tiny",
            strategy="ref.ddp",
            world_size=2,
            micro_batch=2,
            steps=2,
            warmup=1,
            device="cpu",
            options={"roofline": False, "telemetry": False, "python_gc": policy},
        )

    ranks = {p: run_on_gloo(_run_collecting_often, 2, case(p).to_dict()) for p in ("auto", "scheduled")}
    assert all(enabled for results in ranks.values() for _, enabled in results)  # the policy ends with the timed steps
    auto, scheduled = (build_record(case(p), "ok", ranks[p][0][0]) for p in ("auto", "scheduled"))
    assert all(sum(r["host_gc"]["collections_by_generation"]) > 0 for r in auto["per_rank"])
    assert all(r["host_gc"]["collections_by_generation"] == [0, 0, 0] for r in scheduled["per_rank"])
    assert auto["metrics"]["host_gc_pause_s_per_step_max"] == max(
        r["host_gc"]["pause_s_per_step"] for r in auto["per_rank"]
    )
    assert scheduled["metrics"]["host_gc_pause_s_per_step_max"] == 0


def test_launch_pairs_counts_what_the_slower_launch_had(tmp_path):
    """scripts/launch_pairs.py: per pair of launches more than 5 % apart, which figures sided with the slower."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "launch_pairs.py"
    spec = importlib.util.spec_from_file_location("launch_pairs", script)
    pairs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pairs)

    def record(run: str, step_s: float, busy: float, clock: float, copy: str | None = None):
        d = tmp_path / (copy or run) / "r" / "cases"
        d.mkdir(parents=True, exist_ok=True)
        metrics = {"step_time_s_median": step_s, "gpu_util_pct_mean_min": busy, "sm_clock_mhz_median_min": clock}
        rec = {"status": "ok", "case_hash": "abc", "device": {"name": "NVIDIA H100 80GB HBM3"}, "metrics": metrics}
        (d / "abc.json").write_text(json.dumps(rec))

    record("a", 0.100, 98.0, 1980)
    record("b", 0.120, 80.0, 1980)  # slower, less busy, same clock
    record("c", 0.102, 97.0, 1965)  # within 5 % of a
    record("a", 0.100, 98.0, 1980, copy="baselines")  # a copy of a counts once
    out = pairs.compare(pairs.launches(tmp_path), 0.05)
    assert out["pairs"] == 2 and out["configurations"] == 1  # b against a, b against c
    assert out["tally"]["busy_pct"] == [2, 2]
    assert out["tally"]["sm_clock_mhz"] == [2, 0]
    assert out["tally"]["host_us"] == [0, 0]


def test_a_record_warns_when_garbage_collection_took_a_share_of_the_steps():
    from parabench.record import gc_caveat

    ranks = [{"host_gc": {"max_pause_s": 0.346}}, {"host_gc": {"max_pause_s": 0.265}}]
    metrics = {"step_time_s_median": 0.2158, "host_gc_pause_s_per_step_max": 0.0187, "host_gc_full_collections_max": 1}
    note = gc_caveat(metrics, ranks)
    assert "18.7 ms per timed step" in note and "346 ms" in note and "1 full collection," in note
    assert "python_gc" in note
    assert gc_caveat({**metrics, "host_gc_pause_s_per_step_max": 0.0004}, ranks) is None  # 0.2 % of the step
    assert gc_caveat({"step_time_s_median": 0.2}, ranks) is None  # records made before the meter


def test_busiest_threads_name_the_thread_that_took_the_cpu():
    """A host-bound step whose process uses one CPU while its main thread uses half has a second
    thread taking the rest (DeepSpeed's hooks on the autograd thread); the meter names it."""
    import threading

    spun, release = threading.Event(), threading.Event()

    def spin():
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait()  # alive at the second snapshot: /proc lists live threads only

    before = host.thread_cpu_s()
    t0 = time.perf_counter()
    worker = threading.Thread(target=spin, name="spinner")
    worker.start()
    spun.wait()
    wall = time.perf_counter() - t0
    rows = host.busiest_threads(before, host.thread_cpu_s(), wall)
    release.set()
    worker.join()
    spinner = [r for r in rows if r["thread"] == "spinner"]
    # its 0.3 CPU seconds, in /proc's 10 ms ticks; the wall time stretches on a busy machine
    assert spinner and spinner[0]["cpu_share"] * wall >= 0.27, rows
    assert rows == sorted(rows, key=lambda r: -r["cpu_share"])


def test_foreign_load_leaves_the_launchs_own_ranks_out():
    from parabench.metrics import foreign_load
    from parabench.report.html import _shared_host_notes

    def rank(own, other):
        return {
            "host_cpu": {"process_cpu_share": own, "other_cpu_share": other, "load_average": [[1, 1, 1], [3.5, 2, 1]]}
        }

    # two ranks that each see the other as the host's other work: nothing foreign
    alone = foreign_load([rank(1.0, 1.0), rank(1.0, 1.0)])
    assert alone["host_foreign_cpu_share_max"] == 0.0 and alone["host_load_average_max"] == 3.5
    # 1.5 CPUs of something else on top
    busy = foreign_load([rank(1.0, 2.5), rank(1.0, 2.4)])
    assert abs(busy["host_foreign_cpu_share_max"] - 1.5) < 1e-9
    assert foreign_load([{"host_cpu": None}]) == {"host_foreign_cpu_share_max": None, "host_load_average_max": None}
    # the report turns a busy host into a caveat, a quiet one into none
    note = _shared_host_notes({"metrics": {"host_foreign_cpu_share_max": 1.5, "host_load_average_max": 3.5}})
    assert note and "1.5 CPUs" in note[0] and "load average 3.5" in note[0]
    assert _shared_host_notes({"metrics": {"host_foreign_cpu_share_max": 0.2}}) == []


def test_process_facts_name_the_cpus_and_thread_pools():
    import os

    facts = host.process_facts()
    assert facts["cpus_allowed"] == len(os.sched_getaffinity(0))
    assert facts["torch_threads"] == torch.get_num_threads() and facts["host_cpus"] == os.cpu_count()
    assert host._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    # one machine, one boot id: every process reads the same, and a record's ranks name it once
    assert len(facts["boot_id"]) == 36 and facts["boot_id"] == host.boot_id()
    assert boot_ids({"per_rank": [{"host_process": facts}, {"host_process": facts}]}) == [facts["boot_id"]]
    assert boot_ids({"launches": [{"boot_ids": ["b"]}, {"boot_ids": ["a"]}, {}]}) == ["a", "b"]


def test_steal_is_the_hypervisors_share_of_the_timed_window(monkeypatch):
    tick = host.os.sysconf("SC_CLK_TCK")
    stat = {"steal": 0}
    # user nice system idle iowait irq softirq steal: a VM whose hypervisor took 0.5 s over a 2 s window
    monkeypatch.setattr(host, "_proc_stat_cpu", lambda: [100, 0, 50, 900, 0, 0, 0, stat["steal"], 0, 0])
    before = host.cpu_times()
    stat["steal"] = tick // 2
    after = host.cpu_times()
    after["wall_s"] = before["wall_s"] + 2.0
    use = host.cpu_use(before, after, steps=2)
    assert use["steal_cpu_share"] == 0.25
    assert after["host_busy_s"] - before["host_busy_s"] == 0.5  # stolen time counts as busy, as /proc/stat has it
    record_rank = {"host_cpu": use}
    assert host_steal_max([record_rank, {"host_cpu": {**use, "steal_cpu_share": 0.1}}]) == 0.25
    assert host_steal_max([record_rank, {"host_cpu": {**use, "steal_cpu_share": None}}]) is None
    monkeypatch.setattr(host, "_proc_stat_cpu", lambda: None)
    assert host.cpu_use(host.cpu_times(), host.cpu_times(), steps=2)["steal_cpu_share"] is None
