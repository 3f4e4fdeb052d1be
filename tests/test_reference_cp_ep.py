"""Context parallelism (ring attention zig-zag / contiguous, Ulysses) and expert parallelism train
the same model to the same losses and parameters as one process, move exactly the bytes the
theory says, balance the ring's work with the zig-zag split, and a broken ring or Ulysses is
caught. CPU, gloo, fp32, tiny shapes.

Cases of one world size share one spawned process group (``harness.run_cases``); the
single-process ground truth is computed on rank 0 in-process (``harness.single_truth``: same
model, data and global batch of micro_batch x world samples). Tolerances as in test_reference_mp: losses 1e-5 relative,
parameters rtol 1e-5 / atol 1e-5 with Adam eps 1e-6.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import assert_matches_single, max_rel_diff, params_close, payload_by_kind, replica_mean_losses, run_cases

from parabench.case import Case
from parabench.families.context import cp_ops
from parabench.families.expert import ep_ops
from parabench.models import GPT, build_model, model_config, model_flops_per_token, parameter_count
from parabench.registry import expected, get_strategy
from parabench.suite import SuiteError, validate_case
from parabench.theory import sum_ops
from parabench.topology import Topology
from parabench.trainer import TrainSpec

N_STEPS = 5
OPTIM = {"eps": 1e-6}
TOL = 1e-5
PARAM_ATOL = 1e-5


def mk(name, strategy, world, model="tiny", micro_batch=2, grad_accum=1, **options):
    return name, Case(
        model=model,
        strategy=strategy,
        world_size=world,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        lr=1e-3,
        options={"optim": OPTIM, **options},
    )


CASES_2 = dict(
    [
        mk("ring_zz2", "ref.cp_ring", 2, cp_split="zigzag"),
        mk("ring_ct2", "ref.cp_ring", 2, cp_split="contiguous"),
        mk("uly2", "ref.cp_ulysses", 2),
        mk("ring_zz2_ga2", "ref.cp_ring", 2, micro_batch=1, grad_accum=2),
        mk("ep2", "ref.ep", 2, model="tiny-moe"),
        mk("ep2_cap", "ref.ep", 2, model="tiny-moe-cap1"),
        mk("ep2_bal", "ref.ep", 2, model="tiny-moe-bal"),
        mk("broken_ring", "ref.cp_ring", 2, **{"break": "no_lse"}),
        mk("broken_uly", "ref.cp_ulysses", 2, **{"break": "no_reverse"}),
        mk("ds_uly2", "deepspeed.ulysses", 2),
        mk("ep2_bf16", "ref.ep", 2, model="tiny-moe"),
        mk("ring_zz2_bf16", "ref.cp_ring", 2, cp_split="zigzag"),
    ]
)
CASES_2["ep2_bf16"] = dataclasses.replace(CASES_2["ep2_bf16"], precision="bf16")
CASES_2["ring_zz2_bf16"] = dataclasses.replace(CASES_2["ring_zz2_bf16"], precision="bf16")
CASES_4 = dict(
    [
        mk("ring_zz4", "ref.cp_ring", 4, micro_batch=1, cp_split="zigzag"),
        mk("ring_ct4", "ref.cp_ring", 4, micro_batch=1, cp_split="contiguous"),
        mk("uly4", "ref.cp_ulysses", 4, micro_batch=1),
        mk("ep4", "ref.ep", 4, model="tiny-moe", micro_batch=1),
    ]
)
EQUIVALENT = [
    n
    for n in {**CASES_2, **CASES_4}
    if not n.startswith("broken") and n not in ("ep2_cap", "ep2_bf16", "ring_zz2_bf16")
]


def _stats(trainer, case, record):
    record["stats"] = trainer.strategy_stats()


def _group(cases: dict, world: int) -> dict:
    """Every rank trains each case for N_STEPS, then one more step under the comm meter; rank 0
    adds the single-process truth."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the ranks import DeepSpeed (deepspeed.ulysses)
    return run_cases(
        world, cases, N_STEPS, with_truth=True, extra_step=True, meter_steps=(N_STEPS,), want_state=False, on_end=_stats
    )


@pytest.fixture(scope="module")
def group2():
    return _group(CASES_2, 2)


@pytest.fixture(scope="module")
def group4():
    return _group(CASES_4, 4)


@pytest.fixture(scope="module")
def results(group2, group4):
    return {**group2, **group4}


@pytest.mark.parametrize("name", EQUIVALENT)
def test_matches_single_process(results, name):
    res = results[name]
    assert_matches_single(res, res["single"], loss_rtol=TOL, rtol=TOL, atol=PARAM_ATOL)


def test_ep_bf16_runs_close_to_single_process_bf16(results):
    """Under autocast the token rows cross the wire in bf16 (the experts would cast them anyway):
    same recipe as the single-process bf16 run, up to bf16 rounding of the summation order."""
    res = results["ep2_bf16"]
    truth = res["single"]
    assert truth["losses"][-1] < truth["losses"][0]
    assert max_rel_diff(replica_mean_losses(res), truth["losses"]) < 1e-2
    assert res["per_rank"][0]["comm"]["by_kind"]["all_to_all"]["dtypes"] == ["torch.bfloat16"]


def test_ring_bf16_runs_close_to_single_process_bf16(results):
    """Under autocast q, k, v are bf16: K, V and the dK, dV partial sums cross the wire in bf16
    (the theory counts 2 bytes per element and is checked exactly by test_measured_comm_equals_theory)."""
    res = results["ring_zz2_bf16"]
    truth = res["single"]
    assert truth["losses"][-1] < truth["losses"][0]
    assert max_rel_diff(replica_mean_losses(res), truth["losses"]) < 1e-2
    for r in res["per_rank"]:
        assert r["comm"]["by_kind"]["send"]["dtypes"] == ["torch.bfloat16"]
        assert r["comm"]["by_kind"]["recv"]["dtypes"] == ["torch.bfloat16"]


@pytest.mark.parametrize("name", ["broken_ring", "broken_uly"])
def test_broken_variant_is_caught(group2, name):
    res = group2[name]
    # the equivalence check that passes the correct implementations fails on both counts
    assert max_rel_diff(replica_mean_losses(res), res["single"]["losses"]) > 10 * TOL
    assert len(params_close(res["params"], res["single"]["params"], rtol=TOL, atol=PARAM_ATOL)) > 5


@pytest.mark.parametrize("name", [n for n in {**CASES_2, **CASES_4} if not n.startswith("broken")])
def test_measured_comm_equals_theory(results, name):
    case = {**CASES_2, **CASES_4}[name]
    cfg = model_config(case.model, case.seq_len)
    for rank, r in enumerate(results[name]["per_rank"]):
        if case.strategy == "ref.ep":
            layers = r["stats"]["moe_layers"]
            routing = [(layers[k]["sent_rows"], layers[k]["received_rows"]) for k in sorted(layers, key=int)]
            want = sum_ops(ep_ops(cfg, case, routing))
        else:
            want = sum_ops(cp_ops(cfg, case, "ring" if case.strategy == "ref.cp_ring" else "ulysses"))
        got = payload_by_kind(r["comm"])
        assert set(got) == set(want), (rank, got, want)
        for kind in want:
            assert got[kind] == pytest.approx(want[kind], rel=0.01), (rank, kind, got, want)
    if case.strategy != "ref.ep":  # the record's expectation is the same for every rank
        exp = expected(case, cfg, case.world_size)["comm_payload_bytes"]
        assert exp == sum_ops(cp_ops(cfg, case, "ring" if case.strategy == "ref.cp_ring" else "ulysses"))


def test_ep_balanced_expectation_is_the_mean_over_ranks(results):
    """Routing moves rows between ranks unevenly, but sent rows sum to received rows over the group,
    so the balanced expectation equals the mean over ranks of the measured all-to-all payload."""
    for name in ("ep2", "ep4"):
        case = CASES_2.get(name) or CASES_4[name]
        cfg = model_config(case.model)
        per_rank = [r["comm"]["by_kind"]["all_to_all"]["payload_bytes"] for r in results[name]["per_rank"]]
        exp = expected(case, cfg, 1)
        assert sum(per_rank) / len(per_rank) == pytest.approx(exp["comm_payload_bytes_balanced"]["all_to_all"])
        lo, hi = exp["comm_payload_bytes"]["all_to_all"]
        assert all(lo <= p <= hi for p in per_rank), (lo, per_rank, hi)


def test_ep_records_routing_and_drops(group2):
    cap = group2["ep2_cap"]["per_rank"]
    drop = group2["ep2"]["per_rank"]
    cfg = model_config("tiny-moe-cap1")
    for r in drop:
        for layer in r["stats"]["moe_layers"].values():
            assert layer["dropped"] == 0
            assert sum(layer["tokens_per_expert"]) == 2 * cfg.seq_len * cfg.top_k
    dropped = [layer["dropped"] for r in cap for layer in r["stats"]["moe_layers"].values()]
    assert sum(dropped) > 0
    for r in cap:
        for layer in r["stats"]["moe_layers"].values():
            capacity = -(-1.0 * 2 * cfg.seq_len * cfg.top_k // cfg.n_experts)
            assert max(layer["tokens_per_expert"]) <= capacity
            assert sum(layer["tokens_per_expert"]) + layer["dropped"] == 2 * cfg.seq_len * cfg.top_k


def test_zigzag_balances_ring_work(group4):
    zz = [r["stats"]["attn_flops_fwd"] for r in group4["ring_zz4"]["per_rank"]]
    ct = [r["stats"]["attn_flops_fwd"] for r in group4["ring_ct4"]["per_rank"]]
    assert len(set(zz)) == 1
    assert ct == sorted(ct) and ct[-1] > ct[0]
    # contiguous: rank r computes r full blocks + its diagonal; the last rank paces the step
    pairs = [r["stats"]["attn_pairs_full"] + r["stats"]["attn_pairs_diagonal"] for r in group4["ring_ct4"]["per_rank"]]
    assert pairs == [model_config("tiny").n_layers * (r + 1) for r in range(4)]  # summed over layers
    assert max(ct) / (sum(ct) / 4) == pytest.approx(1.6)
    # zig-zag: chunks of s/8, 3 pairs on its own block + 2 per foreign block = 9 pairs of (s/8)^2;
    # contiguous rank 0: one pair of (s/4)^2 = 4 of (s/8)^2
    assert zz[0] * 4 == ct[0] * 9


def test_moe_parameter_counts_and_flops():
    for name in ("tiny", "tiny-moe", "tiny-moe-cap1"):
        cfg = model_config(name)
        with torch.device("meta"):
            m = GPT(cfg)
        counts = parameter_count(cfg)
        assert counts["total"] == sum(p.numel() for p in m.parameters())
        if cfg.is_moe:
            experts = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
            assert counts["experts"] == experts and counts["dense"] == counts["total"] - experts
            per_expert = experts // (cfg.n_experts * cfg.n_moe_layers)
            assert counts["active"] == counts["total"] - cfg.n_moe_layers * (cfg.n_experts - cfg.top_k) * per_expert
            dense = model_config("tiny")
            assert model_flops_per_token(cfg) > model_flops_per_token(dense)
    assert parameter_count(model_config("tiny")) == {
        "total": 136832,
        "blocks": 99840,
        "embeddings": 20480,
        "head": 16384,
        "matmul": 114688,
    }


def test_dense_model_unchanged_by_moe_fields():
    cfg = model_config("tiny")
    m = build_model(cfg, 1)
    assert not any("router" in n or "experts" in n for n, _ in m.named_parameters())
    assert model_config("gpt-125m-8k").seq_len == 8192


@pytest.mark.parametrize(
    "case,msg",
    [
        (Case(model="tiny", strategy="ref.cp_ulysses", world_size=8), "heads"),
        (Case(model="tiny-moe", strategy="ref.cp_ring", world_size=2), "dense models only"),
        (Case(model="tiny", strategy="ref.ep", world_size=2), "MoE model"),
        (Case(model="tiny", strategy="ref.cp_ring", world_size=2, seq_len=30), "chunks"),
        (Case(model="tiny", strategy="ref.cp_ring", world_size=4, options={"cp": 2}), "must equal"),
        (Case(model="tiny", strategy="ref.cp_ring", world_size=4, options={"tp": 2}), "unknown option .tp."),
        (Case(model="tiny-moe", strategy="ref.ep", world_size=8), "experts"),
    ],
)
def test_unsupported_cases_rejected_before_launch(case, msg):
    with pytest.raises(SuiteError, match=msg):
        validate_case(case)


def test_torch_cp_refuses_cpu_with_the_reason():
    cfg = model_config("tiny")
    spec = TrainSpec(
        model=cfg,
        seed=1,
        device=torch.device("cpu"),
        precision="fp32",
        topology=Topology(world_size=2, rank=0),
        micro_batch=2,
    )
    with pytest.raises(NotImplementedError, match="sharding strategy"):
        get_strategy("torch.cp").build(spec)
