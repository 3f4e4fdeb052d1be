"""Peak memory of one training step, by category, for several strategies on 2 gloo ranks (CPU).

Each strategy runs in its own pair of processes (DeepSpeed and FSDP2 patch torch functions, which
would move bytes between categories of cases run after them in the same process). One warm-up
step (Adam state exists from then on), one plain step for the process's peak resident set, then one
step under ``parabench.meters.memory_breakdown`` (live storages by category at the step's peak).

    PYTHONPATH=. python3 suites/studies/scripts/memory_breakdown_compare.py --model proxy-6.7b --seq-len 128 \
        --micro-batch 1 ref.zero3 ref.fsdp torch.fsdp2

Prints rank 0's numbers in MiB, and with ``--json PATH`` writes every rank's.
"""

from __future__ import annotations

import argparse
import json

import torch

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.models import MODEL_LADDER, GPTConfig

MiB = 1 << 20

# CPU proxies of the 2x H100 cases, shrunk in width so that they keep the GPU case's ratios: the root
# unit (embeddings + head) to the blocks, the activations per block to the model state per block
# (34·s·b·h bytes vs 16·12h²/N), and the logits to the model state. With --seq-len/--micro-batch:
#   proxy-6.7b, seq 128, mb 1  ~ gpt-6.7b, seq 2048, mb 1 (root 6 %, activations/state 0.18, logits 2 %)
#   proxy-1.3b, seq 256, mb 4  ~ gpt-1.3b, seq 2048, mb 4 (root 17 %, activations/state 1.4, logits 37 %)
# Registered at import, so the spawned ranks (which import this file) know them too.
MODEL_LADDER.setdefault("proxy-6.7b", GPTConfig(n_layers=32, d_model=256, n_heads=4, vocab_size=3072, seq_len=128))
MODEL_LADDER.setdefault("proxy-1.3b", GPTConfig(n_layers=24, d_model=256, n_heads=4, vocab_size=6144, seq_len=256))


def _measure(case_dict):
    from parabench.meters import memory
    from parabench.meters.memory_breakdown import measure_step
    from parabench.registry import get_strategy
    from parabench.worker import local_batches, make_spec

    case = Case.from_dict(case_dict)
    spec = make_spec(case, torch.device("cpu"))
    trainer = get_strategy(case.strategy).build(spec)
    batches = local_batches(case, spec, 3)
    trainer.train_step(*batches[0])
    memory.reset_peak(torch.device("cpu"))
    trainer.train_step(*batches[1])
    rss = memory.read_peak(torch.device("cpu"))["peak_rss_bytes"]
    if hasattr(trainer, "measure_state"):
        trainer.measure_state = True
    _, res = measure_step(trainer, *batches[2])
    res["state_bytes"] = trainer.state_bytes() if hasattr(trainer, "state_bytes") else None
    res["peak_rss_bytes"] = rss
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("strategies", nargs="+")
    ap.add_argument("--model", default="gpt-125m")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--options", default="{}", help="strategy options as JSON")
    ap.add_argument("--json", help="write every rank's results here")
    args = ap.parse_args()
    out = {}
    cats = ("parameters", "optimizer", "gradients", "communication", "activations", "temporaries", "other")
    print(f"{'strategy':<14}{'peak':>9}{'rss':>9} " + "".join(f"{c[:8]:>9}" for c in cats) + "  phase / op")
    for strategy in args.strategies:
        case = Case(
            model=args.model,
            strategy=strategy,
            world_size=2,
            precision=args.precision,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            device="cpu",
            options=json.loads(args.options),
        )
        ranks = run_on_gloo(_measure, 2, case.to_dict())
        out[strategy] = ranks
        r = ranks[0]
        print(
            f"{strategy:<14}{r['peak_bytes'] / MiB:9.1f}{r['peak_rss_bytes'] / MiB:9.1f} "
            + "".join(f"{r['by_category'][c] / MiB:9.1f}" for c in cats)
            + f"  {r['phase']} / {r['op']}"
        )
        for phase, ph in r["peak_by_phase"].items():
            print(
                f"  {phase:<12}{ph['peak_bytes'] / MiB:9.1f}{'':9} "
                + "".join(f"{ph['by_category'][c] / MiB:9.1f}" for c in cats)
                + f"  {ph['op']}"
            )
        if r["state_bytes"]:
            print(
                " " * 14
                + "state_bytes MiB: "
                + ", ".join(f"{k} {v / MiB:.1f}" for k, v in r["state_bytes"].items() if isinstance(v, (int, float)))
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
