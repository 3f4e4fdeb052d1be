"""The planner: calibration storage, the model's ZeRO lines, leave-one-out hygiene, the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from parabench.cli import main
from parabench.models import GPTConfig, model_config, parameter_count
from parabench.plan import calibrate as C
from parabench.plan import model as M
from parabench.plan import validate as V
from parabench.plan.workload import for_config
from parabench.suite import load_suite
from parabench.theory import zero_paper_state_bytes

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVES = {
    op: {"alpha_s": 2e-5, "busbw_Bps": 300e9, "group_size": 2} for op in ("all_reduce", "all_gather", "reduce_scatter")
}


def _cal(**time) -> dict:
    return {"peak_flops": 989.4e12, "time": time, "memory": {}, "collectives": COLLECTIVES}


def _obs(strategy: str, micro_batch: int, step_s: float, world_size: int = 2) -> C.Observation:
    w = for_config(
        model="tiny", cfg=model_config("tiny"), strategy=strategy, world_size=world_size, micro_batch=micro_batch
    )
    return C.Observation(
        key=json.dumps([strategy, micro_batch, world_size, {}]),
        workload=w,
        step_s=step_s,
        peak_bytes=w.state_bytes * 1.5 + 1e6,
        runs=["r"],
        n_records=1,
    )


def test_calibration_round_trips(tmp_path):
    obs = [_obs(s, mb, 0.01 * mb) for s in ("ref.ddp", "ref.zero2") for mb in (1, 2, 4)]
    cal = C.fit(obs, COLLECTIVES)
    path = C.save(cal, tmp_path / "h100.json")
    assert C.load(path) == cal
    assert C.load_kind("h100", tmp_path) == cal and C.load_kind("a100", tmp_path) is None
    assert C.load_kind("h200", tmp_path)["derived_from"]["kind"] == "h100"  # no h200.json: derived
    (tmp_path / "bad.json").write_text('{"kind": "plan-calibration", "schema_version": 99}')
    with pytest.raises(C.CalibrationError, match="schema"):
        C.load(tmp_path / "bad.json")


@pytest.mark.parametrize("strategy,stage", [("deepspeed.zero1", 1), ("deepspeed.zero2", 2), ("deepspeed.zero3", 3)])
def test_model_states_are_the_zero_lines(strategy, stage):
    """Peers the state meter cannot read are held to the ZeRO paper's line, exactly."""
    w = for_config(model="gpt-350m", cfg=model_config("gpt-350m"), strategy=strategy, world_size=4, micro_batch=1)
    assert w.state_bytes == pytest.approx(zero_paper_state_bytes(stage, w.params, 4))
    assert M.states_at(w, "step") == pytest.approx(w.state_bytes + M.step_copy_bytes(w))


@pytest.mark.parametrize("strategy", ["deepspeed.zero1", "deepspeed.zero2"])
@pytest.mark.parametrize("ranks,bytes_per_param", [(1, 22), (2, 12), (8, None)])
def test_deepspeed_zero12_step_holds_its_gradient_copies(strategy, ranks, bytes_per_param):
    """DeepSpeed ZeRO-1/2's step casts the flattened 16-bit gradient partition to fp32 beside every
    state: 2 + 20/N bytes per parameter, as measured at N = 1 and 2 (ds-step-peak-*-h200x*); where
    ZeRO-1's full 16-bit gradients outweigh that (N = 8), its paper line."""
    w = for_config(model="gpt-350m", cfg=model_config("gpt-350m"), strategy=strategy, world_size=ranks, micro_batch=1)
    at_cast = (2 + 20 / ranks) * w.params
    assert M.states_at(w, "step") == pytest.approx(max(at_cast, w.state_bytes))
    if bytes_per_param is not None:
        assert M.states_at(w, "step") == pytest.approx(bytes_per_param * w.params)
    fp32 = for_config(
        model="gpt-350m",
        cfg=model_config("gpt-350m"),
        strategy=strategy,
        world_size=ranks,
        micro_batch=1,
        precision="fp32",
    )
    assert M.step_copy_bytes(fp32) == 0  # the cast to fp32 copies nothing


def test_deepspeed_zero3_keeps_its_gradient_buffer_and_bucket():
    """DeepSpeed ZeRO-3 allocates its gradient partitions' flat buffer and its reduce bucket at start-up:
    both are alive at the start of backward, where the other sharded trainers hold no gradients."""
    kw = dict(model="gpt-350m", cfg=model_config("gpt-350m"), world_size=4, micro_batch=1)
    ds, ref = for_config(strategy="deepspeed.zero3", **kw), for_config(strategy="ref.zero3", **kw)
    grads = ds.state_parts["grads"]
    assert M.persistent_grad_bytes(ds) == pytest.approx(grads + 2 * M.DS_REDUCE_BUCKET_ELEMENTS)
    assert M.persistent_grad_bytes(ref) == 0


@pytest.mark.parametrize("strategy", ["ref.zero1", "ref.zero2", "ref.zero3", "torch.ddp"])
def test_model_states_are_the_theory_layout(strategy):
    """References are held to the theory's layout of what they actually keep, summed exactly."""
    from parabench.case import Case
    from parabench.registry import expected

    cfg = model_config("gpt-350m")
    w = for_config(model="gpt-350m", cfg=cfg, strategy=strategy, world_size=4, micro_batch=1)
    exp = expected(Case(model="gpt-350m", strategy=strategy, world_size=4, precision="bf16", micro_batch=1), cfg, 4)
    assert w.state_bytes == sum(exp["state_bytes"].values())
    assert w.state_parts == {k: float(v) for k, v in exp["state_bytes"].items()}


def test_leave_one_out_excludes_the_predicted_configuration(monkeypatch):
    obs = [_obs("ref.ddp", mb, 0.01 * mb) for mb in (1, 2, 4)] + [_obs("ref.zero2", 2, 5.0)]
    seen = []
    real_fit = C.fit

    def spy(fit_obs, *a, **k):
        seen.append({o.key for o in fit_obs})
        return real_fit(fit_obs, *a, **k)

    monkeypatch.setattr(C, "fit", spy)
    rows = V.leave_one_out(obs, COLLECTIVES)
    assert all(o.key not in keys for o, keys in zip(obs, seen))
    # the lone ref.zero2 configuration, 100x slower than the physics, is not predicted from itself
    zero2 = next(r for r in rows if r["label"].startswith("ref.zero2"))
    assert zero2["pred_step_s"] < 1.0


def test_leave_one_out_rows_do_not_depend_on_the_worker_processes():
    """The fits are independent: two workers give the serial rows, in the configurations' order."""
    obs = [
        _obs(s, mb, 0.01 * mb * (1.2 if s == "ref.zero2" else 1)) for s in ("ref.ddp", "ref.zero2") for mb in (1, 2, 4)
    ]
    assert V.leave_one_out(obs, COLLECTIVES, jobs=2) == V.leave_one_out(obs, COLLECTIVES)


def test_spearman_and_summary():
    assert V.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert V.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_a_group_is_ranked_by_throughput_not_by_step_time():
    """At one micro-batch, TP x DP (half the data-parallel degree) and accumulation make steps of
    different tokens: the ranking and the fastest configuration are by time per token."""

    def row(key, step, pred, tokens):
        return {
            "key": key,
            "label": key,
            "group": "g",
            "step_s": step,
            "pred_step_s": pred,
            "tokens_per_step": tokens,
            "peak_bytes": None,
            "pred_peak_bytes": None,
        }

    rows = [row("dp", 1.0, 1.0, 8), row("tp", 0.6, 0.6, 4), row("ga", 3.6, 3.6, 32)]
    s = V.summarize(rows)
    assert s["spearman_median"] == pytest.approx(1.0) and s["fastest_share"] == 1.0
    flipped = [row("dp", 1.0, 1.0, 8), row("tp", 0.6, 0.4, 4), row("ga", 3.6, 3.6, 32)]
    assert V.summarize(flipped)["fastest_strict_share"] == 0.0  # per token, ga is fastest, tp predicted so


def test_the_issues_grouping_ranks_every_recipe_and_micro_batch_of_a_model_on_a_gpu_count():
    def row(group, step, pred, tokens=8):
        return {
            "key": f"{group}{step}",
            "label": group,
            "group": group,
            "step_s": step,
            "pred_step_s": pred,
            "tokens_per_step": tokens,
            "peak_bytes": None,
            "pred_peak_bytes": None,
        }

    rows = [
        row("gpt-1.3b w2 amp mb4", 1.0, 1.0),
        row("gpt-1.3b w2 master mb8", 1.6, 1.5, 16),  # 0.100 s per token: the fastest
        row("gpt-1.3b fused w2 master mb4", 1.3, 1.2),  # another layout: its own model
        row("gpt-1.3b w2 fp8 mb4", 0.9, 1.1),  # measured second, predicted slowest
        row("gpt-1.3b w4 amp mb4", 1.0, 1.0),  # another GPU count
    ]
    assert V.scale_group("gpt-1.3b fused w2 master mb4") == "gpt-1.3b fused w2"
    sc = V.summarize(rows)["by_model_and_gpus"]
    [g] = sc["per_group"]  # one (model, GPU count) of 3 or more
    assert g["group"] == "gpt-1.3b w2" and g["configs"] == 3
    assert g["spearman"] == pytest.approx(0.5)  # measured order master, fp8, amp; predicted master, amp, fp8
    assert sc["groups"] == 1 and sc["below_0.9"] == 1
    assert g["spearman_noise_tied"] == pytest.approx(0.5)  # 0.1125 and 0.125 s per token: more than 5 % apart
    # the one pair ordered wrong (amp 0.125, fp8 0.1125 s per token: 11.1 % apart) against the larger of
    # its two implementations' launch spreads
    for i, impl in enumerate(("a", "b", "c", "d", "e")):
        rows[i]["impl"] = impl
    [pair] = V.summarize(rows, {"a": 0.12, "d": 0.02})["by_model_and_gpus"]["per_group"][0]["misordered_pairs"]
    assert set(pair["pair"]) == {"gpt-1.3b w2 amp mb4", "gpt-1.3b w2 fp8 mb4"}
    assert pair["gap_pct"] == pytest.approx(100 / 9) and pair["launch_spread_pct"] == pytest.approx(12)
    assert V.summarize(rows, {"a": 0.12})["by_model_and_gpus"]["misordered_within_launch_spread"] == 1
    assert V.summarize(rows, {"a": 0.10, "d": 0.02})["by_model_and_gpus"]["misordered_within_launch_spread"] == 0
    assert V.summarize(rows)["by_model_and_gpus"]["misordered_within_launch_spread"] is None


def test_cli_rejects_unknown_names(capsys):
    assert main(["plan", "--model", "gpt-99b", "--gpus", "2"]) == 2
    assert "valid models" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt-350m", "--gpus", "2", "--gpu", "tpu-v9"]) == 2
    assert "accepted: h100-80g (calibrated), h200-141g (derived from h100)" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt-350m", "--gpus", "2", "--recipe", "fp9"]) == 2
    assert "valid recipes: " in capsys.readouterr().err


def test_write_suite_parses_and_infeasible_configs_are_dropped(tmp_path, capsys):
    out = tmp_path / "top.toml"
    argv = ["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "64", "--gpus", "2"]
    assert main(argv) == 0
    assert main(["plan", "--model", "small", "--gpus", "2", "--top", "3", "--write-suite", str(out)]) == 0
    suite = load_suite(str(out))
    assert len(suite.cases) == 3 and {c.model for c in suite.cases} == {"small"}


def test_plan_ranks_a_memory_infeasible_config_out_with_a_reason():
    from parabench.plan import search as S

    cal = C.load_kind("h100")
    assert cal is not None, "results/calibration/h100.json is committed"
    cfg = model_config("gpt-6.7b")
    c = S.evaluate(S.Candidate("ref.ddp", 2, 1, 1, {}, "master"), "gpt-6.7b", cfg, cal, 79.2 * M.GIB)
    assert c.dropped and c.dropped.startswith("does not fit") and "states" in c.dropped
    small = dataclasses.replace(c, dropped=None, workload=None, prediction=None, strategy="ref.zero3")
    assert S.evaluate(small, "gpt-6.7b", cfg, cal, 79.2 * M.GIB).dropped is None


def test_plan_peaks_hold_the_alive_states_and_the_printed_parts_sum_to_the_peak():
    """Every gpt-13b / 8-GPU configuration: predicted peak >= the states the model says are alive at
    the peak, no negative part, and the dropped-reason line's parts add up to the printed peak."""
    import re

    from parabench.plan import search as S

    cal, cfg = C.load_kind("h100"), model_config("gpt-13b")
    # torch.pp's theory builds the model per stage on the meta device (4 s a configuration): left out for time
    cands = [c for c in S.candidates(cfg, 8, "master", None) if not c.strategy.startswith("torch.pp")]
    evaluated = [S.evaluate(c, "gpt-13b", cfg, cal, S.GPUS["h100-80g"][1]) for c in cands]
    dropped = [c for c in evaluated if c.dropped]
    predicted = [c for c in evaluated if c.prediction is not None and c.prediction.peak_bytes]
    assert len(predicted) > 100
    for c in predicted:
        p, w = c.prediction, c.workload
        phase = "step" if p.peak_phase == "optimizer step" else "backward"
        assert p.peak_bytes >= M.states_at(w, phase) >= M.states_at(w, "backward") >= 0, S.describe(c)
        assert p.peak_bytes >= M.states_at(w, "step") or phase == "backward"
        assert all(v >= 0 for v in p.memory_bytes.values()), (S.describe(c), p.memory_bytes)
        assert sum(S.peak_split(p).values()) == pytest.approx(p.peak_bytes)
    ddp = next(c for c in dropped if c.strategy == "ref.ddp" and c.dropped.startswith("does not fit"))
    nums = [float(x) for x in re.findall(r"(?<![\w.])(\d+\.\d)(?= GiB| \(|$| \+)", ddp.dropped.split(" > ")[0])]
    peak, states, acts, other, overhead = nums[0], nums[1], nums[-3], nums[-2], nums[-1]
    assert peak >= states >= ddp.workload.state_bytes / M.GIB - 0.05
    assert abs(states + acts + other + overhead - peak) <= 0.25, ddp.dropped


def _device_s(w, cal) -> float:
    consts = M.time_constants(cal["time"])
    return sum(consts[k] * v for k, v in M.time_features(w, COLLECTIVES, consts).items())


def test_overlapped_collective_exposes_its_tail_or_what_compute_cannot_hide():
    """Pieces issued as compute produces them end max(last piece, comm - hidden) after the compute."""
    assert M.overlap_tail_s(10.0, 100.0, 10, 0.0) == pytest.approx(1.0)  # hidden but the last of 10 pieces
    assert M.overlap_tail_s(10.0, 100.0, 10, 0.3) == pytest.approx(3.0)  # the embedding's larger last bucket
    assert M.overlap_tail_s(10.0, 4.0, 5, 0.0) == pytest.approx(10.0 - 4.0 * 0.8)  # compute too short to hide it
    assert M.overlap_tail_s(10.0, 100.0, 1, 0.0) == pytest.approx(10.0)  # one piece: nothing to hide behind
    w = for_config(model="tiny", cfg=model_config("tiny"), strategy="ref.zero2", world_size=2, micro_batch=1)
    f = M.time_features(w, COLLECTIVES, M.TIME_DEFAULTS)
    # a tiny model's gradient is one bucket: its reduce-scatter ends with backward, nothing hidden; the
    # post-update all-gather is serial
    total = sum(
        M.collective_s(COLLECTIVES, k, b, M.group_size(w, k), M.comm_calls(w, k, b)) for k, b in w.comm_bytes.items()
    )
    assert f["comm_serial"] == pytest.approx(total) and f["exp_shard"] == pytest.approx(0.0, abs=1e-15)


def test_scale_cell_reads_a_ranking_whose_merged_groups_all_tied():
    """Every group's runs within 5 % of each other leave no merged Spearman: the cell says so."""
    sc = {"groups": 2, "spearman_median": 0.5, "below_0.9": 1}
    sc |= {"noise_tied_groups": 0, "noise_tied_median": None, "noise_tied_below_0.9": 0}
    assert V.scale_cell(sc) == "0.50, 1 of 2 (merged: -, 0 of 0)"
    assert V.scale_cell(None, empty="–") == "–"


def test_per_unit_sharding_issues_one_collective_per_unit_and_pass():
    """ZeRO-3 / FSDP units gather once in forward and once in backward and reduce once, whatever their
    size; bucketed gradient traffic (ZeRO-1/2, DDP) is priced per 25 MiB piece."""
    cfg = model_config("gpt-1.3b")
    units = cfg.n_layers + 1
    for strategy in ("ref.zero3", "ref.fsdp", "torch.fsdp2"):
        w = for_config(model="gpt-1.3b", cfg=cfg, strategy=strategy, world_size=4, micro_batch=2, grad_accum=3)
        assert M.comm_calls(w, "all_gather", w.comm_bytes["all_gather"]) == 2 * units * 3
        assert M.comm_calls(w, "reduce_scatter", w.comm_bytes["reduce_scatter"]) == units * 3
    w = for_config(model="gpt-1.3b", cfg=cfg, strategy="ref.zero2", world_size=4, micro_batch=2)
    nbytes = w.comm_bytes["reduce_scatter"]
    assert M.comm_calls(w, "reduce_scatter", nbytes) == pytest.approx(nbytes / (25 << 20))


def test_deepspeed_stage_0_to_2_traffic_has_its_own_fitted_share():
    """DeepSpeed's stage 0-2 engine overlaps by its own means: its traffic costs exp_deepspeed, the
    per-unit sharders' hidden traffic exp_shard, and a calibration without exp_deepspeed (one that
    predates it, or with no DeepSpeed record) prices DeepSpeed with exp_shard as before."""
    cfg = model_config("gpt-350m")
    ds = for_config(model="gpt-350m", cfg=cfg, strategy="deepspeed.zero2", world_size=2, micro_batch=4)
    fsdp = for_config(model="gpt-350m", cfg=cfg, strategy="ref.zero3", world_size=2, micro_batch=4)
    f_ds = M.time_features(ds, COLLECTIVES, M.TIME_DEFAULTS)
    f_fsdp = M.time_features(fsdp, COLLECTIVES, M.TIME_DEFAULTS)
    assert f_ds["exp_deepspeed"] > 0 and f_ds["exp_shard"] == 0
    assert f_fsdp["exp_shard"] > 0 and f_fsdp["exp_deepspeed"] == 0
    assert M.time_constants({"exp_shard": 0.3})["exp_deepspeed"] == 0.3
    assert M.time_constants({"exp_shard": 0.3, "exp_deepspeed": 0.5})["exp_deepspeed"] == 0.5


def test_host_bound_step_is_the_larger_of_device_and_hook_time():
    """A hook-driven library waits for its Python: step = max(device, per-tensor cost x tensors x passes)."""
    w = for_config(model="tiny", cfg=model_config("tiny"), strategy="deepspeed.zero3", world_size=2, micro_batch=1)
    assert M.is_host_bound(w)
    assert M.host_units(w) == (M.TENSORS_PER_LAYER["separate"] * w.n_layers + M.TENSORS_OUTSIDE) * w.passes
    cal = _cal(inv_rate=1e-15)
    device = _device_s(w, cal)
    slow = {**cal, "host_tensor_s": {w.impl: 10 * device / M.host_units(w)}}
    assert M.predict(w, slow).step_s == pytest.approx(10 * device)
    assert M.predict(w, slow).bottleneck == "host_wait"
    # a host only 10 % over the device work still sets the step, though its wait is the smallest part
    barely = M.predict(w, {**cal, "host_tensor_s": {w.impl: 1.1 * device / M.host_units(w)}})
    assert barely.time_s["host_wait"] < max(barely.time_s.values()) and barely.bottleneck == "host_wait"
    fast = {**cal, "host_tensor_s": {w.impl: 0.1 * device / M.host_units(w)}}
    assert M.predict(w, fast).step_s == pytest.approx(device)
    assert M.predict(w, fast).bottleneck != "host_wait"


def test_compile_removes_dtensor_dispatch_and_prices_fused_elementwise_traffic():
    """torch.tp is host-bound eager only; a compiled configuration's elementwise traffic takes the
    compiled constant, which falls back to the eager one where no compiled record calibrated it."""
    tp = dict(model="tiny", cfg=model_config("tiny"), strategy="torch.tp", world_size=2, micro_batch=2)
    eager = for_config(**tp, options={"tp": 2})
    compiled = for_config(**tp, options={"tp": 2, "compile": True})
    assert compiled.compiled and not eager.compiled
    assert M.is_host_bound(eager) and not M.is_host_bound(compiled)
    fsdp = for_config(
        model="tiny", cfg=model_config("tiny"), strategy="torch.fsdp2", world_size=2, options={"compile": True}
    )
    assert M.is_host_bound(fsdp)  # its per-module hooks run outside the compiled blocks
    fe, fc = (M.time_features(w, COLLECTIVES, M.time_constants(None)) for w in (eager, compiled))
    assert fe["inv_act_bw"] > 0 and fc["inv_act_bw"] == 0
    assert fc["inv_act_bw_compiled"] == pytest.approx(fe["inv_act_bw"])
    cal = _cal(inv_rate=1e-15, inv_act_bw=1e-12)
    assert M.predict(compiled, cal).step_s == pytest.approx(M.predict(eager, cal).step_s)  # no host cost calibrated
    fused = _cal(inv_rate=1e-15, inv_act_bw=1e-12, inv_act_bw_compiled=0.5e-12)
    assert M.predict(compiled, fused).step_s < M.predict(compiled, cal).step_s


def test_nvme_offload_is_not_modelled():
    """ZeRO-Infinity's step is its disk's; no term models a disk, so the planner leaves it out."""
    assert M.family_of("deepspeed.zero3_nvme") is None and M.family_of("deepspeed.zero3_offload") == "sharded"


def test_host_floor_keeps_the_device_factor_and_binds_only_where_the_host_is_slower():
    """DeepSpeed ZeRO-1/2 tuned: step = max(device x its factor, cost per tensor x tensors x passes);
    the matched profile has no floor."""
    kw = dict(model="tiny", cfg=model_config("tiny"), strategy="deepspeed.zero2", world_size=2, micro_batch=1)
    tuned = for_config(**kw, options={"profile": "tuned"})
    assert M.has_host_floor(tuned) and not M.is_host_bound(tuned)
    assert not M.has_host_floor(for_config(**kw, options={"profile": "matched"}))
    cal = {**_cal(inv_rate=1e-15), "impl_time": {tuned.impl: 1.2}}
    device = 1.2 * _device_s(tuned, cal)
    assert M.predict(tuned, cal).step_s == pytest.approx(device)  # no calibrated floor
    units = M.host_units(tuned)
    low = {**cal, "host_tensor_s": {tuned.impl: 0.5 * device / units}}
    assert M.predict(tuned, low).step_s == pytest.approx(device)
    high = {**cal, "host_tensor_s": {tuned.impl: 2 * device / units}}
    assert M.predict(tuned, high).step_s == pytest.approx(2 * device)


def test_fit_time_leaves_host_floored_steps_out_of_the_device_factor():
    """Host-floored configurations whose step is the host's must not raise the library's device
    factor: the floor is fitted from them, the factor from the ones the device bounds."""
    base = [_obs("ref.zero2", mb, 0.0) for mb in (1, 2, 64, 128)]
    cal_consts = M.time_constants({"inv_rate": 1 / 600e12})
    for o in base:
        f = M.time_features(o.workload, COLLECTIVES, cal_consts)
        o.step_s = sum(cal_consts[k] * v for k, v in f.items())
    ds = []
    for mb in (1, 2, 64, 128):
        o = _obs("deepspeed.zero2", mb, 0.0)
        o.workload = dataclasses.replace(o.workload, profile="tuned")
        o.key += "tuned"
        ds.append(o)
    dev = {
        id(o): 1.1 * sum(cal_consts[k] * v for k, v in M.time_features(o.workload, COLLECTIVES, cal_consts).items())
        for o in ds
    }
    floor = 1.2 * dev[id(ds[1])] / M.host_units(ds[1].workload)  # binds at micro-batches 1 and 2
    assert floor * M.host_units(ds[2].workload) < dev[id(ds[2])] / 1.1
    for o in ds:
        o.step_s = max(dev[id(o)], floor * M.host_units(o.workload))
    consts, impl, host = C.fit_time(base + ds, COLLECTIVES, kind="h100")
    alone_consts, alone_impl, _ = C.fit_time(base + ds[2:], COLLECTIVES, kind="h100")
    assert impl["deepspeed.zero2:tuned"] == pytest.approx(alone_impl["deepspeed.zero2:tuned"], rel=0.01)
    assert consts == pytest.approx(alone_consts, rel=0.01)
    assert host["deepspeed.zero2:tuned"] == pytest.approx(floor, rel=0.05)


def test_device_copies_of_a_pass_hide_its_collectives_too():
    """FSDP2's casts and gradient concatenation run on the compute stream beside its all-gathers and
    reduce-scatters: the slower those copies, the less of the traffic is left unhidden."""
    w = for_config(model="tiny", cfg=model_config("tiny"), strategy="torch.fsdp2", world_size=2, micro_batch=4)
    assert M.device_copy_bytes(w) > 0
    slow_links = {op: {**v, "busbw_Bps": 1e9} for op, v in COLLECTIVES.items()}
    fast_copies, slow_copies = (
        M.time_features(w, slow_links, M.time_constants({"inv_rate": 1e-15, "inv_mem_bw": bw})) for bw in (1e-15, 1e-9)
    )
    assert slow_copies["comm_serial"] < fast_copies["comm_serial"]


def test_fit_host_recovers_the_per_tensor_cost_despite_one_stalled_launch():
    obs = [_obs("deepspeed.zero3", mb, 0.0) for mb in (1, 2, 4)]
    per_tensor = 1e-3
    steps = [per_tensor * M.host_units(o.workload) for o in obs]
    steps[-1] *= 3  # one stalled configuration must not move the fit
    obs = [dataclasses.replace(o, step_s=s) for o, s in zip(obs, steps)]
    assert C.fit_host(obs, [1e-6] * 3)[obs[0].workload.impl] == pytest.approx(per_tensor)


def test_amp_costs_cast_and_fp32_activation_traffic():
    """amp moves 12 more bytes per parameter per pass (casts) and 4- instead of 2-byte activations."""
    cfg = model_config("tiny")
    amp, master = (
        for_config(model="tiny", cfg=cfg, strategy="single", world_size=1, micro_batch=2, recipe=r)
        for r in ("amp", "master")
    )
    fa, fm = M.time_features(amp, COLLECTIVES), M.time_features(master, COLLECTIVES)
    cast = fa["inv_mem_bw"] - 2 * amp.state_bytes - (fm["inv_mem_bw"] - 2 * master.state_bytes)
    assert cast == pytest.approx(M.AMP_CAST_BYTES * amp.params * amp.passes)
    assert fa["inv_act_bw"] == pytest.approx(2 * fm["inv_act_bw"])


def _workload(recipe: str, model="tiny", strategy="single", world_size=1, micro_batch=2, **options):
    return for_config(
        model=model,
        cfg=model_config(model),
        strategy=strategy,
        world_size=world_size,
        micro_batch=micro_batch,
        recipe=recipe,
        options=options,
    )


def test_every_time_constant_is_priced_in_a_printed_part():
    """The step is the sum of the parts the planner prints: a constant outside every part would be
    fitted and then never charged."""
    assert {k for keys in M.TIME_PARTS.values() for k in keys} == set(M.TIME_CONSTANTS)
    w = _workload("fp8", compile=True)
    consts = {k: 1e-12 for k in M.TIME_CONSTANTS}
    feats = M.time_features(w, COLLECTIVES, M.time_constants(consts))
    assert feats["inv_rate_fp8"] > 0 and feats["fp8_cast_s"] > 0
    expected = sum(consts[k] * v for k, v in feats.items())
    assert M.predict(w, _cal(**consts)).step_s == pytest.approx(expected)


def test_fp8_runs_the_block_linears_in_float8_and_pays_their_casts():
    """fp8 is amp with the blocks' linears (72 d^2 L FLOPs per token) at the float8 rate, each float8
    linear's input and output gradient cast per pass (18 d per token and layer, separate layout), and
    the linears' weights cast from fp32 instead of autocast's bf16 copies."""
    fp8, amp = _workload("fp8", compile=True), _workload("amp", compile=True)
    cfg = model_config("tiny")
    assert M.fp8_flops_share(amp) == 0 and M.fp8_cast_elems(amp) == 0
    assert M.fp8_flops_share(fp8) == pytest.approx(72 * cfg.d_model**2 * cfg.n_layers / fp8.flops_per_token)
    tokens = fp8.micro_batch * fp8.seq_len
    assert M.fp8_cast_elems(fp8) == pytest.approx(18 * cfg.d_model * cfg.n_layers * tokens)
    c = M.time_constants({"inv_rate": 1e-15})  # float8 rate = bf16 rate where uncalibrated
    ff, fa = M.time_features(fp8, COLLECTIVES, c), M.time_features(amp, COLLECTIVES, c)
    assert ff["inv_rate"] + ff["inv_rate_fp8"] == pytest.approx(fa["inv_rate"])
    weights = 12 * cfg.d_model**2 * cfg.n_layers
    assert ff["inv_mem_bw"] - fa["inv_mem_bw"] == pytest.approx((M.FP8_WEIGHT_BYTES - M.AMP_CAST_BYTES) * weights)
    faster = _cal(inv_rate=1e-15, inv_rate_fp8=0.5e-15)
    assert M.predict(fp8, faster).time_s["compute"] < M.predict(amp, faster).time_s["compute"]


def test_fp8_memory_has_its_own_activations_and_no_autocast_copy_of_the_float8_weights():
    fp8, amp, eager_amp = _workload("fp8", compile=True), _workload("amp", compile=True), _workload("amp")
    assert (M.act_constant(fp8), M.act_constant(amp), M.act_constant(eager_amp)) == (
        "act_fp8",
        "act_amp_compiled",
        "act_amp",
    )
    first_fp8, first_amp = M.memory_features(fp8)["first"][1], M.memory_features(amp)["first"][1]
    assert first_amp["cast"] - first_fp8["cast"] == pytest.approx(2 * M.block_linear_params(fp8))
    assert first_fp8["act_fp8"] == pytest.approx(first_amp["act_amp_compiled"]) and first_fp8["act_amp"] == 0


def test_fp8_variants_without_terms_are_unmodelled_with_their_reason():
    assert _workload("fp8", compile=True).unmodelled is None and _workload("amp").unmodelled is None
    assert _workload("fp8").unmodelled == M.FP8_EAGER
    assert _workload("master", compile=True, compile_loss=True).unmodelled == M.COMPILED_LOSS
    assert _workload("fp8", compile=True, fp8_filter="auto").unmodelled == M.FP8_FILTER_AUTO
    w = for_config(
        model="tiny",
        cfg=model_config("tiny"),
        strategy="torch.fsdp2",
        world_size=2,
        recipe="fp8",
        options={"compile": True, "fp8_all_gather": True},
    )
    assert w.unmodelled == M.FP8_ALL_GATHER


def test_torch_ddp_compiled_with_the_ddp_optimizer_and_checkpointing_notes_the_unmodelled_split():
    cal = json.loads((Path(C.CALIBRATION_DIR) / "h100.json").read_text())

    def notes(strategy, **options):
        w = _workload("amp", "gpt-125m", strategy, world_size=2, **options)
        return M.predict(w, cal).notes

    assert M.SPLIT_GRAPHS_NOTE in notes("torch.ddp", compile=True, activation_checkpointing=True)
    assert M.SPLIT_GRAPHS_NOTE not in notes("torch.ddp", compile=True)  # modelled
    assert M.SPLIT_GRAPHS_NOTE not in notes(
        "torch.ddp", compile=True, activation_checkpointing=True, ddp_optimizer=False
    )
    assert M.SPLIT_GRAPHS_NOTE not in notes("ref.ddp", compile=True, activation_checkpointing=True)
    # the reference splits only when asked (its ddp_optimizer defaults to false), at its own bucket_mb
    assert M.SPLIT_GRAPHS_NOTE in notes("ref.ddp", compile=True, activation_checkpointing=True, ddp_optimizer=True)
    assert (
        _workload("amp", "gpt-125m", "ref.ddp", 2, compile=True, ddp_optimizer=True, bucket_mb=4).split_bucket_bytes
        == 4 * 2**20
    )
    # a bucket size alone cuts nothing: the blocks are not compiled
    assert _workload("amp", "gpt-125m", "torch.ddp", 2, bucket_mb=4).split_bucket_bytes is None


def test_plan_fp8_compiles_every_candidate_and_needs_a_calibrated_float8_rate(tmp_path, capsys):
    assert main(["plan", "--model", "gpt-1.3b", "--gpus", "1", "--recipe", "fp8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "bf16-fp8" in out and "compile=True" in out
    cal = json.loads((ROOT / "results" / "calibration" / "h100.json").read_text())
    cal["time_fitted"] = [k for k in cal["time_fitted"] if k != "inv_rate_fp8"]
    (tmp_path / "h100.json").write_text(json.dumps(cal))
    argv = ["plan", "--model", "gpt-1.3b", "--gpus", "1", "--recipe", "fp8", "--calibration", str(tmp_path)]
    assert main(argv) == 2
    assert "holds no fp8 record" in capsys.readouterr().err


def test_h200_is_the_h100_calibration_with_memory_bound_time_scaled_by_hbm_bandwidth(tmp_path, capsys):
    """Without an H200 calibration of its own, the H100 one serves: the same SMs, clocks and NVLink,
    so every device constant carries over but the memory-bound time constants, which shrink by the
    HBM bandwidth ratio (3.35 / 4.8 TB/s). A memory-bound configuration then runs faster on H200 by
    up to that ratio, a compute-bound one by much less, and the peak is the same."""
    h100 = C.load_kind("h100")
    h200 = C.derive(h100, "h200")
    assert C.load_kind("h200", tmp_path / "none") is None
    (tmp_path / "h100.json").write_text(json.dumps(h100))
    assert C.load_kind("h200", tmp_path) == h200  # no h200.json there: derived on loading
    assert h200["derived_from"]["kind"] == "h100" and h200["host_tensor_s"] == h100["host_tensor_s"]
    ratio = 3.35 / 4.8
    for k, v in h100["time"].items():
        if isinstance(v, dict):  # attention's measured rate: compute, the same SMs and clocks
            assert h200["time"][k] == v
            continue
        assert h200["time"][k] == pytest.approx(v * ratio if k in M.MEMORY_BOUND_TIME_CONSTANTS else v)
    assert h200["memory"] == h100["memory"] and h200["collectives"] == h100["collectives"]
    assert h200["device_kind"] == "h200" and set(h200["derived_from"]["scaled"]) == set(M.MEMORY_BOUND_TIME_CONSTANTS)

    cfg = model_config("gpt-1.3b")
    w = for_config(model="gpt-1.3b", cfg=cfg, strategy="ref.ddp", world_size=1, micro_batch=4)
    on_h100, on_h200 = M.predict(w, h100), M.predict(w, h200)
    assert ratio < on_h200.step_s / on_h100.step_s < 0.95
    assert on_h200.peak_bytes == on_h100.peak_bytes

    # a stored H200 calibration takes precedence
    (tmp_path / "h200.json").write_text(json.dumps({**h100, "device_kind": "h200"}))
    assert "derived_from" not in C.load_kind("h200", tmp_path)
    assert main(["plan", "--model", "gpt-1.3b", "--gpus", "2", "--gpu", "h200-141g", "--top", "2"]) == 0
    assert "calibration h200 derived from h100" in capsys.readouterr().out


def test_a_derived_part_refits_its_host_costs_from_its_own_records():
    """The host is the part's machine: where the part's own records of a library that waits on its
    host show another host speed, the derived calibration takes that library's per-tensor cost from
    them, on the derived device times, and keeps every other constant as the source's."""
    fsdp = lambda mb, step: _obs("torch.fsdp2", mb, step)  # noqa: E731
    source = C.fit([_obs("ref.zero3", mb, 0.02 * mb) for mb in (1, 2, 4)] + [fsdp(1, 0.5), fsdp(2, 0.5)], COLLECTIVES)
    assert source["host_tensor_s"]["torch.fsdp2:tuned"] == pytest.approx(0.5 / M.host_units(fsdp(1, 0).workload))
    derived = C.derive(source, "h200", [fsdp(1, 0.3), fsdp(4, 0.3), _obs("ref.zero3", 1, 0.01)])
    assert derived["host_tensor_s"]["torch.fsdp2:tuned"] == pytest.approx(0.3 / M.host_units(fsdp(1, 0).workload))
    assert derived["derived_from"]["host_refit"] == ["torch.fsdp2:tuned", "torch.fsdp2:tuned|master"]
    assert derived["derived_from"]["host_refit_configurations"] == 2
    assert M.predict(fsdp(2, 0).workload, derived).step_s == pytest.approx(0.3)
    assert derived["time"] == C.derive(source, "h200")["time"] and derived["impl_time"] == source["impl_time"]
    # a step within the device model's error of its device time shows no host: nothing is refitted
    plain = C.derive(source, "h200")
    device_s = C.device_time(fsdp(4, 0), COLLECTIVES, plain["time"], plain["impl_time"])
    near = C.derive(source, "h200", [fsdp(4, device_s * (1 + C.HOST_EVIDENCE / 2))])
    assert near["host_tensor_s"] == source["host_tensor_s"] and "host_refit" not in near["derived_from"]


def test_deepspeed_stage0_waits_per_tensor_copies_and_all_reduces_with_nothing_beside():
    """DeepSpeed's 16-bit stage 0 (FP16_Optimizer): one host wait per parameter tensor per step (not per
    micro-batch), 36 B per parameter of copies, and its all-reduce priced serial in 5e8-element buckets,
    where ZeRO-1 keeps DeepSpeed's fitted share and none of the stage-0 terms."""
    cfg = model_config("gpt-1.3b")
    cal = C.load_kind("h100")
    tc = M.time_constants(cal["time"])

    def ds(strategy, accum=1):
        return for_config(model="gpt-1.3b", cfg=cfg, strategy=strategy, world_size=2, micro_batch=4, grad_accum=accum)

    zero0, zero1 = ds("deepspeed.zero0"), ds("deepspeed.zero1")
    f0, f1 = M.time_features(zero0, cal["collectives"], tc), M.time_features(zero1, cal["collectives"], tc)
    assert M.uses_fp16_optimizer(zero0) and not M.uses_fp16_optimizer(zero1)
    assert f0["ds_stage0_tensor_s"] == M.TENSORS_PER_LAYER[zero0.layout] * cfg.n_layers + M.TENSORS_OUTSIDE
    assert (
        M.time_features(ds("deepspeed.zero0", 4), cal["collectives"], tc)["ds_stage0_tensor_s"]
        == f0["ds_stage0_tensor_s"]
    )
    assert f1["ds_stage0_tensor_s"] == 0.0
    assert M.device_copy_bytes(zero0) == pytest.approx(36 * zero0.params)
    assert f0["exp_deepspeed"] == 0.0 and f0["comm_serial"] > 0 and f1["exp_deepspeed"] > 0
    nbytes = zero0.comm_bytes["all_reduce"]
    assert M.comm_calls(zero0, "all_reduce", nbytes) == math.ceil(nbytes / 2 / 5e8)


def test_a_derived_part_refits_deepspeed_stage0_wait_from_enough_of_its_own_records():
    """Stage 0's per-tensor wait is the part's host's: from at least STAGE0_MIN_CONFIGURATIONS of the
    part's own stage-0 records the derived calibration takes it back, one stalled launch
    notwithstanding; from fewer it keeps the source's."""
    source = C.load_kind("h100")
    plain = C.derive(source, "h200")
    truth = {**plain, "time": {**plain["time"], "ds_stage0_tensor_s": 0.3e-3}}
    own = []
    for model in ("gpt-350m", "gpt-760m", "gpt-1.3b"):
        for profile in ("tuned", "matched"):
            w = for_config(
                model=model,
                cfg=model_config(model),
                strategy="deepspeed.zero0",
                world_size=2,
                micro_batch=4,
                options={"profile": profile},
            )
            own.append(C.Observation(f"{model}{profile}", w, M.predict(w, truth).step_s, None, ["r"], 1))
    stalled = own[:-1] + [dataclasses.replace(own[-1], step_s=1.5 * own[-1].step_s)]
    derived = C.derive(source, "h200", stalled)
    assert derived["time"]["ds_stage0_tensor_s"] == pytest.approx(0.3e-3)
    assert derived["derived_from"]["stage0_refit_configurations"] == len(own)
    few = C.derive(source, "h200", own[: C.STAGE0_MIN_CONFIGURATIONS - 1])
    assert few["time"]["ds_stage0_tensor_s"] == plain["time"]["ds_stage0_tensor_s"]


def test_a_derived_part_fits_its_hbm_ratio_from_enough_of_its_own_records():
    """The memory-bound constants' factor comes from the part's own device-bound records where it
    has HBM_RATIO_MIN_CONFIGURATIONS of them: records made at a known ratio give it back; fewer
    records leave the datasheets' ratio."""
    source = C.load_kind("h100")
    truth = {**source, "time": C._scaled_time(source, 0.8)}
    cfg = model_config("gpt-1.3b")
    own = []
    for strategy in ("ref.ddp", "ref.zero1", "ref.zero2", "ref.zero3", "ref.fsdp"):
        for mb in (1, 2, 4, 8):
            w = for_config(model="gpt-1.3b", cfg=cfg, strategy=strategy, world_size=2, micro_batch=mb)
            own.append(C.Observation(f"{strategy}{mb}", w, M.predict(w, truth).step_s, None, ["r"], 1))
    derived = C.derive(source, "h200", own)
    assert derived["derived_from"]["hbm_ratio"] == pytest.approx(0.8)
    assert derived["derived_from"]["hbm_ratio_datasheet"] == pytest.approx(3.35 / 4.8)
    few = C.derive(source, "h200", own[: C.HBM_RATIO_MIN_CONFIGURATIONS - 1])
    assert few["derived_from"]["hbm_ratio"] == pytest.approx(3.35 / 4.8)


def test_a_dense_step_on_a_derived_part_is_noted_as_power_capped():
    """A derived part's constants hold the clocks of the source's steps: a configuration predicted
    above POWER_CAP_MFU on it is noted (H200 steps that dense ran at the power cap, slower than
    predicted); the same configuration on the source part is not."""
    cfg = model_config("gpt-6.7b")
    w = for_config(model="gpt-6.7b", cfg=cfg, strategy="ref.fsdp", world_size=4, micro_batch=8)
    h100 = C.load_kind("h100")
    on_h200 = M.predict(w, C.derive(h100, "h200"))
    assert on_h200.mfu > M.POWER_CAP_MFU and any("power cap" in n for n in on_h200.notes)
    assert not any("power cap" in n for n in M.predict(w, h100).notes)
    small = for_config(model="gpt-350m", cfg=model_config("gpt-350m"), strategy="ref.ddp", world_size=1, micro_batch=4)
    assert not any("power cap" in n for n in M.predict(small, C.derive(h100, "h200")).notes)


def test_the_stored_h200_calibration_is_the_h100_one_derived_with_the_h200_records():
    """``calibrate`` writes the parts derived from a kind beside it, so the stored H200 file follows
    the stored H100 one and the committed H200 records; a stale one fails here."""
    h100 = C.load_kind("h100")
    stored = C.load(C.calibration_path("h200"))
    assert stored == json.loads(json.dumps(C.derive(h100, "h200", C.observations(ROOT / "results", "h200"))))
    assert stored["derived_from"]["host_refit_configurations"] >= 19


def test_validation_scores_the_derived_h200_calibration_on_the_h200_records():
    """The H200 records are in no device fit: the derived calibration predicts their steps, and taking
    the HBM bandwidth into account removes the bias the H100 constants as fitted have there."""
    part = V.derived_parts(ROOT / "results", "h100", C.load_kind("h100"))["h200"]
    assert part["derived_from"] == "h100" and part["configurations"] >= 59
    assert part["as_fitted_step_signed_median_pct"] > 5  # H200 runs faster than the H100 constants say
    assert abs(part["step_signed_median_pct"]) < part["as_fitted_step_signed_median_pct"] / 3
    assert len(part["predictions"]) == part["configurations"]
    # the H200 hosts are other machines with other CPUs: their own host costs, each configuration
    # left out of its refit, shrink the large errors of the steps that wait on their host (the
    # libraries whose H100 cost misses most) and leave no bias beyond what the device times carry
    plain = part["without_own_records"]
    assert part["host_waiting_step_p90_pct"] < plain["host_waiting_step_p90_pct"]
    assert abs(part["host_waiting_step_signed_median_pct"]) < 5


def _equal_costs(w) -> list:
    """Every virtual stage's F, B (and W) equal: B = 2F; ZB-H1 T_F = T_B = T_W."""
    chunks = w.pp * (w.virtual_stages if any(c for _, c, _ in M._stage_orders(w)[0]) else 1)
    return [(1.0, 1.0, 1.0) if w.schedule == "zb_h1" else (1.0, 2.0, 0.0)] * chunks


def test_pipeline_factor_is_the_equal_stage_bubble_and_grows_with_a_heavy_last_stage():
    """Equal stages replay to 1 + (p-1)/m (1F1B, GPipe), 1 + (p-1)/(vm) (interleaved) and ZB-H1's
    (p-1)/(3m) at equal F, B, W; a last stage heavier than the others stretches the step beyond it."""
    cfg = dataclasses.replace(model_config("tiny"), n_layers=8)
    for strategy in ("ref.pp_1f1b", "ref.pp_gpipe", "ref.pp_interleaved", "ref.pp_zb"):
        for pp, m in ((2, 4), (4, 8)):
            opts = {"pp": pp, "microbatches": m}
            w = for_config(model="tiny", cfg=cfg, strategy=strategy, world_size=pp, micro_batch=m, options=opts)
            costs = _equal_costs(w)
            equal = M.schedule_factor(M._stage_orders(w), costs)
            assert equal == pytest.approx(1 + M.bubble_ratio(w)), (strategy, pp, m)
            heavy = costs[:-1] + [tuple(1.5 * x for x in costs[-1])]
            assert M.schedule_factor(M._stage_orders(w), heavy) > equal + 0.05, (strategy, pp, m)
            # the model's own costs: the last stage carries the head and the loss
            assert M.pipeline_factor(w, {"logit_s": 1e-11}) > equal
    one = for_config(model="tiny", cfg=cfg, strategy="single", world_size=1, micro_batch=4)
    assert M.pipeline_factor(one, {}) == 1.0


def test_predicted_bubble_is_the_stretch_of_the_per_micro_batch_work():
    cfg = model_config("tiny")
    w = for_config(
        model="tiny", cfg=cfg, strategy="ref.pp_1f1b", world_size=2, micro_batch=4, options={"pp": 2, "microbatches": 4}
    )
    consts = M.time_constants({"inv_rate": 1e-15, "logit_s": 1e-11})
    p = M.predict(w, _cal(**consts))
    feats = M.time_features(w, COLLECTIVES, consts)
    per_mb = sum(consts[k] * feats[k] for k in M.PER_MICROBATCH)  # stretched: the stages' timeline
    stretch = M.pipeline_factor(w, consts)
    assert stretch > 1 + M.bubble_ratio(w)  # the tiny model's head and loss outweigh a stage's blocks
    assert p.time_s["bubble"] == pytest.approx(per_mb * (1 - 1 / stretch))


def test_a_pipeline_at_its_host_floor_says_so():
    """One-row micro-batches whose actions last the host's time per block, not their device work,
    carry the note that their time follows the host's speed; data parallelism never does."""
    cfg = model_config("gpt-350m")
    consts = M.time_constants({"inv_rate": 1 / 790e12, "pp_host_block_s": 0.8e-3})

    def notes(strategy, micro_batch, **options):
        w = for_config(
            model="gpt-350m", cfg=cfg, strategy=strategy, world_size=2, micro_batch=micro_batch, options=options
        )
        return M.predict(w, _cal(**consts)).notes

    assert M.HOST_FLOOR_NOTE in notes("ref.pp_1f1b", 8, pp=2, microbatches=8)  # one row: 0.2 ms a block's F
    assert M.HOST_FLOOR_NOTE not in notes("ref.pp_1f1b", 64, pp=2, microbatches=2)  # 32 rows: device-bound
    assert M.HOST_FLOOR_NOTE not in notes("ref.ddp", 8)


def test_zero_bubble_and_interleaved_bubbles_follow_their_papers():
    """ZB-H1: (p-1) max(T_F, T_B, T_F+T_B-T_W) of idle against m (T_F+T_B+T_W) of compute, (p-1)/(3m+p-1)
    of the step at equal times; interleaved 1F1B divides 1F1B's (p-1)/m by the v chunks per rank."""
    cfg = model_config("tiny")
    opts = {"pp": 2, "microbatches": 4}
    zb = for_config(model="tiny", cfg=cfg, strategy="ref.pp_zb", world_size=2, micro_batch=4, options=opts)
    assert zb.schedule == "zb_h1"
    assert M.bubble_ratio(zb) == pytest.approx(1 / (3 * 4))
    slow_w = dataclasses.replace(zb, zb_times=(1.0, 1.0, 3.0))  # a slow W cannot hide the last stage's wait for F
    assert M.bubble_ratio(slow_w) == pytest.approx(1 * 1.0 / (4 * 5.0))
    assert M.bubble_ratio(dataclasses.replace(zb, zb_times=(1.0, 2.0, 0.5))) == pytest.approx(2.5 / (4 * 3.5))
    one_f_one_b = for_config(model="tiny", cfg=cfg, strategy="ref.pp_1f1b", world_size=2, micro_batch=4, options=opts)

    def units(w, stage):  # micro-batches' worth of a stage's activations at its peak
        return M.pipeline_stage_peaks(w)[stage][0] / (M.activation_layer_bytes(w) * w.n_layers / w.pp)

    # 1F1B: stage i holds p - i micro-batches; ZB-H1 holds min(p, m) from F to W on every stage, the
    # last also their output gradients (dy of 11 sbh elements per layer) and recorded projection outputs
    assert (units(one_f_one_b, 0), units(one_f_one_b, 1)) == (2, 1)
    assert units(zb, 1) == pytest.approx(2 * (1 + 4 / 34) + 2 * 22 / 34)
    # GPipe's last stage: m micro-batches and m - 1 retained loss graphs of 4 B per logit element
    gpipe = for_config(model="tiny", cfg=cfg, strategy="ref.pp_gpipe", world_size=2, micro_batch=4, options=opts)
    act, logit, fixed = M.pipeline_stage_peaks(gpipe)[1]
    assert units(gpipe, 1) == 4 and fixed == pytest.approx(3 * 4 * logit)
    assert M.predict(zb, _cal()).peak_bytes > M.predict(one_f_one_b, _cal()).peak_bytes
    four_layers = dataclasses.replace(cfg, n_layers=4)  # 2 stages x 2 chunks
    inter = for_config(
        model="tiny", cfg=four_layers, strategy="ref.pp_interleaved", world_size=2, micro_batch=4, options=opts
    )
    assert inter.virtual_stages == 2 and M.bubble_ratio(inter) == pytest.approx(1 / (2 * 4))


def test_zero_bubble_record_carries_its_measured_times():
    from parabench.plan.workload import measured_zb_times

    stages = [{"pipeline": {"compute_s_by_kind": {"F": 1.0, "B": 1.0, "W": 3.0}}}, {"pipeline": None}]
    assert measured_zb_times({"per_rank": stages}) == (1.0, 1.0, 3.0)
    assert measured_zb_times({"per_rank": [{"pipeline": {"schedule": "1f1b"}}]}) is None


def test_fused_layout_has_twelve_tensors_per_block_and_is_its_own_configuration():
    """One qkv linear: 12 parameter tensors per block, not 15, for the host-bound term; the workload
    carries the layout and a fused configuration never shares an observation with a separate one."""
    from parabench.plan.workload import from_record

    fused_cfg = model_config("tiny", layout="fused")
    fused = for_config(model="tiny", cfg=fused_cfg, strategy="deepspeed.zero3", world_size=2, micro_batch=1)
    sep = for_config(model="tiny", cfg=model_config("tiny"), strategy="deepspeed.zero3", world_size=2, micro_batch=1)
    assert (fused.layout, sep.layout) == ("fused", "separate")
    assert M.host_units(fused) == (12 * fused.n_layers + 5) * fused.passes
    assert M.host_units(sep) - M.host_units(fused) == 3 * sep.n_layers * sep.passes
    case = {"model": "tiny", "strategy": "ref.ddp", "world_size": 2, "precision": "bf16", "micro_batch": 1}
    record = {
        "case": {**case, "layout": "fused"},
        "model": {"config": fused_cfg.to_dict(), "params": {"total": fused.params}, "flops_per_token": 1e6},
    }
    assert from_record(record).layout == "fused"
    plain = {"case": case, "model": {**record["model"], "config": model_config("tiny").to_dict()}}
    assert from_record(plain).layout == "separate"
    assert C.config_key(record) != C.config_key(plain)
    assert json.loads(C.config_key(record))[-1] == json.loads(C.config_key(plain))[-1] == {}
    assert "fused" in V.group_of(from_record(record)) and "fused" not in V.group_of(from_record(plain))


def test_ranking_metrics_respect_the_noise_band():
    # the 1 % apart pair is one entity; the predicted fastest 2 % off the measured fastest counts
    meas, pred = [1.00, 1.01, 2.0], [1.1, 1.0, 3.0]
    tied, merged = V.noise_merged(meas, pred)
    assert tied[0] == tied[1] and merged[0] == merged[1] == pytest.approx(1.05)
    assert V.resolved_pairs(meas, pred) == (2, 2)
    rows = [
        {
            "key": str(i),
            "label": str(i),
            "group": "g",
            "step_s": m,
            "pred_step_s": p,
            "peak_bytes": None,
            "pred_peak_bytes": None,
        }
        for i, (m, p) in enumerate(zip(meas, pred))
    ]
    s = V.summarize(rows)
    assert s["fastest_share"] == 1.0 and s["fastest_strict_share"] == 0.0
    assert s["spearman_noise_tied_median"] == pytest.approx(1.0)


def test_retest_ranks_the_measurements_against_themselves():
    """The ceiling of the Spearman column: configurations measured in two runs ranked run against
    run. Two runs that agree give 1; two that reverse the order give -1; a configuration measured
    once takes no part; the model's Spearman on the same configurations stands beside it."""

    def obs(i, steps):
        o = _obs("ref.ddp", 1, sum(steps) / len(steps))
        return dataclasses.replace(o, key=str(i), run_steps={f"run{j}": s for j, s in enumerate(steps)})

    agree = [obs(i, (1.0 + i, 1.1 + i)) for i in range(4)]
    rows = [{"key": o.key, "pred_step_s": -o.step_s} for o in agree]  # predicted in reverse
    rt = V.retest(agree + [dataclasses.replace(obs(9, (9.0,)), key="once")], rows)
    (g,) = rt["per_group"]
    assert g["configs"] == 4 and g["retest_spearman"] == pytest.approx(1.0)
    assert g["model_spearman"] == pytest.approx(-1.0) and rt["model_at_or_above_retest"] == 0
    # the second run reverses the first: whichever run a draw takes first, the ranks are opposite
    reverse = [obs(i, (1.0 + i, 4.0 - i)) for i in range(4)]
    rt = V.retest(reverse, [{"key": o.key, "pred_step_s": o.step_s} for o in reverse])
    assert rt["per_group"][0]["retest_spearman"] == pytest.approx(-1.0)
    assert "retest" in "\n".join(V.retest_lines(rt))


def test_superseded_and_perturbed_runs_are_excluded():
    assert "superseded" in C.excluded("results/h100x2/20261126-025621", "ref.ddp")
    assert C.excluded("results/repeatability/slow5", "ref.zero2")
    assert C.excluded("results/gpu-mp/20261126-021202", "torch.pp_1f1b")
    assert C.excluded("results/gpu-mp/20261126-021202", "ref.pp_1f1b") is None
    assert C.excluded("results/h100x2/20261126-180901", "ref.ddp") is None
    assert "copy" in C.excluded("results/baselines/h100x4", "ref.ddp")


def test_an_exclusion_without_a_reason_is_refused(tmp_path):
    bad = tmp_path / "excluded.toml"
    bad.write_text('[[run]]\npath = "h100x2/20261126-025621"\n')
    with pytest.raises(ValueError, match="reason"):
        C.exclusions(bad)
    bad.write_text('[[runs]]\npath = "x"\nreason = "y"\n')
    with pytest.raises(ValueError, match="unknown table"):
        C.exclusions(bad)


def test_predict_suite_writes_one_prediction_per_case(tmp_path):
    """The predictions written beside a suite are keyed by the suite's case hashes."""
    from parabench.plan.check import predict_suite

    suite = tmp_path / "two.toml"
    suite.write_text(
        '[suite]\nname = "two"\ndevice = "cuda"\nprecision = "bf16"\nseq_len = 2048\n\n'
        '[[matrix]]\nmodel = "gpt-1.3b"\nstrategy = ["ref.ddp", "torch.fsdp2"]\nworld_size = 2\nmicro_batch = 4\n'
    )
    out = predict_suite(str(suite))
    hashes = [c.case_hash for c in load_suite(str(suite)).cases]
    assert [p["case_hash"] for p in out["predictions"]] == hashes
    assert all(p["tokens_per_s_per_device"] > 0 and p["peak_bytes"] > 0 for p in out["predictions"])
    calibration = C.load_kind("h100")
    assert out["calibration_configurations"] == calibration["configurations"] > 0
    assert out["calibration_runs"] == calibration["runs"]


def test_predict_suite_prices_node_groups_as_one_node(tmp_path):
    """shard_size "node" is one machine's data-parallel degree to the calibration, as a one-node run resolves it."""
    from parabench.plan.check import predict_suite

    suite = tmp_path / "node.toml"
    suite.write_text(
        '[suite]\nname = "node"\ndevice = "cuda"\nprecision = "bf16"\nseq_len = 2048\n\n'
        '[[matrix]]\nmodel = "gpt-1.3b"\nstrategy = "torch.hsdp"\nworld_size = 4\nmicro_batch = 4\n'
        'options = {shard_size = "node"}\n'
    )
    (row,) = predict_suite(str(suite))["predictions"]
    assert row["case"]["options"]["shard_size"] == 4 and "shard_size=4" in row["label"]
    assert row["tokens_per_s_per_device"] > 0


def test_preregistered_comparison_matches_every_case_of_the_run_by_hash():
    from parabench.plan.validate import preregistered

    rep = preregistered("results/predictions/h100x4.json", "results/h100x4/20261126-203946")
    assert rep["unmatched"] == [] and rep["all_cases"]["configurations"] == 72
    assert rep["largest_world_size"] == 4 and rep["world_size_4"]["configurations"] == 42
    zb = next(r for r in rep["cases"] if r["label"].startswith("ref.pp_zb") and "microbatches=4," in r["label"])
    assert zb["peak_err_pct"] == pytest.approx((zb["pred_peak_bytes"] / zb["peak_bytes"] - 1) * 100)


def test_preregistered_comparison_takes_a_repeated_case_once_at_its_median(tmp_path):
    """Three launches of a case are one configuration in the ranking, at the median over launches."""
    from parabench.plan.validate import preregistered
    from parabench.results import load_run

    run = ROOT / "results/studies/peer-fidelity-350m-gpu/20261127-064048"  # 2 cases, 3 launches each
    records = load_run(run)[1]
    hashes = sorted({r["case_hash"] for r in records})
    preds = {"predictions": [{"case_hash": h, "step_time_s": 0.3, "peak_bytes": 1e10} for h in hashes]}
    (tmp_path / "p.json").write_text(json.dumps(preds))
    rep = preregistered(tmp_path / "p.json", run)
    assert sorted(r["key"] for r in rep["cases"]) == hashes
    for row in rep["cases"]:
        steps = sorted(r["metrics"]["step_time_s_median"] for r in records if r["case_hash"] == row["key"])
        assert len(steps) == 3 and row["step_s"] == pytest.approx(steps[1])


def test_preregistered_comparison_ranks_a_repeated_run_launch_against_launch(tmp_path):
    """A run with repeats carries its own ranking ceiling: per group, its configurations ranked one
    launch against another, beside the predictions' Spearman on the same configurations. Launches
    that keep the order give 1, whatever the predictions say."""
    from parabench.plan.validate import preregistered

    run = ROOT / "results/studies/plan-retest-pipelines-h100x4/20261127-161154"  # 23 configurations, 2-3 launches each
    rep = preregistered(ROOT / "results/predictions/plan-retest-pipelines-h100x4.json", run)
    (g,) = rep["launch_retest"]
    assert g["group"] == "gpt-1.3b w4 master mb16" and g["configs"] == 23
    assert 0.9 < g["retest_spearman"] < 1.0  # two configurations swing by 14 % and 40 % between launches
    assert g["model_spearman"] == pytest.approx(rep["all_cases"]["spearman_median"])

    # three configurations whose launches agree on the order, predicted in reverse
    steps = {"a": (1.0, 1.01, 1.02), "b": (2.0, 2.02, 2.01), "c": (3.0, 3.03, 2.99)}
    rows = [
        {"key": k, "group": "g", "step_s": sorted(v)[1], "pred_step_s": 4.0 - sorted(v)[1], "tokens_per_step": 1}
        for k, v in steps.items()
    ]
    (agree,) = V.launch_retest(rows, {k: list(v) for k, v in steps.items()})
    assert agree["retest_spearman"] == pytest.approx(1.0) and agree["model_spearman"] == pytest.approx(-1.0)
    assert V.launch_retest(rows, {"a": [1.0, 1.1]}) == []  # one configuration with repeats ranks nothing


def test_one_gpu_sharding_and_ddp_copy_bytes_beyond_single():
    """At one GPU FSDP2 does single's work plus its copies (copy-in, copy-out, the one-rank
    reduce-scatter), the references their per-gather cast and out-of-place reduce-scatter, and an
    in-place all-reduce moves nothing but DDP's bucket division."""
    cfg = model_config("gpt-1.3b")
    w = {
        s: for_config(model="gpt-1.3b", cfg=cfg, strategy=s, world_size=1, micro_batch=8)
        for s in ("single", "torch.ddp", "ref.ddp", "ref.zero3", "torch.fsdp2")
    }
    psi = float(w["single"].params)
    copies = {s: M.device_copy_bytes(x) for s, x in w.items()}
    assert copies["single"] == 0
    assert copies["torch.ddp"] == pytest.approx(4 * psi, rel=0.01)  # bf16 gradients read and written
    assert copies["ref.ddp"] == pytest.approx(2 * psi, rel=0.01)  # flat_grad zeroed
    assert copies["ref.zero3"] == pytest.approx(6 * psi, rel=0.02)  # 2 gathers x 6 B less the master cast
    assert copies["torch.fsdp2"] > 20 * psi  # copy-out 4 B x ~2 gathers, fp32 reduce-scatter copy 8 B, copy-in
    rs_copy = M.time_features(w["ref.zero3"], {})["inv_mem_bw"] - 2 * w["ref.zero3"].state_bytes - copies["ref.zero3"]
    assert rs_copy == pytest.approx(4 * psi, rel=0.02)  # the reduce-scatter's copy; the all-gather is in place
    cal = C.load_kind("h100")
    step = {s: M.predict(w[s], cal).step_s for s in ("single", "torch.fsdp2")}
    assert step["torch.fsdp2"] > step["single"]


def test_balanced_split_unloads_the_head_stage_and_its_suite_runs_that_split(tmp_path):
    """gpt-1.3b pp 4: the split that evens the predicted stage costs gives the last stage (head and
    loss) fewer blocks than the first, covers every block once, is predicted faster than the equal
    split, and the suite written from it carries the option to the case."""
    from parabench.plan import search as S

    cal, cfg = C.load_kind("h100"), model_config("gpt-1.3b")
    equal = S.evaluate(
        S.Candidate("ref.pp_1f1b", 4, 16, 1, {"pp": 4, "microbatches": 8}, "master"), "gpt-1.3b", cfg, cal, 79.2 * M.GIB
    )
    uneven = S.balanced(equal, cal)
    split = uneven.options["stage_layers"]
    assert len(split) == 4 and sum(split) == cfg.n_layers and min(split) >= 1
    assert split[-1] < min(split[:-1]), split
    assert "stage_layers" not in equal.options
    S.evaluate(uneven, "gpt-1.3b", cfg, cal, 79.2 * M.GIB)
    assert uneven.dropped is None and uneven.workload.stage_layers == tuple(split)
    assert uneven.prediction.tokens_per_s_per_gpu > 1.05 * equal.prediction.tokens_per_s_per_gpu
    assert f"stage_layers={','.join(map(str, split))}" in S.table([uneven, equal], 2)
    out = tmp_path / "split.toml"
    out.write_text(S.suite_toml("split", "gpt-1.3b", cfg, [uneven, equal], "h100-80g"))
    cases = load_suite(str(out)).cases
    assert [c.options.get("stage_layers") for c in cases] == [split, None]


def test_plan_adds_the_balanced_split_beside_the_equal_one_only_where_they_differ():
    from parabench.models import GPTConfig
    from parabench.plan import search as S

    # a vocabulary this large against d 64 puts most of a stage's cost in the head
    cfg = GPTConfig(n_layers=6, d_model=128, n_heads=4, vocab_size=50304, seq_len=1024)
    ok, dropped = S.plan("custom", cfg, 2, "h100-80g", C.load_kind("h100"))
    pipelined = [c for c in ok + dropped if c.strategy == "ref.pp_1f1b" and c.micro_batch == 4]
    splits = sorted(str(c.options.get("stage_layers")) for c in pipelined if c.options["microbatches"] == 2)
    assert splits == ["None", "[5, 1]"], splits
    assert not any("stage_layers" in c.options for c in ok + dropped if c.strategy == "ref.pp_interleaved")
    flat = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=64)
    ok, dropped = S.plan("custom", flat, 2, "h100-80g", C.load_kind("h100"))
    assert not any("stage_layers" in c.options for c in ok + dropped)


def test_zero_bubble_version_2_is_the_schedule_replay_and_version_1_host_bound():
    """ref.pp_zb version 1 (records without a version) ran W as one autograd call per module and is
    host-bound; version 2 (explicit dy^T x) is the replayed schedule's device time, whatever host cost
    version 1 calibrated; torch.pp_zb stays host-bound."""
    opts = {"pp": 2, "microbatches": 4}
    v2 = for_config(
        model="tiny", cfg=model_config("tiny"), strategy="ref.pp_zb", world_size=2, micro_batch=4, options=opts
    )
    assert v2.strategy_version == "2" and not M.is_host_bound(v2)
    v1 = dataclasses.replace(v2, strategy_version="1")
    assert M.is_host_bound(v1) and M.is_host_bound(dataclasses.replace(v2, strategy_version=None))
    torch_zb = for_config(
        model="tiny", cfg=model_config("tiny"), strategy="torch.pp_zb", world_size=2, micro_batch=4, options=opts
    )
    assert M.is_host_bound(torch_zb)
    cal = _cal(inv_rate=1e-15)
    device = _device_s(v2, cal)
    slow = {**cal, "host_tensor_s": {"ref.pp_zb": 10 * device / M.host_units(v2)}}
    assert M.predict(v2, slow).step_s == pytest.approx(device)
    assert M.predict(v1, slow).step_s == pytest.approx(10 * device)
    # torch.pp_zb without a record of its own waits on the host as ref.pp_zb version 1 did, and says so
    borrowed = M.predict(torch_zb, slow)
    assert borrowed.step_s == pytest.approx(10 * device * M.host_units(torch_zb) / M.host_units(v2), rel=0.01)
    assert any("host cost of ref.pp_zb" in n for n in borrowed.notes)
    own = {**cal, "host_tensor_s": {**slow["host_tensor_s"], "torch.pp_zb": 20 * device / M.host_units(v2)}}
    assert M.predict(torch_zb, own).step_s == pytest.approx(2 * borrowed.step_s, rel=0.01)
    # records of the two versions are two configurations; other strategies' versions are not told apart
    case = {"model": "gpt-1.3b", "strategy": "ref.pp_zb", "world_size": 4, "precision": "bf16", "micro_batch": 16}
    keys = {C.config_key({"case": case, "strategy_version": v}) for v in (None, "1", "2")}
    assert len(keys) == 2
    case_1f1b = {**case, "strategy": "ref.pp_1f1b"}
    assert len({C.config_key({"case": case_1f1b, "strategy_version": v}) for v in (None, "1", "2")}) == 1
    # version 2 configurations do not set the host cost of version 1
    obs = [C.Observation("a", v1, 1.0, None), C.Observation("b", v2, 100.0, None)]
    assert C.fit_host(obs, [1e-6, 1e-6])["ref.pp_zb"] == pytest.approx(1.0 / M.host_units(v1))


def _run_folder(root: Path, name: str, shared: str | None) -> None:
    run = root / name
    (run / "cases").mkdir(parents=True)
    env = {"PARABENCH_HOST_SHARED": shared} if shared is not None else {}
    (run / "manifest.json").write_text(json.dumps({"schema_version": 1, "kind": "run", "env": env}))
    from parabench.case import Case

    case = Case(model="tiny", strategy="single", world_size=1)
    record = {
        "schema_version": 1,
        "kind": "case",
        "case_hash": case.case_hash,
        "label": case.label,
        "status": "ok",
        "device": {"name": "NVIDIA H100 80GB HBM3"},
        "case": case.to_dict(),
    }
    (run / "cases" / f"{case.case_hash}.json").write_text(json.dumps(record))


def test_runs_on_a_shared_host_stay_out_of_the_calibration(tmp_path):
    """A manifest naming other streams on the host (PARABENCH_HOST_SHARED) measured contention: none
    of its records is calibrated on, and the calibration says why; an empty value is a quiet host."""
    _run_folder(tmp_path / "results", "suite/quiet", None)
    _run_folder(tmp_path / "results", "suite/blank", "  ")
    _run_folder(tmp_path / "results", "suite/busy", "zeropp-gpu on GPUs 0,1")
    runs = sorted(run for run, _ in C.gpu_records(tmp_path / "results"))
    assert runs == ["results/suite/blank", "results/suite/quiet"]
    assert C.left_out_runs(tmp_path / "results") == {"results/suite/busy": C.HOST_SHARED_REASON}
    assert C.host_shared({"env": {"PARABENCH_HOST_SHARED": "x"}}) == "x" and C.host_shared({}) is None


def test_torch_pipeline_dp_overlaps_the_last_backward_from_version_3_and_zero_bubble_stays_serial():
    """torch.pp_1f1b version 3 (DDP-wrapped stages) hides its dp all-reduce, but for the last
    (embedding) bucket, behind the last micro-batch's backward; version 2 (its records) and
    torch.pp_zb all-reduce after the schedule, with nothing beside them."""
    cfg, opts = model_config("gpt-125m"), {"pp": 2}
    v3 = for_config(model="gpt-125m", cfg=cfg, strategy="torch.pp_1f1b", world_size=4, micro_batch=8, options=opts)
    zb = for_config(model="gpt-125m", cfg=cfg, strategy="torch.pp_zb", world_size=4, micro_batch=8, options=opts)
    assert v3.strategy_version == "3" and (v3.pp, v3.dp) == (2, 2)
    v2 = dataclasses.replace(v3, strategy_version="2")

    def dp_comm(w) -> tuple[float, float]:
        f = M.time_features(w, COLLECTIVES, M.TIME_DEFAULTS)
        b = w.comm_bytes["all_reduce"]
        serial = M.collective_s(COLLECTIVES, "all_reduce", b, w.dp, M.comm_calls(w, "all_reduce", b))
        return f["comm_serial"], serial

    exposed_v2, serial_v2 = dp_comm(v2)
    exposed_v3, serial_v3 = dp_comm(v3)
    exposed_zb, serial_zb = dp_comm(zb)
    assert serial_v2 > 0 and exposed_v2 == pytest.approx(serial_v2)
    assert exposed_zb == pytest.approx(serial_zb)
    # what stays exposed at version 3 is the embedding's bucket, which backward makes last
    embed_share = cfg.vocab_size * cfg.d_model * 2 / v3.comm_bytes["all_reduce"]
    assert exposed_v3 == pytest.approx(serial_v3 * embed_share) and exposed_v3 < 0.6 * exposed_v2
    # version 3 records are their own configuration; versions before it keep their keys
    case = {"model": "gpt-125m", "strategy": "torch.pp_1f1b", "world_size": 4, "precision": "bf16", "micro_batch": 8}
    keys = [C.config_key({"case": case, "strategy_version": v}) for v in (None, "1", "2", "3")]
    assert len(set(keys[:3])) == 1 and keys[3] != keys[0]


def test_host_floor_lasts_each_action_at_least_its_host_time():
    """An action whose device work is shorter than its host time (``pp_host_block_s`` per block)
    lasts the host time: equal ops all floored to 3 give 1F1B's (m+p-1) (F+B) against m of the
    device's F+B = 3; no floor leaves the replay as it was; the floor follows the chunk's blocks."""
    cfg = dataclasses.replace(model_config("tiny"), n_layers=8)
    p, m = 2, 4
    w = for_config(
        model="tiny", cfg=cfg, strategy="ref.pp_1f1b", world_size=p, micro_batch=m, options={"pp": p, "microbatches": m}
    )
    orders, costs = M._stage_orders(w), _equal_costs(w)
    assert M.schedule_factor(orders, costs, [0.0] * p) == M.schedule_factor(orders, costs)
    assert M.schedule_factor(orders, costs, [3.0] * p) == pytest.approx((m + p - 1) * 6 / (m * 3))
    assert M.pipeline_host_floors(w, {"pp_host_block_s": 1e-3}) == pytest.approx([4e-3, 4e-3])
    inter = for_config(
        model="tiny",
        cfg=cfg,
        strategy="ref.pp_interleaved",
        world_size=p,
        micro_batch=m,
        options={"pp": p, "microbatches": m},
    )
    assert M.pipeline_host_floors(inter, {"pp_host_block_s": 1e-3}) == pytest.approx([2e-3] * 4)
    consts = {"inv_rate": 1e-15}
    assert M.pipeline_factor(w, {**consts, "pp_host_block_s": 1.0}) > M.pipeline_factor(w, consts)


def test_report_shows_each_prediction_and_the_planners_validation():
    """A GPU run's report: each case beside its prediction, then the validation of that device
    kind's calibration (leave one out, out of scale, the measurements' retest, the targets), as
    the committed validation file says; a CPU run has neither."""
    from parabench.report.html import render_report
    from parabench.report.predicted import validation_rows

    html = render_report([ROOT / "results/studies/ds-host-gpu/20261127-043817"], with_figures=False)
    assert 'id="tbl-predicted"' in html and 'id="tbl-plan-validation-h100"' in html
    report = json.loads((ROOT / "results/calibration/validation-h100.json").read_text())
    rows = validation_rows(report)
    loo = rows[0]
    assert loo["test"] == "leave one configuration out"
    assert loo["configs"] == report["leave_one_out"]["configurations"]
    assert loo["step_median"] == report["leave_one_out"]["step_median_pct"]
    sc = report["leave_one_out"]["by_model_and_gpus"]
    assert loo["spearman_scale"].startswith(f"{sc['spearman_median']:.2f}, {sc['below_0.9']} of {sc['groups']}")
    assert rows[-2]["spearman"].startswith(f"{report['retest']['retest_median']:.2f}")
    assert rows[-1]["test"] == "target" and rows[-1]["spearman"] == "reported beside the retest, not a target"
    cpu = render_report([ROOT / "results/meter-overhead/cpu"], with_figures=False)
    assert "tbl-plan-validation" not in cpu


def test_custom_shape_names_round_trip_and_bad_ones_say_the_form():
    from parabench.models import GPTConfig, custom_model_name, is_model_name

    cfg = model_config("custom-L3-d96-h6-v512", seq_len=128)
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.vocab_size, cfg.seq_len) == (3, 96, 6, 512, 128)
    assert custom_model_name(cfg) == "custom-L3-d96-h6-v512"
    assert custom_model_name(model_config("gpt-1.3b")) == "custom-L24-d2048-h16"  # the ladder's default vocab
    assert custom_model_name(GPTConfig(n_layers=2, d_model=64, n_heads=4, mlp_ratio=2)) is None
    assert not is_model_name("custom-L3-d96-h5") and not is_model_name("custom-L3-d96") and not is_model_name({})
    with pytest.raises(KeyError, match="heads must divide the width"):
        model_config("custom-L3-d96-h5")
    with pytest.raises(KeyError, match=r"or custom-L<layers>-d<width>-h<heads>\[-v<vocab>\]"):
        model_config("gpt-99b")


def test_plan_writes_a_runnable_suite_for_a_custom_shape(tmp_path, capsys):
    """A shape off the ladder goes from `parabench plan` to a suite by its shape name, and the
    suite's cases train that shape: the same parameter count as the planner's configuration."""
    from parabench.models import parameter_count

    out = tmp_path / "custom.toml"
    argv = ["plan", "--layers", "3", "--hidden", "96", "--heads", "6", "--vocab", "512", "--seq", "128", "--gpus", "2"]
    assert main([*argv, "--top", "2", "--write-suite", str(out)]) == 0
    assert "custom-L3-d96-h6-v512: 3 layers, d 96, 6 heads, vocab 512, seq 128" in capsys.readouterr().out
    suite = load_suite(str(out))
    assert len(suite.cases) == 2 and {c.model for c in suite.cases} == {"custom-L3-d96-h6-v512"}
    cfg = suite.cases[0].model_config()
    assert (
        cfg.seq_len == 128
        and parameter_count(cfg)["total"]
        == parameter_count(model_config("custom-L3-d96-h6-v512", seq_len=128))["total"]
    )
    assert main(["plan", "--model", "custom-L3-d96-h5", "--gpus", "2"]) == 2
    assert "heads must divide the width" in capsys.readouterr().err
    shape = tmp_path / "moe.toml"
    shape.write_text("n_layers = 2\nd_model = 64\nn_heads = 4\nmlp_ratio = 2\n")
    assert main(["plan", "--shape", str(shape), "--gpus", "2", "--write-suite", str(tmp_path / "x.toml")]) == 2
    assert "cannot carry this one's other fields" in capsys.readouterr().err


def test_accumulated_gradients_are_alive_through_later_micro_batches():
    """Under gradient accumulation the gradients of the earlier micro-batches are alive at the next
    one's peak: the references' ZeRO-1 its full 16-bit buckets (it reduces on the last micro-batch
    only), ZeRO-2 its fp32 main-gradient shards; torch DDP, whose buckets are alive either way, a
    ``p.grad`` of its own beside them under no_sync."""
    from parabench.plan import workload as W

    cfg = model_config("gpt-1.3b")

    def backward_states(strategy, grad_accum):
        w = W.for_config(
            model="gpt-1.3b", cfg=cfg, strategy=strategy, world_size=4, micro_batch=1, grad_accum=grad_accum
        )
        return M.states_at(w, "backward"), w.state_parts

    for strategy, part in (("ref.zero1", "params"), ("ref.zero2", "grads"), ("torch.ddp", "params")):
        (once, parts), (accumulated, _) = backward_states(strategy, 1), backward_states(strategy, 4)
        assert accumulated - once == pytest.approx(parts[part]), strategy
    assert backward_states("ref.zero1", 4)[1]["grads"] > backward_states("ref.zero1", 4)[1]["params"]


def test_a_checkpointed_block_is_recomputed_after_the_loss_backward_is_over():
    """With activation checkpointing, the logits' buffers and the recomputed block's activations
    are never alive together: two phases, and the peak is the larger."""
    from parabench.plan import workload as W

    def phases(vocab, seq):
        cfg = GPTConfig(n_layers=24, d_model=2048, n_heads=16, vocab_size=vocab, seq_len=seq)
        w = W.for_config(
            model="custom",
            cfg=cfg,
            strategy="ref.zero2",
            world_size=2,
            micro_batch=4,
            options={"activation_checkpointing": True},
        )
        return M.memory_features(w), M.predict(w, C.load_kind("h100")).peak_phase

    feats, phase = phases(50304, 2048)
    (_, first), (_, again) = feats["first"], feats["recompute"]
    assert first["logit_bytes_master"] > 0 and again["logit_bytes_master"] == 0
    assert again["act_master"] - first["act_master"] == pytest.approx(34 * 2048 * 4 * 2048)
    assert phase == "start of backward"
    assert phases(256, 8192)[1] == "first block recomputation"


def test_gradient_buffers_are_not_charged_at_the_loss_peak():
    """The references' gradient buffers (the theory's ``grad_buffers``) are made in backward, after the
    loss's peak: the loss phase holds gathered parameters only, a later phase the buffers too."""
    from parabench.plan import workload as W

    w = W.for_config(model="gpt-1.3b", cfg=model_config("gpt-1.3b"), strategy="ref.fsdp", world_size=4, micro_batch=2)
    assert 0 < w.working_set_grad_bytes < w.working_set_bytes
    feats = M.memory_features(w)
    (at_loss, first), (later, backward) = feats["first"], feats["backward"]
    assert later - at_loss == pytest.approx(M.working_set_at(w, "backward") - M.working_set_at(w, "first"))
    assert M.working_set_at(w, "backward") - M.working_set_at(w, "first") > 0.5 * w.working_set_grad_bytes
    assert first["logit_bytes_master"] > 0 and backward["logit_bytes_master"] == 0
    p = M.predict(w, C.load_kind("h100"))
    assert p.peak_phase == "start of backward"
    assert p.memory_bytes["working_set"] == pytest.approx(M.working_set_at(w, "first"))


def test_the_references_sharded_working_set_follows_their_units_through_the_step():
    """reference_impls/fsdp.py: after forward no block is gathered and ref.zero3 frees its root too
    (ref.fsdp keeps it); at the start of backward the root holds the head's gradients only; at the end
    of backward the embeddings' arrive and autograd's root gradients and the root's flat buffer are
    alive together, beside every fp32 gradient shard but the root's."""
    from parabench.plan import workload as W

    def at(strategy, world_size=4, micro_batch=2, model="gpt-1.3b"):
        cfg = model_config(model)
        return W.for_config(model=model, cfg=cfg, strategy=strategy, world_size=world_size, micro_batch=micro_batch)

    zero3, fsdp = at("ref.zero3"), at("ref.fsdp")
    root, head = M.ref_root_params(zero3)
    counts = parameter_count(model_config("gpt-1.3b"))
    assert root == pytest.approx(counts["total"] - counts["blocks"], rel=1e-3)
    assert head == counts["head"] + 2 * 2048
    assert M.working_set_at(zero3, "first") == 0
    assert M.working_set_at(fsdp, "first") == pytest.approx(2 * root)
    assert M.working_set_at(zero3, "backward") == pytest.approx(zero3.working_set_bytes - 2 * (2 * root - head))
    end = M.working_set_at(zero3, "end")
    assert end == pytest.approx(zero3.working_set_grad_bytes - 2 * M.block_params(zero3))
    grads = zero3.state_parts["grads"]
    assert M.states_in(zero3, "end") == pytest.approx(sum(zero3.state_parts.values()) - grads * root / zero3.params)
    accumulating = dataclasses.replace(zero3, grad_accum=2)  # the root's shard is made in the first micro-batch
    assert M.states_in(accumulating, "end") == pytest.approx(sum(zero3.state_parts.values()))
    assert "end" in M.memory_features(zero3) and "end" not in M.memory_features(at("deepspeed.zero3"))
    # one row of gpt-6.7b over 2 ranks: the fp32 shards of the end of backward outweigh the activations
    # of its start (measured: results/h100x2/20261126-180901, 53.1 GiB at the end of backward)
    p = M.predict(at("ref.zero3", world_size=2, micro_batch=1, model="gpt-6.7b"), C.load_kind("h100"))
    assert p.peak_phase == "end of backward"
    assert p.memory_bytes["working_set"] + p.memory_bytes["model_states"] + p.memory_bytes["fixed"] == pytest.approx(
        p.peak_bytes
    )


def test_fsdp2_holds_fp32_sharded_masters_not_the_zero_papers_split():
    """FSDP2's sharded parameters are the fp32 masters: 4 + 4 + 8 bytes per parameter over N, so
    12 of the 16 are alive through backward (the paper's 2 + 2 + 12 split would keep 14)."""
    from parabench.plan import workload as W

    cfg = model_config("gpt-1.3b")
    w = W.for_config(model="gpt-1.3b", cfg=cfg, strategy="torch.fsdp2", world_size=2, micro_batch=4)
    psi_n = w.params / 2
    assert w.state_parts == pytest.approx({"params": 4 * psi_n, "grads": 4 * psi_n, "optimizer": 8 * psi_n})
    assert M.states_at(w, "backward") == pytest.approx(12 * psi_n)
    zero3 = W.for_config(model="gpt-1.3b", cfg=cfg, strategy="deepspeed.zero3", world_size=2, micro_batch=4)
    assert sum(zero3.state_parts.values()) == pytest.approx(sum(w.state_parts.values()), rel=0.01)


def test_amp_weight_copies_are_charged_to_every_trainer_sharded_or_not():
    """Each linear under autocast saves its 16-bit weight for backward, so the copies outlive the
    gathered fp32 units a sharded trainer frees after forward."""
    from parabench.plan import workload as W

    cfg = model_config("gpt-1.3b")

    def cast(strategy):
        w = W.for_config(model="gpt-1.3b", cfg=cfg, strategy=strategy, world_size=2, micro_batch=4, recipe="amp")
        return M.memory_features(w)["first"][1]["cast"], w.params

    (fsdp2, psi), (zero3, _), (ddp, _) = cast("torch.fsdp2"), cast("ref.zero3"), cast("ref.ddp")
    assert fsdp2 == ddp == zero3 == pytest.approx(2 * psi)


def test_an_uncalibrated_profile_takes_the_factor_of_the_same_library_under_another():
    w = for_config(model="tiny", cfg=model_config("tiny"), strategy="deepspeed.zero0", world_size=2)
    matched = dataclasses.replace(w, profile=None)
    assert M.impl_factor(matched, {"deepspeed.zero0:tuned": 1.3, "deepspeed.zero1": 1.1}) == (
        1.3,
        "deepspeed.zero0:tuned",
    )
    assert M.impl_factor(matched, {"deepspeed.zero0": 1.2, "deepspeed.zero0:tuned": 1.3}) == (1.2, "deepspeed.zero0")
    assert M.impl_factor(matched, {"deepspeed.zero1:tuned": 1.3}) == (1.0, None)
    cal = _cal(inv_rate=1e-15) | {"impl_time": {"deepspeed.zero0:tuned": 1.3}}
    base = M.predict(matched, _cal(inv_rate=1e-15))
    assert M.predict(matched, cal).step_s == pytest.approx(1.3 * base.step_s)


def test_plan_prints_each_rows_share_of_the_first_and_the_validated_tie_band(tmp_path, capsys):
    assert main(["plan", "--model", "gpt-350m", "--gpus", "2", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "of #1" in out and "100.0%" in out
    loo = json.loads((ROOT / "results" / "calibration" / "validation-h100.json").read_text())["leave_one_out"]
    assert f"within 3 % in {loo['fastest_share']:.0%} of groups" in out
    (tmp_path / "h100.json").write_text((ROOT / "results" / "calibration" / "h100.json").read_text())
    assert main(["plan", "--model", "gpt-350m", "--gpus", "2", "--top", "3", "--calibration", str(tmp_path)]) == 0
    assert "ties at the model's accuracy" not in capsys.readouterr().out  # no validation beside it: no claim


def test_peaks_of_another_hopper_part_are_scored_against_this_calibration(monkeypatch):
    cal = _cal(inv_rate=1e-15)
    exact = _obs("ref.zero2", 2, 0.1)
    exact = dataclasses.replace(exact, peak_bytes=M.predict(exact.workload, cal).peak_bytes)
    high = dataclasses.replace(exact, peak_bytes=exact.peak_bytes * 1.25)  # the model 20 % under it
    monkeypatch.setattr(C, "observations", lambda results, kind: [exact, high] if kind == "h200" else [])
    got = V.peaks_on_other_parts("results", "h100", cal)
    assert set(got) == {"h200"} and got["h200"]["configurations"] == 2
    assert got["h200"]["peak_median_pct"] == pytest.approx(10.0)
    assert V.peaks_on_other_parts("results", "a100", cal) == {}  # no part shares A100's memory behaviour here


def test_plan_table_lists_what_each_row_borrows_under_it():
    from parabench.plan import search as S

    w = for_config(
        model="tiny",
        cfg=model_config("tiny"),
        strategy="deepspeed.zero2_offload",
        world_size=1,
        options={"profile": "tuned"},
    )
    cal = _cal(inv_rate=1e-15) | {"impl_time": {"deepspeed.zero2_offload": 1.1}}
    c = S.Candidate("deepspeed.zero2_offload", 1, 1, 1, {"profile": "tuned"}, "master", w, M.predict(w, cal))
    text = S.table([c, c], 2)
    assert "notes:\n  #1, #2: implementation factor of deepspeed.zero2_offload: no calibrated record of" in text


def _dynamo_split(cfg, bucket_mb: float, dtype) -> list:
    """The parameter-holding ops of each graph Dynamo's DDPOptimizer cuts one compiled ``Block`` into."""
    import torch
    import torch._dynamo
    from torch._dynamo.backends.distributed import DDPOptimizer

    from parabench.models import Block

    block = Block(cfg).to(dtype)
    captured = {}

    def capture(gm, example_inputs):
        captured.update(gm=gm, example_inputs=example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(block, backend=capture)(torch.randn(2, 16, cfg.d_model, dtype=dtype))
    splitter = DDPOptimizer(bucket_bytes_cap=int(bucket_mb * 2**20), backend_compile_fn=lambda gm, _: gm.forward)
    splitter.compile_fn(captured["gm"], captured["example_inputs"])
    names = {"mlp_modules_fc_": "fc", "mlp_modules_proj_": "fc2", "attn_modules_proj_": "proj"}
    names |= {f"attn_modules_{p}_": p for p in ("qkv", "q", "k", "v")} | {"ln1": "ln1", "ln2": "ln2"}
    return [{next(op for key, op in names.items() if key in p) for p in b.params} for b in splitter.buckets]


@pytest.mark.parametrize(
    "model,bucket_mb,recipe",
    [
        ("custom-L1-d512-h8", 1.5625, "amp"),  # gpt-1.3b's cuts under 25 MiB buckets
        ("custom-L1-d512-h8", 1.0, "fp8"),  # gpt-2.7b's: every linear alone
        ("custom-L1-d512-h8", 6.25, "amp"),  # gpt-350m's
        ("custom-L1-d512-h8", 25.0, "amp"),  # the MLP's second linear alone (the first bucket's 1 MiB)
        ("custom-L1-d512-h8", 3.0, "master"),  # bf16 parameters: half the bytes per bucket
    ],
)
def test_ddp_split_graphs_are_the_ones_dynamo_cuts(model, bucket_mb, recipe):
    import torch

    cfg = model_config(model)
    w = for_config(model=model, cfg=cfg, strategy="torch.ddp", world_size=1, recipe=recipe, options={"compile": True})
    dtype = torch.float32 if recipe in M.AUTOCAST_RECIPES else torch.bfloat16
    ops_with_params = {op for op, params in M._block_ops(w) if params}
    planned = [set(g) & ops_with_params for g in M.ddp_split_graphs(w, bucket_mb * 2**20)]
    assert [g for g in planned if g] == _dynamo_split(cfg, bucket_mb, dtype)


def test_ddp_split_graphs_add_what_the_h100_record_measured():
    """gpt-1.3b mb 4 on one H100 (results/studies/ddp-optimizer-h100x1): torch.ddp compiled held 1.50 GiB (amp) and
    3.75 GiB (fp8) more with the DDPOptimizer on than off."""
    ws = {r: _workload(r, "gpt-1.3b", "torch.ddp", micro_batch=4, compile=True) for r in ("amp", "fp8", "master")}
    assert M.split_graphs_bytes(ws["amp"]) == 1.5 * M.GIB
    assert M.split_graphs_bytes(ws["fp8"]) == 3.75 * M.GIB
    assert M.split_graphs_bytes(ws["master"]) == 0 and M.split_unmodelled(ws["master"])
    off = dataclasses.replace(ws["amp"], split_bucket_bytes=None)
    assert M.split_graphs_bytes(off) == 0 and not M.split_unmodelled(off)
    cal = json.loads((Path(C.CALIBRATION_DIR) / "h100.json").read_text())
    on_peak, off_peak = M.predict(ws["amp"], cal).peak_bytes, M.predict(off, cal).peak_bytes
    assert on_peak - off_peak == pytest.approx(1.5 * M.GIB)


def test_the_amp_split_term_is_what_the_cpu_probe_and_the_gpu_records_measured():
    """results/studies/ddp-optimizer-cpu/probe.json: five cut structures at width 512, saved bytes with the DDPOptimizer
    on less off; results/studies/fp8-peers-gpu: gpt-1.3b on 2 GPUs at 25, 100 and 400 MiB buckets (three structures),
    the peaks' differences. The amp term reproduces both to the byte and to 0.01 GiB."""
    probe = json.loads((Path(C.CALIBRATION_DIR).parent / "studies" / "ddp-optimizer-cpu" / "probe.json").read_text())
    rows = [r for r in probe["rows"] if r["recipe"] == "amp"]
    assert len({len(r["graphs"]) for r in rows}) == 5
    for r in rows:
        cfg = model_config(probe["model"], seq_len=probe["seq_len"])
        w = for_config(
            model=probe["model"],
            cfg=cfg,
            strategy="torch.ddp",
            world_size=1,
            micro_batch=probe["micro_batch"],
            recipe="amp",
            options={"compile": True, "bucket_mb": r["bucket_mb"]},
        )
        assert M.split_graphs_bytes(w) == r["measured_extra_bytes"], r
    peaks = {}
    for path in (Path(C.CALIBRATION_DIR).parent / "studies" / "fp8-peers-gpu").glob("*/cases/*.json"):
        rec = json.loads(path.read_text())
        c = rec["case"]
        if c["strategy"] == "torch.ddp" and c["recipe"] == "amp" and rec["status"] == "ok":
            w = for_config(
                model=c["model"],
                cfg=model_config(c["model"]),
                strategy="torch.ddp",
                world_size=c["world_size"],
                micro_batch=c["micro_batch"],
                recipe="amp",
                options=c["options"],
            )
            peaks[c["options"]["bucket_mb"]] = (rec["metrics"]["peak_alloc_bytes"], M.split_graphs_bytes(w))
    assert sorted(peaks) == [25, 100, 400]
    for b in (25, 100):
        measured, modelled = peaks[b][0] - peaks[400][0], peaks[b][1] - peaks[400][1]
        assert abs(measured - modelled) < 0.01 * M.GIB, (b, measured / M.GIB, modelled / M.GIB)


def _collectives_doc(n: int, alpha_s: float, busbw_Bps: float, device="NVIDIA H100 80GB HBM3", burst=None) -> dict:
    """A collectives-suite result whose backend rows follow alpha + bytes * bus / busbw exactly, and
    with ``burst`` = (alpha, busbw) also the per-call rows of bursts of queued calls."""
    rows = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for algorithm, (a, bw) in (("backend", (alpha_s, busbw_Bps)), ("backend_burst", burst or (None, None))):
            if a is None:
                continue
            for size in (2**k for k in range(10, 31, 2)):
                t = a + size * M.bus_factor(op, n) / bw
                rows.append({"op": op, "algorithm": algorithm, "bytes": size, "time_s_median": t})
        rows.append({"op": op, "algorithm": "ring", "bytes": 2**20, "time_s_median": 1.0})  # not the backend's
    return {"ok": True, "world_size": n, "device": {"name": device}, "rows": rows}


def test_collectives_are_fitted_per_group_size_and_priced_by_the_nearest_below(tmp_path):
    run = tmp_path / "collectives-x" / "r1"
    run.mkdir(parents=True)
    (run / "collectives-w2.json").write_text(json.dumps(_collectives_doc(2, 40e-6, 200e9)))
    (run / "collectives-w4.json").write_text(json.dumps(_collectives_doc(4, 80e-6, 300e9)))
    fit = C.fit_collectives(tmp_path)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        by = fit[op]["by_group"]
        assert sorted(by) == ["2", "4"]
        assert by["2"]["alpha_s"] == pytest.approx(40e-6, rel=1e-6)
        assert by["2"]["busbw_Bps"] == pytest.approx(200e9, rel=1e-6)
        assert by["4"]["busbw_Bps"] == pytest.approx(300e9, rel=1e-6)
        assert fit[op]["group_size"] == 4  # a group larger than any measured gets the largest's fit
    nbytes = 1e9
    for n, measured in ((2, 2), (3, 2), (4, 4), (8, 4)):
        expect = 80e-6 if measured == 4 else 40e-6
        expect += nbytes * M.bus_factor("all_gather", n) / (300e9 if measured == 4 else 200e9)
        assert M.collective_s(fit, "all_gather", nbytes, n, 1) == pytest.approx(expect, rel=1e-6)
    # a calibration written before group sizes were kept prices every group with its one fit
    flat = {op: {k: v for k, v in f.items() if k != "by_group"} for op, f in fit.items()}
    assert M.collective_s(flat, "all_gather", nbytes, 2, 1) == pytest.approx(
        80e-6 + nbytes * M.bus_factor("all_gather", 2) / 300e9, rel=1e-6
    )
    w8 = for_config(model="tiny", cfg=model_config("tiny"), strategy="ref.zero3", world_size=8, micro_batch=1)
    w4 = dataclasses.replace(w8, world_size=4, dp=4)
    assert any("over 8 ranks priced with the 4-rank fit" in n for n in M.unmeasured_group_notes(w8, fit))
    assert M.unmeasured_group_notes(w4, fit) == []


def test_queued_collectives_are_fitted_from_bursts_or_borrow_another_parts_ratios(tmp_path):
    run = tmp_path / "collectives-x" / "r1"
    run.mkdir(parents=True)
    (run / "collectives-w4.json").write_text(json.dumps(_collectives_doc(4, 80e-6, 300e9, burst=(50e-6, 330e9))))
    other = tmp_path / "collectives-burst" / "r2"
    other.mkdir(parents=True)
    # a run of another part with isolated and queued calls at 2 ranks: alpha x0.5, busbw x1.2
    (other / "collectives-w2.json").write_text(
        json.dumps(_collectives_doc(2, 60e-6, 250e9, device="NVIDIA H200", burst=(30e-6, 300e9)))
    )
    (run / "collectives-w2.json").write_text(json.dumps(_collectives_doc(2, 40e-6, 200e9)))
    fit = C.fit_collectives(tmp_path)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        own, borrowed = fit[op]["by_group"]["4"], fit[op]["by_group"]["2"]
        assert own["alpha_queued_s"] == pytest.approx(50e-6, rel=1e-6)
        assert own["busbw_queued_Bps"] == pytest.approx(330e9, rel=1e-6)
        assert borrowed["alpha_queued_s"] == pytest.approx(20e-6, rel=1e-6)
        assert borrowed["busbw_queued_Bps"] == pytest.approx(240e9, rel=1e-6)
        assert "(h200)" in borrowed["queued_source"] and "r2" in borrowed["queued_source"]
        assert own["alpha_s"] == pytest.approx(80e-6, rel=1e-6)  # the isolated fit ignores bursts and other parts
    nbytes, calls = 100 * 2**20, 4
    bus = M.bus_factor("all_gather", 4)
    iso = calls * 80e-6 + nbytes * bus / 300e9
    queued = 80e-6 + nbytes / calls * bus / 300e9 + (calls - 1) * 50e-6 + nbytes * (calls - 1) / calls * bus / 330e9
    assert M.collective_s(fit, "all_gather", nbytes, 4, calls) == pytest.approx(iso, rel=1e-9)
    assert M.collective_s(fit, "all_gather", nbytes, 4, calls, queued=True) == pytest.approx(queued, rel=1e-9)
    assert M.collective_s(fit, "all_gather", nbytes, 4, 1, queued=True) == pytest.approx(80e-6 + nbytes * bus / 300e9)
    # ZeRO-1's all-gather after the update is a bucket loop with nothing beside it: queued calls
    w = for_config(model="gpt-1.3b", cfg=model_config("gpt-1.3b"), strategy="ref.zero1", world_size=4, micro_batch=4)
    isolated_only = {
        op: {**f, "by_group": {g: {k: v for k, v in b.items() if "queued" not in k} for g, b in f["by_group"].items()}}
        for op, f in fit.items()
    }
    ag = w.comm_bytes["all_gather"]
    calls_ag = M.comm_calls(w, "all_gather", ag)
    assert calls_ag > 1
    saved = M.collective_s(fit, "all_gather", ag, 4, calls_ag) - M.collective_s(
        fit, "all_gather", ag, 4, calls_ag, True
    )
    serial = M.time_features(w, fit)["comm_serial"]
    assert M.time_features(w, isolated_only)["comm_serial"] - serial == pytest.approx(saved, rel=1e-9)
    assert saved > 0
    # without bursts at a size, queued calls cost what isolated ones do
    plain = tmp_path / "plain" / "collectives-x" / "r1"
    plain.mkdir(parents=True)
    (plain / "collectives-w2.json").write_text(json.dumps(_collectives_doc(2, 40e-6, 200e9)))
    flat = C.fit_collectives(tmp_path / "plain")
    assert "alpha_queued_s" not in flat["all_gather"]
    assert M.collective_s(flat, "all_gather", nbytes, 2, calls, queued=True) == pytest.approx(
        M.collective_s(flat, "all_gather", nbytes, 2, calls)
    )


def test_zero1_and_zero2_step_their_optimizer_over_the_same_bytes():
    """ref.zero1 holds the whole gradient beside its fp32 shard for the reduce-scatter; the optimizer
    step touches the shard only, as ref.zero2's does: the same traffic at every N (measured within
    0.4 % of each other in the 9 configurations run side by side)."""
    for recipe in ("master", "amp"):
        for n in (1, 2, 4):
            cfg = model_config("gpt-1.3b")
            z1, z2, ddp = (
                for_config(model="gpt-1.3b", cfg=cfg, strategy=s, world_size=n, micro_batch=4, recipe=recipe)
                for s in ("ref.zero1", "ref.zero2", "ref.ddp")
            )
            assert z1.state_bytes > z2.state_bytes  # the layouts differ in what they hold
            assert M.optimizer_step_state_bytes(z1) == pytest.approx(M.optimizer_step_state_bytes(z2))
            assert M.optimizer_step_state_bytes(ddp) == ddp.state_bytes


def test_borrowed_queued_ratios_are_the_median_over_runs_with_bursts(tmp_path):
    for run, (burst_alpha, burst_bw) in (("r2", (30e-6, 300e9)), ("r3", (42e-6, 350e9))):
        d = tmp_path / "collectives-burst" / run
        d.mkdir(parents=True)
        doc = _collectives_doc(2, 60e-6, 250e9, device="NVIDIA H200", burst=(burst_alpha, burst_bw))
        (d / "collectives-w2.json").write_text(json.dumps(doc))
    own = tmp_path / "collectives-x" / "r1"
    own.mkdir(parents=True)
    (own / "collectives-w2.json").write_text(json.dumps(_collectives_doc(2, 40e-6, 200e9)))
    fit = C.fit_collectives(tmp_path)["all_gather"]["by_group"]["2"]
    # alpha ratios 0.5 and 0.7, bus bandwidth ratios 1.2 and 1.4: medians 0.6 and 1.3
    assert fit["alpha_queued_s"] == pytest.approx(0.6 * 40e-6, rel=1e-6)
    assert fit["busbw_queued_Bps"] == pytest.approx(1.3 * 200e9, rel=1e-6)
    assert "r2" in fit["queued_source"] and "r3" in fit["queued_source"]


def test_launch_spread_names_the_trainers_whose_launches_disagree():
    from dataclasses import replace

    from parabench.plan.cli import erratic_note
    from parabench.plan.search import Candidate

    steady = [replace(_obs("ref.ddp", mb, 0.1), launch_steps=[0.100, 0.101]) for mb in (1, 2)]
    erratic = [
        replace(_obs("ref.zero3", 1, 0.2), launch_steps=[0.18, 0.30, 0.19]),
        replace(_obs("ref.zero3", 2, 0.2), launch_steps=[0.20, 0.21]),
        replace(_obs("ref.zero3", 4, 0.2), launch_steps=[0.20]),  # one launch: no spread
    ]
    spread = C.launch_spread(steady + erratic)
    assert spread["ref.ddp"]["configurations"] == 2 and spread["ref.ddp"]["max"] < 0.01
    assert spread["ref.zero3"]["configurations"] == 2
    assert spread["ref.zero3"]["max"] == pytest.approx(0.12 / (0.67 / 3))
    assert spread["ref.zero3"]["median"] == pytest.approx((0.12 / (0.67 / 3) + 0.01 / 0.205) / 2)
    rows = [Candidate(o.workload.strategy, 2, 1, 1, {}, None, workload=o.workload) for o in (steady[0], erratic[0])]
    note = erratic_note(rows, spread)
    assert "ref.zero3" in note and "ref.ddp" not in note and "2 configurations" in note
    assert erratic_note(rows[:1], spread) is None
    assert C.fit(steady + erratic, COLLECTIVES)["launch_spread"] == spread
    assert "python_gc" not in note
    # compiled torch.fsdp2 gets the measured remedy; eager torch.fsdp2 does not
    fsdp2 = _obs("torch.fsdp2", 1, 0.2).workload
    fsdp2_spread = {fsdp2.impl: {"median": 0.1, "max": 0.2, "configurations": 3}}
    for compiled in (True, False):
        w = replace(fsdp2, compiled=compiled)
        note = erratic_note([Candidate(w.strategy, 2, 1, 1, {}, None, workload=w)], fsdp2_spread)
        assert ('python_gc = "scheduled"' in note) is compiled


def test_the_time_fit_runs_to_its_fixed_point():
    """The constants and the implementation factors are refitted on each other until neither moves:
    stopping after a fixed few rounds left this set's constants far from where they settle."""

    def step(strategy: str, mb: int) -> float:
        return (1.3 if strategy.startswith("deepspeed") else 1.0) * (0.01 * mb + 0.004 * (strategy == "ref.zero2"))

    strategies = ("ref.ddp", "ref.zero2", "deepspeed.zero1", "deepspeed.zero2")
    obs = [_obs(s, mb, step(s, mb), ws) for s in strategies for mb in (1, 2, 4, 8) for ws in (1, 2)]
    consts, impl, _ = C.fit_time(obs, COLLECTIVES)
    settled, settled_impl, _ = C.fit_time(obs, COLLECTIVES, rounds=10 * C.FIT_MAX_ROUNDS)
    assert consts == pytest.approx(settled, rel=1e-5)
    assert impl.pop("_fitted") == settled_impl.pop("_fitted") and impl == pytest.approx(settled_impl, rel=1e-5)
    four, _, _ = C.fit_time(obs, COLLECTIVES, rounds=4)
    assert four["exp_deepspeed"] > 2 * consts["exp_deepspeed"]  # four rounds had not settled
    assert impl["deepspeed.zero1:tuned"] == pytest.approx(1.23, abs=0.01)


def test_a_preregistered_check_scores_what_fit_and_what_ran_out_of_memory():
    """A case the planner said fits but ran out of memory, and one it dropped that ran, are both
    named; failures other than OOM say nothing about memory."""
    gib = M.GIB
    manifest = {"devices": [{"memory_bytes": 100 * gib}, {"memory_bytes": 80 * gib}]}  # the smaller card binds
    usable = 80 * gib * 0.88
    predicted = {
        "a": {"peak_bytes": usable - gib},
        "b": {"peak_bytes": usable - gib},
        "c": {"peak_bytes": usable + gib},
    }
    predicted["d"] = {"peak_bytes": usable + gib}
    records = [
        {"case_hash": "a", "label": "fits, ran", "status": "ok"},
        {"case_hash": "b", "label": "fits, oom", "status": "oom"},
        {"case_hash": "c", "label": "dropped, ran", "status": "ok"},
        {"case_hash": "d", "label": "dropped, hung", "status": "timeout"},
    ]
    out = V.fits_as_predicted(records, predicted, manifest)
    assert out["cases"] == 3 and out["as_predicted"] == 1 and out["usable_bytes"] == pytest.approx(usable)
    assert [(r["label"], r["predicted"]) for r in out["wrong"]] == [
        ("fits, oom", "fits"),
        ("dropped, ran", "does not fit"),
    ]
    assert V.fits_as_predicted(records, predicted, {})["cases"] == 0


def test_the_report_sets_out_of_memory_cases_beside_their_predicted_peaks():
    """DeepSpeed ZeRO-1/2 ran out of memory at gpt-13b on 2x H200 (in the optimizer step's gradient
    copies): the report shows both cases with their predicted peaks, beyond what the planner keeps."""
    from parabench.report.predicted import prediction_rows
    from parabench.results import load_run

    run = next((ROOT / "results" / "studies" / "plan-check-13b-h200x2").iterdir())
    rows, missing, _ = prediction_rows([load_run(run)])
    oom = [r for r in rows if r["flag"].startswith("OOM")]
    assert {r["label"].split()[0] for r in oom} == {"deepspeed.zero1", "deepspeed.zero2"} and not missing
    assert all(r["flag"] == "OOM, as predicted" and not r["miss"] and r["step_ms"] is None for r in oom)
    assert all(r["pred_peak_gib"] > 0.88 * 139.8 for r in oom)


def test_deepspeed_keys_set_by_hand_are_outside_the_model():
    """The host and memory terms were fitted on DeepSpeed's defaults: a run that sets its own
    zero_optimization keys is predicted by no term, and says why."""
    kw = dict(model="gpt-350m", cfg=model_config("gpt-350m"), strategy="deepspeed.zero3", world_size=2)
    assert for_config(**kw).unmodelled is None
    hand = for_config(**kw, options={"zero": {"stage3_prefetch_bucket_size": 500_000_000}})
    assert hand.unmodelled == M.DS_ZERO_KEYS


def test_a_wide_pipeline_is_noted_as_measured_slower_than_predicted():
    """Pipelines at widths 4096 and above ran 8-15 % slower than predicted; their predictions say so, and
    neither a narrower pipeline's nor a wide data-parallel trainer's does."""
    cal = C.load_kind("h100")

    def noted(model, strategy, options):
        w = for_config(
            model=model, cfg=model_config(model), strategy=strategy, world_size=2, micro_batch=8, options=options
        )
        return any("in-place weight-gradient adds" in n for n in M.predict(w, cal).notes)

    pipeline = {"pp": 2, "microbatches": 8}
    assert noted("gpt-6.7b", "ref.pp_1f1b", pipeline)
    assert noted("gpt-13b", "torch.pp_1f1b", pipeline)
    assert not noted("gpt-1.3b", "ref.pp_1f1b", pipeline)
    assert not noted("gpt-6.7b", "ref.fsdp", {})


def test_a_width_outside_the_calibration_is_noted_as_extrapolated():
    """The stored calibration knows the widths it was fitted on; a wider model's prediction says so."""
    cal = C.load_kind("h100")
    lo, hi = cal["widths"]
    assert lo <= 1024 and hi < 5120
    wide = for_config(model="gpt-13b", cfg=model_config("gpt-13b"), strategy="ref.zero3", world_size=8, micro_batch=1)
    inside = for_config(
        model="gpt-1.3b", cfg=model_config("gpt-1.3b"), strategy="ref.zero3", world_size=8, micro_batch=1
    )
    assert any("outside the widths" in n for n in M.predict(wide, cal).notes)
    assert not any("outside the widths" in n for n in M.predict(inside, cal).notes)


def test_time_factors_keep_what_the_spread_between_libraries_supports():
    """Empirical Bayes: a library measured once keeps most of its factor when libraries differ far
    more than one library's configurations do, little of it when they do not, and the pseudo-count
    of ``M.SHRINK`` where no library has two configurations to show the spread within one."""
    tight = {"a": [1.46, 1.45, 1.47], "b": [1.04, 1.05, 1.03], "c": [1.54], "d": [0.85]}
    factors = C._impl_factors(tight, log=True)
    assert factors["a"] == pytest.approx(1.46, rel=0.01)
    assert 1.45 < factors["c"] < 1.54  # one configuration: shrunk, but by the records, not halved
    assert 0.85 < factors["d"] < 0.88
    noisy = {"a": [1.3, 0.8, 1.1], "b": [0.75, 1.3, 1.0], "c": [1.05]}
    assert C._impl_factors(noisy, log=True)["c"] == pytest.approx(1.0, abs=0.01)
    single = {"a": [1.5], "b": [0.9]}
    keep = len(single["a"]) / (len(single["a"]) + M.SHRINK)
    assert C._impl_factors(single, log=True)["a"] == pytest.approx(math.exp(math.log(1.5) * keep))
    # memory keeps its pseudo-configurations: one configuration's fraction is halved at SHRINK 1
    assert C._impl_factors({"a": [0.2], "b": [0.1, 0.1]}, log=False)["a"] == pytest.approx(0.2 / (1 + M.SHRINK))
