"""Zero-bubble pipeline parallelism, schedule ZB-H1, over send/recv (torch only).

Qi, Wan, Huang and Lin 2024, "Zero Bubble Pipeline Parallelism" (ICLR 2024, arXiv:2401.10241).

Sec. 2 splits a stage's backward in two. For a linear layer ``y = x W``:

* **B**, the input gradient ``dx = dy W^T``: the previous stage waits for it, so it stays on the
  critical path;
* **W**, the weight gradient ``dW = x^T dy``: nothing downstream waits for it, so it can run
  whenever the stage would otherwise idle, as long as it comes after its B.

Sec. 3.1, ZB-H1: keep 1F1B's warm-up (stage ``i`` runs ``p - i - 1`` forwards ahead), but let
stage ``i`` run its first ``i`` backwards as B only and defer their W; from then on each B is
followed by the oldest deferred W, and the deferred ones drain at the end, where 1F1B's last
stages sit idle. The last stage thus sends input gradients back ``p - 1`` W's sooner and the
tail bubble fills with W's. With forward, B and W times ``T_F, T_B, T_W`` and ``m >= p``
micro-batches, the bubble shrinks from 1F1B's ``(p - 1)(T_F + T_B + T_W)`` to

    bubble time = (p - 1)(T_F + T_B - T_W),  i.e.  (p - 1) / (3m + p - 1) of the step when T_F = T_B = T_W,

about a third of 1F1B's (while T_W is no longer than T_F and T_B; see :func:`bubble_fraction_theory`), while every stage keeps at most ``p`` micro-batches of activations
alive (a micro-batch's activations live from its F until its W), 1F1B's first-stage peak.
Torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank runs the same order (its ZB1P).

How the split is done, layer by layer (Sec. 2: "B and W for each layer"): during F every
module that owns parameters records its output ``y``, and every ``nn.Linear`` also its input
``x`` (:func:`record_split_backward`). B is one ``torch.autograd.grad(out, [stage input, every
y], retain_graph=True)``: autograd computes only what leads to the requested tensors, so it runs
the input-gradient chain and skips every weight gradient (no parameter is asked for), and it
returns ``dy`` for each recorded output on the way. W is then Sec. 2's definition written out
for the linear layers, which hold almost all the weights: with ``x`` and ``dy`` flattened over
batch and sequence, ``dW = dy^T x`` (``x^T dy`` for the paper's ``y = x W``; nn.Linear stores
``W^T``) and ``db = sum of dy`` over the same rows, one matmul accumulated in place into
``.grad`` (:func:`linear_weight_grad`), no autograd call and no graph walk. The other modules
(LayerNorm, Embedding, anything else) keep ``torch.autograd.grad(y, module's own parameters,
dy)``, which runs just the parameter half of that module's backward. They cannot share one call:
a LayerNorm's output depends on earlier LayerNorms' parameters through the residual stream, so
one call over several outputs would count those paths twice. Each parameter affects the stage's
output only through its module's ``y``, so these per-module weight gradients sum to exactly what
one full backward accumulates.

The explicit arithmetic is autograd's own linear backward, so the gradients are autograd's bit
for bit in every recipe: ``mm(dy^T, x)`` and the bias sum in the compute dtype, cast to the
parameter's dtype, added in place to ``.grad`` from the second micro-batch on. Under autocast
("amp": fp32 parameters, bf16 matmuls) the Linear's input is cast in a forward pre-hook exactly
as autocast would cast it inside ``F.linear``, so the recorded ``x`` is the very tensor autograd
saves for the Linear's backward, which lives until W in any case: nothing extra stays alive,
and dropping the micro-batch's W list frees the graph. (``grad.addmm_(dy^T, x)`` would save a
kernel and a weight-sized temporary but round the bf16 sum once instead of twice: different
bits from autograd under the "master" recipe, so it is not used.)

Transport as :mod:`reference_impls.pipeline` (non-blocking sends, blocking receives, handles
waited at the end of the step); W sends nothing, so the point-to-point bytes are 1F1B's.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from reference_impls.pipeline import TAG_ACT, TAG_GRAD, StageClock, stage_head_loss
from reference_impls.pipeline_checks import check_zero_bubble

# --- schedule and theory -------------------------------------------------------------------------


def zb_h1_order(stage: int, n_stages: int, m: int) -> list[tuple[str, int]]:
    """``(kind, micro-batch)`` with kind F, B (input gradient) or W (weight gradient), in the order
    stage ``stage`` runs them: 1F1B's warm-up, then F B [W] pairs where the first ``stage`` W's are
    deferred, then B [W] for the rest, then the deferred W's."""
    warmup = min(n_stages - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    n_b = n_w = 0
    for k in range(m):  # k-th backward; while forwards remain each comes with one
        if warmup + k < m:
            order.append(("F", warmup + k))
        order.append(("B", n_b))
        n_b += 1
        if k >= stage:  # the first `stage` W's wait for the tail
            order.append(("W", n_w))
            n_w += 1
    return order + [("W", i) for i in range(n_w, m)]


def bubble_fraction_theory(n_stages: int, m: int, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """ZB-H1's bubble as a share of the step ``m (T_F + T_B + T_W) + bubble`` (m >= p).

    Qi et al. 2024, Sec. 3.1 give ``(p-1)(T_F + T_B - T_W)``; that holds while ``T_W <= T_F`` and
    ``T_W <= T_B`` (their setting, equal times: ``(p-1) / (3m + p-1)``). A slower W cannot
    shrink the bubble below the last stage's wait for its first forward, ``(p-1) T_F``, nor below
    the first stage's wait for the last backward, ``(p-1) T_B``, so in general (checked by the
    zero-latency simulation in ``tests/test_pp_zb.py``) the bubble is
    ``(p-1) max(T_F, T_B, T_F + T_B - T_W)``. On a CPU, W's host overhead (per-module calls) can make
    ``T_W`` the longest, which is when the general form matters."""
    bubble = (n_stages - 1) * max(t_f, t_b, t_f + t_b - t_w)
    return bubble / (m * (t_f + t_b + t_w) + bubble)


def peak_live_theory(n_stages: int, m: int) -> int:
    """Micro-batches between their F and their W at the peak, on every stage (m >= p)."""
    return min(n_stages, m)


# --- B and W --------------------------------------------------------------------------------------


def record_split_backward(module: nn.Module, record) -> list:
    """Hooks on every submodule of ``module`` that owns trainable parameters: after its forward,
    ``record(mod, y, x)`` with its output ``y`` and, for a plain ``nn.Linear`` (not a subclass,
    whose forward may differ), its input ``x`` (None otherwise). Under autocast a Linear's floating
    input is first cast to the autocast dtype, as ``F.linear`` would (doubles excepted), so ``x``
    is the tensor autograd saves. Returns the hook handles."""
    handles = []
    for mod in module.modules():
        if not any(p.requires_grad for p in mod.parameters(recurse=False)):
            continue
        if type(mod) is nn.Linear:
            handles.append(mod.register_forward_pre_hook(_cast_like_autocast))
            handles.append(mod.register_forward_hook(lambda mod, args, y: record(mod, y, args[0] if args else None)))
        else:
            handles.append(mod.register_forward_hook(lambda mod, args, y: record(mod, y, None)))
    return handles


def _cast_like_autocast(mod, args):
    if not args:
        return None
    x = args[0]
    device = x.device.type
    if not (torch.is_autocast_enabled(device) and x.is_floating_point() and x.dtype != torch.float64):
        return None
    dtype = torch.get_autocast_dtype(device)
    return None if x.dtype == dtype else (x.to(dtype), *args[1:])


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, stage_input: torch.Tensor | None, outputs: list):
    """B: the gradient of the stage input (None on the first stage) and of every recorded module
    output, ``outputs`` being ``(module, y, x)`` as :func:`record_split_backward` gives them, in
    one pass that computes no weight gradient (no parameter is asked for). Returns ``(d stage
    input, [(module, y, x, dy)])``, the list being what W needs; the graph is kept for it
    (``retain_graph``)."""
    wrt = ([] if stage_input is None else [stage_input]) + [y for _, y, _ in outputs]
    grads = torch.autograd.grad(out, wrt, grad, retain_graph=True, allow_unused=True)
    dx = None
    if stage_input is not None:
        dx, grads = grads[0], grads[1:]
    return dx, [(mod, y, x, dy) for (mod, y, x), dy in zip(outputs, grads) if dy is not None]


def linear_weight_grad(mod: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> None:
    """W of one ``y = x W^T + b`` call: ``dW = dy^T x`` and ``db = sum_rows dy`` over the batch
    and sequence rows, in the compute dtype of ``x`` and ``dy``, accumulated into ``.grad`` in
    the parameter's dtype."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    if mod.weight.requires_grad:
        dy_t = dy2.t()
        dw = torch.mm(dy_t, x2)
        if mod.weight.grad is None:
            mod.weight.grad = dw.to(mod.weight.dtype)
        else:  # in place; a bf16 product into an fp32 gradient is widened exactly, as autograd's cast
            mod.weight.grad.add_(dw)
    if mod.bias is not None and mod.bias.requires_grad:
        db = dy2.sum(0)
        if mod.bias.grad is None:
            mod.bias.grad = db.to(mod.bias.dtype)
        else:
            mod.bias.grad.add_(db)


def backward_weight(deferred: list) -> None:
    """W for one micro-batch's ``(module, y, x, dy)``: explicit ``dy^T x`` for the linear layers
    (:func:`linear_weight_grad`), and for every other module the gradient of its own parameters
    from its output's gradient (``torch.autograd.grad``, only its weights asked for),
    accumulated into ``.grad``. The caller drops ``deferred`` afterwards, which frees the graph."""
    linears = [(mod, x, dy) for mod, _, x, dy in deferred if x is not None]
    if linears:
        # x is an activation that requires grad: no graph for this arithmetic; and the dtypes
        # are already the matmul's, autocast must not recast them
        with torch.no_grad(), torch.autocast(linears[0][1].device.type, enabled=False):
            for mod, x, dy in linears:
                linear_weight_grad(mod, x, dy)
    for mod, y, x, dy in deferred:
        if x is not None:
            continue
        params = [q for q in mod.parameters(recurse=False) if q.requires_grad]
        for q, g in zip(params, torch.autograd.grad(y, params, dy)):
            if q.grad is None:
                q.grad = g
            else:
                q.grad += g


class _GraphMarker:
    """Rides on a micro-batch's first autograd node: it lives exactly as long as that graph."""


def _watch_graph(outputs: list):
    """A weak reference that dies with the graph of the first recorded module output (the
    earliest node of the stage's graph: every later node keeps it alive), or None without one."""
    node = outputs[0][1].grad_fn if outputs else None
    if node is None:
        return None
    marker = _GraphMarker()
    node.metadata["parabench_graph"] = marker
    return weakref.ref(marker)


# --- the engine ----------------------------------------------------------------------------------


class ZeroBubblePipelineEngine:
    """Runs one stage's part of ZB-H1 for one batch; records order, timing and live activations.
    Same interface as :class:`reference_impls.pipeline.PipelineEngine` (``module`` is the stage
    that :func:`reference_impls.pipeline.split_stage` kept)."""

    schedule = "zb_h1"

    def __init__(self, module: nn.Module, stage: int, ranks: list[int], group, record_timeline: bool = False):
        self.module, self.stage, self.ranks, self.group = module, stage, ranks, group
        self.n_stages = len(ranks)
        self.first, self.last = stage == 0, stage == self.n_stages - 1
        self.prev = ranks[stage - 1] if not self.first else None
        self.next = ranks[stage + 1] if not self.last else None
        self.record_timeline = record_timeline
        self._stats: dict = {}
        # Every module that owns parameters hands its output (and a Linear its input) to the
        # running forward's list.
        self._outputs: list | None = None
        record_split_backward(module, self._record)

    def _record(self, mod, y, x):
        if self._outputs is not None and torch.is_grad_enabled():
            self._outputs.append((mod, y, x))

    def run(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        n_micro: int,
        act_shape: tuple[int, ...],
        act_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor | None:
        """Forward, B and W of all ``n_micro`` micro-batches; the mean loss on the last stage."""
        if inputs.shape[0] % n_micro:
            raise ValueError(f"{n_micro} micro-batches do not divide a batch of {inputs.shape[0]}")
        p, m = self.n_stages, n_micro
        check_zero_bubble(p, m)
        order = zb_h1_order(self.stage, p, m)
        xs, ys = inputs.chunk(m), targets.chunk(m)
        device = inputs.device
        saved: dict[int, tuple] = {}  # micro-batch -> (stage input, output or loss, module outputs)
        deferred: dict[int, list] = {}  # micro-batch -> [(module, output, Linear input or None, output's gradient)]
        sends: list = []
        total = torch.zeros((), device=device, dtype=torch.float32)
        live = peak_live = 0
        graphs: dict[int, weakref.ref] = {}  # micro-batch -> its graph's first node, while alive
        clock = StageClock(device, self.record_timeline)

        def recv(shape, src, tag):
            return clock.recv(torch.empty(shape, dtype=act_dtype, device=device), src, self.group, tag)

        for kind, i in order:
            if kind == "F":
                x_in = None if self.first else recv(act_shape, self.prev, TAG_ACT).requires_grad_(True)
                t0 = clock.mark()
                self._outputs = []
                x = self.module.embed(xs[i]) if self.first else x_in
                for block in self.module.blocks.values():
                    x = block(x)
                if self.last:
                    out = stage_head_loss(self.module, x, ys[i]) / m
                    total += out.detach()
                else:
                    out = x
                    # hold the sent buffer, not ``out``: with B's retain_graph, a reference to
                    # ``out`` would keep this micro-batch's whole graph alive past its W
                    buf = out.detach()
                    sends.append((dist.isend(buf, dst=self.next, group=self.group, tag=TAG_ACT), buf))
                saved[i] = (x_in, out, self._outputs)
                graphs[i] = _watch_graph(self._outputs)
                self._outputs = None
                del x, out  # ``saved`` holds the graph now, and drops it at B
                live += 1
                peak_live = max(peak_live, live)
            elif kind == "B":
                x_in, out, outputs = saved.pop(i)
                grad = None if self.last else recv(out.shape, self.next, TAG_GRAD)
                t0 = clock.mark()
                dx, deferred[i] = backward_input(out, grad, x_in, outputs)
                if not self.first:
                    sends.append((dist.isend(dx, dst=self.prev, group=self.group, tag=TAG_GRAD), dx))
                del out, outputs  # ``deferred`` holds what W needs
            else:
                t0 = clock.mark()
                backward_weight(deferred.pop(i))
                live -= 1  # the last reference to this micro-batch's graph is gone
            clock.computed(kind, i, t0, clock.mark())

        # every W has run: a graph still alive here is held by something the schedule no longer needs
        graphs_alive = sum(1 for ref in graphs.values() if ref is not None and ref() is not None)
        clock.drain(sends)
        timing = clock.finish()  # step_s, compute_s, wait_s, the timeline
        compute = {k: timing["compute_s_by_kind"].get(k, 0.0) for k in "FBW"}
        compute_s = timing["compute_s"]
        t_f, t_b, t_w = (compute[k] / m for k in "FBW")
        self._stats = {
            "schedule": self.schedule,
            "stage": self.stage,
            "stages": p,
            "microbatches": m,
            "order": [f"{k}{i}" for k, i in order],
            **timing,
            "compute_s_by_kind": compute,
            # T_F = T_B = T_W (the paper's headline), and with this stage's own measured mean times
            "bubble_fraction_theory": bubble_fraction_theory(p, m),
            "bubble_fraction_theory_measured_times": bubble_fraction_theory(p, m, t_f, t_b, t_w)
            if compute_s > 0
            else None,
            "bubble_fraction_theory_1f1b": (p - 1) / (m + p - 1),
            "peak_live_microbatches": peak_live,
            "peak_live_microbatches_theory": peak_live_theory(p, m),
            "graphs_alive_after_last_w": graphs_alive,
        }
        return total if self.last else None

    def stats(self) -> dict:
        return dict(self._stats)
