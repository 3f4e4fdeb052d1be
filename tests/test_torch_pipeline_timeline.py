"""torch.distributed.pipelining under option ``record_timeline``: the peer's actions and waits are
timed like the reference engines' (``peers.torch_pipeline.timed_actions``), so its record carries
the same timeline, order and bubble, and the report replays its schedule. Tiny model, 2 CPU ranks."""

from __future__ import annotations

import pytest
import torch

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.record import build_record
from parabench.report import frames
from parabench.worker import run_case
from reference_impls.pipeline import one_f_one_b_order
from reference_impls.pipeline_zb import zb_h1_order

M = 4


def mk(strategy: str, record_timeline: bool = True, **options) -> Case:
    return Case(
        model="tiny-deep",
        strategy=strategy,
        world_size=2,
        micro_batch=4,
        steps=1,
        warmup=1,
        device="cpu",
        options={"roofline": False, "telemetry": False, "pp": 2, "microbatches": M, "record_timeline": record_timeline}
        | options,
    )


CASES = {
    "zb": mk("torch.pp_zb"),
    "1f1b": mk("torch.pp_1f1b"),
    "interleaved": mk("torch.pp_interleaved", virtual_stages=2),
    "untimed": mk("torch.pp_1f1b", record_timeline=False),
}


def _run(cases: dict) -> dict:
    from torch.distributed.pipelining import schedules

    out = {name: run_case(Case.from_dict(c), torch.device("cpu")) for name, c in cases.items()}
    return {**out, "wait_after": schedules._wait_batch_p2p.__name__}


@pytest.fixture(scope="module")
def records():
    raws = run_on_gloo(_run, 2, {n: c.to_dict() for n, c in CASES.items()})[0]
    return {n: build_record(CASES[n], "ok", raws[n]) for n in CASES} | {"wait_after": raws["wait_after"]}


@pytest.mark.parametrize(
    ("name", "schedule", "kinds"),
    [("zb", "zb_h1", "FBW"), ("1f1b", "1f1b", "FB"), ("interleaved", "interleaved_1f1b", "FB")],
)
def test_every_action_and_wait_is_on_the_timeline(records, name, schedule, kinds):
    chunks = 2 if name == "interleaved" else 1
    for r in records[name]["per_rank"]:
        p = r["pipeline"]
        assert (p["schedule"], p["stages"], p["microbatches"], p["timeline_clock"]) == (schedule, 2, M, "host")
        ops = [e for e in p["timeline"] if e[0] != "wait"]
        assert sorted({e[0] for e in ops}) == sorted(kinds)
        assert all(sum(e[0] == k for e in ops) == M * chunks for k in kinds)
        assert len(p["order"]) == len(ops) and all(p["compute_s_by_kind"][k] > 0 for k in kinds)
        assert any(e[0] == "wait" for e in p["timeline"]) and p["wait_s"] > 0
        assert 0 < p["bubble_fraction_measured"] < 1 and 0 < p["bubble_fraction_theory"] < 1


def test_the_order_is_the_schedules(records):
    for name, order_of in (("zb", zb_h1_order), ("1f1b", one_f_one_b_order)):
        for r in records[name]["per_rank"]:
            stage = r["pipeline"]["stage"]
            assert r["pipeline"]["order"] == [f"{k}{i}c{stage}" for k, i in order_of(stage, 2, M)], name


def test_the_report_replays_the_peers_schedule(records):
    rows = frames.bubble_rows([({"suite": "t", "run_id": "r"}, [records[n] for n in ("zb", "1f1b", "interleaved")])])
    assert len(rows) == 3
    assert all(row["simulated_pct"] is not None for row in rows)


def test_timed_steps_run_the_schedule_untouched(records):
    assert all("pipeline" not in r for r in records["untimed"]["per_rank"])
    assert records["wait_after"] == "_wait_batch_p2p"  # torch's own again once the timeline step ended
