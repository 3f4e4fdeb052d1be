"""Peer profiles (option ``profile``): ``tuned`` (the default, each library's documented best
practice) and ``matched`` (aligned with the references). Both train the same model to the same fp32
losses as one process, both move the bytes their theory says, the profile is in every case's hash
and label, and an unknown profile is refused. CPU, gloo, 2 ranks, the tiny model."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
from harness import max_rel_diff, params_close, run_cases

from parabench.case import Case
from parabench.cli import main
from parabench.metrics import check_against_theory
from parabench.models import model_config
from parabench.registry import expected
from parabench.suite import SuiteError, validate_case

os.environ.setdefault("DS_ACCELERATOR", "cpu")
N_STEPS = 4
TUNED = ["torch.ddp", "torch.fsdp2", "deepspeed.zero1", "deepspeed.zero2", "deepspeed.zero3"]
# matched is the configuration tests/test_peers.py checked before profiles existed; its traffic
# differs from tuned only where these two change what moves.
MATCHED = ["torch.fsdp2", "deepspeed.zero3"]


def mk(strategy: str, profile: str | None, grad_accum: int = 1) -> Case:
    options = {"profile": profile} if profile else {}
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=2,
        micro_batch=2 // grad_accum,
        grad_accum=grad_accum,
        lr=1e-3,
        options=options,
    )


CASES = {f"{s}/tuned": mk(s, None) for s in TUNED}
CASES |= {f"{s}/matched": mk(s, "matched") for s in MATCHED}
CASES |= {f"{s}/tuned/ga2": mk(s, None, grad_accum=2) for s in ("torch.fsdp2", "deepspeed.zero3")}
# every block, and the root, kept gathered from forward to backward: one all-gather per micro-batch
for ga in (1, 2):
    CASES[f"torch.fsdp2/tuned/no-reshard/ga{ga}"] = dataclasses.replace(
        mk("torch.fsdp2", None, grad_accum=ga), options={"profile": "tuned", "reshard_after_forward": False}
    )
# AdamW named in DeepSpeed's engine config instead of a client optimizer (option optimizer_in_config)
CASES["deepspeed.zero3/tuned/config-optimizer"] = dataclasses.replace(
    mk("deepspeed.zero3", None), options={"profile": "tuned", "optimizer_in_config": True}
)


@pytest.fixture(scope="module")
def group():
    """Every case in one process group; the last step under the meter, with the trainer's stats."""
    return run_cases(
        2,
        CASES,
        N_STEPS,
        with_truth=True,
        meter_steps=(N_STEPS - 1,),
        on_end=_stats,
    )


def _stats(trainer, case, record):
    record["strategy_stats"] = trainer.strategy_stats()


@pytest.mark.parametrize("name", list(CASES))
def test_profile_matches_single_process_fp32(group, name):
    res = group[name]
    losses = [sum(r["losses"][i] for r in res["per_rank"]) / 2 for i in range(N_STEPS)]  # each rank: its half
    assert max_rel_diff(losses, res["single"]["losses"]) < 1e-4
    assert params_close(res["params"], res["single"]["params"], rtol=1e-4, atol=1e-5) == []


@pytest.mark.parametrize("name", list(CASES))
def test_profile_traffic_matches_its_theory(group, name):
    case = CASES[name]
    theory = expected(case, model_config(case.model, case.seq_len), 2)
    per_rank = [
        {"rank": i, "comm": r["comm"], "state_bytes": r["state"]} for i, r in enumerate(group[name]["per_rank"])
    ]
    checks = check_against_theory(theory, per_rank)
    assert checks["comm_ok"] is True, checks["comm"]


def test_the_config_optimizer_is_the_one_deepspeed_built(group):
    stats = group["deepspeed.zero3/tuned/config-optimizer"]["per_rank"][0]["strategy_stats"]
    assert stats["optimizer"].startswith("engine config AdamW -> ")  # built by DeepSpeed, named as it ran
    client = group["deepspeed.zero3/tuned"]["per_rank"][0]["strategy_stats"]["optimizer"]
    assert client.startswith("torch.optim.AdamW")


def test_profile_is_in_the_case_hash_and_label():
    tuned, matched = mk("deepspeed.zero2", None), mk("deepspeed.zero2", "matched")
    assert tuned.options == {"profile": "tuned"}  # written into the case, so the record names it
    assert tuned.case_hash == mk("deepspeed.zero2", "tuned").case_hash != matched.case_hash
    assert tuned.label.endswith("[profile=tuned]") and matched.label.endswith("[profile=matched]")
    assert "profile" not in mk("ref.zero2", None).options  # references have no profile


def test_recheck_leaves_records_made_before_profiles_alone(tmp_path, capsys):
    """The committed 2-GPU run predates profiles (its peers ran today's matched configuration):
    its peer records are recognised as made by another version, never judged by the tuned theory."""
    run = tmp_path / "run"
    shutil.copytree(Path(__file__).resolve().parent.parent / "results" / "h100x2" / "20261126-025621", run)
    before = {p.name: p.read_text() for p in (run / "cases").glob("*.json")}
    assert main(["recheck", str(run), "--strategy", "deepspeed.*", "--strategy", "torch.fsdp2"]) == 0
    out = capsys.readouterr().out
    assert "skipped: deepspeed.zero3 gpt-1.3b" in out and "skipped: torch.fsdp2 gpt-1.3b" in out
    assert "not rechecked" in out
    assert {p.name: p.read_text() for p in (run / "cases").glob("*.json")} == before


@pytest.mark.parametrize("strategy", ["torch.ddp", "torch.fsdp2", "deepspeed.zero0", "deepspeed.zero3_offload"])
def test_unknown_profile_is_refused_naming_both(strategy):
    with pytest.raises(SuiteError, match=r"option profile must be 'tuned' \| 'matched', got 'fast'"):
        validate_case(mk(strategy, "fast"))
    with pytest.raises(SuiteError, match="unknown option 'profile'"):
        validate_case(Case(model="tiny", strategy="ref.zero2", world_size=2, options={"profile": "tuned"}))


def test_deepspeed_zero3_working_set_is_what_its_reuse_distance_keeps_gathered():
    """Tuned (DeepSpeed's defaults): up to 1e9 elements stay gathered from forward into backward,
    the whole of gpt-350m (its measured all-gather: every parameter once) and 1e9 of gpt-1.3b's
    1.42e9 (measured: 30 % gathered again); matched (reuse distance 0): none; a given
    ``stage3_max_reuse_distance`` or ``stage3_max_live_parameters`` bounds it."""
    from parabench.theory import psi

    def ws(model, **options):
        case = Case(
            model=model, strategy="deepspeed.zero3", world_size=2, micro_batch=4, precision="bf16", options=options
        )
        return expected(case, model_config(model), 2).get("working_set_bytes")

    small, large = model_config("gpt-350m"), model_config("gpt-1.3b")
    assert ws("gpt-350m", profile="tuned") == {"kept_gathered_params": 2 * psi(small)}
    assert ws("gpt-1.3b", profile="tuned") == {"kept_gathered_params": 2 * 10**9} and psi(large) > 10**9
    assert ws("gpt-1.3b", profile="matched") is None
    assert ws("gpt-1.3b", profile="tuned", zero={"stage3_max_live_parameters": 10**8}) == {
        "kept_gathered_params": 2 * 10**8
    }
    assert ws("gpt-1.3b", profile="tuned", zero={"stage3_max_reuse_distance": 0}) is None
