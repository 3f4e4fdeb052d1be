"""Interleaved 1F1B: Megatron's pipeline schedule with ``v`` virtual stages per rank (torch only).

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 2.2.2, Fig. 4 bottom. The layers are cut into ``C = p * v`` contiguous model
chunks instead of ``p`` stages; rank ``r`` holds chunks ``r, r + p, ..., r + (v - 1) p``. A
micro-batch therefore visits every rank ``v`` times: chunk ``c`` sends its output to chunk
``c + 1`` on the next rank, and the last rank's chunk ``c`` wraps round to rank 0 for chunk
``c + 1``. Each chunk's forward and backward is ``1/v`` of a plain stage's, so the pipeline fills
and drains ``v`` times faster and the bubble shrinks from ``(p - 1) / (m + p - 1)`` to

    bubble fraction = (p - 1) / (v * m + p - 1)

(the paper's bubble time over ideal time, ``(p - 1) / (v m)``, written as a share of the step).
The price is ``v`` times as many boundary crossings: per micro-batch every one of the ``C - 1``
chunk boundaries carries the activation ``[b, s, h]`` forward and its gradient back.

The schedule is Megatron-LM's (``forward_backward_pipelining_with_interleaving``): the ``m * v``
(chunk, micro-batch) units of a rank are taken in groups of ``p`` micro-batches, chunk by chunk
(forward: chunk 0 on micro-batches 0..p-1, chunk 1 on the same ones, ..., then the next ``p``
micro-batches); backwards take the chunks in reverse. Rank ``r`` runs
``2 (p - r - 1) + (v - 1) p`` warm-up forwards, then alternates one forward and one backward,
then drains. This is why ``m`` must be a multiple of ``p``: the groups of ``p`` must tile the
micro-batches. With ``m == p`` Megatron runs every forward first (its warm-up would otherwise
cover all but a few units and its paired send/recv would not line up); we do the same.

Transport as in :mod:`reference_impls.pipeline`: non-blocking sends, blocking receives, handles
waited at the end of the step. Tags name the kind (activation or gradient) and the receiving
rank's local chunk, so a message cannot be taken by the wrong chunk on gloo; on NCCL, which
ignores tags, the schedule itself keeps every (sender, receiver) channel in the same order on
both sides (``tests/test_pp_interleaved.py`` checks it by simulation).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from reference_impls.pipeline import StageClock, partition_layers, stage_head_loss
from reference_impls.pipeline_checks import check_interleaving

# --- schedule -------------------------------------------------------------------------------------


def warmup_units(stage: int, n_stages: int, virtual_stages: int, m: int) -> int:
    """Forwards rank ``stage`` runs before its first backward (Megatron-LM's warm-up count)."""
    total = m * virtual_stages
    if m == n_stages:
        return total
    return min(2 * (n_stages - stage - 1) + (virtual_stages - 1) * n_stages, total)


def unit(k: int, n_stages: int, virtual_stages: int, forward: bool) -> tuple[int, int]:
    """(local chunk, micro-batch) of a rank's ``k``-th forward (or backward) unit."""
    group, within = divmod(k, n_stages * virtual_stages)
    chunk = within // n_stages
    if not forward:
        chunk = virtual_stages - 1 - chunk
    return chunk, group * n_stages + k % n_stages


def interleaved_order(stage: int, n_stages: int, virtual_stages: int, m: int) -> list[tuple[str, int, int]]:
    """``(kind, local chunk, micro-batch)`` in the order rank ``stage`` runs them."""
    check_interleaving(n_stages, virtual_stages, m)
    p, v = n_stages, virtual_stages
    total = m * v
    warm = warmup_units(stage, p, v, m)
    order = [("F", *unit(k, p, v, True)) for k in range(warm)]
    for k in range(total - warm):
        order += [("F", *unit(warm + k, p, v, True)), ("B", *unit(k, p, v, False))]
    order += [("B", *unit(k, p, v, False)) for k in range(total - warm, total)]
    return order


def bubble_fraction_theory(n_stages: int, virtual_stages: int, m: int) -> float:
    """Narayanan et al. 2021, Sec. 2.2.2: the 1F1B bubble divided by the v chunks per rank."""
    return (n_stages - 1) / (virtual_stages * m + n_stages - 1)


def peak_live_theory(stage: int, n_stages: int, virtual_stages: int, m: int) -> int:
    """Most (chunk, micro-batch) activations alive at once on rank ``stage``: the warm-up plus the
    steady state's one forward ahead (each is a chunk's, 1/v of a plain stage's layers)."""
    warm = warmup_units(stage, n_stages, virtual_stages, m)
    return min(warm + 1, m * virtual_stages)


# --- chunks ----------------------------------------------------------------------------------------


def chunk_bounds(n_layers: int, n_stages: int, virtual_stages: int, stage: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` block ranges of rank ``stage``'s chunks, in local chunk order."""
    bounds = partition_layers(n_layers, n_stages * virtual_stages)
    return [bounds[stage + k * n_stages] for k in range(virtual_stages)]


def split_chunks(model: nn.Module, stage: int, n_stages: int, virtual_stages: int) -> nn.Module:
    """Keep, in place, only rank ``stage``'s chunks; parameter names stay the full model's.

    As :func:`reference_impls.pipeline.split_stage`, with ``blocks`` keyed by global index: the
    embedding stays with chunk 0 (rank 0), the final LayerNorm and head with chunk ``C - 1``
    (rank ``p - 1``)."""
    keep = [i for lo, hi in chunk_bounds(len(model.blocks), n_stages, virtual_stages, stage) for i in range(lo, hi)]
    model.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in keep})
    if stage > 0:
        del model.tok_emb, model.pos_emb
    if stage < n_stages - 1:
        del model.ln_f, model.head
    return model


# --- the engine -------------------------------------------------------------------------------------


class InterleavedPipelineEngine:
    """Runs rank ``stage``'s part of the interleaved schedule for one batch; records order, timing
    and live activations. Same interface as :class:`reference_impls.pipeline.PipelineEngine`."""

    schedule = "interleaved_1f1b"

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        ranks: list[int],
        group,
        virtual_stages: int,
        n_layers: int,
        record_timeline: bool = False,
    ):
        self.module, self.stage, self.ranks, self.group = module, stage, ranks, group
        self.n_stages, self.v = len(ranks), virtual_stages
        self.n_chunks = self.n_stages * virtual_stages
        p = self.n_stages
        # Chunk c + 1 lives on the next rank; the last rank's next is rank 0 (its next chunk).
        self.next, self.prev = ranks[(stage + 1) % p], ranks[(stage - 1) % p]
        self.global_chunks = [stage + k * p for k in range(virtual_stages)]
        self.chunk_blocks = [
            [module.blocks[str(i)] for i in range(lo, hi)]
            for lo, hi in chunk_bounds(n_layers, p, virtual_stages, stage)
        ]
        self.record_timeline = record_timeline
        self._stats: dict = {}

    def _tag(self, kind: str, local_chunk: int) -> int:
        """The receiving side's (kind, local chunk): activations even tags, gradients odd."""
        return 2 * local_chunk + (0 if kind == "act" else 1)

    def run(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        n_micro: int,
        act_shape: tuple[int, ...],
        act_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor | None:
        """Forward and backward of all ``n_micro`` micro-batches through this rank's chunks; the
        mean loss on the last rank (it holds the last chunk), None elsewhere."""
        if inputs.shape[0] % n_micro:
            raise ValueError(f"{n_micro} micro-batches do not divide a batch of {inputs.shape[0]}")
        p, v, C = self.n_stages, self.v, self.n_chunks
        order = interleaved_order(self.stage, p, v, n_micro)
        xs, ys = inputs.chunk(n_micro), targets.chunk(n_micro)
        device = inputs.device
        saved: dict[tuple[int, int], tuple] = {}  # (local chunk, micro-batch) -> (input, output or loss)
        sends: list = []
        total = torch.zeros((), device=device, dtype=torch.float32)
        live = peak_live = 0
        clock = StageClock(device, self.record_timeline)

        def recv(src, tag):
            return clock.recv(torch.empty(act_shape, dtype=act_dtype, device=device), src, self.group, tag, -1)

        for kind, k, i in order:
            c = self.global_chunks[k]
            # A neighbour chunk has the same local index on the neighbour rank, except across the
            # wrap: rank p-1's chunk k feeds rank 0's chunk k+1.
            if kind == "F":
                if c == 0:
                    t0 = clock.mark()
                    x_in, x = None, self.module.embed(xs[i])
                else:
                    x_in = recv(self.prev, self._tag("act", k)).requires_grad_(True)
                    t0 = clock.mark()
                    x = x_in
                for block in self.chunk_blocks[k]:
                    x = block(x)
                if c == C - 1:
                    out = stage_head_loss(self.module, x, ys[i]) / n_micro
                    total += out.detach()
                else:
                    out = x
                    k_next = k + 1 if self.stage == p - 1 else k
                    work = dist.isend(out.detach(), dst=self.next, group=self.group, tag=self._tag("act", k_next))
                    sends.append((work, out))
                saved[k, i] = (x_in, out)
                live += 1
                peak_live = max(peak_live, live)
            else:
                x_in, out = saved.pop((k, i))
                grad = None if c == C - 1 else recv(self.next, self._tag("grad", k))
                t0 = clock.mark()
                torch.autograd.backward(out, grad)
                if c > 0:
                    k_prev = k - 1 if self.stage == 0 else k
                    work = dist.isend(x_in.grad, dst=self.prev, group=self.group, tag=self._tag("grad", k_prev))
                    sends.append((work, x_in.grad))
                live -= 1
            clock.computed(kind, i, t0, clock.mark(), c)

        clock.drain(sends)
        self._stats = {
            "schedule": self.schedule,
            "stage": self.stage,
            "stages": p,
            "virtual_stages": v,
            "chunks": self.global_chunks,
            "microbatches": n_micro,
            "order": [f"{kind}{i}c{self.global_chunks[k]}" for kind, k, i in order],
            **clock.finish(),  # step_s, compute_s, wait_s, the timeline
            "bubble_fraction_theory": bubble_fraction_theory(p, v, n_micro),
            # counted in (chunk, micro-batch) activations, each 1/v of a plain stage's
            "peak_live_microbatches": peak_live,
            "peak_live_microbatches_theory": peak_live_theory(self.stage, p, v, n_micro),
        }
        return total if self.stage == p - 1 else None

    def stats(self) -> dict:
        return dict(self._stats)
