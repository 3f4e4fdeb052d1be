"""How the torch peers set up float8 and compile, against torchtitan's and torchao's documented setup.

- ``compile_blocks`` starts each case from empty Dynamo caches: a batched launch runs several cases
  in one process and every block shares ``Block.forward``'s code object, so an earlier case's graph
  would otherwise be reused (traced under another wrapper) and entries would pile up towards
  Dynamo's recompile limit.
- torch.fsdp2 with ``fp8_all_gather`` refreshes every float8 weight's scale after the optimizer
  step in one all-reduce (torchao ``precompute_float8_dynamic_scale_for_fsdp``, torchtitan's
  tensorwise setup), so the pre-all-gather hooks cast with that scale instead of each all-reducing
  its own amax.

CPU only: Dynamo's ``eager`` backend for the cache check; torchao's emulated float8 (real casts and
scales, high-precision product) on gloo for FSDP2, without compile.
"""

from __future__ import annotations

import pytest
import torch

import parabench.fp8 as fp8
from parabench.models import MODEL_LADDER, build_model, global_batch
from parabench.peers.common import compile_blocks
from parabench.topology import Topology
from parabench.trainer import TrainSpec


def test_compile_blocks_drops_an_earlier_cases_graphs():
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    cfg = MODEL_LADDER["tiny"]
    earlier = build_model(cfg, 0).blocks[0]
    code = type(earlier).forward.__code__
    torch._dynamo.reset()
    torch.compile(earlier.forward, backend="eager", fullgraph=True)(torch.randn(1, 8, cfg.d_model))
    assert len(_debug_get_cache_entry_list(code)) == 1  # the earlier case's graph of Block.forward

    eager = TrainSpec(cfg, 0, torch.device("cpu"), "fp32", Topology(1, 0), 1, options={"compile": False})
    compile_blocks(build_model(cfg, 0).blocks, eager)
    assert len(_debug_get_cache_entry_list(code)) == 1  # an eager case leaves compiled state alone

    spec = TrainSpec(cfg, 0, torch.device("cpu"), "fp32", Topology(1, 0), 1, options={"compile": True})
    blocks = build_model(cfg, 0).blocks
    compile_blocks(blocks, spec)
    assert _debug_get_cache_entry_list(code) == []
    assert all("forward" in vars(b) for b in blocks)  # ... and this case's blocks are compiled


def _fsdp2_fp8_scales():
    """Rank-local: one emulated fp8 step of torch.fsdp2; per float8 weight, the precomputed scale
    (None when none was computed) and torchao's dynamic scale of the whole updated weight."""
    import torch.distributed as dist
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import amax_to_scale

    from parabench.case import Case
    from parabench.registry import get_strategy
    from parabench.worker import make_spec

    fp8.EMULATE = True
    case = Case(
        model="tiny",
        strategy="torch.fsdp2",
        world_size=2,
        precision="bf16",
        recipe="fp8",
        micro_batch=2,
        device="cpu",
        options={"fp8_all_gather": True},
    )
    spec = make_spec(case, torch.device("cpu"))
    trainer = get_strategy("torch.fsdp2").build(spec)
    x, y = global_batch(0, case.global_batch, spec.model, case.seed)
    lo = dist.get_rank() * case.micro_batch
    loss = float(trainer.train_step(x[lo : lo + case.micro_batch], y[lo : lo + case.micro_batch]))
    out = []
    for m in trainer.module.modules():
        if isinstance(m, Float8Linear):
            local = m.weight._local_tensor  # to_local() would detach: a wrapper without the scale
            full = m.weight.full_tensor()  # the updated weight (a collective: every rank calls it)
            want = amax_to_scale(full.abs().max().float(), torch.float8_e4m3fn)
            out.append((getattr(local, "_precomputed_scale", None), want))
    return loss, out


def test_fsdp2_float8_all_gather_precomputes_the_scales_after_the_step():
    pytest.importorskip("torchao.float8", reason="parabench[fp8] not installed")
    from parabench.distributed import run_on_gloo

    for loss, scales in run_on_gloo(_fsdp2_fp8_scales, 2):
        assert torch.isfinite(torch.tensor(loss))
        assert len(scales) == 6 * MODEL_LADDER["tiny"].n_layers  # q, k, v, attention and MLP projections
        # every weight's scale from its global amax after the update, on both ranks
        for got, want in scales:
            assert got is not None and torch.allclose(got, want, rtol=1e-6), (got, want)
