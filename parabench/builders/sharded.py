"""Builders of the reference sharded strategies: ZeRO stages 1-3, FSDP (full and hybrid shard),
CPU offload and ZeRO++ (``reference_impls/zero.py``, ``fsdp.py``, ``zero_offload.py``, ``zeropp.py``)."""

from __future__ import annotations

import torch.distributed as dist

from parabench.builders.data_parallel import common_kwargs, dp_groups, reference_model, with_lr_spike
from parabench.families.sharded import ShardedOptions, ZeroInfinityOptions, ZeroPPOptions, hsdp_groups
from parabench.models import lm_loss
from parabench.trainer import TrainSpec, as_trainer


def _zero(spec: TrainSpec, stage: int):
    from reference_impls.zero import ZeRO

    o = ShardedOptions.read(spec.options)
    return with_lr_spike(
        as_trainer(ZeRO)(
            reference_model(spec, o),
            lm_loss,
            spec.topology.dp_group,
            stage=stage,
            bucket_mb=float(o.bucket_mb),
            reduce_every_micro_batch=o.reduce_every_micro_batch,
            **common_kwargs(spec, o, dp_groups(spec)),
        ),
        o,
    )


def build_zero1(spec: TrainSpec):
    return _zero(spec, 1)


def build_zero2(spec: TrainSpec):
    return _zero(spec, 2)


def build_zero2_offload(spec: TrainSpec):
    from reference_impls.zero_offload import ZeROOffload

    o = ShardedOptions.read(spec.options)
    return with_lr_spike(
        as_trainer(ZeROOffload)(
            reference_model(spec, o),
            lm_loss,
            spec.topology.dp_group,
            bucket_mb=float(o.bucket_mb),
            **common_kwargs(spec, o, dp_groups(spec)),
        ),
        o,
    )


def _fsdp(spec: TrainSpec, reshard_root: bool, shard_group=None, replicate_group=None):
    from reference_impls.fsdp import FSDP

    o = ShardedOptions.read(spec.options)
    model = reference_model(spec, o)
    group = shard_group or spec.topology.dp_group
    # The inf flag goes round the shard group and, for HSDP, the replica group too.
    groups = [group or dist.group.WORLD] + ([replicate_group] if replicate_group is not None else [])
    return with_lr_spike(
        as_trainer(FSDP)(
            model,
            lm_loss,
            list(model.blocks),
            group,
            replicate_group=replicate_group,
            reshard_root=reshard_root,
            prefetch=bool(o.prefetch),
            in_flight=o.in_flight,
            reduce_every_micro_batch=o.reduce_every_micro_batch,
            **common_kwargs(spec, o, groups),
        ),
        o,
    )


def build_zero3(spec: TrainSpec):
    return _fsdp(spec, reshard_root=True)


def build_fsdp(spec: TrainSpec):
    return _fsdp(spec, reshard_root=False)


def build_zero3_nvme(spec: TrainSpec):
    """ref.zero3_nvme: the swap files go to a folder of this rank's own under ``nvme_path``, else under
    the case's scratch folder (the runner's), else the system's temporary folder; removed at close."""
    import os
    import tempfile

    from reference_impls.zero_infinity import ZeROInfinity

    o = ZeroInfinityOptions.read(spec.options)
    scratch = os.environ.get("PARABENCH_CASE_SCRATCH")
    root = o.nvme_path or (scratch + ".nvme" if scratch else tempfile.gettempdir())
    os.makedirs(root, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=f"ref-zero3-nvme-rank{spec.topology.rank}-", dir=root)
    model = reference_model(spec, o)
    group = spec.topology.dp_group
    return with_lr_spike(
        as_trainer(ZeROInfinity)(
            model,
            lm_loss,
            list(model.blocks),
            group,
            folder=folder,
            io_threads=o.io_threads,
            prefetch=bool(o.prefetch),
            in_flight=o.in_flight,
            **common_kwargs(spec, o, [group or dist.group.WORLD]),
        ),
        o,
    )


def build_zeropp(spec: TrainSpec):
    from reference_impls.zeropp import ZeroPP

    o = ZeroPPOptions.read(spec.options)
    topo = spec.topology
    hpz_group = None
    if o.hpz and o.hpz_partition_size > 1:  # consecutive dp ranks, as DeepSpeed's (and HSDP's) groups
        secondary, _, _, _ = hsdp_groups(topo.world_size, topo.dp, topo.pp, topo.tp, o.hpz_partition_size, topo.rank)
        hpz_group, _ = dist.new_subgroups_by_enumeration(secondary)
    model = reference_model(spec, o)
    group = topo.dp_group
    return with_lr_spike(
        as_trainer(ZeroPP)(
            model,
            lm_loss,
            list(model.blocks),
            group,
            qwz=o.qwz,
            hpz=o.hpz,
            hpz_group=hpz_group,
            qgz=o.qgz,
            qgz_bits=o.qgz_bits,
            block=o.quant_block,
            prefetch=bool(o.prefetch),
            in_flight=o.in_flight,
            **common_kwargs(spec, o, [group or dist.group.WORLD]),
        ),
        o,
    )


def build_hsdp(spec: TrainSpec):
    topo = spec.topology
    shard_size = ShardedOptions.read(spec.options).shard_size
    shards, replicas, _, _ = hsdp_groups(topo.world_size, topo.dp, topo.pp, topo.tp, shard_size, topo.rank)
    # Every rank creates every group, in the same order (new_group is collective over the world).
    shard_group, _ = dist.new_subgroups_by_enumeration(shards)
    replicate_group, _ = dist.new_subgroups_by_enumeration(replicas)
    return _fsdp(spec, reshard_root=False, shard_group=shard_group, replicate_group=replicate_group)
