"""Llama 3's all-gather context parallelism (``ref.cp_allgather``) trains the same model to the same
losses and parameters as one process, moves exactly the bytes the theory says (one all-gather of K
and V per layer per micro-batch, one reduce-scatter of their gradients, in the compute dtype),
balances attention work under the zig-zag split, and a variant without the reduce-scatter is
caught. CPU, gloo, tiny shapes, every case in one spawned group of 2 ranks (a group of 4 would
double the test's time; the chunk reordering that depends on cp is checked at cp = 4 in-process).
Tolerances as in test_reference_cp_ep.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import assert_matches_single, max_rel_diff, params_close, payload_by_kind, replica_mean_losses, run_cases

from parabench.case import Case
from parabench.families.context import cp_ops
from parabench.metrics import check_against_theory
from parabench.models import model_config
from parabench.registry import expected
from parabench.report.cp_balance import analytic_flops_per_rank
from parabench.suite import SuiteError, validate_case
from parabench.theory import sum_ops
from reference_impls.context_parallel import chunks_of
from reference_impls.cp_allgather import local_calls, to_rank_order, to_sequence_order

N_STEPS = 4
OPTIM = {"eps": 1e-6}
TOL = 1e-5
PARAM_ATOL = 1e-5


def mk(world, micro_batch=2, grad_accum=1, precision="fp32", **options):
    return Case(
        model="tiny",
        strategy="ref.cp_allgather",
        world_size=world,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        precision=precision,
        lr=1e-3,
        options={"optim": OPTIM, **options},
    )


CASES = {
    "zz2": mk(2, cp_split="zigzag"),
    "ct2": mk(2, cp_split="contiguous"),
    "zz2_ga2": mk(2, micro_batch=1, grad_accum=2),
    "zz2_bf16": mk(2, precision="bf16"),
    "broken": mk(2, **{"break": "no_reduce_scatter"}),
}
EQUIVALENT = ["zz2", "ct2", "zz2_ga2"]


def _stats(trainer, case, record):
    record["stats"] = trainer.strategy_stats()


@pytest.fixture(scope="module")
def results():
    return run_cases(
        2, CASES, N_STEPS, with_truth=True, extra_step=True, meter_steps=(N_STEPS,), want_state=False, on_end=_stats
    )


@pytest.mark.parametrize("name", EQUIVALENT)
def test_matches_single_process(results, name):
    res = results[name]
    assert_matches_single(res, res["single"], loss_rtol=TOL, rtol=TOL, atol=PARAM_ATOL)


def test_without_reduce_scatter_is_caught(results):
    """Each rank keeping only its own queries' share of dK, dV fails the check the others pass."""
    res = results["broken"]
    assert max_rel_diff(replica_mean_losses(res), res["single"]["losses"]) > 10 * TOL
    assert len(params_close(res["params"], res["single"]["params"], rtol=TOL, atol=PARAM_ATOL)) > 3


def test_bf16_runs_close_to_single_process_bf16(results):
    """Under autocast K, V and their gradients cross the wire in bf16, as the theory counts them."""
    res = results["zz2_bf16"]
    truth = res["single"]
    assert truth["losses"][-1] < truth["losses"][0]
    assert max_rel_diff(replica_mean_losses(res), truth["losses"]) < 1e-2
    for r in res["per_rank"]:
        assert r["comm"]["by_kind"]["reduce_scatter"]["dtypes"] == ["torch.bfloat16"]
        assert "torch.bfloat16" in r["comm"]["by_kind"]["all_gather"]["dtypes"]  # beside the int64 token ids


@pytest.mark.parametrize("name", [n for n in CASES if n != "broken"])
def test_measured_comm_equals_theory(results, name):
    case = CASES[name]
    cfg = model_config(case.model, case.seq_len)
    want = sum_ops(cp_ops(cfg, case, "allgather"))
    assert set(want) == {"all_gather", "reduce_scatter", "all_reduce"}
    theory = expected(case, cfg, case.world_size)
    assert theory["comm_payload_bytes"] == want  # what the record carries
    for rank, r in enumerate(results[name]["per_rank"]):
        assert payload_by_kind(r["comm"]) == want, (rank, payload_by_kind(r["comm"]), want)
        check = check_against_theory(theory, [{"rank": rank, "comm": r["comm"], "state_bytes": {}}], allowance=0.0)
        assert check["comm_ok"], check["comm"]
    # per layer per micro-batch: K and V gathered once forward, their gradients scattered once backward
    calls = results[name]["per_rank"][0]["comm"]["by_kind"]
    assert calls["reduce_scatter"]["calls"] == cfg.n_layers * case.grad_accum
    assert calls["all_gather"]["calls"] == cfg.n_layers * case.grad_accum + 1  # + the token ids


def test_zigzag_balances_attention_work(results):
    """Zig-zag: the same chunk pairs, FLOPs and kernel calls on every rank; contiguous: the last
    rank computes more. Both as the ring's load-balance analysis counts them (cp_balance)."""
    cfg = model_config("tiny").to_dict()
    for name, split in (("zz2", "zigzag"), ("zz2_ga2", "zigzag"), ("ct2", "contiguous")):
        case = CASES[name]
        stats = [r["stats"] for r in results[name]["per_rank"]]
        flops = [s["attn_flops_fwd"] for s in stats]
        assert flops == analytic_flops_per_rank(case.world_size, split, cfg, case.micro_batch, case.grad_accum)
        assert all(s["split"] == split and s["mode"] == "allgather" and s["ring_hops"] == 0 for s in stats)
        if split == "zigzag":
            assert len(set(flops)) == 1
            cp = case.world_size
            # rank i: chunks i and 2cp-1-i, i + 2cp-1-i full pairs and two diagonal ones, per layer
            # per micro-batch
            per_step = cfg["n_layers"] * case.grad_accum
            assert {(s["attn_pairs_full"], s["attn_pairs_diagonal"]) for s in stats} == {
                (per_step * (2 * cp - 1), per_step * 2)
            }
        else:
            assert flops[1] == 2 * flops[0]  # rank 1: one full pair and its diagonal; rank 0: the diagonal


def test_chunk_reorder_round_trips():
    for cp, split in ((2, "zigzag"), (4, "zigzag"), (3, "contiguous")):
        n_chunks = cp * len(chunks_of(0, cp, split))
        seq = torch.arange(n_chunks * 2).view(1, -1, 1).float()  # [1, s, 1]: each position's index
        by_rank = to_rank_order(seq, cp, split)
        for r in range(cp):
            want = torch.cat([torch.arange(2 * c, 2 * c + 2) for c in chunks_of(r, cp, split)]).float()
            assert torch.equal(by_rank[r].flatten(), want)
        assert torch.equal(to_sequence_order(by_rank, cp, split), seq)


def test_kernel_calls_cover_the_causal_past_once():
    assert local_calls([1, 2]) == [(0, 1, False, 1), (0, 2, True, 1), (1, 2, False, 2), (1, 3, True, 1)]
    assert local_calls([0, 3]) == [(0, 1, True, 1), (1, 3, False, 3), (1, 4, True, 1)]


def test_unsplittable_sequence_rejected_before_launch():
    with pytest.raises(SuiteError, match="does not split into 4 chunks"):
        validate_case(dataclasses.replace(mk(2), seq_len=30))
