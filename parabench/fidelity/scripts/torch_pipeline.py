"""Minimal PyTorch pipeline-parallel training of the parabench GPT, from PyTorch's docs and torchtitan.

Sources (https://pytorch.org/docs/stable/distributed.pipelining.html):
- "Option 1: splitting a model manually": each stage is one ``nn.Module`` that owns its part of
  the model; the transformer layers sit in an ``nn.ModuleDict`` keyed by their global index, so a
  stage keeps the whole model's parameter names, and ``forward`` skips the parts another stage
  owns (the docs' ``self.tok_embeddings(tokens) if self.tok_embeddings else tokens``). Here the
  first stage also holds the token and position embeddings, the last the final LayerNorm and the
  head.
- "Step 1: build PipelineStage": ``PipelineStage(stage_module, stage_index, num_stages, device)``,
  one per stage this rank runs; no ``input_args``: the stage infers its shapes on the first step
  (a warm-up step here).
- "Step 2: use PipelineSchedule for execution": the schedule takes the whole batch and splits it
  into ``n_microbatches`` along dimension 0; the first stage's rank passes the input, the last
  stage's rank ``target=`` and ``losses=`` (the loss of every micro-batch), the others nothing.
  ``loss_fn`` is the GPT's cross-entropy; ``scale_grads=True`` (the default) divides the summed
  gradients by the number of micro-batches: the gradient of the batch's mean loss.
- "Implementing Your Own Schedule" and the schedule classes of the API reference:
  ``ScheduleGPipe`` and ``Schedule1F1B`` take the one stage of a rank
  (``PipelineScheduleSingle``); ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``
  take a list of a rank's stages (``PipelineScheduleMulti``), stage ``rank + k * pp`` for
  ``k < virtual_stages`` (the class computes stage ``local_index * pp + rank``: the looped layout
  of Narayanan et al. 2021). Both split a step's micro-batches into ``max(1, m // pp)`` rounds,
  which must divide ``m``. ``ScheduleInterleavedZeroBubble`` is ZB1P (Qi et al. 2024) with the
  backward split into input and weight gradients.
- AMP (https://pytorch.org/docs/stable/amp.html): the schedule calls the stage's ``forward``
  itself, so the ``amp`` recipe's ``torch.autocast`` goes inside ``forward``; bf16 needs no
  GradScaler. ``torch.optim.AdamW`` ``fused=True`` on CUDA, ``foreach=True`` elsewhere.

The split: torchtitan's (``_generate_llm_fqn_per_model_part`` in
torchtitan/distributed/pipeline_parallel.py, with its defaults
``pipeline_parallel_first_stage_less_layers = 1`` and ``..._last_stage_less_layers = 1``): the
embeddings count as one layer on the first stage and the final norm and head as one on the last,
the ``n_layer + 2`` "effective layers" go out evenly, the first ``(n_layer + 2) % stages`` stages one
more. Where torchtitan refuses the split (a stage would get fewer effective layers than the
embeddings' weight), the script falls back to the even split of the blocks alone, and says so.
``pp`` is the world size (no data parallelism).

Where the script and parabench's adapter (parabench/peers/torch_pipeline.py) differ, the result's
``choices`` names both:
- the split above against the adapter's even split of the blocks;
- the docs build the model on the meta device and keep only the stage's layers, to avoid
  running out of memory; the script, like the adapter, builds the whole GPT on the device and
  then keeps its stages' parts, so that both draw the same initial weights from one generator.
  This costs memory at start-up only, before the measurement.
- ``torch.pp_zb`` runs ``ScheduleInterleavedZeroBubble`` with one stage per rank (the layout of
  ``ref.pp_zb``); the class is documented as interleaved (several stages per rank), which
  ``--schedule zb --virtual-stages 2`` runs. ``parabench fidelity`` passes the adapter's 1.
- torchtitan sums the loss and divides by the global token count itself (``scale_grads=False``);
  the script keeps the schedules' default ``scale_grads=True`` with a mean loss: the same gradient.

Recipes (``--recipe``, bf16 only): ``amp`` (the default): fp32 parameters under autocast.
``master``: bf16 parameters, fp32 master weights and AdamW states (``_gpt.MasterWeightAdamW``).

Run: ``torchrun --nproc-per-node 2 torch_pipeline.py --schedule 1f1b --micro-batch 8
--microbatches 4 --precision bf16 --out result.json``.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = ("interleaved", "zb")  # PipelineScheduleMulti: a list of stages per rank


def even_split(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of every stage: contiguous blocks, the first ``n_layer % n_stages`` one more."""
    base, extra = divmod(n_layer, n_stages)
    bounds, lo = [], 0
    for s in range(n_stages):
        hi = lo + base + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def torchtitan_split(n_layer: int, n_stages: int, input_weight: int = 1, output_weight: int = 1):
    """torchtitan's ``_generate_llm_fqn_per_model_part`` as block bounds ``[lo, hi)`` per stage;
    ValueError where torchtitan raises one."""
    if n_stages == 1:
        return [(0, n_layer)]
    effective = n_layer + input_weight + output_weight
    per_stage, extra = divmod(effective, n_stages)
    if per_stage == 0 or input_weight > per_stage or output_weight > per_stage:
        raise ValueError(
            f"torchtitan refuses {n_stages} stages for {n_layer} layers (+{input_weight}, +{output_weight})"
        )
    bounds, lo = [], 0
    for s in range(n_stages):
        size = per_stage + (1 if s < extra else 0)
        size -= input_weight if s == 0 else output_weight if s == n_stages - 1 else 0
        hi = min(n_layer, lo + size)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class StageModule(nn.Module):
    """Blocks ``[lo, hi)`` of the GPT, with the embeddings on the first stage and the final
    LayerNorm and head on the last; the parts of other stages are None (the docs' manual split)."""

    def __init__(self, gpt: _gpt.GPT, lo: int, hi: int, first: bool, last: bool, autocast):
        super().__init__()
        self.tok_emb = gpt.tok_emb if first else None
        self.pos_emb = gpt.pos_emb if first else None
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(lo, hi)})
        self.ln_f = gpt.ln_f if last else None
        self.head = gpt.head if last else None
        self.autocast = autocast

    def forward(self, h):
        with self.autocast():
            if self.tok_emb is not None:
                h = self.tok_emb(h) + self.pos_emb(torch.arange(h.shape[1], device=h.device))
            for block in self.blocks.values():
                h = block(h)
            return self.head(self.ln_f(h)) if self.head is not None else h


def main():
    ap = _gpt.parser(__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=("amp", "master"), default="amp")
    ap.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b")
    ap.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 2 * pp)")
    ap.add_argument("--virtual-stages", type=int, default=1, help="stages per rank (interleaved, zb)")
    args = ap.parse_args()
    if args.virtual_stages != 1 and args.schedule not in MULTI_STAGE:
        ap.error(f"--schedule {args.schedule} runs one stage per rank (--virtual-stages 1)")
    device = _gpt.init(args)
    pp, rank = dist.get_world_size(), dist.get_rank()
    m = args.microbatches or 2 * pp
    v = args.virtual_stages
    n_stages = pp * v
    if args.micro_batch % m:
        raise SystemExit(f"{m} micro-batches do not divide --micro-batch {args.micro_batch}")
    if n_stages > args.n_layer:
        raise SystemExit(f"{n_stages} stages for {args.n_layer} layers")
    bf16 = args.precision == "bf16"
    master = bf16 and args.recipe == "master"
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 and not master else contextlib.nullcontext
    )

    gpt = _gpt.build_gpt(args, device)
    if master:
        gpt = gpt.to(torch.bfloat16)
    try:
        bounds, split = torchtitan_split(args.n_layer, n_stages), "torchtitan (embeddings and head one layer each)"
    except ValueError as exc:
        bounds, split = even_split(args.n_layer, n_stages), f"even over the blocks ({exc})"
    adapter_bounds = even_split(args.n_layer, n_stages)
    stage_ids = [rank + k * pp for k in range(v)]
    modules = [StageModule(gpt, *bounds[s], s == 0, s == n_stages - 1, autocast) for s in stage_ids]
    del gpt
    stages = [PipelineStage(mod, s, n_stages, device) for mod, s in zip(modules, stage_ids)]
    schedule = SCHEDULES[args.schedule](
        stages if args.schedule in MULTI_STAGE else stages[0], n_microbatches=m, loss_fn=_gpt.lm_loss
    )
    has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids

    cuda = device.type == "cuda"
    params = [p for mod in modules for p in mod.parameters()]
    if master:
        opt = _gpt.MasterWeightAdamW(params, fused=cuda, **_gpt.adamw_hyper(args))
    else:
        impl = {"fused": True} if cuda else {"foreach": True}
        opt = torch.optim.AdamW(params, **_gpt.adamw_hyper(args), **impl)

    def step(x, y):
        losses = []
        targets = {"target": y, "losses": losses} if has_last else {}
        schedule.step(*((x,) if has_first else ()), **targets)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the batch's mean loss on the last stage's rank; the other ranks have none
        return torch.stack([l.detach().float() for l in losses]).mean() if has_last else None

    batches = _gpt.local_batches(args, 0, 1, device)  # every stage's rank sees the whole batch
    library = {
        "library": "torch.distributed.pipelining",
        "recipe": (args.recipe if bf16 else None),
        "schedule": type(schedule).__name__,
        "pp": pp,
        "microbatches": m,
        "virtual_stages": v,
        "split": split,
        "stage_layers": {s: list(bounds[s]) for s in range(n_stages)},
        "optimizer": ("MasterWeightAdamW over " if master else "") + ("fused" if cuda else "foreach") + " AdamW",
    }
    if bounds != adapter_bounds:
        library["choices"] = {
            "stage_layers": {
                "script": [list(b) for b in bounds],
                "case": [list(b) for b in adapter_bounds],
                "source": "torchtitan _generate_llm_fqn_per_model_part (distributed/pipeline_parallel.py)",
            }
        }
    return args, _gpt.measure(args, device, step, batches, args.micro_batch * args.seq_len, library)


if __name__ == "__main__":
    _gpt.finish(*main())
