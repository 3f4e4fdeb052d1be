"""What Dynamo's DDPOptimizer adds to what compiled blocks save for backward, measured on a CPU.

torch.ddp with per-block torch.compile (inductor), Dynamo's DDPOptimizer on and off, amp and fp8, one
gloo rank: the memory-breakdown meter's peak of one step, beside the planner's term
(``parabench.plan.model.split_graphs_bytes``) and the graphs the planner says DDPOptimizer cuts a block
into. ``--bucket-mb`` values chosen against the block's linears (d^2 fp32 = 1 MiB at d 512) reproduce
other models' cuts: 1.5625 cuts a d-512 block as 25 MiB buckets cut gpt-1.3b's (d 2048).

Run: ``python suites/studies/scripts/ddp_optimizer_probe.py --out results/studies/ddp-optimizer-cpu/probe.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections import Counter

import torch

from parabench.case import Case
from parabench.distributed import run_on_gloo


def _compiles():
    from torch._dynamo.utils import counters

    return dict(counters["stats"])


def _measure(case_dicts):
    import torch._dynamo

    from parabench.registry import get_strategy
    from parabench.worker import local_batches, make_spec

    out = []
    for cd in case_dicts:
        torch._dynamo.reset()
        case = Case.from_dict(cd)
        spec = make_spec(case, torch.device("cpu"))
        trainer = get_strategy(case.strategy).build(spec)
        (x0, y0), (x1, y1) = local_batches(case, spec, 2)
        trainer.train_step(x0, y0)
        saved, kinds = {}, {}

        def pack(t):
            st = t.untyped_storage()
            saved[st.data_ptr()] = st.nbytes()
            kinds[st.data_ptr()] = (tuple(t.shape), str(t.dtype).replace("torch.", ""))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.train_step(x1, y1)
        out.append(
            {
                "case": cd,
                "saved_bytes": sum(saved.values()),
                "saved": sorted(map(str, kinds.values())),
                "compiles": _compiles(),
            }
        )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="custom-L2-d512-h8")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[1.5625, 25.0])
    ap.add_argument("--recipes", nargs="+", default=["amp", "fp8"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from parabench.models import model_config
    from parabench.plan import model as M
    from parabench.plan.workload import for_config

    cases = []
    for recipe in args.recipes:
        for bucket_mb in args.bucket_mb:
            for on in (True, False):
                cases.append(
                    Case(
                        model=args.model,
                        strategy="torch.ddp",
                        world_size=1,
                        precision="bf16",
                        recipe=recipe,
                        micro_batch=args.micro_batch,
                        seq_len=args.seq_len,
                        device="cpu",
                        options={"compile": True, "ddp_optimizer": on, "bucket_mb": bucket_mb},
                    ).to_dict()
                )
    measured = run_on_gloo(_measure, 1, cases)[0]
    rows = []
    for i in range(0, len(measured), 2):
        on, off = measured[i], measured[i + 1]
        c = on["case"]
        w = for_config(
            model=c["model"],
            cfg=model_config(c["model"], seq_len=c["seq_len"]),
            strategy="torch.ddp",
            world_size=1,
            micro_batch=c["micro_batch"],
            recipe=c["recipe"],
            options=c["options"],
        )
        bucket = c["options"]["bucket_mb"] * 2**20
        rows.append(
            {
                "recipe": c["recipe"],
                "bucket_mb": c["options"]["bucket_mb"],
                "graphs": M.ddp_split_graphs(w, bucket),
                "saved_on_bytes": on["saved_bytes"],
                "saved_off_bytes": off["saved_bytes"],
                "compile_stats": [on["compiles"], off["compiles"]],
                "measured_extra_bytes": on["saved_bytes"] - off["saved_bytes"],
                # saved tensors (shape, dtype) of one side only
                "saved_on_only": sorted((Counter(on["saved"]) - Counter(off["saved"])).elements()),
                "saved_off_only": sorted((Counter(off["saved"]) - Counter(on["saved"])).elements()),
                "predicted_extra_bytes": M.split_graphs_bytes(w),
            }
        )
    doc = {
        "what": __doc__.splitlines()[0],
        "model": args.model,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    for r in rows:
        print(
            f"{r['recipe']:4s} bucket {r['bucket_mb']:7.4f} MiB  graphs {r['graphs']}\n"
            f"     measured +{r['measured_extra_bytes'] / 2**20:.3f} MiB, predicted +{r['predicted_extra_bytes'] / 2**20:.3f} MiB"
            f"  ({r['compile_stats']})"
        )


if __name__ == "__main__":
    main()
