"""Peers for context parallelism (DeepSpeed-Ulysses, PyTorch's experimental context_parallel) and
expert parallelism (DeepSpeed-MoE).

* ``deepspeed.ulysses``: DeepSpeed's ``DistributedAttention`` (``deepspeed.sequence.layer``) wraps
  the causal SDPA of every block; its all-to-alls (q, k, v to head shards, the output back) are
  DeepSpeed's. Runs on CPU over gloo. The rest of the step is the same as ``ref.cp_ulysses``
  (token-id all-gather over the group, one flat fp32 all-reduce of the gradients, / cp): DeepSpeed's
  engine only wires Ulysses through Megatron-DeepSpeed's model code, so the attention layer is the
  part of DeepSpeed measured here.
* ``torch.cp``: ``torch.distributed.tensor.experimental.context_parallel`` (ring attention over
  DTensor, load-balanced head-tail split). In torch 2.13 it only dispatches the CUDA SDPA kernels
  (flash, efficient, cuDNN); on CPU the SDPA op ``_scaled_dot_product_flash_attention_for_cpu``
  has no sharding strategy and raises NotImplementedError, so the builder refuses CPU runs
  with that reason.
* ``deepspeed.moe``: DeepSpeed-MoE (``deepspeed.moe.layer.MoE``) in the MoE blocks, trained by the
  DeepSpeed engine with ZeRO-0, as a performance / communication peer of ``ref.ep``: same model
  shape, data, AdamW and global batch. Top-2 with a deterministic gate (``use_rts=False``,
  ``noisy_gate_policy=None``, ``top2_2nd_expert_sampling=False``). Models with a
  ``capacity_factor`` (``tiny-moe-cap1``, ``gpt-350m-moe-cap1``) run in capacity mode
  (``drop_tokens=True``, ``min_capacity=0``, option ``min_capacity``): its capacity
  ``ceil(b*s/E * 2*cf)`` is parabench's ``ceil(cf*b*s*k/E)``. Dropless models (``tiny-moe``,
  ``gpt-350m-moe``) run with ``drop_tokens=False``: the capacity is the largest expert demand,
  all-reduced (MAX) over the ep group. The gate takes the router's weights and each rank's experts
  the global experts it owns: both strategies start from the same weights (``full_parameters``
  maps the names back), and with nothing dropped the first step's loss equals ref.ep's. They still
  train different models: DeepSpeed's gate fills an expert's slots with first choices before
  second choices (parabench: token order; the *number* kept per expert, min(demand, C), is the
  same), renormalises a token's gates over its kept experts, and its aux loss is the batch-level
  ``E^2 * mean(me * ce)`` over first choices (added with ``aux_loss_coef`` through the same
  injector, so the reported loss is the LM loss). Nothing is checked for equivalence beyond the
  first step. Communication: 4 dense all-to-alls of [E, C, h] per MoE layer per micro-batch
  (padding included); the engine all-reduces non-expert gradients over the world and expert
  gradients over the expert-data-parallel group (one rank when ep = world). ``strategy_stats``
  reports DeepSpeed's ``exp_counts`` (demand per expert before the capacity cut), the capacity its
  gate returned, and the kept loads and drops derived from them.
  An earlier probe (deepspeed 0.19.8, CPU/gloo, 2 ranks, ep_size=2) saw dropless abort in gloo
  ("Received data size doesn't match expected size"): that happens when the layer is used without
  ``MoE.set_deepspeed_parallelism()`` (which ``deepspeed.initialize`` calls): the gate's ep group
  is then None, so each rank sizes its buffer by its own largest demand and the all-to-all sizes
  differ (reproduced: 4480 vs 4352 bytes). Through the engine, dropless trains on gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parabench.families.context import ContextOptions
from parabench.families.expert import DeepSpeedMoEOptions, ExpertOptions
from parabench.peers.common import CPTrainer, assemble_on_rank0, check_degree
from parabench.peers.deepspeed_zero import DeepSpeedTrainer
from parabench.trainer import TrainSpec


class _DeepSpeedUlyssesTrainer(CPTrainer):
    def __init__(self, spec: TrainSpec):
        o = ContextOptions.read(spec.options)
        super().__init__(spec, "ulysses", o.cp, o.cp_split)
        import deepspeed
        import deepspeed.comm as ds_dist
        from deepspeed.sequence.layer import DistributedAttention

        if not ds_dist.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo" if spec.device.type == "cpu" else "nccl")

        def local_attention(q, k, v):  # [b, s, a/cp, d] -> same layout
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return y.transpose(1, 2)

        self.dist_attn = DistributedAttention(local_attention, spec.topology.dp_group, scatter_idx=2, gather_idx=1)

        def attention(q, k, v):  # parabench layout [b, a, s/cp, d]
            out = self.dist_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0)
            return out.transpose(1, 2)

        self.cp.attention = attention


def build_deepspeed_ulysses(spec: TrainSpec):
    from parabench.peers.deepspeed_zero import deepspeed_on_cpu

    deepspeed_on_cpu(spec)
    return _DeepSpeedUlyssesTrainer(spec)


class _TorchCPTrainer(CPTrainer):
    """torch context_parallel around each step: the token ids, targets and position ids are the
    sharded buffers (the head-tail load balancer reorders them); parameters are replicated plain
    tensors, gradients all-reduced as in ``ref.cp_ring``. Run on 2 H100s: results/cp-ep-gpu."""

    def __init__(self, spec: TrainSpec):
        o = ContextOptions.read(spec.options)
        super().__init__(spec, "ring", o.cp, o.cp_split)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(spec.device.type, (self.cp.cp,), mesh_dim_names=("cp",))

    def train_step(self, inputs, targets):
        from torch.distributed.tensor.experimental import context_parallel

        from parabench.models import lm_loss
        from parabench.peers.common import autocast

        cp = self.cp
        x_all, y_all = cp.gather_batch(inputs, targets)
        pos = torch.arange(x_all.shape[1], device=x_all.device).expand_as(x_all).contiguous()
        total = torch.zeros((), device=inputs.device)
        accum = self.spec.grad_accum
        for x, y, p in zip(x_all.chunk(accum), y_all.chunk(accum), pos.chunk(accum)):
            x, y, p = x.contiguous(), y.contiguous(), p.contiguous()
            with context_parallel(self.mesh, buffers=[x, y, p], buffer_seq_dims=[1, 1, 1]):
                with autocast(self.spec):
                    loss = lm_loss(self._forward(x, p), y) / accum
                loss.backward()
            total += loss.detach()
        cp.all_reduce_grads()
        return self._step(total)

    def _forward(self, tokens, pos):
        m = self.module
        x = m.tok_emb(tokens) + m.pos_emb(pos)
        for blk in m.blocks:
            x = blk(x)  # SDPA(is_causal=True) is what context_parallel swaps for ring attention
        return m.head(m.ln_f(x))


def build_torch_cp(spec: TrainSpec):
    if spec.device.type != "cuda":
        raise NotImplementedError(
            "torch.cp: torch.distributed.tensor.experimental.context_parallel (torch "
            f"{torch.__version__}) handles only the CUDA SDPA kernels (flash/efficient/cuDNN); on CPU "
            "aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy. Run it on GPUs."
        )
    return _TorchCPTrainer(spec)


def _bias_gate_logits(gate, cfg) -> None:
    """The balanced-routing benchmark mode for DeepSpeed's TopKGate: the gate computes its logits
    inline (``F.linear(input_fp32, wg.weight)``, sharded_moe.py), so no hook can reach them; this
    instance-level forward is TopKGate.forward (deterministic settings: no jitter, no timers)
    with parabench's bias added to the logits, so DeepSpeed routes exactly as ref.ep does."""
    import torch.nn.functional as F
    from deepspeed.moe import sharded_moe

    from parabench.models import balanced_routing_bias

    def forward(input, used_token=None, sparse_routes=False, use_tutel=False):
        logits = F.linear(input.float(), weight=gate.wg.weight.float(), bias=None)
        logits = logits + balanced_routing_bias(logits.shape[0], cfg.seq_len, cfg.n_experts, cfg.top_k, logits.device)
        capacity_factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
        if gate.k == 2:
            return sharded_moe.top2gating(
                logits,
                capacity_factor,
                gate.min_capacity,
                gate.drop_tokens,
                gate.ep_group,
                gate.top2_2nd_expert_sampling,
                sparse_routes,
            )
        return sharded_moe.topkgating(
            logits,
            gate.k,
            capacity_factor,
            gate.min_capacity,
            gate.drop_tokens,
            gate.ep_group,
            sparse_routes=sparse_routes,
        )

    gate.forward = forward


class _DeepSpeedMoESlot(nn.Module):
    """The MLP slot of one MoE block, filled with ``deepspeed.moe.layer.MoE``.

    DeepSpeed's gate weight ``wg`` has the router's shape and takes its values; the rank's
    ``E/ep`` local experts take the values of the global experts it owns (``[r*E/ep, (r+1)*E/ep)``,
    as ref.ep shards them), so both start from the same weights. The layer returns
    ``(out, l_aux, exp_counts)``; the block wants ``out`` alone, so ``l_aux`` enters the gradient
    through the same injector parabench's MoE uses (the reported loss stays the LM loss) and
    ``exp_counts`` is kept for ``stats`` without a host sync.
    """

    def __init__(self, full, ep: int, rank: int, min_capacity: int):
        super().__init__()
        from deepspeed.moe.layer import MoE as DeepSpeedMoE

        from parabench.models import MLP

        cfg = full.cfg
        self.cfg = cfg
        device = full.router.weight.device
        dropless = cfg.capacity_factor is None
        with torch.device(device):
            # Deterministic gate: no random token selection, no noise, no Gumbel sampling of the
            # second expert. Capacity mode when the model has a capacity factor, else dropless
            # (DeepSpeed then sizes the buffer by the largest expert demand over the ep group).
            self.moe = DeepSpeedMoE(
                hidden_size=cfg.d_model,
                expert=MLP(cfg),
                num_experts=cfg.n_experts,
                ep_size=ep,
                k=cfg.top_k,
                capacity_factor=1.0 if dropless else cfg.capacity_factor,
                eval_capacity_factor=1.0 if dropless else cfg.capacity_factor,
                min_capacity=min_capacity,
                use_residual=False,
                noisy_gate_policy=None,
                drop_tokens=not dropless,
                use_rts=False,
                top2_2nd_expert_sampling=False,
            )
        # The capacity C the layer used is a local of MOELayer.forward; the gate returns it, so a
        # hook keeps it (a tensor: reading it waits until strategy_stats, after the step).
        self._capacity: torch.Tensor | None = None
        if cfg.balanced_routing:
            _bias_gate_logits(self.moe.deepspeed_moe.gate, cfg)
        self.moe.deepspeed_moe.gate.register_forward_hook(self._keep_capacity)
        local = cfg.n_experts // ep
        self.first = rank * local
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(full.router.weight)
            for j, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                expert.load_state_dict(full.experts[self.first + j].state_dict())
        self.aux_grad_scale = 1.0
        self._exp_counts: torch.Tensor | None = None

    def _keep_capacity(self, gate, inputs, output):
        self._capacity = output[1]  # (l_aux, capacity, E, indices, locations, gates, exp_counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from parabench.models import AuxLossInjector

        out, l_aux, exp_counts = self.moe(x)
        self._exp_counts = exp_counts
        if torch.is_grad_enabled() and self.cfg.aux_loss_coef:
            out = AuxLossInjector.apply(out, l_aux, self.cfg.aux_loss_coef * self.aux_grad_scale)
        return out

    def stats(self) -> dict:
        """Routing of the last micro-batch, in ref.ep's terms. DeepSpeed's ``exp_counts[e]`` is the
        number of this rank's tokens whose first or second choice is e, counted *before* the
        capacity cut. top2gating places all first choices of an expert before its second choices
        and keeps slots ``< capacity``, so the kept assignments are ``min(exp_counts[e], capacity)``
        whatever the order (dropless: capacity = the largest demand over the ep group, nothing
        dropped). The all-to-alls are dense: E x capacity rows each way, empty slots (padding)
        included. ``capacity`` is the one DeepSpeed's gate returned."""
        if self._exp_counts is None:
            return {}
        cfg = self.cfg
        capacity = int(self._capacity)
        routed = [int(c) for c in self._exp_counts.tolist()]
        kept = [min(c, capacity) for c in routed]
        rows = cfg.n_experts * capacity
        return {
            "tokens_per_expert": kept,
            "routed_per_expert": routed,
            "capacity": capacity,
            "dropped": sum(routed) - sum(kept),
            "sent_rows": rows,
            "received_rows": rows,
            "padding_rows": rows - sum(kept),
        }


class _DeepSpeedMoETrainer(DeepSpeedTrainer):
    """GPT whose MoE blocks hold DeepSpeed's MoE layer, trained by the DeepSpeed engine (ZeRO-0).

    The engine reduces gradients as DeepSpeed-MoE does: parameters DeepSpeed marks as experts
    (``allreduce=False``) are all-reduced over the expert-data-parallel group (here one rank per
    group, since ep = world: a no-op call that still shows in the meter), everything else over the
    data-parallel group (the world); both are averaged over the data-parallel size, as ref.ep
    divides by ep. The optimizer gets DeepSpeed's expert / non-expert parameter groups
    (``split_params_into_different_moe_groups_for_optimizer``), with identical AdamW settings.
    """

    def __init__(self, spec: TrainSpec):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        from parabench.models import MoE, build_model

        cfg = spec.model
        ep = dist.get_world_size()
        model = build_model(cfg, spec.seed, spec.device)
        self.slots: dict[int, _DeepSpeedMoESlot] = {}
        min_capacity = ExpertOptions.read(spec.options).min_capacity
        for i, blk in enumerate(model.blocks):
            if isinstance(blk.mlp, MoE):
                blk.mlp = _DeepSpeedMoESlot(blk.mlp, ep, dist.get_rank(), min_capacity)
                self.slots[i] = blk.mlp
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "non_expert"}
        )
        profile = DeepSpeedMoEOptions.read(spec.options).profile  # tuned: DeepSpeed's FusedAdam on GPUs
        super().__init__(spec, stage=0, model=model, param_groups=groups, profile=profile)
        self.ep = ep

    def train_step(self, inputs, targets):
        # The engine divides the loss by the accumulation steps; the injected l_aux gradient must follow.
        for slot in self.slots.values():
            slot.aux_grad_scale = 1.0 / self.spec.grad_accum
        return super().train_step(inputs, targets)

    def _parabench_name(self, name: str) -> str:
        """``blocks.i.mlp.moe.deepspeed_moe.gate.wg.weight`` -> ``blocks.i.mlp.router.weight``;
        ``...experts.deepspeed_experts.j.fc.weight`` -> ``blocks.i.mlp.experts.<first + j>.fc.weight``."""
        parts = name.split(".")
        if len(parts) > 4 and parts[2] == "mlp" and parts[3] == "moe":
            i, rest = int(parts[1]), parts[5:]
            if rest[:2] == ["gate", "wg"]:
                return f"blocks.{i}.mlp.router.{rest[-1]}"
            if rest[:2] == ["experts", "deepspeed_experts"]:
                j = self.slots[i].first + int(rest[2])
                return ".".join(["blocks", str(i), "mlp", "experts", str(j)] + rest[3:])
        return name

    def full_parameters(self):
        """Rank 0 assembles the full model under the GPT's names (experts from their owners)."""
        from deepspeed.moe.utils import is_moe_param

        mine = {
            self._parabench_name(n): p.detach().float().cpu().clone()
            for n, p in self.engine.module.named_parameters()
            if is_moe_param(p) or dist.get_rank() == 0
        }
        return assemble_on_rank0(mine, self.spec)

    def strategy_stats(self) -> dict:
        """Per MoE layer, the last micro-batch: kept assignments per expert (``tokens_per_expert``,
        this rank's tokens, as ref.ep), DeepSpeed's ``exp_counts`` before the capacity cut
        (``routed_per_expert``), ``dropped`` = routed - kept, capacity, and the dense all-to-all's
        rows (``sent_rows`` = ``received_rows`` = E x capacity, ``padding_rows`` of them empty)."""
        return {"ep": self.ep, "moe_layers": {str(i): s.stats() for i, s in self.slots.items()}}


def build_deepspeed_moe(spec: TrainSpec):
    cfg = spec.model
    if not cfg.is_moe:
        raise ValueError("deepspeed.moe needs an MoE model (n_experts > 0), e.g. tiny-moe or tiny-moe-cap1")
    if cfg.top_k != 2:
        raise ValueError(
            f"deepspeed.moe: top_k={cfg.top_k}; only top-2 is wired (DeepSpeed's top2gating "
            "capacity and gate normalisation are the ones matched to parabench's router)"
        )
    o = ExpertOptions.read(spec.options)
    if o.activation_checkpointing:
        raise ValueError("deepspeed.moe: activation_checkpointing is not supported (nor by ref.ep)")
    check_degree("ep", o.ep)
    from parabench.peers.deepspeed_zero import deepspeed_on_cpu

    deepspeed_on_cpu(spec)
    return _DeepSpeedMoETrainer(spec)
