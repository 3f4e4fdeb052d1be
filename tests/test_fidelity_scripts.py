"""Cheap checks of the peer-fidelity scripts, without launching one: every library peer has a script
or a stated reason, every script takes the flags the runner passes it, torchtitan's pipeline split,
the window figures and the report's recipe differences. The launches are in tests/test_fidelity.py."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from parabench.fidelity import NO_SCRIPT, PEER_SCRIPTS, SCRIPTS_DIR, plan
from parabench.metrics import window_summary
from parabench.registry import STRATEGIES
from parabench.report.fidelity import choices_text, ratios


def _flags(path: Path) -> set[str]:
    """The ``--flags`` of every ``add_argument`` call in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            out |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return out


SHARED_FLAGS = _flags(SCRIPTS_DIR / "_gpt.py")


def _functions(path: Path, *names: str) -> SimpleNamespace:
    """Pure-python functions of a script, compiled from its source alone: importing the script
    would import torch's pipelining package, seconds of start-up for arithmetic."""
    tree = ast.parse(path.read_text())
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {d.name for d in defs} == set(names)
    scope: dict = {}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(path), "exec"), scope)
    return SimpleNamespace(**{n: scope[n] for n in names})


def test_every_library_peer_has_a_script_or_a_stated_reason():
    peers = {name for name, spec in STRATEGIES.items() if spec.kind == "peer"}
    assert peers - set(PEER_SCRIPTS) - set(NO_SCRIPT) == set(), "a peer with neither a script nor a reason"
    assert set(PEER_SCRIPTS) & set(NO_SCRIPT) == set()
    assert (set(PEER_SCRIPTS) | set(NO_SCRIPT)) - peers == set(), "a name that is no library peer"
    assert all(len(reason.split()) >= 6 for reason in NO_SCRIPT.values())


def test_every_script_exists_and_takes_the_flags_registered_for_it():
    for name, peer in PEER_SCRIPTS.items():
        path = SCRIPTS_DIR / peer.script
        assert path.is_file(), name
        flags = _flags(path) | SHARED_FLAGS
        assert {a.split("=")[0] for a in peer.extra_args if a.startswith("--")} <= flags, name


def _record(strategy: str, world_size: int = 2, device: str = "cpu", **options) -> dict:
    case = dict(strategy=strategy, model="tiny", world_size=world_size, precision="bf16", micro_batch=2,
                grad_accum=1, steps=2, warmup=1, seed=1, lr=1e-3, options=options)  # fmt: skip
    case["recipe"] = STRATEGIES[strategy].recipes[0]
    return {"case": case, "device": {"type": device}}


TORCH_CASES = {
    "torch.ddp": _record("torch.ddp"),
    "torch.fsdp2": _record("torch.fsdp2", compile=True),
    "torch.fsdp2_offload": _record("torch.fsdp2_offload"),
    "torch.hsdp": _record("torch.hsdp", world_size=4, shard_size=2),
    "torch.tp": _record("torch.tp", tp=2),
    "torch.tp_sp": _record("torch.tp_sp", tp=2),
    "torch.cp": _record("torch.cp", device="cuda", cp=2),
    **{f"torch.pp_{s}": _record(f"torch.pp_{s}", pp=2, microbatches=2) for s in ("gpipe", "1f1b", "interleaved", "zb")},
}


@pytest.mark.parametrize("strategy", sorted(TORCH_CASES))
def test_plan_gives_each_torch_peer_flags_its_script_parses(strategy):
    args, why = plan(TORCH_CASES[strategy])
    assert why is None, why
    script = Path(args[0])
    assert script.parent == SCRIPTS_DIR and script.name == PEER_SCRIPTS[strategy].script
    flags = _flags(script) | SHARED_FLAGS
    assert {a.split("=")[0] for a in args[1:] if a.startswith("--")} <= flags
    expected = {
        "torch.hsdp": "--shard-size=2",
        "torch.tp_sp": "--sequence-parallel",
        "torch.fsdp2_offload": "--cpu-offload",
        "torch.fsdp2": "--compile",
        "torch.cp": "--device=cuda",
    }.get(strategy)
    assert expected is None or expected in args


def test_plan_refuses_an_hsdp_shard_size_that_does_not_divide_the_world():
    assert "shard" in plan(_record("torch.hsdp", world_size=4, shard_size=3))[1]


def test_pipeline_script_splits_as_torchtitan_counting_embeddings_and_head_as_layers():
    torch_pipeline = _functions(SCRIPTS_DIR / "torch_pipeline.py", "torchtitan_split", "even_split")
    # torchtitan's _generate_llm_fqn_per_model_part(4, 24): 26 effective layers, 7 7 6 6
    assert torch_pipeline.torchtitan_split(24, 4) == [(0, 6), (6, 13), (13, 19), (19, 24)]
    assert torch_pipeline.torchtitan_split(8, 2) == [(0, 4), (4, 8)]
    assert torch_pipeline.even_split(24, 4) == [(0, 6), (6, 12), (12, 18), (18, 24)]
    for n_layer in (2, 5, 8, 30):
        for n_stages in (1, 2, 4):
            try:
                bounds = torch_pipeline.torchtitan_split(n_layer, n_stages)
            except ValueError:
                continue
            assert bounds[0][0] == 0 and bounds[-1][1] == n_layer
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    with pytest.raises(ValueError):
        torch_pipeline.torchtitan_split(2, 8)


def test_window_metrics_take_the_slowest_rank_and_need_every_rank():
    got = window_summary([{"timed_window_s": 2.0}, {"timed_window_s": 4.0}], timed_tokens=800, world=2)
    assert got == {"timed_window_s_max": 4.0, "window_tokens_per_s": 200.0, "window_tokens_per_s_per_device": 100.0}
    assert window_summary([{"timed_window_s": 2.0}, {}], 800, 2)["window_tokens_per_s"] is None


def test_report_sets_the_windows_beside_each_other_and_names_the_recipe_differences():
    record = {"metrics": {"tokens_per_s_per_device": 100.0, "window_tokens_per_s_per_device": 60.0}}
    choice = {"script": "torchtitan's groups", "case": "blocks only", "source": "apply_fsdp"}
    entry = {
        "result": {
            "tokens_per_s_per_device": 100.0,
            "window_tokens_per_s_per_device": 80.0,
            "choices": {"fsdp_groups": choice},
        }
    }
    r = ratios(record, entry)
    assert r["tps_ratio"] == 1.0 and r["window_ratio"] == pytest.approx(0.75)
    text = choices_text(entry["result"])
    assert "fsdp_groups" in text and "torchtitan's groups" in text and "blocks only" in text
    assert choices_text({}) == ""
