"""The peers (PyTorch DDP/FSDP2, DeepSpeed ZeRO-0..3) train the same model to the same losses as
one process on the same global batch: fp32, 2 gloo ranks, 1e-4 relative at every step."""

import os

import pytest
from helpers import max_rel_diff, params_close, single_reference, train

from parabench.case import Case

os.environ.setdefault("DS_ACCELERATOR", "cpu")
PEERS = ["torch.ddp", "torch.fsdp2", "deepspeed.zero0", "deepspeed.zero1", "deepspeed.zero2", "deepspeed.zero3"]


@pytest.fixture(scope="module")
def reference():
    return single_reference(Case(model="tiny", strategy="torch.ddp", world_size=2, micro_batch=2, lr=1e-3), n_steps=5)


@pytest.mark.parametrize("strategy", PEERS)
def test_peer_matches_single_process(strategy, reference):
    run = train(Case(model="tiny", strategy=strategy, world_size=2, micro_batch=2, lr=1e-3), n_steps=5)
    assert max_rel_diff(run["losses"], reference["losses"]) < 1e-4
    assert reference["losses"][-1] < reference["losses"][0]  # the data is learnable
    assert params_close(run["params"], reference["params"], rtol=1e-4, atol=1e-5) == []


def test_grad_accumulation_matches_single_process():
    case = Case(model="tiny", strategy="torch.ddp", world_size=2, micro_batch=1, grad_accum=2, lr=1e-3)
    ref = single_reference(case, n_steps=4)
    for strategy in ("torch.ddp", "deepspeed.zero2"):
        run = train(Case(**{**case.to_dict(), "strategy": strategy}), n_steps=4)
        assert max_rel_diff(run["losses"], ref["losses"]) < 1e-4, strategy


def test_wrong_learning_rate_is_caught(reference):
    """The equivalence check has teeth: a peer trained differently does not pass it."""
    run = train(Case(model="tiny", strategy="torch.ddp", world_size=2, micro_batch=2, lr=1.1e-3), n_steps=5)
    assert max_rel_diff(run["losses"], reference["losses"]) > 1e-4
