"""README's "Adding a strategy", followed verbatim: the snippet it shows (docs/examples/add_strategy.py)
registers a strategy that trains on two gloo ranks with its state and communication checks true in
fp32 and bf16, that the planner prices and that the report pairs with its peer. And a failed state
check shows on the console row and fails a ``--strict`` run."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from harness import run_cases

ROOT = Path(__file__).resolve().parents[1]
SNIPPET = ROOT / "docs" / "examples" / "add_strategy.py"
# The spawned ranks import this module to unpickle its hook, and with it the snippet: the strategy
# is registered there as in the test process.
sys.path.insert(0, str(SNIPPET.parent))
import add_strategy  # noqa: E402

from parabench.case import Case  # noqa: E402
from parabench.metrics import check_against_theory  # noqa: E402
from parabench.record import theory_for  # noqa: E402
from parabench.registry import STRATEGIES  # noqa: E402

NAME = "ref.ddp_flat"
N_STEPS = 3
CASES = {
    precision: Case(
        model="tiny",
        strategy=NAME,
        world_size=2,
        precision=precision,
        micro_batch=2,
        lr=1e-3,
        device="cpu",
    )
    for precision in ("fp32", "bf16")
}


def _state_and_stats(trainer, case, record):
    record["strategy_stats"] = trainer.strategy_stats()


@pytest.fixture(scope="module")
def group():
    """Both cases on two ranks; the last step metered and its state sampled, as the worker does."""
    return run_cases(
        2, CASES, N_STEPS, meter_steps=(N_STEPS - 1,), measure_state_from=N_STEPS - 1, on_end=_state_and_stats
    )


def test_the_snippet_registers_its_row():
    row = STRATEGIES[NAME]
    assert row.builder == f"{add_strategy.__name__}:build_flat_ddp"
    assert row.recipes_for("bf16")[0] == "master"  # bf16 trains with fp32 masters by default


@pytest.mark.parametrize("precision", list(CASES))
def test_it_runs_with_its_state_and_traffic_as_its_theory_says(group, precision):
    case = CASES[precision]
    res = group[precision]
    losses = [r["losses"] for r in res["per_rank"]]
    assert all(len(steps) == N_STEPS and all(loss is not None for loss in steps) for steps in losses)
    per_rank = [
        {"rank": i, "comm": r["comm"], "state_bytes": r["state"], "strategy_stats": r["strategy_stats"]}
        for i, r in enumerate(res["per_rank"])
    ]
    checks = check_against_theory(theory_for(case, per_rank), per_rank)
    assert checks["state_ok"] is True, checks["state"]
    assert checks["comm_ok"] is True, checks["comm"]


def test_the_planner_prices_it():
    from parabench.plan import calibrate as C
    from parabench.plan import model as M
    from parabench.plan import search as S
    from parabench.shapes import model_config

    cal = C.load_kind("h100")
    cfg = model_config("gpt-125m")
    priced = S.evaluate(S.Candidate(NAME, 2, 4, 1, {}, "master"), "gpt-125m", cfg, cal, 80 * M.GIB)
    assert priced.dropped is None and priced.prediction.step_s > 0 and priced.prediction.peak_bytes > 0
    # without the row's planner facts the same strategy is not priced
    unmodelled = S.evaluate(S.Candidate("ref.cp_ring", 2, 4, 1, {}, "amp"), "gpt-125m", cfg, cal, 80 * M.GIB)
    assert unmodelled.dropped == "not modelled by the planner"


def test_the_report_pairs_it_with_its_peer():
    from parabench.report.spread import is_peer

    assert is_peer(NAME, "torch.ddp")
    assert not is_peer(NAME, "torch.fsdp2") and not is_peer("torch.ddp", NAME)


def test_the_readme_shows_the_snippet_verbatim():
    readme = (ROOT / "README.md").read_text()
    found = re.search(
        r"<!-- add-strategy snippet -->\n```python\n(.*?)```\n<!-- /add-strategy snippet -->", readme, re.S
    )
    assert found, "README.md lacks the add-strategy snippet between its markers"
    assert found.group(1) == SNIPPET.read_text()


def _ok_record(**checks) -> dict:
    return {
        "status": "ok",
        "label": "ref.ddp_flat tiny w2 bf16-master mb2",
        "duration_s": 1.0,
        "checks": {"ok": all(v is not False for v in checks.values()), **checks},
        "metrics": {
            "tokens_per_s_per_device": 1000.0,
            "step_time_s_median": 0.01,
            "peak_alloc_bytes": 2**20,
            "final_loss": 4.0,
        },
    }


def test_a_failed_state_check_shows_on_the_row_and_fails_a_strict_run():
    from parabench.cli import run_exit_status
    from parabench.runner import OFF_THEORY, _row, off_theory

    bad = _ok_record(comm_ok=True, state_ok=False)
    assert "comm=theory" in _row(bad) and "state!=theory" in _row(bad)
    good = _ok_record(comm_ok=True, state_ok=True)
    assert "!=theory" not in _row(good)
    assert off_theory(bad) and not off_theory(good)
    assert run_exit_status({"ok": 1, OFF_THEORY: 1}, strict=True) == 1
    assert run_exit_status({"ok": 1, OFF_THEORY: 1}, strict=False) == 0
    assert run_exit_status({"ok": 1}, strict=True) == 0
