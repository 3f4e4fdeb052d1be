"""ref.ps_async, the bounded-delay parameter server: no gradient it averages is staler than its bound, the
staleness is real when the bound allows it, with the bound at 0 it is the synchronous ref.ps bit for bit,
and at equal samples its loss stays beside the synchronous server's. CPU, gloo, tiny model, three ranks
(a server and two workers) in one spawned group."""

from __future__ import annotations

import pytest
import torch
from harness import run_cases

from parabench.case import Case

N_STEPS = 6
WORLD = 3
BOUND = 2


def mk(strategy, **options):
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=WORLD,
        micro_batch=2,
        lr=1e-3,
        device="cpu",
        options={"optim": {"eps": 1e-6}, **options},
    )


CASES = {
    "sync": mk("ref.ps"),
    "async0": mk("ref.ps_async", max_staleness=0),
    "async": mk("ref.ps_async", max_staleness=BOUND),
}


def _stats(trainer, case, record):
    record["strategy_stats"] = trainer.strategy_stats()


@pytest.fixture(scope="module")
def runs():
    return run_cases(WORLD, CASES, N_STEPS, on_end=_stats, params_on_every_rank=True)


def test_no_gradient_is_staler_than_the_bound_and_some_are_stale(runs):
    server = runs["async"]["per_rank"][0]["strategy_stats"]
    counts = {int(k): v for k, v in server["staleness_counts"].items()}
    assert server["role"] == "server" and server["max_staleness_bound"] == BOUND
    assert sum(counts.values()) == N_STEPS * WORLD  # every rank's gradient of every step, once
    assert max(counts) <= BOUND, counts
    # a worker starts its next batch before the update its gradient went into comes back
    assert server["staleness_max"] >= 1, counts
    workers = [r["strategy_stats"] for r in runs["async"]["per_rank"][1:]]
    assert sum(sum(w["staleness_counts"].values()) for w in workers) == N_STEPS * (WORLD - 1)


def test_bound_zero_is_the_synchronous_server_exactly(runs):
    sync, async0 = runs["sync"], runs["async0"]
    assert async0["per_rank"][0]["strategy_stats"]["staleness_counts"] == {"0": N_STEPS * WORLD}
    for a, b in zip(sync["per_rank"], async0["per_rank"]):
        assert a["losses"] == b["losses"]
    for name, p in sync["params"].items():
        assert torch.equal(p, async0["params"][name]), name


def test_every_rank_ends_on_the_servers_parameters(runs):
    """After the drain every worker holds the server's final parameters, though it trained on older ones."""
    server, *workers = [r["params"] for r in runs["async"]["per_rank"]]
    for w in workers:
        for name, p in server.items():
            assert torch.equal(p, w[name]), name


def test_stale_loss_stays_beside_the_synchronous_loss_at_equal_samples(runs):
    sync = runs["sync"]["per_rank"][0]["losses"]
    stale = runs["async"]["per_rank"][0]["losses"]
    assert sync[0] == stale[0]  # the first batch sees W_0 on every rank either way
    assert abs(stale[-1] - sync[-1]) / sync[-1] < 0.02, (sync, stale)
    assert stale[-1] < stale[0]
