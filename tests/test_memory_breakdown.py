"""The memory-breakdown meter (parabench/meters/memory_breakdown.py) and the reference ZeRO memory bounds.

Two gloo ranks, the ``small`` model in bf16 with buckets of 0.125 MiB (about three per block, as 25 MiB
buckets are for gpt-1.3b), one warm-up step, then one step under the meter:

* the meter's categories add up to its peak;
* ref.zero2 never holds more gradient bytes than its fp32 main-gradient shard plus a bounded number of
  gradient buckets (``in_flight`` reduce-scatters outstanding, each with its receive shard, and at most
  two buckets being filled), both at the meter's peak and at every gradient hook of the step;
* ref.zero2 peaks no higher than ref.zero1 on the same case.
"""

from __future__ import annotations

import torch

from parabench.case import Case
from parabench.distributed import run_on_gloo

BUCKET_MB = 0.125


def _case(strategy):
    return Case(
        model="small",
        strategy=strategy,
        world_size=2,
        precision="bf16",
        micro_batch=4,
        seq_len=64,
        device="cpu",
        options={"bucket_mb": BUCKET_MB},
    )


def _measure(case_dicts):
    from parabench.meters.memory_breakdown import measure_step
    from parabench.registry import get_strategy
    from parabench.worker import local_batches, make_spec

    out = {}
    for cd in case_dicts:
        case = Case.from_dict(cd)
        spec = make_spec(case, torch.device("cpu"))
        trainer = get_strategy(case.strategy).build(spec)
        (x0, y0), (x1, y1) = local_batches(case, spec, 2)
        trainer.train_step(x0, y0)
        # High-water mark of the gradient buckets alive, sampled at every gradient hook.
        live = {"buckets": 0, "bytes": 0}
        ready = trainer._grad_ready

        def sample(p, b, s):
            ready(p, b, s)
            bufs = [g for g in trainer._gbuf if g is not None] + [o for _, o, _ in trainer._pending]
            live["buckets"] = max(live["buckets"], sum(g is not None for g in trainer._gbuf))
            live["bytes"] = max(live["bytes"], sum(t.numel() * t.element_size() for t in bufs))

        trainer._grad_ready = sample
        for h in trainer._hooks:
            h.remove()
        trainer._hooks = [
            p.register_post_accumulate_grad_hook(lambda p, b=b, s=s: trainer._grad_ready(p, b, s))
            for b in trainer.buckets
            for p, s in zip(b.params, b.starts)
        ]
        _, res = measure_step(trainer, x1, y1)
        elem = trainer.flat_param.element_size()
        res["bucket_bytes_max"] = max(b.numel for b in trainer.buckets) * elem
        res["main_shard_bytes"] = 4 * sum(b.numel for b in trainer.buckets) // trainer.world
        res["in_flight"], res["world"], res["live"] = trainer.in_flight, trainer.world, live
        trainer.close()
        out[case.strategy] = res
    return out


def test_memory_breakdown_zero():
    res = run_on_gloo(_measure, 2, [_case("ref.zero1").to_dict(), _case("ref.zero2").to_dict()])
    for rank in res:
        for strategy, r in rank.items():
            cats = r["by_category"]
            assert sum(cats.values()) == r["peak_total_bytes"] == r["peak_bytes"], (strategy, r)
            assert r["peak_bytes"] > r["baseline_bytes"] > 0
            assert cats["parameters"] > 0 and cats["optimizer"] > 0 and cats["activations"] > 0
        z2 = rank["ref.zero2"]
        # in_flight outstanding buckets (+ their receive shard) and at most two being filled.
        bound_buckets = z2["in_flight"] + 2
        bound = (
            z2["main_shard_bytes"]
            + bound_buckets * z2["bucket_bytes_max"]
            + z2["in_flight"] * z2["bucket_bytes_max"] // z2["world"]
        )
        assert z2["by_category"]["gradients"] <= bound, (z2["by_category"], bound)
        assert z2["live"]["buckets"] <= bound_buckets, z2["live"]
        assert z2["live"]["bytes"] <= bound - z2["main_shard_bytes"], (z2["live"], bound)
        assert z2["peak_bytes"] <= rank["ref.zero1"]["peak_bytes"], (z2["peak_bytes"], rank["ref.zero1"]["peak_bytes"])


# --- ZeRO-3 / FSDP beside torch FSDP2 ------------------------------------------------------------
# ``small`` in bf16 at two shapes that keep the ratios of the 2x H100 cases (root unit to blocks,
# activations per block to model state per block, logits to model state): seq 128 x mb 4 ~ gpt-1.3b
# mb 4 (the peak at the start of backward, on the logits' gradient), seq 64 x mb 1 ~ gpt-6.7b mb 1
# (activations small beside the model state: the peak at the end of backward or in the update); and
# one in between, seq 64 x mb 4, where the peak falls inside the last block's backward.
FSDP_SHAPES = {"like-1.3b": (128, 4), "like-6.7b": (64, 1), "between": (64, 4)}


def _fsdp_case(strategy, shape):
    seq_len, micro_batch = FSDP_SHAPES[shape]
    return Case(
        model="small",
        strategy=strategy,
        world_size=2,
        precision="bf16",
        micro_batch=micro_batch,
        seq_len=seq_len,
        device="cpu",
    )


def _measure_plain(named_cases):
    """Per case: one warm-up step, then one step under the meter; the reference's unit sizes beside it."""
    from parabench.meters.memory_breakdown import measure_step
    from parabench.registry import get_strategy
    from parabench.worker import local_batches, make_spec

    out = {}
    for name, cd in named_cases.items():
        case = Case.from_dict(cd)
        spec = make_spec(case, torch.device("cpu"))
        trainer = get_strategy(case.strategy).build(spec)
        (x0, y0), (x1, y1) = local_batches(case, spec, 2)
        trainer.train_step(x0, y0)
        _, res = measure_step(trainer, x1, y1)
        if hasattr(trainer, "units"):
            res["root_bytes"], res["block_bytes"] = trainer.units[0].nbytes, trainer.units[1].nbytes
            trainer.close()
        out[name] = res
    return out


def test_memory_breakdown_zero3_not_above_fsdp2():
    """ref.zero3 in bf16 keeps only its fp32 shards between steps (cast-on-gather, no 16-bit copy) and grows
    its fp32 gradient shard unit by unit in backward. Against torch.fsdp2 (tuned: torchtitan's groups, every
    block resharded after forward, the final norm and head kept gathered), in forward, in backward and over
    the whole step:

    * at the GPU-proportioned shapes it peaks no higher, but in backward;
    * in backward, and in between over the step, it may exceed it by at most one block's 16-bit gradient
      buffer (allocated whole at the block's first gradient so that the rest accumulate in place, where
      FSDP2 holds the gradients made so far and copies them into its reduce-scatter input at the block's
      end; measured at like-6.7b: 179,476 B over, the buffer 396,544 B);
    * ref.fsdp keeps the root gathered from forward to backward: at most the root's bytes above ref.zero3;
    * the transient working set stays inside what parabench.theory states.

    torch.fsdp2 runs in processes of its own (FSDP2 patches torch functions)."""
    from parabench.models import model_config
    from parabench.registry import expected

    refs = run_on_gloo(
        _measure_plain,
        2,
        {
            **{f"ref.zero3 {k}": _fsdp_case("ref.zero3", k).to_dict() for k in FSDP_SHAPES},
            "ref.fsdp between": _fsdp_case("ref.fsdp", "between").to_dict(),
        },
    )
    peers = run_on_gloo(
        _measure_plain, 2, {f"torch.fsdp2 {k}": _fsdp_case("torch.fsdp2", k).to_dict() for k in FSDP_SHAPES}
    )
    for rank, peer in zip(refs, peers):
        for shape, (seq_len, _) in FSDP_SHAPES.items():
            exp = expected(_fsdp_case("ref.zero3", shape), model_config("small", seq_len=seq_len), 2)
            shard = exp["state_bytes"]["params"] // 4  # fp32 elements of this rank's shards
            z3, fsdp2 = rank[f"ref.zero3 {shape}"], peer[f"torch.fsdp2 {shape}"]
            slack = z3["block_bytes"] if shape == "between" else 0
            assert z3["peak_bytes"] <= fsdp2["peak_bytes"] + slack, (shape, z3["peak_bytes"], fsdp2["peak_bytes"])
            for phase in ("forward", "backward", "step"):
                mine, theirs = z3["peak_by_phase"][phase], fsdp2["peak_by_phase"][phase]
                allowed = z3["block_bytes"] if phase == "backward" else slack
                assert mine["peak_bytes"] <= theirs["peak_bytes"] + allowed, (shape, phase, mine, theirs)
                cats = mine["by_category"]
                # fp32 shards (the optimizer's parameters) and Adam's moments, 12 bytes per shard element,
                # plus 0-d step counters: nothing else persistent, no 16-bit shard.
                assert 12 * shard <= cats["optimizer"] <= 12 * shard + 64, (shape, phase, cats, shard)
                assert cats["parameters"] <= exp["working_set_bytes"]["gathered_params"], (shape, phase, cats)
                assert cats["gradients"] <= 4 * shard + exp["working_set_bytes"]["grad_buffers"], (shape, phase, cats)
        fsdp, z3 = rank["ref.fsdp between"], rank["ref.zero3 between"]
        assert fsdp["peak_bytes"] <= z3["peak_bytes"] + fsdp["root_bytes"], (fsdp["peak_bytes"], z3["peak_bytes"])


def _measure_with_works_held(named_cases):
    """``_measure_plain`` with every reduce-scatter's work handle kept until its step ends, as gloo's worker
    thread may keep one after ``wait()`` returns (it drops it when it next takes the queue's lock)."""
    import reference_impls.fsdp as fsdp

    held = []
    issue, step = fsdp.reduce_scatter_into, fsdp.FSDP.train_step

    def issue_and_hold(*args, **kwargs):
        work = issue(*args, **kwargs)
        held.append(work)
        return work

    def step_then_release(self, inputs, targets):
        try:
            return step(self, inputs, targets)
        finally:
            held.clear()

    fsdp.reduce_scatter_into, fsdp.FSDP.train_step = issue_and_hold, step_then_release
    return _measure_plain(named_cases)


def test_zero3_peak_does_not_depend_on_when_the_backend_drops_its_work():
    """A collective's work may outlive ``wait()`` on the backend's thread: ref.zero3 frees its reduce-scatter
    buffers itself and the meter leaves out gloo's own copy, so the peak is the same either way."""
    cases = {shape: _fsdp_case("ref.zero3", shape).to_dict() for shape in FSDP_SHAPES}
    promptly = run_on_gloo(_measure_plain, 2, cases)
    late = run_on_gloo(_measure_with_works_held, 2, cases)
    for now, held in zip(promptly, late):
        for shape in FSDP_SHAPES:
            assert held[shape]["peak_bytes"] == now[shape]["peak_bytes"], (shape, held[shape], now[shape])
