"""The one place where tensor, pipeline and data parallelism are composed (torch only).

Order, and why (picotron's TP -> PP -> DP; torchtitan writes its reasons down the same way):

1. **Tensor parallelism first.** It replaces every layer by its shard, sliced from the full layer
   (which must still exist: after a pipeline split another stage's layers would be gone from the
   module, but we also want the TP wrapper's ``embed``/``head_loss`` to be what the pipeline puts
   on its first and last stage). Everything after it sees the final local parameters.
2. **Pipeline second.** It keeps the layers of this rank's stage and drops the rest. The boundary
   activation it sends is whatever the TP model's residual stream is: ``[b, s, h]`` replicated
   over the TP group, or ``[b, s/t, h]`` under sequence parallelism. With ``virtual_stages > 1``
   the rank keeps ``v`` chunks instead of one stage (``pipeline_interleaved.py``); nothing else
   changes for TP or DP.
3. **Data parallelism last.** It only has to reduce the gradients of whatever parameters this
   rank ended up holding, once per step, after the pipeline flush (all micro-batches) and after
   the sequence-parallel all-reduce of the replicated parameters over the TP group. Reducing once
   per step rather than per micro-batch is what ``no_sync`` buys DDP; we simply never sync early.
   One flat fp32 all-reduce over the dp group (a single bucket, not overlapped with backward:
   the pipeline's last backward is the earliest point all stages' gradients are final anyway).

Process groups are passed in explicitly; nothing here is global.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from reference_impls.pipeline import PipelineEngine, split_stage
from reference_impls.pipeline_interleaved import InterleavedPipelineEngine, split_chunks
from reference_impls.pipeline_zb import ZeroBubblePipelineEngine
from reference_impls.tensor_parallel import allreduce_sequence_parallel_grads, apply_tensor_parallel


def allreduce_grads_mean(params, group) -> None:
    """Average gradients over the data-parallel group: one flat all-reduce, then divide."""
    grads = [p.grad for p in params if p.grad is not None]
    n = dist.get_world_size(group)
    if n == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(n)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class ParallelGPT:
    """This rank's part of a GPT under TP x PP x DP, and how to run one step's forward/backward."""

    def __init__(
        self,
        module: nn.Module,
        shard_dims: dict,
        tp_group,
        dp_group,
        engine: PipelineEngine | InterleavedPipelineEngine | ZeroBubblePipelineEngine | None,
        microbatches: int,
        seq_len: int,
        d_model: int,
        sp_params: list,
        tp: int,
        sequence_parallel: bool,
    ):
        self.module, self.shard_dims = module, shard_dims
        self.tp_group, self.dp_group, self.engine = tp_group, dp_group, engine
        self.microbatches, self.seq_len, self.d_model = microbatches, seq_len, d_model
        self.sp_params, self.tp, self.sequence_parallel = sp_params, tp, sequence_parallel

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, grad_accum: int = 1):
        """Accumulate this step's gradients; return the mean loss (None on non-last stages)."""
        if self.engine is not None:
            n_micro = self.microbatches * grad_accum
            s_local = self.seq_len // self.tp if self.sequence_parallel else self.seq_len
            act_shape = (inputs.shape[0] // n_micro, s_local, self.d_model)
            # The residual stream crosses stage boundaries in the parameters' dtype (fp32 under
            # autocast, bf16 when the parameters are bf16).
            act_dtype = next(self.module.parameters()).dtype
            loss = self.engine.run(inputs, targets, n_micro, act_shape, act_dtype)
        else:
            loss = torch.zeros((), device=inputs.device)
            for x, y in zip(inputs.chunk(grad_accum), targets.chunk(grad_accum)):
                part = self.module(x, y) / grad_accum
                part.backward()
                loss += part.detach()
        self.reduce_grads()
        return loss

    def reduce_grads(self) -> None:
        if self.sp_params:
            allreduce_sequence_parallel_grads(self.sp_params, self.tp_group)
        allreduce_grads_mean(self.module.parameters(), self.dp_group)

    def pipeline_stats(self) -> dict | None:
        return self.engine.stats() if self.engine is not None else None


def parallelize(
    model: nn.Module,
    *,
    tp_group,
    pp_group,
    dp_group,
    sequence_parallel: bool = False,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    record_timeline: bool = False,
    virtual_stages: int = 1,
    stage_layers: list[int] | None = None,
) -> ParallelGPT:
    """Apply TP, then PP, then DP to the full ``model`` (built identically on every rank).
    ``stage_layers``: blocks per pipeline stage (``pipeline.partition_layers``); None, an equal
    split. One stage per rank only: interleaving cuts ``pp x virtual_stages`` chunks instead."""
    cfg = model.cfg
    tp = dist.get_world_size(tp_group)
    pp = dist.get_world_size(pp_group)
    sp_params: list = []
    if tp > 1 or sequence_parallel:  # 1. tensor parallel
        model = apply_tensor_parallel(model, tp_group, sequence_parallel)
        shard_dims = model.shard_dims()
        sp_names = {n for n, d in shard_dims.items() if d is None} if sequence_parallel else set()
    else:
        shard_dims = {n: None for n, _ in model.named_parameters()}
        sp_names = set()
    engine = None
    if pp > 1:  # 2. pipeline
        stage = dist.get_rank(pp_group)
        ranks = dist.get_process_group_ranks(pp_group)
        if virtual_stages > 1:
            if stage_layers is not None:
                raise ValueError(
                    f"stage_layers sets the blocks of each of {pp} pipeline stages; interleaving "
                    f"(virtual_stages={virtual_stages}) cuts {pp * virtual_stages} chunks and takes no stage_layers"
                )
            n_layers = len(model.blocks)
            model = split_chunks(model, stage, pp, virtual_stages)
            engine = InterleavedPipelineEngine(
                model, stage, ranks, pp_group, virtual_stages, n_layers, record_timeline=record_timeline
            )
        elif schedule == "zb_h1":  # B and W split (pipeline_zb.py); the stage split of 1F1B
            model = split_stage(model, stage, pp, stage_layers)
            engine = ZeroBubblePipelineEngine(model, stage, ranks, pp_group, record_timeline=record_timeline)
        else:
            model = split_stage(model, stage, pp, stage_layers)
            engine = PipelineEngine(model, stage, ranks, pp_group, schedule=schedule, record_timeline=record_timeline)
    names = dict(model.named_parameters())
    shard_dims = {n: shard_dims[n] for n in names}
    sp_params = [p for n, p in names.items() if n in sp_names]
    # 3. data parallel: ParallelGPT.reduce_grads, once per step
    return ParallelGPT(
        model,
        shard_dims,
        tp_group,
        dp_group,
        engine,
        microbatches or 2 * pp,
        cfg.seq_len,
        cfg.d_model,
        sp_params,
        tp,
        sequence_parallel,
    )
