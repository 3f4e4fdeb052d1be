"""PipeDream-2BW: an asynchronous pipeline without flushes, its weights double-buffered (torch only).

GPipe and 1F1B (``pipeline.py``) flush the pipeline every batch so that every micro-batch of a batch
sees the same weights and the update is plain synchronous SGD; the flush is the bubble
``(p - 1) / (m + p - 1)``. PipeDream (Narayanan et al. 2019, "PipeDream: Generalized Pipeline
Parallelism for DNN Training", Sec. 3.3 "weight stashing") never flushes: a stage runs the 1F1B steady
state forever, and a micro-batch's backward must use the weights its forward used, so a stage stashes
one weight version per micro-batch in flight (up to ``p - stage`` versions). The seeds describe it:
"some data of the second batch are processed before properly updating the tensors based on the first
batch", with "version control of weights (weight stashing)" (seed 001_49cb7c694370cc74.txt, "PipeDream").

PipeDream-2BW (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training", ICML, Sec. 3.1)
keeps **two** versions per stage. Every micro-batch of batch ``b`` runs, forward and backward, on the
same version ``W(b-1)``; its gradient goes into the update of the newest version

    W(b+1) = W(b) - ν · ∇f(W(b-1))                       (Sec. 3.1, "1-stale" weight update)

so the update is delayed by exactly one step (``W(-1) = W(0)``: the first step is an ordinary one).
The new version is written into the buffer batch ``b`` used, which is free once batch ``b``'s last
backward on this stage is done; batch ``b+1``'s micro-batches already in flight use ``W(b)``, the other
buffer, untouched. That needs ``m >= p`` micro-batches per batch: a stage's ``w = p - stage - 1``
micro-batches in flight must all belong to one batch when it updates.

Here the two versions are two copies of the stage module whose parameters are views of two flat
buffers; their ``.grad`` are views of one shared flat gradient (one batch accumulates at a time: a
stage runs its backwards in micro-batch order). The optimizer's one flat parameter is re-pointed at the
destination buffer before each step, so Adam's moments carry over. Memory per stage, fp32:
2 × 4Ψ_stage parameters + 4Ψ_stage gradient + 8Ψ_stage Adam, against PipeDream's (p - stage) × 4Ψ_stage
of stashed weights.

Schedule: the global 1F1B stream of micro-batches ``k = 0, 1, 2, ...``; after every forward, a stage
runs the backward of its oldest micro-batch once more than ``w`` are in flight. One call to
:meth:`PipeDream2BW.run` forwards one batch's ``m`` micro-batches (and the backwards that fall due),
so the last ``w`` backwards of a batch run during the next call: that overlap is what removes the
flush. A send whose receiver takes it in the next call is waited for at the end of that next call, so
no step ends waiting for a neighbour's next step. :meth:`flush` runs every backward still owed and its
update (before reading the parameters, and at the end).
"""

from __future__ import annotations

import copy
from collections import deque

import torch
import torch.distributed as dist
import torch.nn as nn

from reference_impls.dp_common import adamw, bind_grads, bind_params, flatten, plan_buckets, tensor_bytes
from reference_impls.pipeline import TAG_ACT, TAG_GRAD, StageClock, stage_head_loss

VERSIONS = 2


def pipedream_versions(n_stages: int, stage: int) -> int:
    """Weight versions PipeDream's weight stashing keeps on ``stage``: one per micro-batch in flight."""
    return n_stages - stage


class PipeDream2BW:
    """One stage of a PipeDream-2BW pipeline: two weight versions, a 1-step delayed update."""

    def __init__(self, module: nn.Module, stage: int, ranks: list[int], group, *, adam: dict, dp_group=None):
        self.stage, self.ranks, self.group, self.dp_group = stage, ranks, group, dp_group
        self.n_stages = len(ranks)
        self.first, self.last = stage == 0, stage == self.n_stages - 1
        self.prev = ranks[stage - 1] if not self.first else None
        self.next = ranks[stage + 1] if not self.last else None
        self.warmup = self.n_stages - stage - 1  # micro-batches in flight after a forward, at most
        self.modules = [module, copy.deepcopy(module)]
        layouts = [plan_buckets(m.parameters(), float("inf"), 4) for m in self.modules]
        self.flat = [flatten(layout, torch.float32) for layout in layouts]
        self.flat_grad = torch.zeros_like(self.flat[0])
        for layout, flat in zip(layouts, self.flat):
            bind_params(layout, flat)
            bind_grads(layout, self.flat_grad)
        self._layout = layouts
        self.opt_param = nn.Parameter(self.flat[0])
        self.optimizer = adamw([self.opt_param], **adam)
        self.updates = 0  # W(updates) is the newest version, in flat[updates % 2]
        self.batches = 0  # batches whose forwards have been issued
        self.in_flight: deque = deque()  # (batch, micro, stage input, output or loss), oldest first
        self.n_micro: dict[int, int] = {}  # micro-batches of each batch not yet backwarded
        self.sends_prev_call: list = []
        self.record_timeline = False
        self._stats: dict = {}
        self.peak_live = 0

    # --- versions ------------------------------------------------------------------------------

    def module_for(self, batch: int) -> nn.Module:
        """The copy holding W(batch - 1), which every micro-batch of ``batch`` runs on."""
        return self.modules[(batch - 1) % VERSIONS]

    def _update(self, batch: int) -> None:
        """Batch ``batch``'s gradient (on W(batch-1)) is complete: W(batch+1) = W(batch) - ν·g, written
        into the buffer W(batch-1) occupied."""
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(self.flat_grad, group=self.dp_group)
            self.flat_grad.div_(dist.get_world_size(self.dp_group))
        newest, dest = self.flat[batch % VERSIONS], self.flat[(batch + 1) % VERSIONS]
        dest.copy_(newest)
        self.opt_param.data = dest
        self.opt_param.grad = self.flat_grad
        self.optimizer.step()
        self.opt_param.grad = None
        self.flat_grad.zero_()
        self.updates += 1

    # --- the schedule --------------------------------------------------------------------------

    def _forward(self, batch, micro, x_tok, y, n_micro, act_shape, act_dtype, clock, sends, total):
        module = self.module_for(batch)
        if self.first:
            t0 = clock.mark()
            x_in, x = None, module.embed(x_tok)
        else:
            x_in = clock.recv(torch.empty(act_shape, dtype=act_dtype, device=y.device), self.prev, self.group, TAG_ACT)
            x_in.requires_grad_(True)
            t0 = clock.mark()
            x = x_in
        for block in module.blocks.values():
            x = block(x)
        if self.last:
            out = stage_head_loss(module, x, y) / n_micro
            total += out.detach()
        else:
            out = x
            sends.append((dist.isend(out.detach(), dst=self.next, group=self.group, tag=TAG_ACT), out))
        self.in_flight.append((batch, micro, x_in, out))
        self.peak_live = max(self.peak_live, len(self.in_flight))
        clock.computed("F", micro, t0, clock.mark())

    def _backward(self, clock, sends):
        batch, micro, x_in, out = self.in_flight.popleft()
        grad = None
        if not self.last:
            grad = clock.recv(torch.empty_like(out), self.next, self.group, TAG_GRAD)
        t0 = clock.mark()
        torch.autograd.backward(out, grad)
        if not self.first:
            sends.append((dist.isend(x_in.grad, dst=self.prev, group=self.group, tag=TAG_GRAD), x_in.grad))
        clock.computed("B", micro, t0, clock.mark())
        self.n_micro[batch] -= 1
        if self.n_micro[batch] == 0:
            del self.n_micro[batch]
            self._update(batch)

    def run(self, inputs, targets, n_micro: int, act_shape, act_dtype=torch.float32):
        """Forward this batch's ``n_micro`` micro-batches and every backward that falls due; the batch's
        mean loss on the last stage (whose backwards all fall due within the call), None elsewhere."""
        if n_micro < self.n_stages:
            raise ValueError(f"PipeDream-2BW needs at least as many micro-batches ({n_micro}) as stages")
        batch = self.batches
        self.batches += 1
        self.n_micro[batch] = n_micro
        clock = StageClock(inputs.device, self.record_timeline)
        sends: list = []
        total = torch.zeros((), device=inputs.device)
        for micro, (x, y) in enumerate(zip(inputs.chunk(n_micro), targets.chunk(n_micro))):
            self._forward(batch, micro, x, y, n_micro, act_shape, act_dtype, clock, sends, total)
            if len(self.in_flight) > self.warmup:
                self._backward(clock, sends)
        clock.drain(self.sends_prev_call)  # received by now: the receivers are in this call too
        self.sends_prev_call = sends
        self._stats = {
            "schedule": "2bw",
            "stage": self.stage,
            "stages": self.n_stages,
            "microbatches": n_micro,
            **clock.finish(),
            "bubble_fraction_theory": 0.0,  # no flush: the steady state only (the fill happens once)
            "peak_live_microbatches": self.peak_live,
            "peak_live_microbatches_theory": min(self.n_stages - self.stage, n_micro),
            "weight_versions": VERSIONS,
            "weight_versions_pipedream": pipedream_versions(self.n_stages, self.stage),
            "updates_applied": self.updates,
            "microbatches_in_flight_at_end": len(self.in_flight),
        }
        return total if self.last else None

    def flush(self) -> None:
        """Run every backward still owed, with its update, and finish every send."""
        sends: list = []
        clock = StageClock(self.flat_grad.device)
        while self.in_flight:
            self._backward(clock, sends)
        for work, _ in self.sends_prev_call + sends:
            work.wait()
        self.sends_prev_call = []

    # --- state ---------------------------------------------------------------------------------

    def newest_named_parameters(self) -> dict[str, torch.Tensor]:
        """The newest version W(updates), by the stage module's parameter names."""
        return dict(self.modules[self.updates % VERSIONS].named_parameters())

    def state_bytes(self) -> dict:
        return {
            "params": tensor_bytes(self.flat),
            "grads": tensor_bytes([self.flat_grad]),
            "optimizer": tensor_bytes(
                v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
            ),
        }

    def stats(self) -> dict:
        return dict(self._stats)


def delayed_update_reference(model: nn.Module, loss_fn, batches, *, adam: dict) -> nn.Module:
    """One process, the same update rule: the gradient of step ``t`` taken at W(t-1), applied to W(t).
    The single-process truth PipeDream-2BW is checked against."""
    params = list(model.parameters())
    optimizer = adamw(params, **adam)
    previous = [p.detach().clone() for p in params]  # W(t-1); W(-1) = W(0)
    for inputs, targets in batches:
        current = [p.detach().clone() for p in params]  # W(t)
        with torch.no_grad():
            for p, w in zip(params, previous):
                p.copy_(w)
        loss_fn(model(inputs), targets).backward()
        with torch.no_grad():
            for p, w in zip(params, current):
                p.copy_(w)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        previous = current
    return model
