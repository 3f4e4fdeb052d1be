"""The communication meter sees every kind of c10d op, eager and functional, with the
nccl-tests payload conventions; the flight recorder (wire level) agrees with it."""

import os

import torch
import torch.distributed as dist
from harness import record_on_gloo

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.meters import flight_recorder
from parabench.meters.comm import CommMeter
from reference_impls._compat import all_gather_into, reduce_scatter_into


def _every_op():
    import torch.distributed._functional_collectives as fc

    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.randn(1000)
    start = flight_recorder.last_record_id()
    with CommMeter() as meter:
        dist.all_reduce(x)  # payload 4000
        all_gather_into(torch.empty(1000 * n), x)  # payload 4000 n (full output)
        reduce_scatter_into(torch.empty(1000 // n), x)  # payload 4000 (full input)
        dist.reduce_scatter(torch.empty(500), list(x.chunk(n)))  # list form: 4000 (full input)
        dist.broadcast(x, 0)  # 4000
        dist.all_to_all_single(torch.empty(1000), x)  # 4000
        if r == 0:
            dist.send(x, 1)
        else:
            dist.recv(x, 0)  # 4000 on one side each
        fc.wait_tensor(fc.all_reduce(x, "sum", dist.group.WORLD))  # functional: 4000
        fc.wait_tensor(fc.all_gather_tensor(x, 0, dist.group.WORLD))  # functional: 4000 n
        dist.all_reduce(torch.ones(4))  # 16 bytes: a scalar op
    return meter.summary(), flight_recorder.summary_since(start)


def test_meter_sees_every_op_kind_with_payload_conventions():
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # inherited by the spawned ranks
    try:
        (summary, fr), (summary1, _) = run_on_gloo(_every_op, 2)
    finally:
        del os.environ["TORCH_FR_BUFFER_SIZE"]
    k = {kind: (v["calls"], v["payload_bytes"]) for kind, v in summary["by_kind"].items()}
    assert k["all_reduce"] == (2, 8000)
    assert k["all_gather"] == (2, 16000)
    assert k["reduce_scatter"] == (2, 8000)
    assert k["broadcast"] == (1, 4000) and k["all_to_all"] == (1, 4000)
    assert k["send"] == (1, 4000) and summary1["by_kind"]["recv"]["payload_bytes"] == 4000
    assert summary["scalar_ops"]["all_reduce"] == {"calls": 1, "payload_bytes": 16}
    assert summary["by_kind"]["all_reduce"]["wire_bytes"] == 8000  # 2(n-1)/n x payload, n = 2
    # Wire level: gloo logs reduce-scatter as all-reduce and omits point-to-point (docs/facts.md);
    # the all-gathers agree byte for byte.
    assert fr["all_gather"]["payload_bytes"] >= 8000


def test_bf16_tensor_and_pipeline_parallel_traffic_matches_theory():
    """Under autocast (the "amp" recipe), g's forward all-reduces (with SP: the forward reduce-scatters and their
    backward all-gathers; expert parallelism's token rows) travel in bf16 while f's backward, the embedding, the cross-entropy and the
    pipeline's residual-stream activations stay fp32; theory says so, per rank, to 1 %."""
    amp = {"precision": "bf16", "recipe": "amp", "steps": 1, "warmup": 0, "device": "cpu"}
    cases = [
        Case(model="tiny", strategy="ref.tp", world_size=2, micro_batch=8, options={"tp": 2}, **amp),
        Case(
            model="tiny",
            strategy="ref.pp_1f1b",
            world_size=2,
            micro_batch=8,
            options={"pp": 2, "microbatches": 4},
            **amp,
        ),
        Case(model="tiny", strategy="ref.tp_sp", world_size=2, micro_batch=8, options={"tp": 2}, **amp),
        Case(
            model="tiny",
            strategy="ref.pp_1f1b",
            world_size=4,
            micro_batch=8,
            options={"pp": 2, "tp": 2, "sp": True, "microbatches": 4},
            **amp,
        ),
        Case(model="tiny-moe", strategy="ref.ep", world_size=2, micro_batch=4, **amp),
    ]
    records = [record_on_gloo(c) for c in cases]  # the traffic does not depend on the launcher
    for r in records:
        assert r["status"] == "ok" and r["checks"]["comm_ok"] is True, (r["label"], r["checks"].get("comm_per_rank"))
    tp = next(r for r in records if r["case"]["strategy"] == "ref.tp")
    assert tp["per_rank"][0]["comm"]["by_kind"]["all_reduce"]["dtypes"] == ["torch.bfloat16", "torch.float32"]
    sp = next(r for r in records if r["case"]["strategy"] == "ref.tp_sp")
    for kind in ("all_gather", "reduce_scatter"):
        assert sp["per_rank"][0]["comm"]["by_kind"][kind]["dtypes"] == ["torch.bfloat16", "torch.float32"]
    ep = next(r for r in records if r["case"]["strategy"] == "ref.ep")
    assert ep["per_rank"][0]["comm"]["by_kind"]["all_to_all"]["dtypes"] == ["torch.bfloat16"]


def _subgroup_ops():
    mine = [dist.new_group([0]), dist.new_group([1])][dist.get_rank()]  # every rank creates every group
    with CommMeter() as meter:
        dist.all_reduce(torch.ones(1000), group=mine)
        dist.all_reduce(torch.ones(1000))
    return [(e.group_size, e.wire_bytes) for e in meter.events]


def test_meter_reads_the_group_of_eager_ops():
    """Eager c10d ops carry their group as a boxed ScriptObject; a one-rank group moves nothing on the wire."""
    assert run_on_gloo(_subgroup_ops, 2)[0] == [(1, 0.0), (2, 4000.0)]
