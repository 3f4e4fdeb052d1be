"""Thin builders that turn ``reference_impls`` classes into parabench trainers.

The reference classes are plain torch (no parabench imports) and already speak the Trainer
interface (``train_step``, ``state_bytes``, ``full_parameters``, ``close``, ``measure_state``);
they are registered as virtual subclasses of :class:`parabench.strategies.Trainer`. Each builder
makes the shared model, hands over the data-parallel group(s), the compute dtype and the
explicit AdamW hyperparameters, and reads its options from ``spec.options``:

* ``bucket_mb`` (ddp, zero1, zero2): gradient bucket size in MiB of the compute dtype, default 25;
* ``shard_size`` (hsdp): ranks per shard group, default 2;
* ``prefetch`` (zero3, fsdp, hsdp): all-gather the next block ahead of time, default True;
* fp16 only (``reference_impls/mixed_precision.py``): ``init_scale`` (default 2**16),
  ``growth_interval`` (default 2000), ``scaler_check`` ("global", default, or "local": the broken
  per-rank check kept to show the failure), ``inject_inf = {rank, step}`` (an inf written into that
  rank's gradient shard at that step, before unscale);
* any precision: ``lr_spike = {step, factor}`` (that step's learning rate times factor),
  ``activation_checkpointing`` (recompute each transformer block in backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parabench.models import build_model, lm_loss
from parabench.strategies import Trainer, TrainSpec


def _scaler(spec: TrainSpec, groups):
    """fp16: the dynamic loss scaler whose inf check all-reduces over ``groups`` (every group
    holding a shard); None for fp32/bf16, where nothing is scaled and nothing syncs."""
    if spec.precision != "fp16":
        return None
    from reference_impls.mixed_precision import DynamicLossScaler

    o = spec.options
    return DynamicLossScaler(init_scale=float(o.get("init_scale", 2.0 ** 16)),
                             growth_interval=int(o.get("growth_interval", 2000)),
                             check=o.get("scaler_check", "global"),
                             groups=[g for g in groups if g is not None], inject_inf=o.get("inject_inf"))


def _common(spec: TrainSpec, groups=()) -> dict:
    if spec.precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"reference data-parallel strategies support fp32, bf16 and fp16, not {spec.precision!r}")
    o = spec.optim
    return dict(grad_accum=spec.grad_accum, compute_dtype=spec.compute_dtype,
                adam=dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay),
                grad_scaler=_scaler(spec, groups))


def _model(spec: TrainSpec):
    model = build_model(spec.model, spec.seed, spec.device)
    if spec.options.get("activation_checkpointing"):
        from reference_impls.activation_checkpointing import checkpoint_blocks

        checkpoint_blocks(model.blocks)
    return model


def _register(cls):
    Trainer.register(cls)
    return cls


def _with_lr_spike(trainer, spec: TrainSpec):
    """Option ``lr_spike = {step, factor}``: multiply the learning rate of that one step by factor."""
    spike = spec.options.get("lr_spike")
    if not spike:
        return trainer
    inner, counter = trainer.train_step, [0]

    def train_step(inputs, targets):
        opt = getattr(trainer, "optimizer", None)
        hit = opt is not None and counter[0] == int(spike.get("step", 0))
        if hit:
            saved = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] *= float(spike.get("factor", 10.0))
        try:
            return inner(inputs, targets)
        finally:
            counter[0] += 1
            if hit:
                for g, lr in zip(opt.param_groups, saved):
                    g["lr"] = lr

    trainer.train_step = train_step
    return trainer


def build_ps(spec: TrainSpec):
    from reference_impls.data_parallel import ParameterServer

    # Only the server decides (it holds the summed gradient): no all-reduce of the inf flag.
    return _with_lr_spike(_register(ParameterServer)(_model(spec), lm_loss, spec.topology.dp_group,
                                                     **_common(spec)), spec)


def build_ddp(spec: TrainSpec):
    from reference_impls.data_parallel import DDP

    # Every rank holds the full reduced gradient; the global check still all-reduces the inf flag
    # over the dp group, so an inf that appears on one rank only (after the all-reduce) skips everywhere.
    return _with_lr_spike(_register(DDP)(_model(spec), lm_loss, spec.topology.dp_group,
                                         bucket_mb=float(spec.options.get("bucket_mb", 25)),
                                         **_common(spec, [spec.topology.dp_group or dist.group.WORLD])), spec)


def _zero(spec: TrainSpec, stage: int):
    from reference_impls.zero import ZeRO

    return _with_lr_spike(_register(ZeRO)(_model(spec), lm_loss, spec.topology.dp_group, stage=stage,
                                          bucket_mb=float(spec.options.get("bucket_mb", 25)),
                                          **_common(spec, [spec.topology.dp_group or dist.group.WORLD])), spec)


def build_zero1(spec: TrainSpec):
    return _zero(spec, 1)


def build_zero2(spec: TrainSpec):
    return _zero(spec, 2)


def build_zero2_offload(spec: TrainSpec):
    from reference_impls.zero_offload import ZeROOffload

    return _with_lr_spike(_register(ZeROOffload)(_model(spec), lm_loss, spec.topology.dp_group,
                                                 bucket_mb=float(spec.options.get("bucket_mb", 25)),
                                                 **_common(spec, [spec.topology.dp_group or dist.group.WORLD])), spec)


def _fsdp(spec: TrainSpec, reshard_root: bool, shard_group=None, replicate_group=None):
    from reference_impls.fsdp import FSDP

    model = _model(spec)
    group = shard_group or spec.topology.dp_group
    # The inf flag goes round the shard group and, for HSDP, the replica group too.
    groups = [group or dist.group.WORLD] + ([replicate_group] if replicate_group is not None else [])
    return _with_lr_spike(_register(FSDP)(model, lm_loss, list(model.blocks), group,
                                          replicate_group=replicate_group, reshard_root=reshard_root,
                                          prefetch=bool(spec.options.get("prefetch", True)),
                                          **_common(spec, groups)), spec)


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
