"""Expert parallelism for the mixture-of-experts GPT (torch only).

GShard (Lepikhin et al. 2020, Sec. 3.2) and Switch Transformer (Fedus et al. 2021, Sec. 2.2):
the E experts of every MoE layer are sharded over the ``ep`` ranks (rank r owns experts
``[r*E/ep, (r+1)*E/ep)``); everything else (attention, embeddings, LayerNorms, the routers) is
replicated and data parallel. Each rank routes its own tokens and moves them to the experts'
owners:

1. **route** locally (top-k token choice, capacity per expert over the rank's own tokens when a
   capacity factor is set: GShard's "local group dispatching"; dropless otherwise);
2. **counts**: one small all-to-all of the per-expert token counts ``[ep, E/ep]``, so every rank
   knows how many rows it will receive from each source and for which local expert;
3. **dispatch**: ``all_to_all_single`` of the token rows sorted by expert, with split sizes;
4. the owner runs each local expert on its rows (grouped by source rank, then local expert);
5. **combine**: the reverse all-to-all brings every output row back to the rank of its token,
   where it is scaled by its gate and summed into the token's output.

The backward of an all-to-all is the all-to-all with the split sizes swapped, so backward moves
the same volume: per MoE layer and micro-batch, forward ``A_r + R_r`` rows and backward the same,
with ``A_r`` the (kept) assignments rank r routes and ``R_r`` the rows it receives; ``h`` elements
per row. Dropless top-k with balanced routing gives ``A_r = R_r = b*s*k``.

Gradients: the replicated ("dense") parameters see only local tokens and are all-reduced over the
group (one flat buffer) and divided by ep; an expert's gradient already sums the contributions of
every rank's tokens (they arrived through the backward all-to-all), so it is only divided by ep
(each rank's loss is the mean over its own tokens). With ep = world there are no data-parallel
replicas of an expert, hence no expert all-reduce; with ep < world it would be reduced over the
ranks that hold the same experts.

The load-balancing loss (the ``route`` function the caller passes in) is computed per sequence on the rank that
owns the sequence, so it needs no communication and matches single-process training exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


def _all_to_all_v(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((sum(out_splits),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAllV(torch.autograd.Function):
    """all_to_all_single with split sizes; backward = the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all_v(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all_v(grad, in_splits, out_splits, ctx.group), None, None, None


class ExpertParallelMoE(nn.Module):
    """This rank's shard of a full MoE layer (``router``, ``experts``, ``cfg``): the router and
    ``E/ep`` experts. ``routing`` holds the model's own pieces, so the shard routes as the full layer:
    ``router_logits(router, flat, cfg, s)``, ``route(logits, k, capacity_factor, b)`` and
    ``add_aux_loss(out, aux, coef)`` (the load-balancing loss's gradient, outside the reported loss)."""

    def __init__(self, full: nn.Module, group, routing):
        super().__init__()
        self.routing = routing
        self.cfg, self.group = full.cfg, group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        E = self.cfg.n_experts
        if E % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the {E} experts")
        self.local = E // self.ep
        self.first = self.rank * self.local
        self.router = full.router
        self.experts = nn.ModuleList(full.experts[self.first : self.first + self.local])
        self.aux_grad_scale = 1.0
        self.stats: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        k, E, ep, local = self.cfg.top_k, self.cfg.n_experts, self.ep, self.local
        flat = x.reshape(b * s, d)
        r = self.routing
        experts, gates, keep, aux = r.route(
            r.router_logits(self.router, flat, self.cfg, s), k, self.cfg.capacity_factor, b
        )

        # 1. this rank's kept assignments, sorted by expert (= by destination rank, then local expert)
        tok = torch.arange(b * s, device=x.device).repeat_interleave(k)
        kept = keep.reshape(-1).nonzero().squeeze(1)
        order = torch.argsort(experts.reshape(-1)[kept], stable=True)
        idx = kept[order]
        tok_sorted, exp_sorted, gate_sorted = tok[idx], experts.reshape(-1)[idx], gates.reshape(-1)[idx]
        send_counts = torch.bincount(exp_sorted, minlength=E).view(ep, local)

        # 2.-3. counts, then the rows, in the compute dtype: under autocast the experts' first matmul
        #       would cast them anyway, so casting before the wire changes no value and halves the bytes
        rows_out = flat[tok_sorted]
        if torch.is_autocast_enabled(x.device.type):
            rows_out = rows_out.to(torch.get_autocast_dtype(x.device.type))
        recv, recv_counts, splits = self.dispatch(rows_out, send_counts)
        in_splits, out_splits = splits

        # 4. local experts; 5. combine: outputs back to the tokens' ranks, gate-weighted sum per token
        back = self.combine(self.run_local_experts(recv, recv_counts), splits)
        out = torch.zeros_like(flat).index_add(
            0, tok_sorted, back.to(flat.dtype) * gate_sorted.unsqueeze(1).to(flat.dtype)
        )

        self.stats = {
            "tokens_per_expert": send_counts.reshape(-1).tolist(),  # this rank's routing
            "received_per_local_expert": recv_counts.sum(0).tolist(),
            "sent_rows": int(sum(in_splits)),
            "received_rows": int(sum(out_splits)),
            "dropped": int((~keep).sum()),
        }
        if torch.is_grad_enabled() and self.cfg.aux_loss_coef:
            out = self.routing.add_aux_loss(out, aux, self.cfg.aux_loss_coef * self.aux_grad_scale)
        return out.view(b, s, d)

    def dispatch(self, rows: torch.Tensor, send_counts: torch.Tensor):
        """``rows`` sorted by expert, ``send_counts[dst, e]`` rows for local expert e of rank dst.
        One all-to-all of the counts (``recv_counts[src, e]``: rows rank src sends for local expert
        e), then one of the rows. Returns the received rows (grouped by source rank, then local
        expert), ``recv_counts`` and the split sizes ``(in_splits, out_splits)`` for :meth:`combine`."""
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        return _AllToAllV.apply(rows, out_splits, in_splits, self.group), recv_counts, (in_splits, out_splits)

    def combine(self, out_rows: torch.Tensor, splits) -> torch.Tensor:
        """The reverse exchange: every output row back to the rank and position it came from."""
        in_splits, out_splits = splits
        return _AllToAllV.apply(out_rows, in_splits, out_splits, self.group)

    def run_local_experts(self, recv: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        if recv.shape[0] == 0:
            # No local expert got a row in this layer (routing can collapse onto other ranks'
            # experts). The empty output must still hang off the received tensor: otherwise this
            # rank's autograd graph drops both backward all-to-alls of the layer while its peers
            # issue them, and the group deadlocks.
            return recv
        ep = self.ep
        starts = torch.cat([recv_counts.new_zeros(1), recv_counts.reshape(-1).cumsum(0)[:-1]]).view(ep, self.local)
        out_rows = torch.zeros_like(recv)
        for e, expert in enumerate(self.experts):
            rows = torch.cat(
                [
                    torch.arange(int(starts[src, e]), int(starts[src, e] + recv_counts[src, e]), device=recv.device)
                    for src in range(ep)
                ]
            )
            if rows.numel():
                out_rows = out_rows.index_copy(0, rows, expert(recv[rows]))
        return out_rows


class ExpertParallel:
    """A GPT whose MoE layers are :class:`ExpertParallelMoE` over ``group`` (ep = group size)."""

    def __init__(self, model: nn.Module, group, routing, loss_fn):
        """``routing``: ``moe_type`` (the model's MoE layer class) and the pieces
        :class:`ExpertParallelMoE` takes; ``loss_fn(logits, targets)``: the training loss."""
        self.model, self.group, self.loss_fn = model, group, loss_fn
        self.ep = dist.get_world_size(group)
        self.moe_layers: dict[int, ExpertParallelMoE] = {}
        for i, blk in enumerate(model.blocks):
            if isinstance(blk.mlp, routing.moe_type):
                blk.mlp = ExpertParallelMoE(blk.mlp, group, routing)
                self.moe_layers[i] = blk.mlp
        expert_ids = {id(p) for m in self.moe_layers.values() for p in m.experts.parameters()}
        self.dense = [p for p in model.parameters() if id(p) not in expert_ids]
        self.expert_params = [p for p in model.parameters() if id(p) in expert_ids]

    def global_name(self, name: str) -> str:
        """``blocks.i.mlp.experts.<local>.…`` -> the full model's name (global expert index)."""
        parts = name.split(".")
        if len(parts) > 4 and parts[2] == "mlp" and parts[3] == "experts":
            parts[4] = str(self.moe_layers[int(parts[1])].first + int(parts[4]))
        return ".".join(parts)

    def forward_backward(self, inputs, targets, grad_accum: int, autocast=None) -> torch.Tensor:
        import contextlib

        for m in self.moe_layers.values():
            m.aux_grad_scale = 1.0 / grad_accum
        total = torch.zeros((), device=inputs.device)
        for x, y in zip(inputs.chunk(grad_accum), targets.chunk(grad_accum)):
            with autocast() if autocast else contextlib.nullcontext():
                loss = self.loss_fn(self.model(x), y) / grad_accum
            loss.backward()
            total += loss.detach()
        self.reduce_grads()
        return total

    def reduce_grads(self):
        """Dense gradients: one flat all-reduce over the group, / ep. Expert gradients: / ep only."""
        for p in self.dense:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in self.dense])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.ep)
        off = 0
        for p in self.dense:
            p.grad.copy_(flat[off : off + p.numel()].view_as(p))
            off += p.numel()
        for p in self.expert_params:
            if p.grad is not None:  # an expert no token chose keeps no gradient, as in one process
                p.grad.div_(self.ep)

    def routing_stats(self) -> dict:
        return {str(i): m.stats for i, m in self.moe_layers.items()}
