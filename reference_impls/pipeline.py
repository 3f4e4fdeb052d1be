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
backward times. This file measures it: every stage records when it computes and when it waits
(in ``recv``, and for outstanding ``isend``s at the end of the step), on the host clock, or with
CUDA events on a GPU when option ``record_timeline`` asks (``StageClock``), and the bubble
fraction of a stage is its waiting time over its step.

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

from reference_impls.pipeline_checks import check_stage_layers

TAG_ACT, TAG_GRAD = 0, 1


# --- partition and schedules ---------------------------------------------------------------------


def partition_layers(n_layers: int, n_stages: int, stage_layers=None) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` block ranges per stage.

    Without ``stage_layers``, as equal as the count allows, the first stages taking the remainder.
    With it, ``stage_layers[s]`` blocks on stage ``s``: an uneven split that gives the end stages
    fewer blocks, since the first also runs the embedding and the last the final LayerNorm, head
    and loss (at gpt-1.3b pp 4 the last stage's step was 35-45 % longer than the others' on an
    equal split, docs/results.md). Megatron-LM's ``--decoder-first-pipeline-num-layers`` /
    ``--decoder-last-pipeline-num-layers`` and torchtitan's
    ``pipeline_parallel_first_stage_less_layers`` / ``pipeline_parallel_last_stage_less_layers``
    (``generate_llm_fqn_per_model_part``, which counts the embedding and the output as layers)
    make the same choice; here the counts are given outright."""
    if stage_layers is not None:
        check_stage_layers(stage_layers, n_layers, n_stages)
        sizes = list(stage_layers)
    else:
        if n_stages > n_layers:
            raise ValueError(f"{n_stages} stages for {n_layers} layers")
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(n_stages)]
    bounds, lo = [], 0
    for size in sizes:
        bounds.append((lo, lo + size))
        lo += size
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


def split_stage(model: nn.Module, stage: int, n_stages: int, stage_layers=None) -> nn.Module:
    """Keep, in place, only what stage ``stage`` runs; parameter names stay the full model's.
    ``stage_layers``: blocks per stage (:func:`partition_layers`); None, an equal split.

    ``model`` needs ``tok_emb, pos_emb, blocks, ln_f, head`` and an ``embed(tokens)`` method (the
    GPT and its tensor-parallel shard both have them). ``blocks`` becomes a ModuleDict keyed by
    the global block index, so ``blocks.5.attn.q.weight`` keeps its name on whatever stage holds it.
    """
    lo, hi = partition_layers(len(model.blocks), n_stages, stage_layers)[stage]
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
    """One step of a pipeline stage: the intervals it computed and the ones it waited for a
    neighbour (the measured bubble), relative to the step's start.

    Marks are tokens, resolved to seconds by :meth:`finish`. On the host clock (a CPU, or a GPU
    without ``device_timed``) a mark is ``time.perf_counter()``: exact on a CPU, where the host
    runs the work; on a GPU it sees kernel launches only, so no bubble is given there. With
    ``device_timed`` (option ``record_timeline`` on a GPU) a mark is a CUDA event recorded on the
    current stream, without a host sync: it completes when the device reaches it, so an interval
    is the device's own. A blocking NCCL ``recv`` and ``work.wait()`` make the current stream
    wait for the transfer, so the interval around them is the device waiting for a neighbour.
    One synchronisation at :meth:`finish` reads every event."""

    def __init__(self, device: torch.device, device_timed: bool = False):
        self.on_cuda = device.type == "cuda"
        self.device_timed = device_timed and self.on_cuda
        self._stream = torch.cuda.current_stream(device) if self.device_timed else None
        self._marks: list = []  # perf_counter seconds, or CUDA events
        self._entries: list[tuple] = []  # (kind, micro, t0 token, t1 token, *detail); kind "wait" for waits
        self._drain: tuple[int, int] | None = None
        self.start = self.mark()

    def mark(self) -> int:
        """A point in the step; its time is read by :meth:`finish`."""
        if self.device_timed:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self._stream)
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def recv(self, buf: torch.Tensor, src: int, group, tag: int, *detail) -> torch.Tensor:
        """Blocking receive into ``buf``, its wait recorded (``detail``: extra fields of the event)."""
        t0 = self.mark()
        dist.recv(buf, src=src, group=group, tag=tag)
        self.waited(t0, self.mark(), *detail)
        return buf

    def waited(self, t0: int, t1: int, *detail) -> None:
        """The stage waited for a neighbour from mark ``t0`` to mark ``t1``."""
        self._entries.append(("wait", -1, t0, t1, *detail))

    def computed(self, kind: str, micro: int, t0: int, t1: int, *detail) -> None:
        """Micro-batch ``micro``'s op ``kind`` ran from mark ``t0`` to mark ``t1``."""
        self._entries.append((kind, micro, t0, t1, *detail))

    def drain(self, sends: list) -> None:
        """Wait for the step's outstanding sends (idle time too); the step ends after them."""
        t0 = self.mark()
        for work, _ in sends:
            work.wait()
        self._drain = (t0, self.mark())

    def finish(self) -> dict:
        """The step's record, every mark in seconds from the step's start: ``timeline`` (one
        ``(kind, micro, t0, t1, *detail)`` per op and per wait), ``step_s``, ``compute_s`` and
        ``compute_s_by_kind``, ``wait_s`` (receives and the final drain of sends), ``host_gap_s``
        (the rest of the step, between marks: on the device, idle waiting for the host to launch),
        the idle share ``bubble_fraction_measured`` (None where the clock saw launches only) and
        ``timeline_clock``."""
        if self._drain is None:
            raise RuntimeError("StageClock.finish before drain: the step has no end")
        if self.device_timed:
            self._marks[-1].synchronize()  # the last event recorded: every earlier one is done
            first = self._marks[self.start]
            seconds = [first.elapsed_time(event) / 1000 for event in self._marks]
        else:
            seconds = [t - self._marks[self.start] for t in self._marks]
        timeline = [(kind, micro, seconds[t0], seconds[t1], *detail) for kind, micro, t0, t1, *detail in self._entries]
        by_kind: dict[str, float] = {}
        wait_s = seconds[self._drain[1]] - seconds[self._drain[0]]
        for kind, _, t0, t1, *_ in timeline:
            if kind == "wait":
                wait_s += t1 - t0
            else:
                by_kind[kind] = by_kind.get(kind, 0.0) + t1 - t0
        step_s = seconds[self._drain[1]]
        compute_s = sum(by_kind.values())
        bubble = wait_s / step_s if step_s > 0 else None
        return {
            "step_s": step_s,
            "compute_s": compute_s,
            "compute_s_by_kind": by_kind,
            "wait_s": wait_s,
            "host_gap_s": max(step_s - compute_s - wait_s, 0.0),
            "bubble_fraction_measured": bubble if (self.device_timed or not self.on_cuda) else None,
            "bubble_fraction_host_clock": None if self.device_timed else bubble,
            "timeline_clock": "cuda_events" if self.device_timed else "host",
            "timeline": timeline,
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
        clock = StageClock(device, self.record_timeline)

        def recv(shape, src, tag):
            return clock.recv(torch.empty(shape, dtype=act_dtype, device=device), src, self.group, tag)

        for kind, i in order:
            if kind == "F":
                if self.first:
                    t0 = clock.mark()
                    x_in, x = None, self.module.embed(xs[i])
                else:
                    x_in = recv(act_shape, self.prev, TAG_ACT).requires_grad_(True)
                    t0 = clock.mark()
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
                t0 = clock.mark()
                torch.autograd.backward(out, grad)
                if not self.first:
                    sends.append((dist.isend(x_in.grad, dst=self.prev, group=self.group, tag=TAG_GRAD), x_in.grad))
                live -= 1
            clock.computed(kind, i, t0, clock.mark())

        clock.drain(sends)
        m, p = n_micro, self.n_stages
        self._stats = {
            "schedule": self.schedule,
            "stage": self.stage,
            "stages": p,
            "microbatches": m,
            "order": [f"{k}{i}" for k, i in order],
            # step_s, compute_s, wait_s, the timeline; the embedding's forward (first stage) counts as compute
            **clock.finish(),
            "bubble_fraction_theory": bubble_fraction_theory(p, m),
            "peak_live_microbatches": peak_live,
            "peak_live_microbatches_theory": m if self.schedule == "gpipe" else min(p - self.stage, m),
        }
        return total if self.last else None

    def stats(self) -> dict:
        return dict(self._stats)
