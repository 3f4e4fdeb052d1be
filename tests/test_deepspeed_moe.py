"""deepspeed.moe (DeepSpeed-MoE's ``MoE`` layer in the MoE blocks, ZeRO-0 engine) beside ref.ep in
the same configuration: capacity mode (tiny-moe-cap1, tiny-moe-cap2) and dropless (tiny-moe).
CPU, gloo, 2 ranks.

DeepSpeed's gate is not parabench's router (batch-level aux loss, first choices placed before
second choices when slots run out, gates renormalised over the kept experts), so the two train
different models; but both start from the same weights, and with nothing dropped (dropless, or
tiny-moe-cap2: capacity = all of a rank's tokens) their first forward is the same function. Every
check on routing is therefore made on step 0, where the two route identically.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.families.expert import deepspeed_moe_capacity, deepspeed_moe_ops
from parabench.meters.comm import CommMeter
from parabench.models import model_config, parameter_count
from parabench.registry import expected, get_strategy
from parabench.suite import SuiteError, validate_case
from parabench.theory import BYTES, sum_ops
from parabench.worker import local_batches, make_spec

N_STEPS = 5


def mk(strategy, model, micro_batch=2, grad_accum=1, precision="fp32"):
    return Case(
        model=model,
        strategy=strategy,
        world_size=2,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        precision=precision,
        lr=1e-3,
        options={"optim": {"eps": 1e-6}},
    )


CASES = {
    "ep_cap2": mk("ref.ep", "tiny-moe-cap2"),
    "ds_cap2": mk("deepspeed.moe", "tiny-moe-cap2"),
    "ep_cap1": mk("ref.ep", "tiny-moe-cap1"),
    "ds_cap1": mk("deepspeed.moe", "tiny-moe-cap1"),
    "ds_cap1_bf16_ga2": mk("deepspeed.moe", "tiny-moe-cap1", micro_batch=1, grad_accum=2, precision="bf16"),
    "ep_drop": mk("ref.ep", "tiny-moe"),
    "ds_drop": mk("deepspeed.moe", "tiny-moe"),
    "ds_drop_bf16_ga2": mk("deepspeed.moe", "tiny-moe", micro_batch=1, grad_accum=2, precision="bf16"),
    "ep_bal": mk("ref.ep", "tiny-moe-bal"),
    "ds_bal": mk("deepspeed.moe", "tiny-moe-bal"),
}
DS_CASES = [n for n, c in CASES.items() if c.strategy == "deepspeed.moe"]
PAIRS = [
    ("tiny-moe-cap2", "ds_cap2", "ep_cap2"),
    ("tiny-moe-cap1", "ds_cap1", "ep_cap1"),
    ("tiny-moe", "ds_drop", "ep_drop"),
    ("tiny-moe-bal", "ds_bal", "ep_bal"),
]


def _run(cases: dict, n_steps: int) -> dict:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported
    out = {}
    for name, cd in cases.items():
        case = Case.from_dict(cd)
        spec = make_spec(case, torch.device("cpu"))
        trainer = get_strategy(case.strategy).build(spec)
        params0 = trainer.full_parameters()
        batches = local_batches(case, spec, n_steps)
        capacities = []  # deepspeed.moe: the capacity of every MoE layer and micro-batch of step 0
        slots = getattr(trainer, "slots", {})
        hooks = [
            s.moe.deepspeed_moe.gate.register_forward_hook(lambda m, i, o: capacities.append(int(o[1])))
            for s in slots.values()
        ]
        with CommMeter() as meter:  # step 0: both strategies still route with the same weights
            losses = [float(trainer.train_step(*batches[0]))]
        for h in hooks:
            h.remove()
        stats0 = trainer.strategy_stats()
        losses += [float(trainer.train_step(*batches[i])) for i in range(1, n_steps)]
        events = [(e.kind, e.payload_bytes, e.group_size) for e in meter.events]
        out[name] = {
            "losses": losses,
            "comm": meter.summary(),
            "events": events,
            "stats0": stats0,
            "capacities": capacities,
            "state": trainer.state_bytes(),
            "params0": params0 if dist.get_rank() == 0 else None,
        }
        trainer.close()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_on_gloo(_run, 2, {n: c.to_dict() for n, c in CASES.items()}, N_STEPS)


def _layers(stats):
    return [stats["moe_layers"][k] for k in sorted(stats["moe_layers"], key=int)]


@pytest.mark.parametrize("name", DS_CASES)
def test_trains(runs, name):
    for r in runs:
        losses = r[name]["losses"]
        assert all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("ds,ep", [("ds_cap2", "ep_cap2"), ("ds_drop", "ep_drop"), ("ds_bal", "ep_bal")])
def test_same_weights_and_first_step_as_ref_ep_when_nothing_is_dropped(runs, ds, ep):
    """The gate takes the router's weights and each rank's local experts the global experts it owns,
    under the GPT's names; with nothing dropped the first forward is ref.ep's to float rounding."""
    a, b = runs[0][ds]["params0"], runs[0][ep]["params0"]
    assert list(a) == list(b)
    assert all(torch.equal(a[n], b[n]) for n in a)
    for r in runs:
        assert r[ds]["losses"][0] == pytest.approx(r[ep]["losses"][0], rel=1e-6)
        assert all(d["dropped"] == 0 for d in _layers(r[ds]["stats0"]))


@pytest.mark.parametrize("name", DS_CASES)
def test_measured_comm_equals_theory(runs, name):
    """Exactly (to 1 %) what the record's expectation says; dropless: the exact ops from the measured
    capacities, inside the record's range, and one 8-byte capacity all-reduce per layer."""
    case = CASES[name]
    cfg = model_config(case.model)
    exp = expected(case, cfg, case.world_size)
    dropless = cfg.capacity_factor is None
    for r in runs:
        comm = r[name]["comm"]
        got = {k: v["payload_bytes"] for k, v in comm["by_kind"].items()}
        want_all = sum_ops(deepspeed_moe_ops(cfg, case, r[name]["capacities"]))
        assert len(r[name]["capacities"]) == cfg.n_moe_layers * case.grad_accum
        assert set(got) == set(exp["comm_payload_bytes"]) == set(want_all)
        for kind, want in want_all.items():
            assert got[kind] == pytest.approx(want, rel=0.01), (kind, got, want)
            record = exp["comm_payload_bytes"][kind]
            if isinstance(record, list):
                assert dropless and kind == "all_to_all" and record[0] <= got[kind] <= record[1]
            else:
                assert record == want
        assert comm["scalar_ops"] == exp["comm_scalar_ops"]
        # gradients: the non-expert all-reduce over the world, the local experts' over their one-rank group
        grads = sorted((b, n) for kind, b, n in r[name]["events"] if kind == "all_reduce" and b > 64)
        assert grads == sorted(
            [(exp["comm_payload_bytes_dense_grads"], 2), (exp["comm_payload_bytes_expert_grads"], 1)]
        )
        assert comm["by_kind"]["all_reduce"]["wire_bytes"] == exp["comm_payload_bytes_dense_grads"]  # 2(n-1)/n = 1
        if case.precision == "fp32":
            state = r[name]["state"]
            assert state["params"] == exp["state_bytes"]["params"]
            assert state["optimizer"] == exp["state_bytes"]["optimizer"]


def test_capacity_and_all_to_all_shape():
    """The dense buffer is [E, C, h] per all-to-all; C is parabench's ceil(cf·T·k/E) for top-2."""
    cfg = model_config("tiny-moe-cap1")
    T = 2 * cfg.seq_len
    assert deepspeed_moe_capacity(T, cfg.n_experts, 2, 1.0) == math.ceil(1.0 * T * 2 / cfg.n_experts) == 64
    assert deepspeed_moe_capacity(T, cfg.n_experts, 2, 2.0) == T
    assert deepspeed_moe_capacity(T, cfg.n_experts, 2, 1.0, min_capacity=100) == 100
    exp = expected(CASES["ds_cap1"], cfg, 2)["comm_payload_bytes"]
    assert exp["all_to_all"] == cfg.n_moe_layers * 4 * cfg.n_experts * 64 * cfg.d_model * 4
    counts = parameter_count(cfg)
    assert exp["all_reduce"] == 4 * (counts["dense"] + counts["experts"] // 2)


def test_drops_reported_and_consistent_with_ref_ep(runs):
    """exp_counts is DeepSpeed's demand per expert (first or second choice, before the capacity cut);
    kept = min(demand, C). On step 0 the kept loads equal ref.ep's, which drops by the same count
    (in another order); nothing is dropped when the capacity holds all of a rank's tokens, nor
    dropless, where C is the largest demand over the group."""
    for r in runs:
        for model, ds, ep in PAIRS:
            cfg = model_config(model)
            for layer, (d, e) in enumerate(zip(_layers(r[ds]["stats0"]), _layers(r[ep]["stats0"]))):
                T = 2 * cfg.seq_len
                if cfg.capacity_factor is not None:
                    assert d["capacity"] == math.ceil(cfg.capacity_factor * T * cfg.top_k / cfg.n_experts)
                else:
                    assert d["capacity"] == max(max(_layers(q[ds]["stats0"])[layer]["routed_per_expert"]) for q in runs)
                    assert d["dropped"] == 0
                assert sum(d["routed_per_expert"]) == T * cfg.top_k
                assert d["tokens_per_expert"] == [min(c, d["capacity"]) for c in d["routed_per_expert"]]
                assert d["dropped"] == sum(d["routed_per_expert"]) - sum(d["tokens_per_expert"])
                assert d["tokens_per_expert"] == e["tokens_per_expert"] and d["dropped"] == e["dropped"]
                assert d["padding_rows"] == cfg.n_experts * d["capacity"] - sum(d["tokens_per_expert"])
        assert all(d["dropped"] == 0 for d in _layers(r["ds_cap2"]["stats0"]))
    assert sum(d["dropped"] for r in runs for d in _layers(r["ds_cap1"]["stats0"])) > 0


@pytest.mark.parametrize("model,ds,ep", PAIRS)
def test_all_to_all_bytes_against_ref_ep(runs, model, ds, ep):
    """Not the same bytes, by design: ref.ep sends only the kept rows (variable splits after a
    small counts all-to-all), DeepSpeed the dense [E, C, h] buffer with its empty slots. Summed
    over the ranks, per MoE layer, with the same routing (step 0):
    DeepSpeed = ref.ep (rows) + 4·h·bytes x padding slots; equal only when every expert is full."""
    cfg = model_config(model)
    row = cfg.d_model * BYTES["fp32"]
    ds_total = sum(r[ds]["comm"]["by_kind"]["all_to_all"]["payload_bytes"] for r in runs)
    ep_rows = sum(b for r in runs for kind, b, _ in r[ep]["events"] if kind == "all_to_all" and b > 64)
    padding = sum(d["padding_rows"] for r in runs for d in _layers(r[ds]["stats0"]))
    assert ds_total == ep_rows + 4 * row * padding
    assert (ds_total > ep_rows) if padding else (model == "tiny-moe-bal" and ds_total == ep_rows)


def test_validation():
    validate_case(Case(model="tiny-moe-cap1", strategy="deepspeed.moe", world_size=2))
    validate_case(Case(model="tiny-moe", strategy="deepspeed.moe", world_size=2))
    with pytest.raises(SuiteError, match="MoE model"):
        validate_case(Case(model="tiny", strategy="deepspeed.moe", world_size=2))
    with pytest.raises(SuiteError, match="experts"):
        validate_case(Case(model="tiny-moe", strategy="deepspeed.moe", world_size=8))


def test_dropless_record_range_and_balanced_value():
    """Dropless C lies in [ceil(b·s·k/E), b·s]; balanced routing gives ref.ep's balanced volume too."""
    case = CASES["ds_drop"]
    cfg = model_config(case.model)
    exp = expected(case, cfg, 2)
    lo, hi = exp["comm_payload_bytes"]["all_to_all"]
    row = cfg.d_model * 4 * cfg.n_experts * 4 * cfg.n_moe_layers
    assert (lo, hi) == (row * 64, row * 128)
    ref = expected(CASES["ep_drop"], cfg, 2)["comm_payload_bytes_balanced"]
    assert exp["comm_payload_bytes_balanced"]["all_to_all"] == ref["all_to_all"]
    assert exp["comm_scalar_ops"] == {"all_reduce": {"calls": 1, "payload_bytes": 8}}


def test_balanced_routing_gives_every_expert_its_share_in_both(runs):
    """tiny-moe-bal (the balanced benchmark mode): on every rank and MoE layer each expert serves
    exactly s*k/E tokens per sequence, in ref.ep and in DeepSpeed (whose gate computes its logits
    inline, so parabench replaces its forward); DeepSpeed's dropless buffer then has no padding."""
    cfg = model_config("tiny-moe-bal")
    share = CASES["ep_bal"].micro_batch * cfg.seq_len * cfg.top_k // cfg.n_experts
    for r in runs:
        for d, e in zip(_layers(r["ds_bal"]["stats0"]), _layers(r["ep_bal"]["stats0"])):
            assert e["tokens_per_expert"] == d["tokens_per_expert"] == [share] * cfg.n_experts
            assert d["padding_rows"] == 0 and d["dropped"] == e["dropped"] == 0
    for name in ("ep_drop", "ds_drop"):  # the unbiased router of the same weights is not balanced
        assert any(max(d["tokens_per_expert"]) > share for r in runs for d in _layers(r[name]["stats0"]))
