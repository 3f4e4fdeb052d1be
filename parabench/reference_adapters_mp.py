"""parabench adapters for the model-parallel reference implementations (tensor, sequence and
pipeline parallelism, composed with data parallelism) in ``reference_impls/``.

Strategies: ``ref.tp`` (Megatron TP), ``ref.tp_sp`` (+ sequence parallel), ``ref.pp_gpipe`` and
``ref.pp_1f1b``. Each reads its degrees from ``spec.options`` (``tp``, ``pp``; the topology already
laid the grid out from them), so ``ref.tp`` on ``tp x dp`` ranks, ``ref.pp_1f1b`` on ``pp x dp``
and ``ref.pp_1f1b`` with ``tp`` set on ``tp x pp x dp`` all go through the one composition
function, :func:`reference_impls.compose.parallelize`.

Options: ``microbatches`` (pipeline micro-batches per micro_batch, default ``2*pp``),
``schedule`` (for ``ref.tp``/``ref.tp_sp`` with ``pp > 1``: ``1f1b`` or ``gpipe``), ``sp``
(sequence parallel under a pipeline strategy), ``record_timeline`` (synchronise the device
around every pipeline event of the instrumented step, so its timeline is exact on GPUs; the timed
steps run unsynchronised).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parabench.models import build_model
from parabench.peers.common import adamw, autocast, optimizer_state_bytes, tensor_bytes
from parabench.strategies import Trainer, TrainSpec
from reference_impls.compose import parallelize


def gather_full_parameters(named: dict[str, torch.Tensor], shard_dims: dict, coords) -> dict | None:
    """Rank 0 assembles the full model from every rank's shards (collective over the world).

    ``coords`` = (dp, pp, tp) of this rank. Only dp replica 0 is used; each name is owned by one
    pipeline stage; tensor-parallel shards are concatenated along their split dimension in tp order.
    """
    mine = {"coords": tuple(coords),
            "params": {n: (t.detach().float().cpu(), shard_dims.get(n)) for n, t in named.items()}}
    everything = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everything, dst=0)
    if dist.get_rank() != 0:
        return None
    parts: dict[str, list] = {}
    for r in everything:
        dp_rank, _, tp_rank = r["coords"]
        if dp_rank != 0:
            continue
        for n, (t, dim) in r["params"].items():
            parts.setdefault(n, []).append((tp_rank, t, dim))
    full = {}
    for n, shards in parts.items():
        shards.sort(key=lambda x: x[0])
        dim = shards[0][2]
        full[n] = shards[0][1] if dim is None else torch.cat([t for _, t, _ in shards], dim=dim)
    return full


class ModelParallelTrainer(Trainer):
    def __init__(self, spec: TrainSpec, sequence_parallel: bool, schedule: str):
        self.spec = spec
        topo = spec.topology
        o = spec.options
        model = build_model(spec.model, spec.seed, spec.device)
        self.par = parallelize(model, tp_group=topo.tp_group, pp_group=topo.pp_group, dp_group=topo.dp_group,
                               sequence_parallel=sequence_parallel, schedule=schedule,
                               microbatches=o.get("microbatches"))
        # The synchronised timeline runs on the instrumented step only (measure_state is set for
        # it), so the timed steps of a record_timeline case keep their speed.
        self._timeline_wanted = bool(o.get("record_timeline"))
        del model
        self.optimizer = adamw(self.par.module.parameters(), spec)
        self.measure_state = False
        self._grad_bytes = 0

    def train_step(self, inputs, targets):
        if self.par.engine is not None:
            self.par.engine.record_timeline = self._timeline_wanted and self.measure_state
        with autocast(self.spec):
            loss = self.par.forward_backward(inputs, targets, self.spec.grad_accum)
        if self.measure_state:
            self._grad_bytes = tensor_bytes(p.grad for p in self.par.module.parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def state_bytes(self):
        return {"params": tensor_bytes(self.par.module.parameters()), "grads": self._grad_bytes,
                "optimizer": optimizer_state_bytes(self.optimizer)}

    def full_parameters(self):
        return gather_full_parameters(dict(self.par.module.named_parameters()), self.par.shard_dims,
                                      self.spec.topology.coords)

    def pipeline_stats(self) -> dict | None:
        """This stage's last-step schedule record: order, compute/wait seconds, measured and
        theoretical bubble fraction, peak live micro-batches (None without a pipeline)."""
        return self.par.pipeline_stats()

    def close(self):
        self.optimizer = None
        self.par = None


def build_tp(spec: TrainSpec) -> ModelParallelTrainer:
    return ModelParallelTrainer(spec, sequence_parallel=False, schedule=spec.options.get("schedule", "1f1b"))


def build_tp_sp(spec: TrainSpec) -> ModelParallelTrainer:
    return ModelParallelTrainer(spec, sequence_parallel=True, schedule=spec.options.get("schedule", "1f1b"))


def build_pp_gpipe(spec: TrainSpec) -> ModelParallelTrainer:
    return ModelParallelTrainer(spec, sequence_parallel=bool(spec.options.get("sp")), schedule="gpipe")


def build_pp_1f1b(spec: TrainSpec) -> ModelParallelTrainer:
    return ModelParallelTrainer(spec, sequence_parallel=bool(spec.options.get("sp")), schedule="1f1b")
