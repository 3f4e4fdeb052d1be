"""The DeepSpeed fidelity scripts, without launching them: every DeepSpeed peer has one, the arguments
``parabench.fidelity.plan`` builds from a case parse in its script, and the tuned profile writes the
keys the tuned adapter writes. (Launches under torchrun: tests/test_fidelity.py.)"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from parabench.fidelity import NO_SCRIPT, PEER_SCRIPTS, SCRIPTS_DIR, plan
from parabench.registry import STRATEGIES

DEEPSPEED_PEERS = sorted(n for n, row in STRATEGIES.items() if n.startswith("deepspeed.") and row.kind == "peer")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), SCRIPTS_DIR / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(strategy: str, model: str = "tiny", **options) -> dict:
    case = dict(strategy=strategy, model=model, world_size=2, precision="bf16", micro_batch=4, grad_accum=1,
                steps=2, warmup=1, seed=1, lr=1e-3, options={"profile": "tuned", **options})  # fmt: skip
    if strategy == "deepspeed.ulysses":
        del case["options"]["profile"]  # no profiles: the adapter has one configuration
    return {"case": case, "device": {"type": "cpu"}}


def test_every_deepspeed_peer_has_a_script_that_imports_no_parabench():
    # ZeRO-Infinity alone goes without (NO_SCRIPT says why): its speed is the drive's
    assert set(DEEPSPEED_PEERS) - set(PEER_SCRIPTS) == {"deepspeed.zero3_nvme"} <= set(NO_SCRIPT)
    for name in set(DEEPSPEED_PEERS) - set(NO_SCRIPT):
        path = SCRIPTS_DIR / PEER_SCRIPTS[name].script
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        roots = {n.split(".")[0] for n in names}
        assert not roots & {"parabench", "reference_impls"}, f"{path.name} imports {sorted(names)}"
        assert roots & {"deepspeed"}, f"{path.name} does not use DeepSpeed"


@pytest.mark.parametrize(
    "strategy, model, options, expected",
    [
        ("deepspeed.zero0", "tiny", {}, {"stage": 0, "profile": "tuned", "layout": "separate"}),
        ("deepspeed.zero2_offload", "tiny", {}, {"stage": 2, "offload_optimizer": "cpu"}),
        (
            "deepspeed.zeropp",
            "tiny",
            {"hpz": True, "qgz": True},
            {
                "stage": 3,
                "zero_hpz_partition_size": 2,
                "zero_quantized_gradients": True,
                "zero_quantized_weights": False,
            },
        ),
        ("deepspeed.pp", "tiny", {"pp": 2, "microbatches": 2}, {"microbatches": 2, "profile": "tuned"}),
        ("deepspeed.ulysses", "tiny", {"cp": 2}, {"recipe": "amp", "micro_batch": 4}),
        (
            "deepspeed.moe",
            "tiny-moe-cap1",
            {"min_capacity": 3},
            {"n_experts": 4, "top_k": 2, "moe_every": 2, "capacity_factor": 1.0, "min_capacity": 3},
        ),
    ],
)
def test_plan_arguments_parse_in_the_peer_script(strategy, model, options, expected):
    args, why = plan(_record(strategy, model, **options))
    assert why is None, why
    parsed = _script(Path(args[0]).name).parse_args(args[1:])
    assert {k: getattr(parsed, k) for k in expected} == expected


def test_plan_refuses_what_the_deepspeed_scripts_cannot_run():
    assert "MoE GPT" in plan(_record("deepspeed.moe", "tiny"))[1]
    assert "balanced routing" in plan(_record("deepspeed.moe", "tiny-moe-bal"))[1]
    assert "stage_layers" in plan(_record("deepspeed.pp", pp=2, stage_layers=[1, 1]))[1]
    assert "whole world" in plan(_record("deepspeed.pp", pp=1))[1]


@pytest.mark.parametrize("stage, offload", [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_tuned_script_config_writes_the_tuned_adapter_keys(stage, offload, precision):
    """The keys that make ``tuned`` tuned (timer, overlap, gradient norm, overflow check, no clipping)
    are the adapter's on the script's side too; ``defaults`` writes none of them."""
    import argparse

    from parabench.models import model_config
    from parabench.peers.deepspeed_zero import ds_config as adapter_config
    from parabench.topology import Topology
    from parabench.trainer import TrainSpec

    spec = TrainSpec(model_config("tiny"), 1, torch.device("cuda"), precision, Topology(2, 0, dp=2), 4,
                     recipe="master" if precision == "bf16" else None)  # fmt: skip
    adapter = adapter_config(spec, stage, offload, profile="tuned")
    ns = dict(micro_batch=4, lr=1e-3, precision=precision, stage=stage, offload_optimizer="cpu" if offload else "none")
    script = _script("deepspeed_zero.py").ds_config(argparse.Namespace(**ns, profile="tuned"), cuda=True)
    keys = ("timers", "bf16", "gradient_clipping")

    def tuned(cfg: dict) -> dict:
        return {**{k: cfg.get(k) for k in keys}, "bf16": cfg.get("bf16") or {"enabled": False}}

    assert tuned(script) == tuned(adapter)
    assert script["zero_optimization"] == adapter["zero_optimization"]
    defaults = _script("deepspeed_zero.py").ds_config(argparse.Namespace(**ns, profile="defaults"), cuda=True)
    assert "timers" not in defaults and "overlap_comm" not in defaults["zero_optimization"]
    if stage == 0:  # the pipeline's and MoE's engines run stage 0 with the same keys
        for name in ("deepspeed_pipe.py", "deepspeed_moe.py"):
            other = _script(name)
            args = argparse.Namespace(micro_batch=4, lr=1e-3, precision=precision, profile="tuned")
            cfg = other.ds_config(args, True, 2) if name == "deepspeed_pipe.py" else other.ds_config(args, True)
            assert tuned(cfg) == tuned(adapter), name
