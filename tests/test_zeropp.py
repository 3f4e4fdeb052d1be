"""ZeRO++ (reference_impls/zeropp.py, ref.zeropp; peer deepspeed.zeropp). CPU, gloo, 2 ranks, tiny
model; every case shares one spawned group.

What is asserted, and why:
* All options off is ref.zero3: the same losses and parameters bit for bit (same collectives on the
  same buffers), and both equal one process on the global batch (test_reference_dp.py's tolerance).
* hpZ alone changes where the backward weights come from, not their values: with partition size 2
  (the whole world here) and 1 (every rank keeps the unit) the result is ref.zero3's bit for bit.
* qwZ and qgZ quantize, so they only track ref.zero3: over N_STEPS steps at lr 1e-3 the losses stay
  within LOSS_RTOL relative (measured below 1e-3; int4 gradients are the coarsest). A qgZ that forgot
  the scales, or summed codes, would be off by orders of magnitude.
* Round trip: |x - dequantize(quantize(x))| <= max|block| / (2·qmax) element-wise, int8 and int4.
* Bytes: the comm meter around one train_step equals ref_zeropp_expectation exactly, per kind; the
  model-state bytes (the hpZ secondary copy included) too; and the wire dtypes are int8/uint8.
* deepspeed.zeropp: qwz/qgz are skipped on a CPU with the quantizer's reason; hpz alone runs there.
"""

from __future__ import annotations

import pytest
import torch
from harness import assert_matches_single, max_rel_diff, payload_by_kind, replica_mean_losses, run_cases, single_truth

from parabench.case import Case
from parabench.launch import LaunchOptions
from parabench.models import model_config
from parabench.registry import expected
from parabench.runner import skip_reason
from reference_impls.zeropp import dequantize, quantize

N_STEPS = 3
OPTIM = {"eps": 1e-6}  # as test_reference_dp.py
LOSS_RTOL = 5e-3


def mk(strategy="ref.zeropp", precision="fp32", **options):
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=2,
        precision=precision,
        micro_batch=2,
        lr=1e-3,
        device="cpu",
        options={"optim": OPTIM, **options},
    )


CASES = {
    "zero3": mk("ref.zero3"),
    "off": mk(),
    "hpz2": mk(hpz=True, hpz_partition_size=2),
    "hpz1": mk(hpz=True, hpz_partition_size=1),
    "qwz": mk(qwz=True),
    "qgz4": mk(qgz=True),
    "all": mk(qwz=True, hpz=True, qgz=True, qgz_bits=8, quant_block=96),  # int8 gradients, many blocks
    "zero3-bf16": mk("ref.zero3", precision="bf16"),
    "all-bf16": mk(precision="bf16", qwz=True, hpz=True, hpz_partition_size=1, qgz=True),
    "ds-hpz": mk("deepspeed.zeropp", hpz=True, hpz_partition_size=2),
}


def _stats(trainer, case, record):
    record["stats"] = trainer.strategy_stats()


@pytest.fixture(scope="module")
def group():
    return run_cases(2, CASES, N_STEPS, meter_steps=(N_STEPS - 1,), measure_state_from=N_STEPS - 1, on_end=_stats)


def _losses(group, name):
    return replica_mean_losses(group[name])


@pytest.mark.parametrize("name", ["off", "hpz2", "hpz1"])
def test_exactly_zero3(group, name):
    assert _losses(group, name) == _losses(group, "zero3")
    assert all(torch.equal(group[name]["params"][k], v) for k, v in group["zero3"]["params"].items())
    truth = single_truth(CASES[name], N_STEPS)
    assert_matches_single(group[name], truth, loss_rtol=1e-5, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name,base", [("qwz", "zero3"), ("qgz4", "zero3"), ("all", "zero3"), ("all-bf16", "zero3-bf16")]
)
def test_quantized_tracks_zero3(group, name, base):
    got, want = _losses(group, name), _losses(group, base)
    assert got[-1] < got[0]  # it trains
    assert got != want  # the quantization is real
    assert max_rel_diff(got, want) < LOSS_RTOL, (got, want)


@pytest.mark.parametrize("name", [n for n in CASES if n != "ds-hpz"])
def test_bytes_equal_theory(group, name):
    case = CASES[name]
    exp = expected(case, model_config(case.model), 2)
    for r in group[name]["per_rank"]:
        assert payload_by_kind(r["comm"]) == exp["comm_payload_bytes"], (name, r["comm"]["by_kind"])
        assert r["state"] == exp["state_bytes"], (name, r["state"], exp["state_bytes"])
    o = case.options
    dtypes = {d for v in group[name]["per_rank"][0]["comm"]["by_kind"].values() for d in v["dtypes"]}
    if o.get("qwz") or o.get("qgz"):
        assert dtypes & {"torch.int8", "torch.uint8"}, dtypes


def test_savings_against_zero3():
    """The expectation's own figures: qwZ halves the bf16 gathers (plus scales), int4 qgZ is ~1/4 of a
    bf16 reduce-scatter, hpZ at partition size 1 drops the backward gathers."""
    cfg = model_config("gpt-350m")

    def comm(**o):
        c = Case(model="gpt-350m", strategy="ref.zeropp", world_size=2, precision="bf16", options=o)
        return expected(c, cfg, 2)["comm_payload_bytes"]

    z3 = comm()
    assert 0.5 < comm(qwz=True)["all_gather"] / z3["all_gather"] < 0.51
    assert 0.25 < comm(qgz=True)["all_to_all"] / z3["reduce_scatter"] < 0.26
    assert comm(hpz=True, hpz_partition_size=1)["all_gather"] * 2 == z3["all_gather"]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_round_trip(bits):
    torch.manual_seed(0)
    x = torch.randn(3, 1000) * torch.logspace(-3, 2, 1000)  # blocks of very different ranges
    x[1, :200] = 0  # an all-zero block
    block, qmax = 128, 2 ** (bits - 1) - 1
    q, scales = quantize(x, block, bits)
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8) and q.shape[1] == 8 * block * bits // 8
    back = dequantize(q, scales, block, bits)[:, :1000]
    bound = torch.nn.functional.pad(x.abs(), (0, 24)).view(3, 8, block).amax(2) / (2 * qmax)
    err = (x - back).abs()
    assert (err <= bound.repeat_interleave(block, 1)[:, :1000] * (1 + 1e-6) + 1e-12).all()
    assert torch.equal(back[1, :128], torch.zeros(128))


def test_deepspeed_hpz_on_cpu(group):
    """hpZ alone needs no quantizer: DeepSpeed runs it on the CPU accelerator and trains like ZeRO-3."""
    got = _losses(group, "ds-hpz")
    stats = group["ds-hpz"]["per_rank"][0]["stats"]
    assert stats["zero_hpz_partition_size"] == 2 and stats["hpz_secondary_tensors"] > 0, stats
    assert got[-1] < got[0]
    assert max_rel_diff(got, _losses(group, "zero3")) < 1e-4


@pytest.mark.parametrize("option", ["qwz", "qgz"])
def test_deepspeed_quantizers_skipped_on_cpu(option):
    reason = skip_reason(mk("deepspeed.zeropp", **{option: True}), LaunchOptions())
    assert reason and "CUDA" in reason and "QuantizerBuilder" in reason
    assert skip_reason(mk("deepspeed.zeropp", hpz=True), LaunchOptions()) is None
