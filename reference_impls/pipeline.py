"""Pipeline parallelism over send/recv: GPipe and 1F1B (PipeDream-Flush) schedules (torch only).

The layers are cut into ``p`` contiguous stages (the embedding on the first, the final LayerNorm,
head and loss on the last); a batch is cut into ``m`` micro-batches that flow through the stages.
Activations ``[b_mb, s, h]`` go forward with ``send``/``recv`` to the next stage, gradients of the
same shape go backward to the previous one. Gradients accumulate over the micro-batches in
``.grad`` and the optimizer steps once per batch (a "flush"), so the result is the same
synchronous SGD step as on one device.

* GPipe (Huang et al. 2019, Sec. 2.2, Fig. 2c): every stage runs all ``m`` forwards, then all
  ``m`` backwards. Each stage holds the activations of all ``m`` micro-batches at the peak.
* 1F1B / PipeDream-Flush (Narayanan et al. 2019 "PipeDream", Sec. 3.2; Narayanan et al. 2021
  "Efficient Large-Scale Language Model Training on GPU Clusters", Sec. 2.2.1, Fig. 4 top): stage
  ``i`` runs ``w = min(p - i - 1, m)`` warm-up forwards, then alternates one forward and one
  backward, then drains ``w`` backwards. At most ``w + 1 <= p`` micro-batches are alive per stage.

Both have the same bubble (idle) fraction, ``(p - 1) / (m + p - 1)`` (Narayanan 2021, eq. 1,
written there as bubble time / ideal time = (p - 1) / m), with equal per-stage forward and
backward times. This file measures it: every stage records, on the host clock, when it computes
and when it waits (in ``recv``, and for outstanding ``isend``s at the end of the step), and the
bubble fraction of a stage is ``wait / (wait + compute)`` over the step.

Sends are non-blocking (``isend``; handles waited at the end of the step) and receives blocking,
so any schedule whose dependencies are acyclic cannot deadlock, whatever the transport does
with unmatched sends (gloo waits for the receiver).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

TAG_ACT, TAG_GRAD = 0, 1


# --- partition and schedules ---------------------------------------------------------------------


def partition_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` block ranges per stage; the first stages take the remainder."""
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} stages for {n_layers} layers")
    base, extra = divmod(n_layers, n_stages)
    bounds, lo = [], 0
    for s in range(n_stages):
        hi = lo + base + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def gpipe_order(stage: int, n_stages: int, m: int) -> list[tuple[str, int]]:
    """All forwards, then all backwards in micro-batch order (as torch's ScheduleGPipe)."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(stage: int, n_stages: int, m: int) -> list[tuple[str, int]]:
    """PipeDream-Flush: ``min(p-i-1, m)`` warm-up forwards, 1F1B steady state, cool-down backwards."""
    warmup = min(n_stages - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    return order


SCHEDULES = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}


def bubble_fraction_theory(n_stages: int, m: int) -> float:
    return (n_stages - 1) / (m + n_stages - 1)


# --- stage construction -------------------------------------------------------------------------


def split_stage(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """Keep, in place, only what stage ``stage`` runs; parameter names stay the full model's.

    ``model`` needs ``tok_emb, pos_emb, blocks, ln_f, head`` and an ``embed(tokens)`` method (the
    GPT and its tensor-parallel shard both have them). ``blocks`` becomes a ModuleDict keyed by
    the global block index, so ``blocks.5.attn.q.weight`` keeps its name on whatever stage holds it.
    """
    lo, hi = partition_layers(len(model.blocks), n_stages)[stage]
    model.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
    if stage > 0:
        del model.tok_emb, model.pos_emb
    if stage < n_stages - 1:
        del model.ln_f, model.head
    return model


def stage_head_loss(model: nn.Module, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's loss: the model's own ``head_loss`` if it has one (tensor parallel),
    else final LayerNorm, head and mean token cross-entropy in fp32."""
    if hasattr(model, "head_loss"):
        return model.head_loss(x, targets)
    logits = model.head(model.ln_f(x))
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- the engine ------------------------------------------------------------------------------


class StageClock:
    """One step of a pipeline stage on the host clock: the intervals it computed and the ones it
    waited for a neighbour (the measured bubble), relative to the step's start. With ``synchronize``
    (option ``record_timeline``) every mark waits for the device, so on a GPU an interval is the
    work's own rather than its launch's; without it the default path has no host syncs."""

    def __init__(self, synchronize: bool):
        self.synchronize = synchronize
        self.wait_s = 0.0
        self.events: list[tuple] = []
        self.start = self.now()

    def now(self) -> float:
        if self.synchronize and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def recv(self, buf: torch.Tensor, src: int, group, tag: int, *detail) -> torch.Tensor:
        """Blocking receive into ``buf``, its wait recorded (``detail``: extra fields of the event)."""
        t0 = self.now()
        dist.recv(buf, src=src, group=group, tag=tag)
        t1 = self.now()
        self.wait_s += t1 - t0
        self.events.append(("wait", -1, t0 - self.start, t1 - self.start, *detail))
        return buf

    def computed(self, kind: str, micro: int, t0: float, t1: float, *detail) -> None:
        self.events.append((kind, micro, t0 - self.start, t1 - self.start, *detail))

    def drain(self, sends: list) -> float:
        """Wait for the step's outstanding sends (idle time too); the step's length."""
        t0 = self.now()
        for work, _ in sends:
            work.wait()
        t1 = self.now()
        self.wait_s += t1 - t0
        return t1 - self.start

    def bubble_stats(self, step_s: float, on_cuda: bool) -> dict:
        """The idle share of this stage's step. On a GPU the host clock only sees kernel launches
        unless the clock synchronises: then there is no measurement, never a misleading one."""
        host = self.wait_s / step_s if step_s > 0 else None
        return {
            "wait_s": self.wait_s,
            "bubble_fraction_measured": host if (self.synchronize or not on_cuda) else None,
            "bubble_fraction_host_clock": host,
            "timeline_synchronized": bool(self.synchronize),
            "timeline": self.events,
        }


class PipelineEngine:
    """Runs one stage's part of a schedule for one batch; records order, timing and live activations.

    ``ranks`` are the global ranks of the pipeline group in stage order; ``group`` that group.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        ranks: list[int],
        group,
        schedule: str = "1f1b",
        record_timeline: bool = False,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
        self.module, self.stage, self.ranks, self.group = module, stage, ranks, group
        self.n_stages = len(ranks)
        self.schedule = schedule
        self.first, self.last = stage == 0, stage == self.n_stages - 1
        self.prev = ranks[stage - 1] if not self.first else None
        self.next = ranks[stage + 1] if not self.last else None
        self.record_timeline = record_timeline
        self._stats: dict = {}

    def run(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        n_micro: int,
        act_shape: tuple[int, ...],
        act_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor | None:
        """Forward and backward of all ``n_micro`` micro-batches of ``inputs``/``targets`` (``[B, s]``);
        the mean loss on the last stage, None elsewhere. ``act_shape`` is one micro-batch's
        boundary activation (``[B/m, s, h]``, or ``[B/m, s/t, h]`` under sequence parallelism)."""
        if inputs.shape[0] % n_micro:
            raise ValueError(f"{n_micro} micro-batches do not divide a batch of {inputs.shape[0]}")
        xs, ys = inputs.chunk(n_micro), targets.chunk(n_micro)
        order = SCHEDULES[self.schedule](self.stage, self.n_stages, n_micro)
        device = inputs.device
        saved: dict[int, tuple] = {}  # micro-batch -> (stage input, stage output or loss)
        sends: list = []
        total = torch.zeros((), device=device, dtype=torch.float32)
        live = peak_live = 0
        compute_s = 0.0
        clock = StageClock(self.record_timeline)

        def recv(shape, src, tag):
            return clock.recv(torch.empty(shape, dtype=act_dtype, device=device), src, self.group, tag)

        for kind, i in order:
            if kind == "F":
                if self.first:
                    t0 = clock.now()
                    x_in, x = None, self.module.embed(xs[i])
                else:
                    x_in = recv(act_shape, self.prev, TAG_ACT).requires_grad_(True)
                    t0 = clock.now()
                    x = x_in
                for block in self.module.blocks.values():
                    x = block(x)
                if self.last:
                    out = stage_head_loss(self.module, x, ys[i]) / n_micro
                    total += out.detach()
                else:
                    out = x
                    sends.append((dist.isend(out.detach(), dst=self.next, group=self.group, tag=TAG_ACT), out))
                saved[i] = (x_in, out)
                live += 1
                peak_live = max(peak_live, live)
            else:
                x_in, out = saved.pop(i)
                grad = None if self.last else recv(out.shape, self.next, TAG_GRAD)
                t0 = clock.now()
                torch.autograd.backward(out, grad)
                if not self.first:
                    sends.append((dist.isend(x_in.grad, dst=self.prev, group=self.group, tag=TAG_GRAD), x_in.grad))
                live -= 1
            t1 = clock.now()
            compute_s += t1 - t0
            clock.computed(kind, i, t0, t1)

        step_s = clock.drain(sends)
        m, p = n_micro, self.n_stages
        self._stats = {
            "schedule": self.schedule,
            "stage": self.stage,
            "stages": p,
            "microbatches": m,
            "order": [f"{k}{i}" for k, i in order],
            "step_s": step_s,
            "compute_s": compute_s,
            # the embedding's forward (first stage) counts as compute
            **clock.bubble_stats(step_s, device.type == "cuda"),
            "bubble_fraction_theory": bubble_fraction_theory(p, m),
            "peak_live_microbatches": peak_live,
            "peak_live_microbatches_theory": m if self.schedule == "gpipe" else min(p - self.stage, m),
        }
        return total if self.last else None

    def stats(self) -> dict:
        return dict(self._stats)
