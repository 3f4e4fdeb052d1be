"""DeepSpeed engine with ZeRO stage 0 (plain data parallel) to 3, configured from the case.

The optimizer is a client ``torch.optim.AdamW`` with parabench's explicit hyperparameters (the
fused CUDA kernel on GPUs, the same one the torch peers use), so the comparison measures ZeRO's
partitioning and communication rather than two different Adam kernels, and no DeepSpeed op has
to be JIT-compiled on a fresh machine. ``zero_allow_untested_optimizer`` admits it.
DeepSpeed divides the loss by the accumulation steps itself, so micro-batch losses go in
unscaled. On a CPU, ``DS_ACCELERATOR=cpu`` must be set before DeepSpeed is imported (the runner
does this).
"""

from __future__ import annotations

import os

import torch

from parabench.models import build_model, lm_loss
from parabench.peers.common import adamw, optimizer_state_bytes, tensor_bytes
from parabench.strategies import Trainer, TrainSpec


def ds_config(spec: TrainSpec, stage: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.grad_accum,
        "train_batch_size": spec.micro_batch * spec.grad_accum * spec.topology.dp,
        "zero_optimization": {"stage": stage, **spec.options.get("zero", {})},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if stage == 3:
        # Reshard after forward like FSDP2 and ref.zero3, so the three are comparable in memory
        # and traffic: DeepSpeed's defaults keep small parameters resident and keep any
        # parameter whose reuse comes within 1e9 elements, which makes its traffic depend on the
        # model size in ways no formula in the record could follow.
        cfg["zero_optimization"].setdefault("stage3_param_persistence_threshold", 0)
        cfg["zero_optimization"].setdefault("stage3_max_reuse_distance", 0)
    if spec.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if "bucket_mb" in spec.options:
        size = int(spec.options["bucket_mb"] * 2**20)
        cfg["zero_optimization"].update(reduce_bucket_size=size, allgather_bucket_size=size)
    return cfg


class DeepSpeedTrainer(Trainer):
    def __init__(self, spec: TrainSpec, stage: int):
        import deepspeed

        self.spec, self.stage = spec, stage
        model = build_model(spec.model, spec.seed, spec.device)
        config = ds_config(spec, stage)
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=adamw(model.parameters(), spec), config=config,
            dist_init_required=False, mpu=None,
        )
        self.measure_state = False

    def train_step(self, inputs, targets):
        total = torch.zeros((), device=inputs.device)
        accum = self.spec.grad_accum
        for x, y in zip(inputs.chunk(accum), targets.chunk(accum)):
            loss = lm_loss(self.engine(x), y)
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach() / accum
        return total

    def loss_scale(self):
        if self.spec.precision != "fp16":
            return None
        return {"scale": float(self.engine.optimizer.loss_scale), "skipped": not self.engine.was_step_applied()}

    def state_bytes(self):
        """What the engine holds, read from its documented optimizer attributes.

        Parameters: the module's (for stage 3, each rank's ``ds_tensor`` partition). Optimizer:
        the wrapped AdamW's moments plus the fp32 master partitions DeepSpeed keeps. Gradients
        live in DeepSpeed's private buffers and are not counted (reported as None).
        """
        params = list(self.engine.module.parameters())
        if self.stage == 3:
            p_bytes = tensor_bytes(p.ds_tensor for p in params if hasattr(p, "ds_tensor"))
        else:
            p_bytes = tensor_bytes(params)
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        o_bytes = optimizer_state_bytes(inner)
        master = (getattr(opt, "single_partition_of_fp32_groups", None)
                  or getattr(opt, "fp32_partitioned_groups_flat", None)
                  or getattr(opt, "fp32_groups_flat_partition", None))
        if master is not None:
            o_bytes += tensor_bytes(master)
        return {"params": p_bytes, "grads": None, "optimizer": o_bytes}

    def full_parameters(self):
        import deepspeed

        params = dict(self.engine.module.named_parameters())
        if self.stage == 3:
            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
                return {n: p.detach().float().cpu().clone() for n, p in params.items()}
        # Stages 0-2 hold the full module on every rank (bf16 copies in bf16 runs).
        return {n: p.detach().float().cpu() for n, p in params.items()}

    def close(self):
        self.engine.destroy() if hasattr(self.engine, "destroy") else None
        del self.engine


def _builder(stage: int):
    def build(spec: TrainSpec) -> DeepSpeedTrainer:
        if spec.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        return DeepSpeedTrainer(spec, stage)
    return build


build_zero0 = _builder(0)
build_zero1 = _builder(1)
build_zero2 = _builder(2)
build_zero3 = _builder(3)
