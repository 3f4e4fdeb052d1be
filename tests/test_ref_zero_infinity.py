"""ref.zero3_nvme (reference_impls/zero_infinity.py), ZeRO-3 with parameter shards and optimizer state in
files: it trains exactly as ref.zero3 (same losses, same parameters, bit for bit on CPU), moves exactly
the collective bytes of ref.zero3, reads and writes exactly the file bytes its theory says every step,
keeps on disk what the theory says, holds no parameter or optimizer state in memory between steps, and
removes its files at close. Two gloo ranks, tiny model, files in the system's temporary folder."""

from __future__ import annotations

import os

import pytest
import torch
from harness import max_rel_diff, payload_by_kind, replica_mean_losses, run_cases, single_truth

from parabench.case import Case
from parabench.models import model_config
from parabench.registry import expected

N_STEPS = 2


def mk(strategy, grad_accum=1):
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=2,
        micro_batch=2 // grad_accum,
        grad_accum=grad_accum,
        lr=1e-3,
        device="cpu",
        options={"optim": {"eps": 1e-6}},
    )


CASES = {"zero3": mk("ref.zero3"), "nvme": mk("ref.zero3_nvme"), "nvme-ga2": mk("ref.zero3_nvme", 2)}


def _files(trainer, case, spec):
    return {"folder": getattr(trainer, "store", None) and trainer.store.folder}


def _on_disk(trainer, case, record):
    if hasattr(trainer, "store"):
        record["stats"] = trainer.strategy_stats()


@pytest.fixture(scope="module")
def group():
    return run_cases(
        2,
        CASES,
        N_STEPS,
        meter_steps=(N_STEPS - 1,),
        measure_state_from=N_STEPS - 1,
        on_build=_files,
        on_end=_on_disk,
    )


def test_trains_exactly_as_zero3(group):
    zero3, nvme = group["zero3"], group["nvme"]
    assert [r["losses"] for r in nvme["per_rank"]] == [r["losses"] for r in zero3["per_rank"]]
    assert all(torch.equal(nvme["params"][n], p) for n, p in zero3["params"].items())
    truth = single_truth(CASES["nvme-ga2"], N_STEPS)  # with accumulation: one process on the global batch
    assert max_rel_diff(replica_mean_losses(group["nvme-ga2"]), truth["losses"]) < 1e-5


@pytest.mark.parametrize("name", ["nvme", "nvme-ga2"])
def test_bytes_on_the_wire_on_disk_and_in_memory_equal_theory(group, name):
    case = CASES[name]
    exp = expected(case, model_config("tiny"), 2)
    zero3 = expected(CASES["zero3"], model_config("tiny"), 2)["comm_payload_bytes"]
    assert exp["nvme_io_bytes_per_step"]["read"] > 2 * case.grad_accum * exp["nvme_state_bytes"]["params"]
    for r in group[name]["per_rank"]:
        assert payload_by_kind(r["comm"]) == exp["comm_payload_bytes"]
        if case.grad_accum == 1:
            assert exp["comm_payload_bytes"] == zero3
        stats = r["stats"]
        assert stats["nvme_read_bytes_per_step"] == exp["nvme_io_bytes_per_step"]["read"]
        assert stats["nvme_write_bytes_per_step"] == exp["nvme_io_bytes_per_step"]["write"]
        assert stats["nvme_state_bytes"] == {k: v for k, v in exp["nvme_state_bytes"].items() if k != "grads"}
        assert r["state"] == exp["state_bytes"]
        assert not os.path.exists(r["folder"])  # removed at close
