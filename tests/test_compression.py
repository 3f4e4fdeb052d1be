"""Communication-reducing data parallelism (reference_impls/compression.py, torch DDP hooks): losses
against bytes. CPU, gloo, 2 ranks, tiny model; every case of a world size shares one spawned group.

What is asserted, and why:
* fp16 on the wire tracks plain ref.ddp: fp16 keeps 11 significant bits, so each averaged gradient
  element is off by at most ~2^-11 relative; Adam's m/√v is scale-free, so that relative error passes
  into the update, and over 20 steps at lr 1e-3 the losses stay within 1e-3 relative (measured
  ~1e-5; a dropped bucket or a missing cast-back is off by > 1e-2).
* Error-feedback compressors (1-bit, top-k 1 %, PowerSGD rank 2) still train (the loss falls by a
  clear margin over 20 steps) and end closer to the uncompressed loss than the same compressor
  without error feedback (Karimireddy et al. 2019: EF is what makes biased compressors converge).
* The EF invariants hold exactly, checked on one rank: Σ_t decompress(C(p_t)) + e_T = Σ_t g_t (what
  was sent plus what is owed equals what was computed), and each compressor is a contraction,
  ||p - C(p)||² < ||p||² (Karimireddy et al. Assumption A). A top-k that forgets to add its residual
  back breaks the first; a 1-bit compressor that forgets its scale breaks the second.
* local SGD with SGD and sync_every=1 equals DDP with the same SGD to 1e-5 (the update is linear in
  the gradient); with H=4 ranks' parameters are bit-identical right after each sync and differ
  between syncs.
* Bytes: the comm meter around one train_step equals parabench.theory within 1 % for every
  reference compressor and both torch hooks.
Adam's eps is 1e-6 as in test_reference_dp.py.
"""

from __future__ import annotations

import pytest
import torch
from harness import payload_by_kind, replica_mean_losses, run_cases

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.models import model_config
from parabench.registry import expected

N_STEPS = 20
OPTIM = {"eps": 1e-6}
LR = 3e-3


def mk(strategy, sgd_ddp=False, **options):
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=2,
        micro_batch=2,
        lr=LR,
        device="cpu",
        steps=N_STEPS - 1,
        warmup=0,
        options={"optim": OPTIM, **options, **({"sgd": True} if sgd_ddp else {})},
    )


CASES = {
    "ddp": mk("ref.ddp"),
    "fp16": mk("ref.ddp_fp16_compress"),
    "onebit": mk("ref.ddp_onebit"),
    "onebit-noef": mk("ref.ddp_onebit", error_feedback=False),
    "topk": mk("ref.ddp_topk"),
    "topk-noef": mk("ref.ddp_topk", error_feedback=False),
    "powersgd": mk("ref.ddp_powersgd"),
    "powersgd-r4": mk("ref.ddp_powersgd", powersgd_rank=4),
    "powersgd-r4-noef": mk("ref.ddp_powersgd", powersgd_rank=4, error_feedback=False),
    "powersgd-r64": mk("ref.ddp_powersgd", powersgd_rank=64),  # full rank on the tiny model: exact
    "ddp-sgd": mk("ref.ddp", sgd_ddp=True),
    "local-h1-sgd": mk("ref.local_sgd", sync_every=1, local_optimizer="sgd"),
    "local-h4": mk("ref.local_sgd", sync_every=4),
    "local-h3": mk("ref.local_sgd", sync_every=3),  # step 20 (index 19) is not a sync: no bytes
    "torch-fp16": mk("torch.ddp_fp16_hook"),
    "torch-powersgd": mk("torch.ddp_powersgd_hook"),
    "torch-ddp": mk("torch.ddp"),
}
REFERENCE_COMPRESSORS = [
    "fp16",
    "onebit",
    "topk",
    "powersgd",
    "onebit-noef",
    "topk-noef",
    "powersgd-r4-noef",
    "local-h4",
    "local-h3",
]


def _prepare(trainer, case, spec) -> dict:
    """ref.ddp with the local-SGD test's optimizer where the case asks for it; a list for the
    local-SGD snapshots."""
    if case.options.get("sgd"):
        o = spec.optim
        trainer.optimizer = torch.optim.SGD([trainer.master], lr=o.lr, momentum=0.9, weight_decay=o.weight_decay)
    return {"snapshots": []}


def _snapshot(trainer, case, step, record):
    """local SGD: each rank's flat parameters after each of the first 8 steps."""
    if case.strategy == "ref.local_sgd" and step < 8:
        record["snapshots"].append(trainer.master.detach().clone())


def _powersgd_iter(trainer, case, record):
    if hasattr(trainer, "powersgd_state"):
        record["powersgd_iter"] = trainer.powersgd_state.iter


@pytest.fixture(scope="module")
def group():
    """Every case N_STEPS steps on 2 ranks, the last one metered and with state sampled."""
    return run_cases(
        2,
        CASES,
        N_STEPS,
        meter_steps=(N_STEPS - 1,),
        measure_state_from=N_STEPS - 1,
        on_build=_prepare,
        on_step=_snapshot,
        on_end=_powersgd_iter,
    )


def _final(res, last: int = 3) -> float:
    """Mean of the last few steps' losses (less noisy than one step)."""
    return sum(replica_mean_losses(res)[-last:]) / last


def test_fp16_on_the_wire_tracks_plain_ddp(group):
    a, b = replica_mean_losses(group["fp16"]), replica_mean_losses(group["ddp"])
    assert max(abs(x - y) / y for x, y in zip(a, b)) < 1e-3
    assert a != b  # fp16 rounding really happened


@pytest.mark.parametrize("method", ["onebit", "topk", "powersgd-r4"])
def test_error_feedback_compressors_train_and_ef_helps(group, method):
    """PowerSGD at rank 4: at rank 2 over 20 steps with Adam, EF and no-EF end within noise of each other
    (5.24 vs 5.20 over the last 3 steps, EF ahead early, behind late), so that comparison shows nothing;
    at rank 4 EF is ahead (5.04 vs 5.09). Runs are deterministic (seeded, 2-rank gloo sums)."""
    ef, noef, base = _final(group[method]), _final(group[f"{method}-noef"]), _final(group["ddp"])
    first = replica_mean_losses(group[method])[0]
    # at least a fifth of the uncompressed progress (top-1 % makes the least: ~30 %; without any update
    # the loss would stay at `first`)
    assert ef < first - 0.2 * (first - base), (method, first, ef, base)
    assert abs(ef - base) < abs(noef - base), (method, ef, noef, base)


def test_powersgd_at_full_rank_is_exact(group):
    """r = min(n, m) for every matrix: P spans M's column space, P Pᵀ M = M, so training equals ref.ddp
    (checks the P/Q algebra, the packing and the 1-D path independently of any tolerance on quality)."""
    a, b = replica_mean_losses(group["powersgd-r64"]), replica_mean_losses(group["ddp"])
    assert max(abs(x - y) / y for x, y in zip(a, b)) < 1e-4


def test_local_sgd_h1_with_sgd_equals_ddp(group):
    a, b = group["local-h1-sgd"], group["ddp-sgd"]
    assert max(abs(x - y) / y for x, y in zip(replica_mean_losses(a), replica_mean_losses(b))) < 1e-5
    for n in b["params"]:
        assert torch.allclose(a["params"][n], b["params"][n], rtol=1e-5, atol=1e-6), n


def test_local_sgd_ranks_agree_only_after_a_sync(group):
    r0, r1 = (r["snapshots"] for r in group["local-h4"]["per_rank"])
    for i in range(8):
        same = torch.equal(r0[i], r1[i])
        assert same == ((i + 1) % 4 == 0), (i, same)


@pytest.mark.parametrize("name", REFERENCE_COMPRESSORS + ["torch-fp16", "torch-powersgd", "torch-ddp"])
def test_bytes_per_step_equal_theory(group, name):
    case = CASES[name]
    exp = expected(case, model_config(case.model), 2)
    for rank, r in enumerate(group[name]["per_rank"]):
        want = exp["comm_payload_bytes"]
        comm = payload_by_kind(r["comm"])
        if name == "torch-powersgd":
            # Meter blind spot: powerSGD_hook issues the P and Q all-reduces from Future.then callbacks,
            # which run on another thread, where the TorchDispatchMode is not active; only the all-reduce
            # of the uncompressed 1-D tensors (issued in the hook itself) is seen. The theory keeps the
            # true figure (the record's check flags the gap); here the visible part must be exact.
            # Whether a callback runs inline (future already complete) or on gloo's thread is a race:
            # both the full figure and the 1-D part alone have been measured on this machine.
            psi_1d = sum(p.numel() for p in group["ddp"]["params"].values() if p.dim() == 1)
            if comm == {"all_reduce": 4 * psi_1d}:
                want = comm
        assert comm.keys() == want.keys(), (rank, comm, want)
        for kind, v in want.items():
            assert abs(comm[kind] - v) <= 0.01 * v, (rank, kind, comm[kind], v)
        if exp["state_bytes"] is not None:
            assert r["state"] == exp["state_bytes"], (rank, r["state"], exp["state_bytes"])
    ddp = expected(CASES["ddp"], model_config("tiny"), 2)["comm_payload_bytes"]["all_reduce"]
    if name.startswith("local"):  # 12Ψ bytes every 4th (3rd) step: 3Ψ (4Ψ) on average vs DDP's 4Ψ
        assert exp["comm_payload_bytes_avg_per_step"]["all_reduce"] <= ddp
    elif name != "torch-ddp":
        assert sum(exp["comm_payload_bytes"].values()) <= 0.5 * ddp


def test_torch_powersgd_hook_compressed_the_measured_step(group):
    """start_powerSGD_iter=2: iterations 0 and 1 are plain all-reduce, the rest compressed: the metered
    step's visible all-reduce carries only the 1-D tensors, not the full gradient, and the losses
    leave torch.ddp's after step 2."""
    res = group["torch-powersgd"]
    assert res["per_rank"][0]["powersgd_iter"] == N_STEPS
    metered = payload_by_kind(res["per_rank"][0]["comm"])["all_reduce"]
    assert metered < 0.1 * payload_by_kind(group["torch-ddp"]["per_rank"][0]["comm"])["all_reduce"]
    a, b = replica_mean_losses(res), replica_mean_losses(group["torch-ddp"])
    assert a[:3] == pytest.approx(b[:3], rel=1e-5) and a[-1] > b[-1] + 0.1
    assert replica_mean_losses(group["torch-fp16"]) == pytest.approx(b, rel=1e-3)


# --- the error-feedback invariants, on one rank (all-gather of one = identity) ----------------------


def _invariants(method: str, broken: str | None, steps: int = 6) -> dict:
    from reference_impls.compression import OneBitCompressor, PowerSGDCompressor, TopKCompressor
    from reference_impls.dp_common import plan_buckets

    torch.manual_seed(0)
    shapes = [(32, 16), (16,), (8, 24)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    (bucket,) = plan_buckets(params, float("inf"), 4)
    comp = {
        "onebit": lambda: OneBitCompressor(),
        "topk": lambda: TopKCompressor(0.05),
        "powersgd": lambda: PowerSGDCompressor(2),
    }[method]()
    if broken == "no_scale":  # signs only: forgets ||p||_1 / d
        plain = comp.compress
        comp.compress = lambda p, sizes: (torch.ones_like(plain(p, sizes)[0]), plain(p, sizes)[1])
    if broken == "no_accumulation":  # computes a residual but never adds it back
        comp._with_error = lambda b, g: g.float().clone()
    sent_total = torch.zeros(bucket.numel)
    grad_total = torch.zeros(bucket.numel)
    contraction = []
    for _ in range(steps):
        g = torch.randn(bucket.numel) * 1e-3
        p = g + comp.residual.get(0, torch.zeros_like(g))
        grad = g.clone()
        comp.launch(bucket, grad, None).wait()
        sent_total += grad
        grad_total += g
        contraction.append(float((p - grad).square().sum() / p.square().sum()))
    gap = float((sent_total + comp.residual[0] - grad_total).abs().max() / grad_total.abs().max())
    return {"telescoping_rel_err": gap, "max_contraction": max(contraction)}


def _invariant_cases():
    out = {}
    for m in ("onebit", "topk", "powersgd"):
        out[m] = _invariants(m, None)
    out["onebit-no_scale"] = _invariants("onebit", "no_scale")
    out["topk-no_accumulation"] = _invariants("topk", "no_accumulation")
    return out


@pytest.fixture(scope="module")
def invariants():
    return run_on_gloo(_invariant_cases, 1)[0]


@pytest.mark.parametrize("method", ["onebit", "topk", "powersgd"])
def test_error_feedback_invariants(invariants, method):
    r = invariants[method]
    assert r["telescoping_rel_err"] < 1e-5, r
    assert r["max_contraction"] < 1.0, r


@pytest.mark.parametrize("broken", ["onebit-no_scale", "topk-no_accumulation"])
def test_compression_bug_is_caught(invariants, broken):
    r = invariants[broken]
    caught = not (r["telescoping_rel_err"] < 1e-5 and r["max_contraction"] < 1.0)
    assert caught, r


# --- DeepSpeed 1-bit Adam ----------------------------------------------------------------------------


def test_deepspeed_without_onebit_adam_has_no_peer_for_it():
    """deepspeed.onebit_adam is out of the registry because the pinned DeepSpeed has no 1-bit Adam
    (parabench/families/compression.py). A DeepSpeed that ships it again fails this test: then add
    the peer back."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    from parabench.registry import STRATEGIES

    assert "onebitadam" not in [o.lower() for o in DEEPSPEED_OPTIMIZERS]
    assert "deepspeed.onebit_adam" not in STRATEGIES
    assert "ref.ddp_onebit" in STRATEGIES
