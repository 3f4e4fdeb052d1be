"""Thin builders that turn ``reference_impls`` classes into parabench trainers.

The reference classes are plain torch (no parabench imports) and already speak the Trainer
interface (``train_step``, ``state_bytes``, ``full_parameters``, ``close``, ``measure_state``);
they are registered as virtual subclasses of :class:`parabench.strategies.Trainer`. Each builder
makes the shared model, hands over the data-parallel group(s), the compute dtype and the
explicit AdamW hyperparameters, and reads its options from ``spec.options``:

* ``bucket_mb`` (ddp, zero1, zero2): gradient bucket size in MiB of the compute dtype, default 25;
* ``shard_size`` (hsdp): ranks per shard group, default 2;
* ``prefetch`` (zero3, fsdp, hsdp): all-gather the next block ahead of time, default True.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parabench.models import build_model, lm_loss
from parabench.strategies import Trainer, TrainSpec


def _common(spec: TrainSpec) -> dict:
    if spec.precision not in ("fp32", "bf16"):
        raise ValueError(f"reference data-parallel strategies support fp32 and bf16, not {spec.precision!r} "
                         "(fp16 needs the loss scaler, see reference_impls/dp_common.py)")
    o = spec.optim
    return dict(grad_accum=spec.grad_accum, compute_dtype=spec.compute_dtype,
                adam=dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay))


def _model(spec: TrainSpec):
    return build_model(spec.model, spec.seed, spec.device)


def _register(cls):
    Trainer.register(cls)
    return cls


def build_ps(spec: TrainSpec):
    from reference_impls.data_parallel import ParameterServer

    return _register(ParameterServer)(_model(spec), lm_loss, spec.topology.dp_group, **_common(spec))


def build_ddp(spec: TrainSpec):
    from reference_impls.data_parallel import DDP

    return _register(DDP)(_model(spec), lm_loss, spec.topology.dp_group,
                          bucket_mb=float(spec.options.get("bucket_mb", 25)), **_common(spec))


def _zero(spec: TrainSpec, stage: int):
    from reference_impls.zero import ZeRO

    return _register(ZeRO)(_model(spec), lm_loss, spec.topology.dp_group, stage=stage,
                           bucket_mb=float(spec.options.get("bucket_mb", 25)), **_common(spec))


def build_zero1(spec: TrainSpec):
    return _zero(spec, 1)


def build_zero2(spec: TrainSpec):
    return _zero(spec, 2)


def _fsdp(spec: TrainSpec, reshard_root: bool, shard_group=None, replicate_group=None):
    from reference_impls.fsdp import FSDP

    model = _model(spec)
    return _register(FSDP)(model, lm_loss, list(model.blocks), shard_group or spec.topology.dp_group,
                           replicate_group=replicate_group, reshard_root=reshard_root,
                           prefetch=bool(spec.options.get("prefetch", True)), **_common(spec))


def build_zero3(spec: TrainSpec):
    return _fsdp(spec, reshard_root=True)


def build_fsdp(spec: TrainSpec):
    return _fsdp(spec, reshard_root=False)


def hsdp_groups(world: int, dp: int, pp: int, tp: int, shard_size: int, rank: int):
    """(shard ranks, replicate ranks) lists for every data-parallel group of the grid
    ``arange(world).view(dp, pp, tp)``, and the two lists this rank belongs to.

    Within each dp group, consecutive dp ranks form a shard group (the fast links, like torch's
    HSDP mesh ``(replicate, shard)``); ranks with the same position in their shard group form a
    replica group."""
    if dp % shard_size or shard_size < 1:
        raise ValueError(f"hsdp: shard_size {shard_size} must divide the data-parallel degree {dp}")
    grid = torch.arange(world).view(dp, pp, tp)
    shards, replicas = [], []
    for p in range(pp):
        for t in range(tp):
            col = grid[:, p, t].tolist()
            shards += [col[k:k + shard_size] for k in range(0, dp, shard_size)]
            replicas += [col[j::shard_size] for j in range(shard_size)]
    mine = lambda lists: next(g for g in lists if rank in g)  # noqa: E731
    return shards, replicas, mine(shards), mine(replicas)


def build_hsdp(spec: TrainSpec):
    topo = spec.topology
    shard_size = int(spec.options.get("shard_size", 2))
    shards, replicas, _, _ = hsdp_groups(topo.world_size, topo.dp, topo.pp, topo.tp, shard_size, topo.rank)
    # Every rank creates every group, in the same order (new_group is collective over the world).
    shard_group, _ = dist.new_subgroups_by_enumeration(shards)
    replicate_group, _ = dist.new_subgroups_by_enumeration(replicas)
    return _fsdp(spec, reshard_root=False, shard_group=shard_group, replicate_group=replicate_group)
