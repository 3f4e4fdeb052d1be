"""PyTorch pipeline parallelism: ``torch.distributed.pipelining`` stages cut from the same GPT.

The stage of this rank keeps contiguous blocks (the first stage also the embeddings, the last
the final LayerNorm and head); ``PipelineStage`` talks to its neighbours over
``topology.pp_group``; ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` /
``ScheduleInterleavedZeroBubble`` run ``microbatches * grad_accum`` micro-batches (``microbatches`` defaults to ``2*pp``) with
``scale_grads=True`` (gradients of the mean loss).

Data parallelism (``dp > 1``), torch.pp_gpipe / torch.pp_1f1b / torch.pp_interleaved: each stage
module is wrapped in ``DistributedDataParallel`` over ``topology.dp_group`` before it is given to
``PipelineStage``, the composition torch's pipelining runtime is written for
(torch/distributed/pipelining/stage.py, ``forward_maybe_with_nosync`` and
``backward_maybe_with_nosync``: every micro-batch's forward and backward but the last backward run
under ``no_sync``, gradients accumulate locally; the last backward calls the reducer's
``prepare_for_backward`` itself, so DDP's bucketed all-reduce (``bucket_cap_mb`` 25, its default,
and ``gradient_as_bucket_view=True`` as the DDP notes and ``torch.ddp`` use) overlaps that
backward). DDP averages over dp; the schedule's ``scale_grads`` (``perform_reduce_grad``, after
the reduction) then divides by the micro-batches: the gradient of the global mean loss. The
alternative torch's stage code also takes, an ``FSDPModule`` / ``ReplicateModule``
(``perform_reduce_grad``), is torchtitan's: until March 2026 torchtitan refused DDP with any other
parallelism ("DDP has not supported > 1D parallelism", its ``apply_ddp``), then wrapped every block
in the FSDP-based ``torch.distributed._composable.replicate_with_fsdp.replicate`` (pytorch/torchtitan
#2458), and since April 2026 applies ``fully_shard`` over its ``dp_replicate`` x ``fsdp`` mesh
(#2900, ``torchtitan/models/llama3/parallelize.py``). On a pure replicate axis those reduce only in
``perform_reduce_grad``, after the last backward, turn the parameters into DTensors and are
private (``_composable``) for replicate; DDP is the public wrapper torch's stage handles that
overlaps the reduction with the last backward, so it is used here. ``strategy_stats`` says which
reduction ran (``dp_grad_sync``).

torch.pp_zb keeps an explicit average after the schedule (``common.average_over_dp``: DDP's
25 MiB buckets over ``topology.dp_group``, one all-reduce each): its split backward (``stage_backward_input``, then ``stage_backward_weight``)
computes weight gradients with ``torch.autograd.grad`` and adds them to ``.grad`` by hand
(torch/distributed/pipelining/_backward.py), so DDP's accumulate-grad hooks never fire on any
stage but the first (whose weight step is a full backward): with DDP, a pp 2 x dp 2 CPU run
all-reduced nothing on stage 1 and its replicas drifted apart, silently.

``torch.pp_zb`` gives ``ScheduleInterleavedZeroBubble`` one stage per rank: its order is then
ZB-H1's (Qi et al. 2024, Sec. 3.1; the class calls it ZB1P), with the backward split into
``stage_backward_input`` and ``stage_backward_weight``. It is the zero-bubble schedule of torch
that takes the same one-stage-per-rank layout as ``ref.pp_zb``; ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV`` need exactly two stages per rank in a V.

Option ``record_timeline``: on the worker's untimed timeline step, every action the schedule runs
(``forward_one_chunk`` F, ``backward_one_chunk`` B, ``backward_weight_one_chunk`` W) and every
wait for its point-to-point transfers (``schedules._wait_batch_p2p``) is timed with the
reference's ``StageClock`` (CUDA events on a GPU), so ``pipeline_stats`` gives the same timeline,
order and bubble as the reference engines, and the report replays both alike. The timed steps
run the schedule untouched.
"""

from __future__ import annotations

import contextlib

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
from torch.distributed.pipelining import schedules as pp_schedules
from torch.nn.parallel import DistributedDataParallel as DDP

from parabench.families.model_parallel import ModelParallelOptions, torch_pipeline_schedule
from parabench.models import build_model, lm_loss
from parabench.peers.common import (
    autocast,
    average_over_dp,
    compile_blocks,
    optimizer_state_bytes,
    recipe_module,
    recipe_optimizer,
    tensor_bytes,
)
from parabench.trainer import Trainer, TrainSpec
from reference_impls.pipeline import StageClock, partition_layers


class GPTStage(nn.Module):
    """Blocks ``[lo, hi)`` of a GPT (keyed by their global index, so names match the GPT's)."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool, spec: TrainSpec):
        super().__init__()
        self.first, self.last = first, last
        self.spec = spec
        if first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x):
        # The schedule calls forward itself, so the "amp" recipe's autocast goes here.
        with autocast(self.spec):
            if self.first:
                x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
            for block in self.blocks.values():
                x = block(x)
            return self.head(self.ln_f(x)) if self.last else x


class TorchPipelineTrainer(Trainer):
    def __init__(self, spec: TrainSpec, schedule: str):
        self.spec = spec
        topo = spec.topology
        pp, self.pp_rank = topo.pp, topo.pp_rank
        model = recipe_module(build_model(spec.model, spec.seed, spec.device), spec)
        o = ModelParallelOptions.read(spec.options)
        v = o.virtual_stages if schedule == "interleaved" else 1
        n_chunks = pp * v
        # the same split as the reference (o.stage_layers: one stage per rank; validation refuses it interleaved)
        bounds = partition_layers(spec.model.n_layers, n_chunks, o.stage_layers)
        # Interleaved: rank r holds chunks r, r + pp, r + 2pp, ... (Narayanan et al. 2021, Sec. 2.2.2).
        self.stage_ids = [self.pp_rank + k * pp for k in range(v)]
        self.modules = [GPTStage(model, *bounds[s], s == 0, s == n_chunks - 1, spec) for s in self.stage_ids]
        del model
        for m in self.modules:  # per block of this rank's stages, as torchtitan's pipelined llama
            compile_blocks(m.blocks.values(), spec)
        self.dp_grad_sync = dp_grad_sync(schedule, dist.get_world_size(topo.dp_group))
        submods = [self._wrap(m) for m in self.modules] if self.dp_grad_sync == "ddp" else self.modules
        self.stages = [
            PipelineStage(m, s, n_chunks, spec.device, group=topo.pp_group) for m, s in zip(submods, self.stage_ids)
        ]
        self.n_micro = o.n_microbatches * spec.grad_accum
        cls = {
            "gpipe": ScheduleGPipe,
            "1f1b": Schedule1F1B,
            "interleaved": ScheduleInterleaved1F1B,
            "zb": ScheduleInterleavedZeroBubble,
        }[schedule]
        # The multi-stage schedules take a list of this rank's stages (one for zero-bubble).
        stage_arg = self.stages if schedule in ("interleaved", "zb") else self.stages[0]
        self.schedule = cls(stage_arg, n_microbatches=self.n_micro, loss_fn=lm_loss)
        self.has_first = 0 in self.stage_ids
        self.has_last = n_chunks - 1 in self.stage_ids
        self.params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = recipe_optimizer(self.params, spec)
        self.measure_state = False
        self._grad_bytes = 0
        self.schedule_name = schedule
        self._stats: dict | None = None

    def _wrap(self, module: GPTStage) -> DDP:
        # No find_unused_parameters: every parameter of a stage gets a gradient in every step.
        ddp = DDP(
            module,
            device_ids=[self.spec.device.index] if self.spec.device.type == "cuda" else None,
            process_group=self.spec.topology.dp_group,
            gradient_as_bucket_view=True,
        )
        # The stage arms the reducer itself before the last backward (``prepare_for_backward``);
        # a forward outside ``no_sync`` arms it too. The stage's first-step metadata inference runs
        # the module's forward outside ``no_sync`` (stage.py ``_forward_metadata_inference``), so
        # the no_sync backwards after it would feed the reducer: under GPipe's order that breaks
        # DDP's bucket rebuild (params_.size() == rebuilt_param_indices_.size() asserts in the
        # next step's forward). Off for good, as ``no_sync`` turns it off per call, it leaves the
        # last backward's arming to the stage alone.
        ddp.require_backward_grad_sync = False
        return ddp

    def strategy_stats(self) -> dict:
        return {"dp_grad_sync": self.dp_grad_sync}

    def pipeline_stats(self) -> dict | None:
        return self._stats

    def train_step(self, inputs, targets):
        losses: list = []
        kwargs = {}
        if self.has_last:
            kwargs.update(target=targets, losses=losses)
        args = (inputs,) if self.has_first else ()
        self._stats = None
        if self.record_timeline:
            clock = StageClock(self.spec.device, device_timed=True)
            with timed_actions(self.stages, clock) as order:
                self.schedule.step(*args, **kwargs)
            clock.drain([])  # the schedule waited for its own sends before returning
            self._stats = self._timeline_stats(clock, order)
        else:
            self.schedule.step(*args, **kwargs)
        dp = self.spec.topology.dp_group
        if self.dp_grad_sync == "bucketed_all_reduce_after_schedule":
            average_over_dp(self.params, dp)
        if self.measure_state:
            self._grad_bytes = tensor_bytes(p.grad for p in self.params)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack([l.detach().float() for l in losses]).mean() if self.has_last else None

    def _timeline_stats(self, clock: StageClock, order: list[str]) -> dict:
        p = self.spec.topology.pp
        # the expectation's schedule name and bubble, so a bubble row reads them as the reference's
        theory = torch_pipeline_schedule(self.schedule_name, p, len(self.stages), self.n_micro)
        return {
            "schedule": theory["schedule"],
            "stage": self.pp_rank,
            "stages": p,
            "microbatches": self.n_micro,
            "order": order,
            **clock.finish(),
            "bubble_fraction_theory": theory["bubble_fraction"],
        }

    def state_bytes(self):
        return {
            "params": tensor_bytes(self.params),
            "grads": self._grad_bytes,
            "optimizer": optimizer_state_bytes(self.optimizer),
        }

    def full_parameters(self):
        mine = {
            "dp": self.spec.topology.dp_rank,
            "params": {n: p.detach().float().cpu() for m in self.modules for n, p in m.named_parameters()},
        }
        everything = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, everything, dst=0)
        if dist.get_rank() != 0:
            return None
        full = {}
        for r in everything:
            if r["dp"] == 0:
                full.update(r["params"])
        return full


ACTIONS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


@contextlib.contextmanager
def timed_actions(stages: list[PipelineStage], clock: StageClock):
    """While open, every action of ``stages`` and every wait for a point-to-point transfer is an
    interval of ``clock`` (each entry's detail: the stage's global chunk index); yields the list
    the actions are appended to, in the order they ran (labels as the reference's: ``F3c1``)."""
    order: list[str] = []

    def timed(stage: PipelineStage, method: str, kind: str):
        run = getattr(stage, method)

        def action(chunk_id, *args, **kwargs):
            t0 = clock.mark()
            out = run(chunk_id, *args, **kwargs)
            clock.computed(kind, chunk_id, t0, clock.mark(), stage.stage_index)
            order.append(f"{kind}{chunk_id}c{stage.stage_index}")
            return out

        return action

    wait = pp_schedules._wait_batch_p2p

    def timed_wait(work):
        t0 = clock.mark()
        wait(work)
        clock.waited(t0, clock.mark())

    try:
        for stage in stages:
            for method, kind in ACTIONS.items():
                setattr(stage, method, timed(stage, method, kind))
        pp_schedules._wait_batch_p2p = timed_wait  # the schedules call it by its module-level name
        yield order
    finally:
        pp_schedules._wait_batch_p2p = wait
        for stage in stages:
            for method in ACTIONS:
                stage.__dict__.pop(method, None)


def dp_grad_sync(schedule: str, dp: int) -> str:
    """How gradients are averaged over data parallelism: "none" (dp 1), "ddp" (each stage module in
    DDP, reduced by the pipelining runtime), or "bucketed_all_reduce_after_schedule" (the
    zero-bubble split backward, which DDP's hooks cannot see; module docstring)."""
    if dp == 1:
        return "none"
    return "bucketed_all_reduce_after_schedule" if schedule == "zb" else "ddp"


def build_gpipe(spec: TrainSpec) -> TorchPipelineTrainer:
    return TorchPipelineTrainer(spec, "gpipe")


def build_1f1b(spec: TrainSpec) -> TorchPipelineTrainer:
    return TorchPipelineTrainer(spec, "1f1b")


def build_interleaved(spec: TrainSpec) -> TorchPipelineTrainer:
    return TorchPipelineTrainer(spec, "interleaved")


def build_zb(spec: TrainSpec) -> TorchPipelineTrainer:
    return TorchPipelineTrainer(spec, "zb")
