"""Pieces shared by the adapters that drive a plain ``torch.nn.Module`` with a torch optimizer."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from parabench.models import build_model, lm_loss
from parabench.trainer import Trainer, TrainSpec


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank stores (a DTensor's local shard, else ``t`` itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


# DDP's default ``bucket_cap_mb``: a bucket is all-reduced once it holds at least this many bytes.
DP_BUCKET_BYTES = 25 * 2**20


def average_over_dp(params, dp_group, bucket_bytes: int = DP_BUCKET_BYTES) -> int:
    """Average the local gradient shards over ``dp_group`` as DDP does: in parameter order, each
    dtype's gradients fill flat buckets, a bucket closing once it holds ``bucket_bytes`` or more;
    one all-reduce per bucket. Every bucket's collective is started before the first is waited on,
    so copying one bucket in overlaps the previous one's all-reduce (at most one flat copy of the
    gradients alive). For peers whose gradients DDP's hooks cannot reduce: torch.tp after backward,
    on gradients already in their parameter's layout (during backward the embeddings' gradients are
    still full ``Replicate`` tensors, t times their shard), and torch.pp_zb after its split
    backward. Returns the number of buckets."""
    world = dist.get_world_size(dp_group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = local_tensor(p.grad)
            by_dtype.setdefault(g.dtype, []).append(g)
    buckets: list[list[torch.Tensor]] = []
    for grads in by_dtype.values():
        bucket, size = [], 0
        for g in grads:
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= bucket_bytes:
                buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            buckets.append(bucket)
    pending = []
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        pending.append((bucket, flat, dist.all_reduce(flat, group=dp_group, async_op=True)))
    for bucket, flat, work in pending:
        work.wait()
        flat.div_(world)
        for g, mean in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(mean.view_as(g))
    return len(buckets)


def tensor_bytes(tensors) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Adam's moments, plus the fp32 master weights of the "master" recipe."""
    return getattr(optimizer, "master_bytes", 0) + tensor_bytes(
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def adamw(params, spec: TrainSpec) -> torch.optim.Optimizer:
    """AdamW with parabench's explicit hyperparameters; the fused CUDA kernel where there is one."""
    o = spec.optim
    impl = {"fused": True} if spec.device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, **impl)


def autocast(spec: TrainSpec):
    """The "amp" recipe's forward: fp32 parameters, matmuls in bf16/fp16 (torch.amp). Under
    "master" (and fp32) the parameters already are in the compute dtype: nothing to cast."""
    if not spec.autocast_on:
        return contextlib.nullcontext()
    return torch.autocast(device_type=spec.device.type, dtype=spec.compute_dtype)


def master_recipe(spec: TrainSpec) -> bool:
    return spec.recipe == "master" and spec.precision != "fp32"


def recipe_module(model: torch.nn.Module, spec: TrainSpec) -> torch.nn.Module:
    """ "master": the module's parameters in the compute dtype (bf16), before any wrapper sees them;
    "fp8": fp32 parameters, the blocks' linears swapped for torchao's Float8Linear (``parabench.fp8``)."""
    if spec.recipe == "fp8":
        from parabench.families.data_parallel import DataParallelOptions
        from parabench.fp8 import convert

        return convert(model, DataParallelOptions.read(spec.options).fp8_filter)
    return model.to(spec.compute_dtype) if master_recipe(spec) else model


def recipe_optimizer(params, spec: TrainSpec, make=None):
    """AdamW (``make(params)``, default ``adamw``) over the parameters; under "master" over fp32
    copies of them (``reference_impls.mixed_precision.MasterWeightOptimizer``: PyTorch has no
    fp32-master optimizer for bf16 modules, so the peers share the references' few lines)."""
    make = make or (lambda ps: adamw(ps, spec))
    if master_recipe(spec):
        from reference_impls.mixed_precision import MasterWeightOptimizer

        return MasterWeightOptimizer(params, make)
    return make(list(params))


def loss_scale_options(spec: TrainSpec):
    """The loss-scaling, fault and checkpointing options every data-parallel peer reads (their one
    definition is the family's dataclass; imported here, not at the top: the families import this module)."""
    from parabench.families.data_parallel import LossScaleOptions

    return LossScaleOptions.read(spec.options)


def checkpoint_blocks(model: torch.nn.Module, spec: TrainSpec) -> None:
    """Option ``activation_checkpointing``: recompute every transformer block in backward. Applied
    before DDP / fully_shard / deepspeed.initialize (the same function the references use; see
    ``reference_impls/activation_checkpointing.py`` for why the forward, not the module, is wrapped)."""
    if loss_scale_options(spec).activation_checkpointing:
        from reference_impls.activation_checkpointing import checkpoint_blocks as _ckpt

        _ckpt(model.blocks)


def compile_blocks(blocks, spec: TrainSpec, split_bucket_bytes: int | None = None) -> None:
    """Option ``compile``: ``torch.compile`` every transformer block, in torchtitan's order
    (torchtitan/models/llama3/infra/parallelize.py: tensor parallelism, then activation
    checkpointing, then ``apply_compile`` per block, then FSDP / DDP), so call it after
    ``parallelize_module`` and ``checkpoint_blocks`` and before DDP / ``fully_shard``.

    torchtitan wraps each block (``torch.compile(block)``, an ``OptimizedModule`` re-registered
    in its place); here the block's *forward* is compiled instead (its instance attribute, as
    ``checkpoint_blocks`` does), which gives the same compiled region, with the module's hooks
    (FSDP's gathers, DDP's nothing) outside it, and keeps the parameter names (no ``_orig_mod.``),
    which the references' flat buffers and the equivalence tests key on. ``fullgraph`` as
    torchtitan: dense blocks in one graph (a graph break is an error, not a silent eager region),
    mixture-of-experts blocks allowed to break. Compilation itself happens at the first call, in
    the first warm-up step, which the worker times apart (``first_step_s``, metric ``compile_s``).

    Dynamo's caches are reset first, so the case traces its own graphs. A batched launch runs
    several cases in one process, and every block of every case shares one code object
    (``Block.forward``): without the reset a case reuses any earlier case's graph whose guards pass,
    and guards see neither the wrapper nor its compile-time choices (a torch.ddp case after ref.ddp
    ran ref.ddp's graph, never split at DDP's buckets by Dynamo's DDPOptimizer), while the entries
    pile up towards ``torch._dynamo.config.recompile_limit`` (8 per code object), past which Dynamo
    runs the block eagerly with only a warning. Inductor's on-disk FX graph cache survives the reset,
    so a rerun of the same graph still compiles in seconds.

    ``split_bucket_bytes``: split each block's graph at gradient-bucket boundaries of that many
    bytes, as Dynamo's DDPOptimizer does for a block under torch DDP (``bucket_split_backend``)."""
    if not spec.options.get("compile", False):
        return
    torch._dynamo.reset()
    backend = "inductor" if split_bucket_bytes is None else bucket_split_backend(split_bucket_bytes)
    for block in blocks:
        block.forward = torch.compile(block.forward, fullgraph=not spec.model.is_moe, backend=backend)


def bucket_split_backend(bucket_bytes: int):
    """A torch.compile backend that splits a graph where torch DDP would (Dynamo's DDPOptimizer,
    torch/_dynamo/backends/distributed.py: parameters counted in reverse graph order into buckets of
    ``bucket_bytes``, the first capped at DDP's 1 MiB) and compiles each piece with Inductor, as
    Dynamo does for a compiled block under DDP (torch.ddp's default, option ``ddp_optimizer``).

    Dynamo applies its DDPOptimizer only inside a ``DistributedDataParallel`` module; this gives the
    same split to a reference whose buckets are its own. Two changes: a parameter is counted by its
    own bytes, not its storage's, because a reference's parameters are views of one flat buffer
    (whose storage DDPOptimizer would count in full for each); and buckets under 1 MiB are allowed
    (the first bucket is then no larger than the others), where DDPOptimizer asserts."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    class ViewSizedSplit(DDPOptimizer):
        def add_param(self, bucket, param, name: str) -> None:
            bucket.size += param.numel() * param.element_size()
            bucket.params.append(name)
            bucket.param_ids.append(id(param))

    inductor = torch._TorchCompileInductorWrapper(mode=None, options=None, dynamic=None)
    first = min(int(bucket_bytes), torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
    return ViewSizedSplit(
        bucket_bytes_cap=int(bucket_bytes), backend_compile_fn=inductor, first_bucket_cap=first
    ).compile_fn


def grad_scaler(spec: TrainSpec):
    """fp16: ``torch.amp.GradScaler`` (keywords: ShardedGradScaler orders the factors differently);
    options ``init_scale`` (2**16) and ``growth_interval`` (2000). None for fp32/bf16."""
    if spec.precision != "fp16":
        return None
    o = loss_scale_options(spec)
    return torch.amp.GradScaler(
        spec.device.type,
        init_scale=float(o.init_scale),
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=o.growth_interval,
    )


class TorchTrainer(Trainer):
    """Forward/backward over ``grad_accum`` micro-batches, then one optimizer step.

    ``no_sync`` (DDP) suppresses gradient communication on all but the last micro-batch.
    Gradient bytes are sampled just before the optimizer step (when gradients are largest)
    but only when ``measure_state`` is set, which the runner does on an untimed step.

    fp16: the loss goes through ``torch.amp.GradScaler`` (scale, ``step`` unscales and skips the
    update on inf/NaN, ``update`` backs off or grows). GradScaler decides from the gradients this
    rank holds: with DDP those are already all-reduced (an inf anywhere in backward reaches every
    rank through the sum); with FSDP2 they are DTensor shards and GradScaler's unscale all-reduces
    its found-inf flag over the mesh. Fault injection (``inject_inf = {rank, step, where}``):
    ``where = "shard"`` (default) writes the inf into this rank's (local shard of the) first
    parameter's gradient after communication, just before unscale, as the references do;
    ``where = "backward"`` writes it from a gradient hook during backward, before communication.
    ``lr_spike = {step, factor}`` multiplies that step's learning rate.
    """

    def __init__(
        self,
        spec: TrainSpec,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        no_sync=None,
        autocast_enabled: bool = True,
    ):
        self.spec, self.module, self.optimizer = spec, module, optimizer
        self.no_sync = no_sync
        self.autocast_enabled = autocast_enabled
        self.measure_state = False
        self._grad_bytes = 0
        self.scaler = grad_scaler(spec)
        self._step = 0
        self._prev_scale = self.scaler.get_scale() if self.scaler is not None else None
        self._inject = loss_scale_options(spec).inject_inf
        self._hook = None
        if self._inject and self._inject.get("where", "shard") == "backward":
            first = next(p for p in self.module.parameters() if p.requires_grad)
            self._hook = first.register_hook(self._inject_hook)

    def _inject_now(self) -> bool:
        f = self._inject
        return bool(f) and int(f.get("step", 0)) == self._step and int(f.get("rank", 0)) == _global_rank()

    def _inject_hook(self, grad):
        if not self._inject_now():
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    def train_step(self, inputs, targets):
        accum = self.spec.grad_accum
        total = torch.zeros((), device=inputs.device)
        spike = loss_scale_options(self.spec).lr_spike
        saved = None
        if spike and int(spike.get("step", 0)) == self._step:
            saved = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] *= float(spike.get("factor", 10.0))
        for i, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
            last = i == accum - 1
            sync = contextlib.nullcontext() if last or self.no_sync is None else self.no_sync()
            with sync:
                with autocast(self.spec) if self.autocast_enabled else contextlib.nullcontext():
                    loss = lm_loss(self.module(x), y) / accum
                (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            total += loss.detach()
        if self.measure_state:
            self._grad_bytes = tensor_bytes(p.grad for p in self.module.parameters())
        if self.scaler is None:
            self.optimizer.step()
        else:
            if self._inject_now() and self._inject.get("where", "shard") == "shard":
                g = next(p.grad for p in self.module.parameters() if p.grad is not None)
                local_tensor(g).view(-1)[0] = float("inf")
            self.scaler.step(self.optimizer)  # unscale, skip on inf/NaN (no host sync)
            self.scaler.update()
        if saved is not None:
            for g, lr in zip(self.optimizer.param_groups, saved):
                g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self._step += 1
        return total

    def loss_scale(self):
        """fp16: the scale after the last step and whether that step was skipped.

        GradScaler keeps its scale on the device: ``get_scale()`` is a host sync (cheap on CPU, a
        stall of the pipeline on a GPU), which is why the worker calls this for fp16 cases only.
        A skipped step is read as a scale that went down (docs/facts.md: compare before and after
        ``update()``; backoff always lowers it), so call this after every step."""
        if self.scaler is None:
            return None
        new = self.scaler.get_scale()
        skipped = new < self._prev_scale
        out = {"scale_used": self._prev_scale, "scale": new, "overflow": skipped, "skipped": skipped}
        self._prev_scale = new
        return out

    def close(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def state_bytes(self):
        return {
            "params": tensor_bytes(self.module.parameters()),
            "grads": self._grad_bytes,
            "optimizer": optimizer_state_bytes(self.optimizer),
        }


# --- shells shared by the references and the peers of context / expert parallelism -------------


def check_degree(key: str, n: int | None) -> int:
    """The cp (ep) degree: for now only the whole world (None means the world)."""
    world = dist.get_world_size()
    n = world if n is None else int(n)
    if n != world:
        raise ValueError(f"{key}={n}: only {key} = world size ({world}) is supported for now")
    return n


class ReplicatedTrainer(Trainer):
    """Shared plumbing: AdamW over local parameters, state bytes, full parameters on rank 0."""

    measure_state = False
    _grad_bytes = 0

    def _step(self, loss):
        if self.measure_state:
            self._grad_bytes = tensor_bytes(p.grad for p in self.module.parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def state_bytes(self):
        return {
            "params": tensor_bytes(self.module.parameters()),
            "grads": self._grad_bytes,
            "optimizer": optimizer_state_bytes(self.optimizer),
        }

    def close(self):
        self.optimizer = None
        self.module = None


class CPTrainer(ReplicatedTrainer):
    """Context parallelism around the model (``reference_impls/context_parallel.py``); ``split``
    (ring: "zigzag" | "contiguous") and ``broken`` (a test hook) as the caller read them."""

    def __init__(self, spec: TrainSpec, mode: str, cp: int | None, split: str, broken: str | None = None):
        from reference_impls.cp_model import ContextParallel

        self.spec = spec
        check_degree("cp", cp)
        if spec.model.is_moe:
            raise ValueError("context parallelism is implemented for dense models only")
        self.module = build_model(spec.model, spec.seed, spec.device)
        self.cp = ContextParallel(
            self.module, spec.topology.dp_group, mode, split=split, broken=broken, loss_fn=lm_loss
        )
        self.optimizer = adamw(self.module.parameters(), spec)

    def train_step(self, inputs, targets):
        loss = self.cp.forward_backward(inputs, targets, self.spec.grad_accum, autocast=lambda: autocast(self.spec))
        return self._step(loss)

    def full_parameters(self):
        if dist.get_rank() != 0:
            return None
        return {n: p.detach().float().cpu().clone() for n, p in self.module.named_parameters()}

    def strategy_stats(self) -> dict:
        return {"cp": self.cp.cp, "mode": self.cp.mode, "split": self.cp.split, **self.cp.stats.as_dict()}


def build_model_names(spec: TrainSpec):
    from parabench.models import GPT

    with torch.device("meta"):
        return list(GPT(spec.model).named_parameters())


def assemble_on_rank0(mine: dict, spec: TrainSpec) -> dict | None:
    """Rank 0: the full model's parameters, in the GPT's order, from every rank's named pieces
    (dense ones from rank 0, experts from their owners); other ranks: None."""
    everything = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everything, dst=0)
    if dist.get_rank() != 0:
        return None
    full = {}
    for part in everything:
        full.update(part)
    return {n: full[n] for n, _ in build_model_names(spec)}
