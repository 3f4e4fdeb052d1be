"""DeepSpeed engine with ZeRO stage 0 (plain data parallel) to 3, configured from the case.

Profiles (option ``profile``, recorded in every case and in ``strategy_stats``):

* ``tuned`` (the default): DeepSpeed's documented best practice for throughput. Sources: the
  config reference (https://www.deepspeed.ai/docs/config-json/, docs/_pages/config-json.md of
  deepspeedai/DeepSpeed, checked at 00376da: ``overlap_comm`` "attempts to overlap the reduction of
  the gradients with backward computation", default false; ``contiguous_gradients`` default true;
  ``compute_grad_norm`` false "only with a GPU optimizer, without ZenFlow, gradient clipping, or
  ZeRO Stage 1 BF16 parameters with FP32 gradient accumulation", none of which a tuned case with
  it off has; ``communication_data_type`` unset, so gradients are reduced in the parameter dtype,
  bf16/fp16 under the 16-bit recipes, as the references do; bucket sizes 5e8 elements;
  ``timers.throughput``), the config models of the pinned 0.19.8
  (runtime/zero/config.py: ``overlap_comm`` defaults on only at stage 3, ``compute_grad_norm``
  may be false at stages 1-2 when there is no clipping; runtime/precision_config.py:
  ``bf16.check_grad_overflow``; utils/config.py: the throughput timer's docstring on the cost of
  its synchronisation), the ZeRO tutorial (https://www.deepspeed.ai/tutorials/zero/) and
  engine.py's optimizer selection (FusedAdam gets the flat FP16_Optimizer at stage 0, a client
  optimizer FP16_UnfusedOptimizer). Keys: throughput timer off; ``overlap_comm`` and
  ``contiguous_gradients`` on (stages 1-3); ``compute_grad_norm`` off at stages 1-2 without
  offload or fp16; ``bf16.check_grad_overflow`` off; bucket sizes and stage-3 prefetch /
  persistence / reuse at DeepSpeed's defaults (not written); DeepSpeed's FusedAdam on GPUs,
  torch's fused AdamW where its op does not build (the reason recorded); with optimizer offload
  (CPU or NVMe) on a GPU machine DeepSpeedCPUAdam, the optimizer the ZeRO-Offload tutorial
  (https://www.deepspeed.ai/tutorials/zero-offload/) and ``zero_force_ds_cpu_optimizer`` (on by
  default) ask for, torch's AdamW where its op does not build (the reason recorded); torch's
  AdamW on CPUs.
* ``matched``: the configuration parabench used before profiles, aligned with the references'
  memory and traffic: DeepSpeed's engine defaults, stage 3 resharding every parameter after use
  (persistence threshold and reuse distance 0), the client torch AdamW below.

In ``matched`` the optimizer is a client ``torch.optim.AdamW`` with parabench's explicit
hyperparameters (the fused CUDA kernel on GPUs, the same one the torch peers use), so the
comparison measures ZeRO's partitioning and communication rather than two different Adam
kernels, and no DeepSpeed op has to be JIT-compiled on a fresh machine.
``zero_allow_untested_optimizer`` admits it.
DeepSpeed divides the loss by the accumulation steps itself, so micro-batch losses go in
unscaled. On a CPU, ``DS_ACCELERATOR=cpu`` must be set before DeepSpeed is imported (the runner
does this).

fp16 at stage 0 does not train in DeepSpeed 0.19.8 (a DeepSpeed bug, kept as it behaves; measured
and asserted in tests/test_mixed_precision.py::test_deepspeed_zero0_fp16_mechanism). The client
AdamW is not DeepSpeed's FusedAdam, so stage 0 fp16 wraps it in FP16_UnfusedOptimizer
(deepspeed/runtime/engine.py:2599), a DeepSpeedOptimizer but not a ZeROOptimizer
(runtime/fp16/unfused_optimizer.py:25, runtime/base_optimizer.py:250). ``engine.backward`` scales
the loss only for ZeROOptimizer instances or torch autocast's GradScaler (engine.py:3416-3420) and
then calls ``loss.backward()`` itself (engine.py:3428), never the wrapper's ``backward`` that would
multiply by ``cur_scale`` (unfused_optimizer.py:260-272); ``engine.scale`` has the same gap
(engine.py:3371). The wrapper's ``step`` still divides the all-reduced gradients by ``cur_scale``
(unfused_optimizer.py:228 -> 256), 2**16 for this profile (runtime/fp16/loss_scaler.py:63-65), so
AdamW gets gradients 65536x too small (below eps) and the loss stays flat: 1.8e-2 off fp32 over 5
steps on the tiny model, replicas still bit-identical, one fp16 all-reduce of all gradients per
step. Upstream: DeepSpeed PR #8393 (open). Multiplying the loss by ``engine.optimizer.loss_scale``
before ``engine.backward`` makes it train (2.3e-3 off fp32); the rest is the wrapper's initial AdamW
step on zero gradients (unfused_optimizer.py:108 -> 412-425: weight decay once, Adam's step count
one ahead); undoing that too gives deepspeed.zero1's fp16 losses (bit for bit in
isolation, within 2e-6 otherwise). On GPUs the torch
AdamW (fused CUDA kernel) is not FusedAdam either: the same path, the same result.
suites/studies/scripts/ds_zero0_fp16_repro.py reproduces all of this.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import torch

from parabench.families.sharded import DeepSpeedZeroOptions, ShardedOptions, ShardedPeerOptions
from parabench.models import build_model, lm_loss
from parabench.peers.common import adamw, checkpoint_blocks, optimizer_state_bytes, tensor_bytes
from parabench.trainer import Trainer, TrainSpec


def ds_config(
    spec: TrainSpec, stage: int, offload: bool = False, profile: str = "matched", nvme: dict | None = None
) -> dict:
    """The engine's config. ``profile`` (see the module docstring): ``matched`` or ``tuned`` (every
    DeepSpeed peer's option, deepspeed.pp's and deepspeed.moe's included). ``nvme``: the
    ZeRO-Infinity sections (``offload_param``, ``offload_optimizer``, ``aio``) of
    ``peers.deepspeed_nvme.nvme_config``, which replace the CPU offload below."""
    o = ShardedOptions.read(spec.options)
    cfg = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.grad_accum,
        "train_batch_size": spec.micro_batch * spec.grad_accum * spec.topology.dp,
        "zero_optimization": {"stage": stage, **o.zero},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if stage == 3 and profile == "matched":
        # Reshard after forward like FSDP2 and ref.zero3, so the three are comparable in memory
        # and traffic: DeepSpeed's defaults keep small parameters resident and keep any
        # parameter whose reuse comes within 1e9 elements, which makes its traffic depend on the
        # model size in ways no formula in the record could follow.
        cfg["zero_optimization"].setdefault("stage3_param_persistence_threshold", 0)
        cfg["zero_optimization"].setdefault("stage3_max_reuse_distance", 0)
    if spec.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec.precision == "fp16":
        # Dynamic scaling (loss_scale 0) with the same rule as GradScaler and the references: halve
        # on every overflow (DeepSpeed's default hysteresis 2 would skip the first overflow without
        # backing off), double after ``growth_interval`` clean steps. Stage 0 with a client (non-
        # FusedAdam) optimizer gets DeepSpeed's FP16_UnfusedOptimizer, which ignores
        # initial_scale_power (it starts at 2**16) and initialises Adam's state with one AdamW step
        # on zero gradients (weight decay applied once, step counter advanced): as DeepSpeed behaves.
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": int(math.log2(float(o.init_scale))),
            "loss_scale_window": o.growth_interval,
            "hysteresis": 1,
            "consecutive_hysteresis": False,
            "min_loss_scale": 1,
        }
    if profile == "tuned":
        _tune(cfg, spec, stage, offload)
    if offload:
        # ZeRO-Offload (Ren et al. 2021): fp32 master, Adam moments and the update on the CPU, by
        # DeepSpeedCPUAdam (tuned, on a GPU machine) or a client torch AdamW, which DeepSpeed
        # refuses with offload unless told not to force its own.
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": spec.device.type == "cuda"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if nvme:
        cfg["aio"] = nvme["aio"]
        cfg["zero_optimization"].update(
            offload_param=nvme["offload_param"], offload_optimizer=nvme["offload_optimizer"]
        )
        for key, value in nvme.get("zero", {}).items():  # e.g. the reuse distance NVMe swapping needs
            cfg["zero_optimization"].setdefault(key, value)
    if "bucket_mb" in spec.options:  # unset: DeepSpeed's own bucket sizes, not ShardedOptions' default
        # DeepSpeed counts both bucket sizes in elements; gradients and parameters travel in the
        # parameter dtype (fp32, or bf16/fp16 under its mixed precision).
        # ZeRO-1/2 also require a multiple of its start alignment (2 elements: 4 bytes of fp16).
        size = int(o.bucket_mb * 2**20) // spec.compute_dtype.itemsize // 2 * 2
        cfg["zero_optimization"].update(reduce_bucket_size=size, allgather_bucket_size=size)
    return cfg


def _tune(cfg: dict, spec: TrainSpec, stage: int, offload: bool) -> None:
    """The ``tuned`` profile's keys (sources in the module docstring). ``setdefault``: a key given
    through ``options.zero`` wins. Bucket sizes and stage-3 prefetch / persistence / reuse stay at
    DeepSpeed's defaults by not being written."""
    # The throughput timer synchronises the device twice per step (its own docstring: "at the
    # expense of performance degradation"); parabench times the steps itself.
    cfg["timers"] = {"throughput": {"enabled": False}}
    zero = cfg["zero_optimization"]
    if stage >= 1:
        zero.setdefault("overlap_comm", True)  # DeepSpeed's default only at stage 3
        zero.setdefault("contiguous_gradients", True)
    # No clipping (gradient_clipping 0), so the global norm is never used: skip its per-tensor pass
    # and host sync. DeepSpeed allows this at stages 1-2 only, not with optimizer offload, and fp16
    # keeps it (the norm is part of its overflow detection).
    if stage in (1, 2) and not offload and spec.precision != "fp16":
        zero.setdefault("compute_grad_norm", False)
    if spec.precision == "bf16":
        cfg["bf16"]["check_grad_overflow"] = False  # bf16 does not overflow where fp32 would not; no scaler


def deepspeed_adamw(
    params, spec: TrainSpec, profile: str, offload: bool, on_gpu_machine: bool = False
) -> tuple[torch.optim.Optimizer, str]:
    """The optimizer and how it is named in the record. ``tuned`` on a GPU: DeepSpeed's FusedAdam
    (AdamW mode) when its op builds, which also puts stage 0's 16-bit training on DeepSpeed's flat
    FP16_Optimizer instead of the per-tensor FP16_UnfusedOptimizer a client optimizer gets; if the
    op does not build, torch's fused AdamW, the reason recorded. ``tuned`` with ``offload`` on a GPU
    machine (``spec.device`` is then the CPU the update runs on, ``on_gpu_machine`` says where the
    model is): DeepSpeedCPUAdam (AdamW mode, its JIT-built SIMD op), or torch's AdamW with the
    reason. Otherwise (``matched``, CPU) the client torch AdamW of ``common.adamw``."""
    params = list(params)
    fallback = ""
    if profile == "tuned" and offload and on_gpu_machine:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            o = spec.optim
            opt = DeepSpeedCPUAdam(
                params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, adamw_mode=True
            )
            return opt, "deepspeed.ops.adam.DeepSpeedCPUAdam (adamw_mode)"
        except Exception as exc:  # the JIT build of the CPU op
            fallback = f" (DeepSpeedCPUAdam did not build: {type(exc).__name__}: {str(exc)[:200]})"
    if profile == "tuned" and spec.device.type == "cuda" and not offload:
        try:
            from deepspeed.ops.adam import FusedAdam

            o = spec.optim
            opt = FusedAdam(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, adam_w_mode=True)
            return opt, "deepspeed.ops.adam.FusedAdam (adam_w_mode)"
        except Exception as exc:  # the JIT build of the CUDA op: no compiler, headers or ninja on the machine
            fallback = f" (DeepSpeed's FusedAdam did not build: {type(exc).__name__}: {str(exc)[:200]})"
    opt = adamw(params, spec)
    kind = "fused" if opt.defaults.get("fused") else "foreach" if opt.defaults.get("foreach") else "for-loop"
    return opt, f"torch.optim.AdamW ({kind}){fallback}"


def _allow_fp16_on_cpu(spec: TrainSpec) -> None:
    """DeepSpeed refuses fp16 when the accelerator says it has no fp16 (engine.py checks
    ``get_accelerator().is_fp16_supported()``); its CPU accelerator says so unless oneDNN reports
    fp16 support, which most CPUs do not. torch computes fp16 on any CPU (slowly), so on a CPU
    device only, and only for fp16 cases, the check is overridden on the accelerator instance.
    Nothing changes on GPUs."""
    if spec.device.type != "cpu" or spec.precision != "fp16":
        return
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if not acc.is_fp16_supported():
        acc.is_fp16_supported = lambda: True  # CPU only: see the docstring


class DeepSpeedTrainer(Trainer):
    """fp16: DeepSpeed's own dynamic loss scaler (``engine.backward`` scales the loss; the optimizer
    wrapper unscales, checks for overflow — all-reducing the flag over the data-parallel group —
    skips the step and backs off). Fault injection ``inject_inf = {rank, step}``: a gradient hook on
    the first parameter writes an inf into that rank's gradient during backward of that step (the
    only place a client can reach: DeepSpeed keeps reduced gradients in private buffers), so it
    enters DeepSpeed's reduction like a real overflow. ``lr_spike = {step, factor}`` multiplies the
    learning rate of the wrapped optimizer's param groups for that step."""

    def __init__(
        self,
        spec: TrainSpec,
        stage: int,
        offload: bool = False,
        model: torch.nn.Module | None = None,
        param_groups: list[dict] | None = None,
        profile: str = "matched",
        nvme: dict | None = None,
    ):
        """``model`` / ``param_groups``: a prepared module and optimizer groups (deepspeed.moe passes
        its MoE model and DeepSpeed's expert / non-expert groups); by default the GPT, one group."""
        import deepspeed

        self.spec, self.stage = spec, stage
        _allow_fp16_on_cpu(spec)
        if model is None:
            model = build_model(spec.model, spec.seed, spec.device)
            checkpoint_blocks(model, spec)  # a model-level option: the blocks recompute inside the engine
        self.profile = profile
        config = ds_config(spec, stage, offload, profile, nvme)
        params = param_groups if param_groups is not None else list(model.parameters())
        if DeepSpeedZeroOptions.read(spec.options).optimizer_in_config and not offload:
            o = spec.optim
            config["optimizer"] = {
                "type": "AdamW",
                "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay},
            }
            if spec.device.type != "cuda":
                config["optimizer"]["params"]["torch_adam"] = True  # no fused op to build on a CPU
            optimizer = None
        else:
            opt_spec = replace(spec, device=torch.device("cpu")) if offload else spec  # AdamW runs on the CPU
            optimizer, self.optimizer_name = deepspeed_adamw(
                params, opt_spec, profile, offload, on_gpu_machine=spec.device.type == "cuda"
            )
        self.engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=params if optimizer is None else None,
            config=config,
            dist_init_required=False,
            mpu=None,
        )
        if optimizer is None:
            inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
            self.optimizer_name = f"engine config AdamW -> {type(inner).__module__}.{type(inner).__name__}"
        self.measure_state = False
        self._step = 0
        self._prev_scale = self._scale() if spec.precision == "fp16" else None
        self._inject = ShardedOptions.read(spec.options).inject_inf
        self._hook = None
        if self._inject:
            first = next(p for p in self.engine.module.parameters() if p.requires_grad)
            self._hook = first.register_hook(self._inject_hook)

    def _inject_hook(self, grad):
        f = self._inject
        import torch.distributed as dist

        if int(f.get("step", 0)) != self._step or int(f.get("rank", 0)) != dist.get_rank():
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    def _scale(self) -> float:
        opt = self.engine.optimizer
        return float(getattr(opt, "loss_scale", None) or opt.cur_scale)

    def train_step(self, inputs, targets):
        total = torch.zeros((), device=inputs.device)
        accum = self.spec.grad_accum
        spike = ShardedOptions.read(self.spec.options).lr_spike
        groups, saved = self.engine.optimizer.param_groups, None
        if spike and int(spike.get("step", 0)) == self._step:
            saved = [g["lr"] for g in groups]
            for g in groups:
                g["lr"] *= float(spike.get("factor", 10.0))
        if ShardedOptions.read(self.spec.options).reduce_every_micro_batch:
            for x, y in zip(inputs.chunk(accum), targets.chunk(accum)):
                loss = lm_loss(self.engine(x), y)
                self.engine.backward(loss)
                self.engine.step()
                total += loss.detach() / accum
        else:
            # Accumulation without communication (ZeRO-2): DeepSpeed 0.19's coalesce_grad_reduction
            # leaves every micro-batch's gradients on the parameters and reduces them once, when the
            # block exits; engine.step() is illegal inside it, so the one step follows, at a boundary
            # set by hand (the block restores the flag it found on entry).
            with self.engine.coalesce_grad_reduction():
                for i, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
                    loss = lm_loss(self.engine(x), y)
                    self.engine.set_gradient_accumulation_boundary(i == accum - 1)
                    self.engine.backward(loss)
                    total += loss.detach() / accum
            self.engine.set_gradient_accumulation_boundary(True)
            self.engine.step()
        if saved is not None:
            for g, lr in zip(groups, saved):
                g["lr"] = lr
        self._step += 1
        return total

    def strategy_stats(self) -> dict:
        """The profile, the optimizer that ran and the wrapper DeepSpeed put around it (the flat
        FP16_Optimizer / ZeRO optimizers, or the per-tensor FP16_UnfusedOptimizer)."""
        return {
            "profile": self.profile,
            "optimizer": self.optimizer_name,
            "optimizer_wrapper": type(self.engine.optimizer).__name__,
        }

    def loss_scale(self):
        if self.spec.precision != "fp16":
            return None
        new = self._scale()
        skipped = not self.engine.was_step_applied()
        out = {
            "scale_used": self._prev_scale,
            "scale": new,
            "overflow": bool(getattr(self.engine.optimizer, "overflow", skipped)),
            "skipped": skipped,
        }
        self._prev_scale = new
        return out

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
        return {"params": p_bytes, "grads": None, "optimizer": deepspeed_optimizer_bytes(self.engine.optimizer)}

    def full_parameters(self):
        import deepspeed

        params = dict(self.engine.module.named_parameters())
        if self.stage == 3:
            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
                return {n: p.detach().float().cpu().clone() for n, p in params.items()}
        # Stages 0-2 hold the full module on every rank (bf16 copies in bf16 runs).
        return {n: p.detach().float().cpu() for n, p in params.items()}

    def close(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.engine.destroy() if hasattr(self.engine, "destroy") else None
        del self.engine


def deepspeed_optimizer_bytes(opt) -> int:
    """Optimizer state a DeepSpeed engine's optimizer holds: the wrapped AdamW's moments plus the
    fp32 master partitions of whichever wrapper it is (ZeRO-1/2, ZeRO-3, BF16_Optimizer)."""
    inner = getattr(opt, "optimizer", opt)
    master = (
        getattr(opt, "single_partition_of_fp32_groups", None)
        or getattr(opt, "fp32_partitioned_groups_flat", None)
        or getattr(opt, "fp32_groups_flat_partition", None)
    )
    return optimizer_state_bytes(inner) + (tensor_bytes(master) if master is not None else 0)


def deepspeed_on_cpu(spec: TrainSpec) -> None:
    """Before DeepSpeed is imported, on a CPU device: its CPU accelerator, and no JIT build of its
    shared-memory all-reduce op (``deepspeed/comm/torch.py`` ``build_shm_op``). That op serves only
    ``inference_all_reduce`` (DeepSpeed inference's tensor parallelism); training's collectives go
    to torch.distributed (gloo) with or without it, so skipping it changes nothing measured, and
    saves its compilation (30-90 s on a 2-core machine, in every fresh environment)."""
    if spec.device.type != "cpu":
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import importlib

    # By module path: ``deepspeed.comm`` has an attribute ``torch`` (the torch package itself).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _builder(stage: int, offload: bool = False):
    def build(spec: TrainSpec) -> DeepSpeedTrainer:
        deepspeed_on_cpu(spec)
        return DeepSpeedTrainer(spec, stage, offload, profile=ShardedPeerOptions.read(spec.options).profile)

    return build


build_zero0 = _builder(0)
build_zero1 = _builder(1)
build_zero2 = _builder(2)
build_zero3 = _builder(3)
# ZeRO-Offload: optimizer states, fp32 master and the update on the CPU. On a CPU-only machine the
# "device" is the CPU already: the offload is a copy within the same memory (a no-op in effect).
build_zero2_offload = _builder(2, offload=True)
build_zero3_offload = _builder(3, offload=True)


class DeepSpeedZeroPPTrainer(DeepSpeedTrainer):
    """ZeRO-3 with ZeRO++'s three switches as DeepSpeed's config keys (https://www.deepspeed.ai/tutorials/zeropp/):
    ``zero_quantized_weights`` (qwz), ``zero_hpz_partition_size`` (hpz), ``zero_quantized_gradients``
    (qgz). The quantizers are CUDA ops (the runner skips those cases on a CPU:
    ``families.sharded.deepspeed_zeropp_unsupported``); hpZ alone runs on the CPU accelerator."""

    def __init__(self, spec: TrainSpec):
        from parabench.families.sharded import DeepSpeedZeroPPOptions

        o = DeepSpeedZeroPPOptions.read(spec.options)
        self.zeropp = {
            "zero_quantized_weights": o.qwz,
            "zero_hpz_partition_size": o.hpz_partition_size if o.hpz else 1,
            "zero_quantized_gradients": o.qgz,
        }
        super().__init__(
            replace(spec, options={**spec.options, "zero": {**self.zeropp, **o.zero}}), 3, profile=o.profile
        )

    def strategy_stats(self) -> dict:
        """The ZeRO++ keys given, and how many parameters hold an hpZ secondary partition (0 with hpZ off)."""
        params = self.engine.module.parameters()
        secondary = sum(getattr(p, "ds_secondary_tensor", None) is not None for p in params)
        return {**super().strategy_stats(), **self.zeropp, "hpz_secondary_tensors": secondary}

    def close(self):
        super().close()
        # DeepSpeed keeps hpZ's sub-group in a module global that it refuses to create twice
        # (utils/groups.py ``_create_zero_param_parallel_group`` asserts it is None): forget it, so
        # a later engine in the same process can make its own.
        from deepspeed.utils import groups

        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None


def build_zeropp(spec: TrainSpec) -> DeepSpeedZeroPPTrainer:
    deepspeed_on_cpu(spec)
    return DeepSpeedZeroPPTrainer(spec)
