"""Reproduce / diagnose DeepSpeed stage 0 fp16 (FP16_UnfusedOptimizer) on CPU/gloo, 2 ranks, tiny.

Per strategy and step: each rank's loss, a checksum of its parameters, the all-reduce traffic of the
step (CommMeter), the size of the gradients the optimizer wrapper receives relative to the loss scale
(what ``engine.backward`` really scaled by), and the loss scale. ``deepspeed.zero0+prescale``: the same
engine with the loss multiplied by the optimizer's loss scale before ``engine.backward`` (the fix
DeepSpeed PR #8393 proposes), to confirm the mechanism; ``+fresh``: also undo the wrapper's
initial AdamW step on zero gradients (the residual gap). Compares deepspeed.zero0 with
deepspeed.zero1 and ref.ddp (fp16), all against the single-process fp32 losses.

    python3 suites/studies/scripts/ds_zero0_fp16_repro.py [strategy ...]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.meters.comm import CommMeter
from parabench.models import global_batch, model_config
from parabench.registry import get_strategy
from parabench.topology import Topology, build_topology
from parabench.trainer import OptimConfig, TrainSpec
from parabench.worker import local_batches

N_STEPS, LR, OPTIM = 5, 1e-3, {"eps": 1e-6}


def _case(strategy: str, precision: str) -> Case:
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=2,
        precision=precision,
        micro_batch=2,
        grad_accum=1,
        lr=LR,
        device="cpu",
        options={"optim": OPTIM, "bucket_mb": 0.05},
    )


def _rank_run(strategies: list[str], precision: str) -> dict:
    topo = build_topology("cpu")
    out = {}
    for s in strategies:
        case = _case(s, precision)
        spec = TrainSpec(
            model=model_config("tiny"),
            seed=case.seed,
            device=torch.device("cpu"),
            precision=precision,
            topology=topo,
            micro_batch=2,
            grad_accum=1,
            optim=OptimConfig(lr=LR, **OPTIM),
            options=case.options,
        )
        base, _, variant = s.partition("+")
        tr = get_strategy(base).build(spec)
        if "fresh" in variant.split("+"):
            # Undo FP16_UnfusedOptimizer.initialize_optimizer_states' AdamW step on zero gradients:
            # un-apply its one weight decay (p *= 1 - lr*wd) and drop the state (step counter back to 0).
            w = tr.engine.optimizer
            with torch.no_grad():
                for g32, g16, grp in zip(w.fp32_groups, w.fp16_groups, w.optimizer.param_groups):
                    for p32, p16 in zip(g32, g16):
                        p32.div_(1 - grp["lr"] * grp["weight_decay"])
                        p16.copy_(p32)
            w.optimizer.state.clear()
        if "prescale" in variant.split("+"):
            # What DeepSpeed PR #8393 proposes: scale the loss by the wrapper's current loss scale before
            # engine.backward (FP16_UnfusedOptimizer.backward would do loss.float() * cur_scale).
            eng = tr.engine
            orig_backward = eng.backward
            eng.backward = lambda loss, _o=orig_backward, _e=eng, **k: _o(loss.float() * _e.optimizer.loss_scale, **k)
        grad_norms = []
        opt = getattr(getattr(tr, "engine", None), "optimizer", None)
        if opt is not None and hasattr(opt, "fp16_groups"):  # FP16_UnfusedOptimizer: watch what step() sees
            orig = opt.step

            def step(*a, _orig=orig, _opt=opt, **k):
                g = [p.grad.float() for grp in _opt.fp16_groups for p in grp if p.grad is not None]
                grad_norms.append(
                    (float(torch.linalg.vector_norm(torch.stack([x.norm() for x in g]))), float(_opt.loss_scale))
                )
                return _orig(*a, **k)

            opt.step = step
        rows = []
        for x, y in local_batches(case, spec, N_STEPS):
            with CommMeter() as m:
                loss = float(tr.train_step(x, y))
            comm = m.summary()
            ar = comm["by_kind"].get("all_reduce", {})
            params = tr.full_parameters()
            cks = float(sum(p.double().sum() + (p.double() ** 2).sum() for p in params.values()))
            rows.append(
                {
                    "loss": loss,
                    "checksum": cks,
                    "allreduce_calls": ar.get("calls", 0),
                    "allreduce_bytes": ar.get("payload_bytes", 0),
                    "dtypes": sorted(ar.get("dtypes", [])),
                }
            )
        tr.close()
        out[s] = {"rows": rows, "grad_norms_seen_by_step": grad_norms}
    return out


def _single_fp32() -> list[float]:
    cfg = model_config("tiny")
    spec = TrainSpec(
        model=cfg,
        seed=1234,
        device=torch.device("cpu"),
        precision="fp32",
        topology=Topology(world_size=1, rank=0),
        micro_batch=4,
        grad_accum=1,
        optim=OptimConfig(lr=LR, **OPTIM),
        options={},
    )
    tr = get_strategy("single").build(spec)
    return [float(tr.train_step(*global_batch(step, 4, cfg, 1234))) for step in range(N_STEPS)]


def main() -> None:
    strategies = sys.argv[1:] or ["deepspeed.zero0", "deepspeed.zero0+prescale", "deepspeed.zero1", "ref.ddp"]
    fp32 = _single_fp32()
    res = run_on_gloo(_rank_run, 2, strategies, "fp16")
    print("single fp32 losses:", ["%.6f" % v for v in fp32])
    for s in strategies:
        print(f"\n== {s} fp16")
        r0, r1 = res[0][s], res[1][s]
        for i, (a, b) in enumerate(zip(r0["rows"], r1["rows"])):
            mean = (a["loss"] + b["loss"]) / 2
            print(
                f" step {i}: loss r0 {a['loss']:.6f} r1 {b['loss']:.6f} mean {mean:.6f} "
                f"rel.dev vs fp32 {abs(mean - fp32[i]) / fp32[i]:.2e} | checksum r0 {a['checksum']:.6f} "
                f"r1 {b['checksum']:.6f} equal={a['checksum'] == b['checksum']} | all_reduce "
                f"{a['allreduce_calls']} calls {a['allreduce_bytes']} B {a['dtypes']}"
            )
        if r0["grad_norms_seen_by_step"]:
            print(
                " FP16_UnfusedOptimizer.step sees |grad| (rank 0) and loss scale:",
                [("%.3e" % g, s_) for g, s_ in r0["grad_norms_seen_by_step"]],
            )


if __name__ == "__main__":
    main()
