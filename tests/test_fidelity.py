"""Peer fidelity: the library scripts run standalone, import nothing of parabench, train the very
model parabench trains, and ``parabench fidelity`` sets them beside their adapters in the report."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import parabench

from parabench.cli import main as cli_main
from parabench.fidelity import PEER_SCRIPTS, SCRIPTS_DIR, fidelity_line, plan
from parabench.models import build_model, model_config, parameter_count
from parabench.report.fidelity import ratios
from parabench.report.html import render_report
from parabench.stats import combine_launches

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in SCRIPTS_DIR.glob("*.py") if p.name != "__init__.py")
TINY = ["--n-layer=2", "--n-head=4", "--d-model=64", "--vocab=256", "--seq-len=64", "--micro-batch=2"]
RESULT_KEYS = {
    "tokens_per_s_per_device",
    "step_time_s_median",
    "step_times_s",
    "peak_memory_bytes",
    "peak_memory_source",
    "final_loss",
    "losses",
    "config",
    "timed_window_s",
    "window_tokens_per_s_per_device",
    "timing",
    "choices",
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


def test_scripts_import_only_torch_deepspeed_and_the_standard_library():
    assert {p.name for p in SCRIPTS} >= {"_gpt.py", *(s.script for s in PEER_SCRIPTS.values())}
    allowed = set(sys.stdlib_module_names) | {"torch", "_gpt"}
    for path in SCRIPTS:
        names = _imports(path)
        extra = names - allowed - ({"deepspeed"} if path.name.startswith("deepspeed") else set())
        assert not extra, f"{path.name} imports {sorted(extra)}: the scripts stand alone (torch/deepspeed only)"
        assert "parabench" not in names and "reference_impls" not in names


@pytest.mark.parametrize("layout", ["separate", "fused"])
def test_script_gpt_is_parabench_gpt_name_for_name_and_weight_for_weight(layout):
    sys.path.insert(0, str(SCRIPTS_DIR))
    try:
        import _gpt
    finally:
        sys.path.remove(str(SCRIPTS_DIR))
    cfg = model_config("tiny", layout=layout)
    args = _gpt.parser("t").parse_args(TINY + ["--seed=7", f"--layout={layout}"])
    mine = dict(_gpt.build_gpt(args, torch.device("cpu")).named_parameters())
    theirs = dict(build_model(cfg, 7).named_parameters())
    assert list(mine) == list(theirs)
    assert sum(p.numel() for p in mine.values()) == parameter_count(cfg)["total"]
    for name, p in theirs.items():
        assert torch.equal(mine[name], p), name
    from parabench.models import global_batch

    x, y = _gpt.global_batch(3, 4, args)
    px, py = global_batch(3, 4, cfg, 7)
    assert torch.equal(x, px) and torch.equal(y, py)


STANDALONE = {
    "fsdp2": ("torch_fsdp2.py", "--precision=bf16", "--recipe=amp"),
    "fsdp2_compiled": ("torch_fsdp2.py", "--precision=bf16", "--recipe=amp", "--compile"),
    "tp": ("torch_tp.py", "--precision=bf16", "--recipe=master"),
    "zero3": ("deepspeed_zero.py", "--stage=3", "--precision=bf16"),
}


# DeepSpeed's engine on a CPU JIT-compiles its shared-memory all-reduce op when it starts (218.9 s
# on a 2-core machine with a cold cache). The op serves only DeepSpeed inference's
# inference_all_reduce; training's collectives go to gloo with or without it, and parabench's own
# DeepSpeed peers skip the build the same way (parabench.peers.deepspeed_zero.deepspeed_on_cpu).
# These tests are about the scripts, not the build, so the DeepSpeed script runs through this shim.
WITHOUT_SHM_OP = """
import importlib, os, runpy, sys
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
script = sys.argv.pop(1)
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="module")
def standalone(tmp_path_factory) -> dict:
    """Each script under its own ``torchrun --nproc-per-node=2`` on gloo, all at once (they wait
    on start-up more than they compute); name -> (exit status, output tail, JSON result or None)."""
    tmp = tmp_path_factory.mktemp("standalone")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    shim = tmp / "without_shm_op.py"
    shim.write_text(WITHOUT_SHM_OP)
    procs = {}
    for name, (script, *args) in STANDALONE.items():
        entry = [str(shim)] if script.startswith("deepspeed") else []
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               *entry, str(SCRIPTS_DIR / script), *TINY, "--steps=2", "--warmup=1", "--device=cpu",
               f"--out={tmp / name}.json", *args]  # fmt: skip
        log = open(tmp / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp), log)
    out = {}
    for name, (proc, log) in procs.items():
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
        path = tmp / f"{name}.json"
        out[name] = (
            rc,
            (tmp / f"{name}.log").read_text()[-3000:],
            json.loads(path.read_text()) if path.exists() else None,
        )
    return out


@pytest.mark.parametrize("name", list(STANDALONE))
def test_scripts_run_standalone_under_torchrun_with_a_well_formed_result(standalone, name):
    rc, tail, result = standalone[name]
    assert rc == 0 and result is not None, tail
    assert RESULT_KEYS <= set(result), sorted(RESULT_KEYS - set(result))
    assert result["tokens_per_s_per_device"] > 0 and result["peak_memory_bytes"] > 0
    assert result["peak_memory_source"] == "ru_maxrss" and len(result["step_times_s"]) == 2
    assert len(result["losses"]) == 3 and all(l == l for l in result["losses"])
    assert result["config"]["world_size"] == 2 and result["config"]["device"] == "cpu"
    for host in result["host_per_rank"]:  # the worker's host-speed probe, on both sides of the steps
        assert set(host["dispatch_us"]) == {"before", "after"} and all(v > 0 for v in host["dispatch_us"].values())
    assert (
        result["config"]["recipe"] == {"fsdp2": "amp", "fsdp2_compiled": "amp", "tp": "master", "zero3": "master"}[name]
    )
    if name.startswith("fsdp2"):
        assert bool(result["config"]["fsdp2"]["compile"]) == name.endswith("compiled")


def test_compiled_fsdp2_script_trains_as_the_eager_one(standalone):
    """Inductor reorders reductions: the compiled blocks' losses equal the eager ones' to rounding."""
    eager, compiled = standalone["fsdp2"][2], standalone["fsdp2_compiled"][2]
    assert eager is not None and compiled is not None, standalone["fsdp2_compiled"][1]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-3)


def test_deepspeed_script_config_is_the_documented_one(standalone):
    result = standalone["zero3"][2]
    assert result is not None, standalone["zero3"][1]
    cfg = result["config"]["ds_config"]
    assert cfg["bf16"] == {"enabled": True}
    # DeepSpeed's defaults (the tuned keys are the other profile's); no clipping, as parabench's recipe
    assert cfg["zero_optimization"] == {"stage": 3} and cfg["gradient_clipping"] == 0.0
    assert result["config"]["optimizer_wrapper"] == "DeepSpeedZeroOptimizer_Stage3"
    assert result["config"]["optimizer"] == "torch.optim.adamw.AdamW"  # FusedAdam is CUDA's


def test_deepspeed_script_tuned_profile_turns_off_the_timer_and_overflow_check():
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("ds_script", SCRIPTS_DIR / "deepspeed_zero.py")
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    args = argparse.Namespace(micro_batch=2, lr=1e-3, precision="bf16", stage=3, profile="tuned")
    tuned = ds.ds_config(args, cuda=True)
    assert tuned["timers"] == {"throughput": {"enabled": False}}
    assert tuned["bf16"] == {"enabled": True, "check_grad_overflow": False}
    defaults = ds.ds_config(argparse.Namespace(**{**vars(args), "profile": "defaults"}), cuda=True)
    assert "timers" not in defaults and defaults["bf16"] == {"enabled": True}


def test_plan_names_why_a_case_has_no_script_run():
    def record(**case):
        base = dict(strategy="torch.ddp", model="tiny", world_size=2, precision="bf16", micro_batch=2,
                    grad_accum=1, steps=2, warmup=1, seed=1, lr=1e-3, options={})  # fmt: skip
        return {"case": {**base, **case}, "device": {"type": "cpu"}}

    args, why = plan(record())
    assert why is None and "--recipe=amp" in args and "--device=cpu" in args  # DDP's own recipe
    assert "--recipe=master" in plan(record(strategy="torch.fsdp2"))[0]
    assert "--recipe=master" in plan(record(recipe="bf16-master"))[0]
    assert "--stage" in plan(record(strategy="deepspeed.zero2"))[0]
    # the tuned adapter meets the script with the same documented keys; matched meets the defaults
    assert "--profile=tuned" in plan(record(strategy="deepspeed.zero3", options={"profile": "tuned"}))[0]
    assert not any(
        "--profile" in a for a in plan(record(strategy="deepspeed.zero3", options={"profile": "matched"}))[0]
    )
    assert not any("--profile" in a for a in plan(record(strategy="torch.fsdp2", options={"profile": "tuned"}))[0])
    assert "gradient accumulation" in plan(record(grad_accum=2))[1]
    assert "activation_checkpointing" in plan(record(options={"activation_checkpointing": True}))[1]
    assert "no recipe 'amp'" in plan(record(strategy="deepspeed.zero3", recipe="amp"))[1]
    assert "whole world" in plan(record(strategy="torch.tp", world_size=4, options={"tp": 2}))[1]
    assert "fp16" in plan(record(precision="fp16"))[1]
    assert not any(a.startswith("--layout") for a in args)  # the default layout: the script's default
    assert "--layout=fused" in plan(record(strategy="deepspeed.zero3", layout="fused"))[0]
    assert "q, k, v" in plan(record(strategy="torch.tp", layout="fused", options={"tp": 2}))[1]
    compiled = {"options": {"compile": True}}
    assert "--compile" in plan(record(strategy="torch.fsdp2", **compiled))[0]
    assert "--compile" not in plan(record(strategy="torch.fsdp2", options={"compile": False}))[0]
    assert "does not take: compile" in plan(record(**compiled))[1]  # torch.ddp's script: not yet


def test_fidelity_command_writes_results_and_the_report_table(tmp_path):
    out = tmp_path / "res"
    proc = parabench(
        "run", "suite", "peer-fidelity", "--filter", "torch.ddp", "--out", out, "--run-id", "t", "--no-report"
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_dir = out / "peer-fidelity" / "t"
    assert cli_main(["fidelity", str(run_dir), "--no-report"]) == 0
    (record_path,) = (run_dir / "cases").glob("*.json")
    record = json.loads(record_path.read_text())
    case_recipe = record["case"]["recipe"]  # bf16: the suite's default, master
    entry = json.loads((run_dir / "fidelity" / record_path.name).read_text())
    assert entry["status"] == "ok" and entry["recipe"] == case_recipe == "master" and entry["strategy"] == "torch.ddp"
    case, result = record["case"], entry["result"]
    assert result["config"]["micro_batch"] == case["micro_batch"] and result["config"]["steps"] == case["steps"]
    # Same weights, same data, same library calls: on CPU the script retraces the adapter exactly.
    n = case["warmup"] + case["steps"]
    assert result["losses"] == record["metrics"]["losses"][:n]
    html = render_report([run_dir], with_figures=False)
    assert 'id="tbl-peer-fidelity"' in html and record["label"] in html
    # Kept on a second call; --launches 2 adds one launch beside the first, whose result stays.
    assert cli_main(["fidelity", str(run_dir), "--no-report"]) == 0
    assert json.loads((run_dir / "fidelity" / record_path.name).read_text()) == entry
    assert cli_main(["fidelity", str(run_dir), "--no-report", "--launches", "2"]) == 0
    two = json.loads((run_dir / "fidelity" / record_path.name).read_text())
    assert [x["started_at"] for x in two["launches"]][0] == entry["launches"][0]["started_at"]
    assert len(two["launches"]) == 2 and two["result"] == entry["result"]
    assert two["launches"][1]["result"]["losses"] == result["losses"]  # CPU: the same numbers again
    assert ratios(record, two)["launches"] == "1 / 2"


def _launch(tps, mem=100):
    return {"status": "ok", "result": {"tokens_per_s_per_device": tps, "peak_memory_bytes": mem}}


def test_ratios_pool_launches_by_median_with_an_interval():
    def rec(tps, repeat=0):
        metrics = {"tokens_per_s_per_device": tps, "step_time_s_median": 1e5 / tps, "peak_alloc_bytes": 100}
        return {"case_hash": "h", "status": "ok", "case": {"options": {}, "repeat": repeat}, "metrics": metrics}

    entry = {"status": "ok", "launches": [_launch(t) for t in (15_235, 16_469, 23_119, 17_059)]}
    adapter = [rec(t, i) for i, t in enumerate((20_112, 16_352, 18_103, 16_002))]
    (combined,) = combine_launches(adapter)  # as the report reads a run with --repeats
    r = ratios(combined, entry)
    # medians 17,227.5 / 16,764: one launch a side could have read 0.69x or 1.32x
    assert r["tps_ratio"] == pytest.approx(17_227.5 / 16_764) and r["verdict"] == "pass"
    assert r["launches"] == "4 / 4"
    low, high = r["tps_interval"]["low"], r["tps_interval"]["high"]
    assert low < 0.95 < 1.0 < high and 0 < r["tps_interval"]["coverage"] < 1
    # The console's line says the same as the report's table: medians, interval, launches a side.
    line = fidelity_line({**combined, "label": "c"}, entry)
    assert f"({17_227.5 / 16_764:.3f}x, interval " in line and "medians of 4 / 4 launches" in line
    assert line.endswith(": pass")
    # A single launch a side: no interval; an entry from before launches existed still reads.
    one = ratios(rec(15_000), {"status": "ok", "result": _launch(20_000)["result"]})
    assert one["tps_interval"] is None and one["tps_ratio"] == 0.75 and one["verdict"] == "fail"


PP_SUITE = """
[suite]
name = "pp-fidelity-test"
description = "torch.pp_1f1b and torch.pp_interleaved, tiny-deep, pp 2 on gloo"
device = "cpu"
precision = "bf16"
recipe = "master"
steps = 2
warmup = 1
lr = 1e-3
timeout_s = 180

[[matrix]]
model = "tiny-deep"
strategy = ["torch.pp_1f1b", "torch.pp_interleaved"]
world_size = 2
micro_batch = 4
options = {pp = 2, microbatches = 4}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pipeline_script_retraces_the_adapter_for_1f1b_and_interleaved(tmp_path):
    """The scripts run (argv from ``plan``, as ``parabench fidelity`` launches them) while the
    suite runs the adapters: the CPU spends these launches importing torch, not training. Each
    script's two ranks are started with torchrun's environment (RANK, WORLD_SIZE, MASTER_*), not
    under torchrun itself, which would import torch once more per launch."""
    from parabench.suite import load_suite

    suite = tmp_path / "pp-fidelity-test.toml"
    suite.write_text(PP_SUITE)
    cases = load_suite(str(suite)).cases
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    scripts = {}
    for case in cases:
        args, why = plan({"case": case.to_dict(), "device": {"type": "cpu"}})
        assert why is None, why
        out = tmp_path / f"{case.strategy}.json"
        log = open(tmp_path / f"{case.strategy}.log", "w")
        rendezvous = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        ranks = [
            subprocess.Popen(
                [sys.executable, *args, f"--out={out}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**env, **rendezvous, "RANK": str(r), "LOCAL_RANK": str(r)},
            )
            for r in range(2)
        ]
        scripts[case.strategy] = (ranks, log, out)
    try:
        proc = parabench("run", "suite", suite, "--out", tmp_path / "res", "--run-id", "t", "--no-report")
    finally:
        for ranks, log, _ in scripts.values():
            for p in ranks:
                try:
                    p.wait(timeout=180)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            log.close()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_dir = tmp_path / "res" / "pp-fidelity-test" / "t"
    for case in cases:
        ranks, _, out = scripts[case.strategy]
        rcs = [p.returncode for p in ranks]
        assert rcs == [0, 0] and out.exists(), (tmp_path / f"{case.strategy}.log").read_text()[-3000:]
        result = json.loads(out.read_text())
        record = json.loads((run_dir / "cases" / f"{case.case_hash}.json").read_text())
        config = result["config"]
        # The adapter's split: 8 blocks over 2 (1F1B) or 2 x 2 (interleaved) stages.
        assert config["pp"] == 2 and config["microbatches"] == 4 and config["recipe"] == "master"
        assert config["virtual_stages"] == (2 if case.strategy == "torch.pp_interleaved" else 1)
        n = case.warmup + case.steps
        # Same stages, schedule, weights and data: on CPU the script retraces the adapter exactly.
        assert result["losses"] == record["metrics"]["losses"][:n], case.strategy
    configs = {c.strategy: json.loads((tmp_path / f"{c.strategy}.json").read_text())["config"] for c in cases}
    assert configs["torch.pp_1f1b"]["schedule"] == "Schedule1F1B"
    assert configs["torch.pp_interleaved"]["schedule"] == "ScheduleInterleaved1F1B"
    # torchtitan's split (embeddings and head weigh one layer each), the adapter's even one beside it
    assert configs["torch.pp_interleaved"]["stage_layers"] == {"0": [0, 2], "1": [2, 5], "2": [5, 7], "3": [7, 8]}
    choices = json.loads((tmp_path / "torch.pp_interleaved.json").read_text())["choices"]
    assert choices["stage_layers"]["case"] == [[0, 2], [2, 4], [4, 6], [6, 8]]


def test_pipeline_script_knows_the_adapters_even_split():
    from reference_impls.pipeline import partition_layers

    sys.path.insert(0, str(SCRIPTS_DIR))
    try:
        import torch_pipeline
    finally:
        sys.path.remove(str(SCRIPTS_DIR))
    for n_layer in (2, 7, 8, 24, 30):
        for n_stages in range(1, min(n_layer, 8) + 1):
            assert torch_pipeline.even_split(n_layer, n_stages) == partition_layers(n_layer, n_stages)


def test_plan_passes_the_pipeline_options_and_refuses_what_the_script_cannot_run():
    def record(strategy="torch.pp_1f1b", world_size=2, **options):
        case = dict(strategy=strategy, model="tiny-deep", world_size=world_size, precision="bf16",
                    recipe="bf16-master", micro_batch=8, grad_accum=1, steps=2, warmup=1, seed=1, lr=1e-3,
                    options={"pp": 2, **options})  # fmt: skip
        return {"case": case, "device": {"type": "cpu"}}

    args, why = plan(record())
    assert why is None and args[1:3] == ["--schedule", "1f1b"]
    assert {"--microbatches=4", "--virtual-stages=1", "--recipe=master"} <= set(args)  # 2 * pp by default
    args = plan(record("torch.pp_interleaved", microbatches=8))[0]
    assert {"--schedule", "interleaved", "--microbatches=8", "--virtual-stages=2"} <= set(args)
    assert "--virtual-stages=3" in plan(record("torch.pp_interleaved", microbatches=8, virtual_stages=3))[0]
    # ZB-H1, GPipe: one stage per rank whatever virtual_stages says (the adapter ignores it there).
    assert "--virtual-stages=1" in plan(record("torch.pp_zb", virtual_stages=2))[0]
    assert "--schedule" in plan(record("torch.pp_gpipe"))[0]
    assert "whole world" in plan(record(world_size=4))[1]  # pp 2 x dp 2
    assert "does not take: sp" in plan(record(sp=True))[1]
    assert "does not take: schedule" in plan(record(schedule="gpipe"))[1]  # ref.tp's option
    assert "tensor parallelism" in plan(record(tp=2))[1]
    assert "gradient accumulation" in plan({**record(), "case": {**record()["case"], "grad_accum": 2}})[1]
    # The pipeline options belong to the pipeline script only.
    assert "does not take: microbatches, pp" in plan(record("torch.ddp", microbatches=4))[1]


def test_a_ratio_between_hosts_apart_in_speed_is_not_judged():
    """results/h200x1/20261129-075224: the adapters ran on one H200 machine (host probe 9-12 µs per
    dispatch), the scripts later on another (6.8-8.5 µs). Host-bound cases follow the host: their
    speed ratio is not judged, their memory still is; the same pair on one host is judged."""
    run = ROOT / "results" / "h200x1" / "20261129-075224"
    records = [json.loads(p.read_text()) for p in sorted((run / "cases").glob("*.json"))]
    by_hash = {r["case_hash"]: r for r in combine_launches(records)}
    verdicts = {}
    for path in sorted((run / "fidelity").glob("*.json")):
        record, entry = by_hash[path.stem], json.loads(path.read_text())
        r = ratios(record, entry)
        assert r["adapter_dispatch_us"] > 1.15 * r["script_dispatch_us"], record["label"]
        verdicts[record["label"]] = r["verdict"]
        # The same script launches, their host probe set to the adapter's: judged on tokens/s again.
        same_host = {
            **entry,
            "launches": [
                {
                    **x,
                    "result": {**x["result"], "host_per_rank": [{"dispatch_us": {"before": r["adapter_dispatch_us"]}}]},
                }
                for x in entry["launches"]
            ],
        }
        assert ratios(record, same_host)["verdict"] in ("pass", "fail")
    assert len(verdicts) == 4 and set(verdicts.values()) == {"speed not judged (hosts apart)"}
    line = fidelity_line({**by_hash[path.stem]}, json.loads(path.read_text()))
    assert "host dispatch µs adapter/script" in line and line.endswith("speed not judged (hosts apart)")


def test_one_machine_is_judged_on_speed_whatever_its_probe_and_two_machines_are_not():
    """results/studies/peer-fidelity-fused-h200x1/20261129-102919: DeepSpeed ZeRO-3 gpt-350m, adapter
    and script alternating on one H200 machine, whose single-core speed moved between launches (host
    probe medians 10.0 / 7.0 µs). Those records predate the boot id, so the probe guard holds the
    speed back; with both sides' boot ids equal the ratio is judged, and with different ones it is
    not, whatever the probes say."""
    run = ROOT / "results" / "studies" / "peer-fidelity-fused-h200x1" / "20261129-102919"
    records = [json.loads(p.read_text()) for p in sorted((run / "cases").glob("*.json"))]
    by_hash = {r["case_hash"]: r for r in combine_launches(records)}
    entry = json.loads((run / "fidelity" / "417a41e6fd166e80.json").read_text())
    record = by_hash["417a41e6fd166e80"]
    before = ratios(record, entry)
    assert before["verdict"] == "speed not judged (hosts apart)" and before["same_machine"] is None

    def on(adapter_boot: str, script_boot: str) -> dict:
        rec = {**record, "launches": [{**row, "boot_ids": [adapter_boot]} for row in record["launches"]]}
        ent = {
            **entry,
            "launches": [
                {
                    **x,
                    "result": {
                        **x["result"],
                        "host_per_rank": [{**h, "boot_id": script_boot} for h in x["result"]["host_per_rank"]],
                    },
                }
                for x in entry["launches"]
            ],
        }
        return ratios(rec, ent)

    same = on("machine-a", "machine-a")
    assert same["same_machine"] is True and same["verdict"] == "pass"  # 0.952x, peak 1.000x
    assert round(same["tps_ratio"], 3) == 0.952
    apart = on("machine-a", "machine-b")
    assert apart["same_machine"] is False and apart["verdict"] == "speed not judged (hosts apart)"
