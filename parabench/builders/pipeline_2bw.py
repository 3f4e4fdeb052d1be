"""Builder of ref.pp_2bw: PipeDream-2BW (``reference_impls/pipeline_2bw.py``) on ``pp`` stages x ``dp``."""

from __future__ import annotations

import torch

from parabench.builders.model_parallel import gather_full_parameters
from parabench.families.model_parallel import ModelParallelOptions
from parabench.models import build_model
from parabench.peers.common import autocast, compile_blocks
from parabench.trainer import Trainer, TrainSpec


class PipeDream2BWTrainer(Trainer):
    def __init__(self, spec: TrainSpec):
        from reference_impls.pipeline import split_stage
        from reference_impls.pipeline_2bw import PipeDream2BW

        self.spec = spec
        topo = spec.topology
        o = ModelParallelOptions.read(spec.options)
        stage = torch.distributed.get_rank(topo.pp_group)
        ranks = torch.distributed.get_process_group_ranks(topo.pp_group)
        module = split_stage(build_model(spec.model, spec.seed, spec.device), stage, len(ranks), o.stage_layers)
        compile_blocks(module.blocks.values(), spec)
        a = spec.optim
        self.engine = PipeDream2BW(
            module,
            stage,
            ranks,
            topo.pp_group,
            adam=dict(lr=a.lr, betas=a.betas, eps=a.eps, weight_decay=a.weight_decay),
            dp_group=topo.dp_group,
        )
        self.n_micro = o.n_microbatches * spec.grad_accum
        self.d_model = spec.model.d_model

    def train_step(self, inputs, targets):
        self.engine.record_timeline = self.record_timeline
        act_shape = (inputs.shape[0] // self.n_micro, inputs.shape[1], self.d_model)
        with autocast(self.spec):
            return self.engine.run(inputs, targets, self.n_micro, act_shape, torch.float32)

    def state_bytes(self):
        return self.engine.state_bytes()

    def full_parameters(self):
        self.engine.flush()  # the backwards still in flight and their update: the newest version is final
        named = self.engine.newest_named_parameters()
        return gather_full_parameters(named, {n: None for n in named}, self.spec.topology.coords)

    def pipeline_stats(self):
        return self.engine.stats()

    def close(self):
        if self.engine is not None:
            self.engine.flush()
        self.engine = None


def build_pp_2bw(spec: TrainSpec) -> PipeDream2BWTrainer:
    return PipeDream2BWTrainer(spec)
