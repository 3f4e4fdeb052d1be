"""PyTorch FSDP2: ``fully_shard`` on every transformer block, then on the root module.

Parameters are DTensors sharded along dim 0 over the data-parallel mesh; each block's
parameters are all-gathered before its forward and backward and resharded after, and gradients
are reduce-scattered. Recipe "master" (bf16/fp16): the policy is 16-bit parameters for compute and
fp32 gradient reduction (torchtitan's default; ``matched`` reduces in the compute dtype, as the
references do), so the sharded fp32 parameters are the master weights. Recipe "amp": fp32 shards,
fp32 traffic, autocast forward. Recipe "fp8" (``parabench.fp8``): "amp" with the blocks' linears
in torchao's Float8Linear; option ``fp8_all_gather`` gathers their weights in float8 (torchao's
``enable_fsdp_float8_all_gather``, cast from the fp32 shard before the gather) and, as torchtitan's
tensorwise setup pairs it (``--float8.enable_fsdp_float8_all_gather
--float8.precompute_float8_dynamic_scale_for_fsdp``, torchao benchmarks/float8/training/llama3.sh),
computes every float8 weight's scale after the optimizer step in one all-reduce
(``precompute_float8_dynamic_scale_for_fsdp``); without it each weight's pre-all-gather hook
all-reduces its own amax, eagerly, in forward and again in backward. fp16 adds
the plain ``torch.amp.GradScaler`` (see ``common.TorchTrainer``): its unscale of DTensor gradient
shards all-reduces the found-inf flag over the mesh, so every rank skips alike (docs/facts.md).

``torch.fsdp2_offload``: the same with ``CPUOffloadPolicy`` — sharded parameters, gradients and
the optimizer step live in CPU memory; each block's shard is copied to the device for its
all-gather. On a CPU-only machine the "device" is the CPU already, so the copies are no-ops and the
numbers measure only the policy's bookkeeping.

Profiles (option ``profile``):

* ``tuned`` (the default) is torchtitan's FSDP2 setup, as its current source applies it to every
  decoder (pytorch/torchtitan at b5bcd76, torchtitan/distributed/fsdp.py
  ``apply_fsdp_to_decoder``, called by torchtitan/models/llama3/parallelize.py
  ``parallelize_llama``; the grouping since torchtitan#1094): the token embedding is its own
  ``fully_shard`` group; the final norm and the output head are one group, not resharded after
  forward ("FSDP would prefetch them immediately"); every transformer block is its own group;
  then the root, left to FSDP2's own choice (``reshard_after_forward`` unset: the root is not
  resharded after forward; here it holds the position embedding only). The blocks and the token
  embedding follow ``get_fsdp_reshard_after_forward_policy``: its "default" without pipelining
  reshards them, and the [norm, head] group is resharded under "always" only. Option
  ``reshard_after_forward``, where given, picks "always" (true) or "never" (false).
  ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32, cast_forward_inputs=False)``: torchtitan's
  ``training.mixed_precision_reduce`` admits float32 only (torchtitan/config/configs.py), so tuned
  FSDP2 always reduce-scatters in fp32 (``families.sharded.fsdp2_reduce_dtype``, which the report
  shows beside a ratio to a reference that reduces in bf16). torch's fused AdamW on GPUs
  (``common.adamw``). Not taken over: torchtitan's ``disable_fsdp_gradient_division`` (it divides
  by the global token count itself; parabench's loss is a mean, so FSDP2's own division stays).
* ``matched``: every block and the root (embeddings, final norm, head) resharded after forward
  (option ``reshard_after_forward``), gradients reduced in the compute dtype: the memory and
  traffic of ref.zero3.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from parabench.families.sharded import ShardedPeerOptions, fsdp2_reduce_dtype
from parabench.models import build_model
from parabench.peers.common import TorchTrainer, adamw, checkpoint_blocks, compile_blocks
from parabench.trainer import TrainSpec


class FSDP2Trainer(TorchTrainer):
    # Option fp8_all_gather: refresh the float8 weights' scales after each optimizer step.
    precompute_float8_scales = False

    def train_step(self, inputs, targets):
        loss = super().train_step(inputs, targets)
        if self.precompute_float8_scales:
            # torchao: "run after the optimizer step. It performs a single all-reduce to compute the
            # scales for all float8 weights" (torchao/float8/fsdp_utils.py); torchtitan calls it from
            # its post-optimizer hook (components/quantization/float8.py, ``post_optimizer_hook``).
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.module)
        return loss

    def full_parameters(self):
        return {n: p.full_tensor().detach().float().cpu() for n, p in self.module.named_parameters()}


def shard_groups(model, o: ShardedPeerOptions, given: dict) -> list[tuple[object, bool | None]]:
    """The ``fully_shard`` groups in the order they are applied, each with its
    ``reshard_after_forward`` (None: FSDP2's own choice). ``tuned``: torchtitan's
    ``apply_fsdp_to_decoder`` (module docstring), with its policy "default" unless option
    ``reshard_after_forward`` is given ("always" for true, "never" for false). ``matched``: every
    block, then the root, at the option's value."""
    if o.profile != "tuned":
        return [(block, o.reshard_after_forward) for block in model.blocks] + [(model, o.reshard_after_forward)]
    policy = ("always" if o.reshard_after_forward else "never") if "reshard_after_forward" in given else "default"
    reshard = policy != "never"  # get_fsdp_reshard_after_forward_policy without pipelining
    return (
        [(model.tok_emb, reshard), ([model.ln_f, model.head], policy == "always")]
        + [(block, reshard) for block in model.blocks]
        + [(model, None)]
    )


def build(spec: TrainSpec, offload: bool = False, mesh=None) -> FSDP2Trainer:
    model = build_model(spec.model, spec.seed, spec.device)
    o = ShardedPeerOptions.read(spec.options)
    if spec.recipe == "fp8":  # first, as torchtitan converts before parallelizing
        from parabench.fp8 import convert

        convert(model, o.fp8_filter, fsdp_float8_all_gather=o.fp8_all_gather)
    checkpoint_blocks(model, spec)  # before fully_shard: its hooks stay outside the recomputed region
    compile_blocks(model.blocks, spec)  # ... and outside the compiled one (torchtitan's order)
    mesh = mesh if mesh is not None else spec.topology.mesh["dp"]
    mp = mixed_precision_policy(spec, o)
    extra = {"offload_policy": CPUOffloadPolicy(pin_memory=spec.device.type == "cuda")} if offload else {}
    for modules, reshard in shard_groups(model, o, spec.options):
        fully_shard(modules, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, **extra)
    # With offload the parameters (and the AdamW step) are on the CPU: no fused CUDA kernel there.
    opt_spec = replace(spec, device=torch.device("cpu")) if offload else spec
    trainer = FSDP2Trainer(
        spec,
        model,
        adamw(model.parameters(), opt_spec),
        no_sync=None if o.reduce_every_micro_batch else lambda: without_gradient_sync(model),
        autocast_enabled=spec.autocast_on,
    )
    trainer.precompute_float8_scales = spec.recipe == "fp8" and o.fp8_all_gather
    return trainer


@contextlib.contextmanager
def without_gradient_sync(model):
    """Option reduce_every_micro_batch false: FSDP2's accumulation without communication
    (``set_requires_gradient_sync(False)`` on every micro-batch but the last, recursively on every
    fully_shard module): gradients accumulate unsharded, the last backward reduce-scatters them."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def mixed_precision_policy(spec: TrainSpec, o: ShardedPeerOptions) -> MixedPrecisionPolicy:
    """ "master": FSDP2 casts the fp32 shards (the master weights) to bf16/fp16 for compute, and
    reduces gradients in ``fsdp2_reduce_dtype``'s dtype: fp32 (``tuned``, torchtitan's, which also
    leaves forward inputs uncast) or the compute dtype (``matched``, as the references
    reduce-scatter). "amp" and fp32: no casting by FSDP2, fp32 on the wire, autocast in the forward
    (``TorchTrainer``)."""
    if spec.autocast_on or spec.precision == "fp32":
        return MixedPrecisionPolicy()
    reduce = torch.float32 if fsdp2_reduce_dtype(spec.precision, spec.recipe, o) == "fp32" else spec.compute_dtype
    if o.profile == "tuned":
        return MixedPrecisionPolicy(param_dtype=spec.compute_dtype, reduce_dtype=reduce, cast_forward_inputs=False)
    return MixedPrecisionPolicy(param_dtype=spec.compute_dtype, reduce_dtype=reduce)


def build_offload(spec: TrainSpec) -> FSDP2Trainer:
    return build(spec, offload=True)


def build_hsdp(spec: TrainSpec) -> FSDP2Trainer:
    """FSDP2 hybrid shard: a 2-D (replicate, shard) mesh over the data-parallel ranks; parameters
    are sharded within groups of ``shard_size`` consecutive ranks and replicated across groups
    (gradients reduce-scattered in the group, then all-reduced across replicas)."""
    from torch.distributed.device_mesh import init_device_mesh

    topo = spec.topology
    if topo.tp != 1 or topo.pp != 1:
        raise ValueError("torch.hsdp composes with neither tp nor pp here")
    shard = ShardedPeerOptions.read(spec.options).shard_size
    if topo.dp % shard:
        raise ValueError(f"shard_size={shard} does not divide the data-parallel degree {topo.dp}")
    mesh = init_device_mesh(spec.device.type, (topo.dp // shard, shard), mesh_dim_names=("replicate", "shard"))
    return build(spec, mesh=mesh)
