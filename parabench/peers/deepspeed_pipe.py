"""DeepSpeed's pipeline engine: ``deepspeed.pipe.PipelineModule`` + ``deepspeed.initialize`` +
``engine.train_batch``, cut from the same GPT as ``ref.pp_*`` and ``torch.pp_*``.

Layers: the embeddings (token + position), every transformer block, the final LayerNorm + head.
They are the modules of ``build_model(cfg, seed)`` itself (same initial weights), handed to
PipelineModule as plain modules; the stage split is parabench's (``partition_layers`` over the
blocks, the embeddings on the first stage, LayerNorm + head on the last), not DeepSpeed's
``partition_method``: ``_partition_layers`` is overridden to set the same boundaries the
reference and torch pipelines use, so the three run the same stages. Loss: parabench's
``lm_loss`` as the module's ``loss_fn``.

Micro-batches: ``microbatches * grad_accum`` (``microbatches`` defaults to ``2*pp``, as for
the other pipeline peers) pipeline micro-batches of ``micro_batch / microbatches`` samples,
given to DeepSpeed as ``gradient_accumulation_steps`` and ``train_micro_batch_size_per_gpu``;
``train_step`` is one ``engine.train_batch`` over an iterator of those micro-batches: DeepSpeed's
TrainSchedule (1F1B: ``p - stage - 1`` warm-up forwards, alternate, drain), the last stage's loss
divided by the accumulation steps (gradients of the mean loss), then ReduceTiedGrads, ReduceGrads
and one optimizer step. Engine config and optimizer as the other DeepSpeed peers in the case's
profile (ZeRO stage 0: ``parabench.peers.deepspeed_zero.ds_config`` and ``deepspeed_adamw``;
``tuned``: throughput timer off, bf16 overflow check off, DeepSpeed's FusedAdam on GPUs;
``matched``: the client torch AdamW); bf16 through DeepSpeed's ``bf16`` config, as for
them (bf16 module, fp32 master weights and gradient accumulation in DeepSpeed's BF16_Optimizer).

Communication (read from deepspeed/runtime/pipe/engine.py and p2p.py, confirmed by the meter):
blocking ``send``/``recv`` of the activation forward and its gradient backward per micro-batch
(the parameter dtype); before the first activation ever sent, one 256-int32 tensor-meta message
(``_send_tensor_meta``, 1 KiB; the shapes are then cached, ``dynamic_shape=False``); at the end
of every ``train_batch`` the last stage broadcasts [loss, dp-averaged loss] (two fp32) over the
pipe group, so every stage learns the loss. The engine's start-up exchanges one scalar between
neighbours ("just send a 0"). Only pp == world_size (no data parallelism) and no tensor
parallelism are wired; suite validation refuses the rest.

Checked on CPU/gloo (tests/test_deepspeed_pipe.py: fp32 equal to one process, bf16 close; bytes
equal to parabench.theory) and on 2 H100s over NCCL (results/h100x2, bytes equal to the theory).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from parabench.families.model_parallel import DeepSpeedPipeOptions
from parabench.models import build_model, lm_loss
from parabench.peers.common import tensor_bytes
from parabench.trainer import Trainer, TrainSpec
from reference_impls.pipeline import partition_layers


class Embed(nn.Module):
    """Token + position embeddings (the GPT's own modules)."""

    def __init__(self, tok_emb: nn.Module, pos_emb: nn.Module):
        super().__init__()
        self.tok_emb, self.pos_emb = tok_emb, pos_emb

    def forward(self, tokens):
        return self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))


class Head(nn.Module):
    """Final LayerNorm and output head (the GPT's own modules)."""

    def __init__(self, ln_f: nn.Module, head: nn.Module):
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x):
        return self.head(self.ln_f(x))


def layer_bounds(n_layers: int, pp: int, stage_layers: list[int] | None = None) -> list[int]:
    """PipelineModule ``parts`` for layers [Embed, block 0..L-1, Head]: parabench's block split
    (``stage_layers`` blocks per stage when given), the embeddings with the first stage's blocks,
    the head with the last's."""
    bounds = partition_layers(n_layers, pp, stage_layers)
    return [0] + [1 + hi for _, hi in bounds[:-1]] + [n_layers + 2]


def gpt_names(n_layers: int) -> list[str]:
    """Per pipeline layer, the prefix its parameters carry in the GPT ('' for Embed and Head)."""
    return [""] + [f"blocks.{i}." for i in range(n_layers)] + [""]


def _pipeline_module_class():
    from deepspeed.pipe import PipelineModule

    class ParabenchPipelineModule(PipelineModule):
        """PipelineModule with parabench's stage boundaries (``parts``) instead of a
        ``partition_method``; DeepSpeed calls ``_partition_layers`` from its ``__init__``."""

        def __init__(self, layers, parts: list[int], **kwargs):
            self._parabench_parts = parts
            super().__init__(layers, **kwargs)

        def _partition_layers(self, method="uniform"):
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self.parts = list(self._parabench_parts)
            self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    return ParabenchPipelineModule


def ds_pipe_config(spec: TrainSpec, n_micro: int, mb_size: int, profile: str = "tuned") -> dict:
    from parabench.peers.deepspeed_zero import ds_config

    cfg = ds_config(replace(spec, micro_batch=mb_size, grad_accum=n_micro), stage=0, profile=profile)
    cfg["train_batch_size"] = mb_size * n_micro * spec.topology.dp
    return cfg


class DeepSpeedPipelineTrainer(Trainer):
    def __init__(self, spec: TrainSpec):
        import deepspeed
        import deepspeed.comm as ds_dist
        from deepspeed.runtime.pipe.topology import ProcessTopology

        self.spec = spec
        topo = spec.topology
        if topo.tp != 1 or topo.dp != 1:
            raise ValueError(f"deepspeed.pp wires pp == world_size only (got dp={topo.dp}, tp={topo.tp})")
        if not ds_dist.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo" if spec.device.type == "cpu" else "nccl")
        pp, cfg = topo.pp, spec.model
        o = DeepSpeedPipeOptions.read(spec.options)
        self.profile = o.profile
        self.n_micro = o.n_microbatches * spec.grad_accum
        self.mb_size = spec.micro_batch * spec.grad_accum // self.n_micro
        if self.mb_size * self.n_micro != spec.micro_batch * spec.grad_accum:
            raise ValueError(f"{self.n_micro} micro-batches do not divide {spec.micro_batch * spec.grad_accum} samples")

        model = build_model(cfg, spec.seed, spec.device)
        layers = [Embed(model.tok_emb, model.pos_emb), *model.blocks, Head(model.ln_f, model.head)]
        parts = layer_bounds(cfg.n_layers, pp, o.stage_layers)
        # Axes (data, pipe): rank = data * pp + pipe, parabench's grid (pipeline innermost).
        ds_topo = ProcessTopology(axes=["data", "pipe"], dims=[topo.dp, pp])
        cls = _pipeline_module_class()
        pipe = cls(layers, parts, topology=ds_topo, loss_fn=lm_loss)
        # PipelineModule keeps its layer list; drop the other stages' modules so they are freed.
        lo, hi = pipe._local_start, pipe._local_stop
        pipe._layer_specs = [l if lo <= i < hi else None for i, l in enumerate(pipe._layer_specs)]
        prefixes = gpt_names(cfg.n_layers)
        self._names = {}
        for i in range(lo, hi):
            for n, p in layers[i].named_parameters():
                self._names[id(p)] = prefixes[i] + n
        del model, layers

        from parabench.peers.deepspeed_zero import deepspeed_adamw

        optimizer, self.optimizer_name = deepspeed_adamw(pipe.parameters(), spec, o.profile, offload=False)
        self.engine, *_ = deepspeed.initialize(
            model=pipe,
            optimizer=optimizer,
            config=ds_pipe_config(spec, self.n_micro, self.mb_size, o.profile),
            dist_init_required=False,
        )
        self.stage = self.engine.stage_id
        self.is_last = self.engine.is_last_stage()
        self.measure_state = False
        self._grad_bytes = None
        take = self.engine._take_model_step

        def sampled_step(*args, **kwargs):  # gradients are complete just before the optimizer step
            if self.measure_state:
                self._grad_bytes = self._held_grad_bytes()
            return take(*args, **kwargs)

        self.engine._take_model_step = sampled_step

    def _held_grad_bytes(self) -> int:
        opt = self.engine.optimizer
        n = tensor_bytes(p.grad for p in self.engine.module.parameters())
        flat = getattr(opt, "fp32_groups_gradients_flat", None)  # BF16_Optimizer's fp32 accumulators
        return n + (tensor_bytes(flat) if flat is not None else 0)

    def train_step(self, inputs, targets):
        micro = list(zip(inputs.split(self.mb_size), targets.split(self.mb_size)))
        loss = self.engine.train_batch(iter(micro))
        # DeepSpeed broadcasts the loss to every stage; like the other pipeline peers, only the
        # last stage reports it (the one that computed it).
        return loss.detach().float() if self.is_last else None

    def state_bytes(self):
        from parabench.peers.deepspeed_zero import deepspeed_optimizer_bytes

        return {
            "params": tensor_bytes(self.engine.module.parameters()),
            "grads": self._grad_bytes,
            "optimizer": deepspeed_optimizer_bytes(self.engine.optimizer),
        }

    def strategy_stats(self) -> dict:
        return {
            "profile": self.profile,
            "optimizer": self.optimizer_name,
            "optimizer_wrapper": type(self.engine.optimizer).__name__,
        }

    def full_parameters(self):
        from parabench.peers.common import assemble_on_rank0

        mine = {
            n: p.detach().float().cpu() for n, p in ((self._names[id(p)], p) for p in self.engine.module.parameters())
        }
        return assemble_on_rank0(mine, self.spec)

    def close(self):
        if hasattr(self, "engine"):
            self.engine.destroy() if hasattr(self.engine, "destroy") else None
            del self.engine
        # The pipeline engine hands its grid to DeepSpeed as the process-wide model-parallel unit
        # (runtime/engine.py: ``groups.mpu = self.mpu``), and destroy() leaves it there: a later
        # engine in this process would read its model-parallel and data-parallel sizes from this
        # pipeline ("'NoneType' object has no attribute 'get_model_parallel_rank'" in ZeRO-3, "1 is
        # not divisible by 2" in the MoE engine's expert groups).
        from deepspeed.utils import groups

        groups.mpu = None


def build(spec: TrainSpec) -> DeepSpeedPipelineTrainer:
    from parabench.peers.deepspeed_zero import deepspeed_on_cpu

    deepspeed_on_cpu(spec)
    return DeepSpeedPipelineTrainer(spec)
