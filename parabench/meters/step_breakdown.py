"""Where one training step's time goes: compute, communication, and communication nothing hides.

:func:`measure_step` runs one extra, untimed ``train_step`` under ``torch.profiler`` and reduces its
events to intervals on one clock:

* ``step_s``: the step's wall time on this rank, host clock, from the start of ``train_step`` to
  the end of a device synchronise after it (so every kernel of the step has finished);
* ``compute_s``: the length of the *union* of compute intervals (nested and concurrent intervals
  count once);
* ``comm_s``: the length of the union of communication intervals;
* ``exposed_comm_s``: communication time during which no compute interval runs (``comm`` minus
  ``compute``, as interval sets); ``overlapped_comm_s = comm_s - exposed_comm_s``;
* ``overlap_fraction = 1 - exposed_comm_s / comm_s`` (None when the step does not communicate);
* ``memcpy_s`` (GPU only): copies and memsets on the device, counted neither as compute nor as
  communication; ``idle_s``: the rest of the step, when none of the above runs (launch gaps,
  Python, host-side waits);
* ``top_comm``: the communication kernels (GPU) or ops (CPU) with the most time, summed per name.
* ``top_compute``: the compute kernels with the most time, summed per name (GPU; None on CPUs,
  where host ops nest and their sums would count time twice): where two implementations of the
  same step spend their compute differently, this names the kernels.

What an interval is depends on the device; ``source`` says which:

``"cuda_kernels"``: device kernels from CUPTI. A kernel whose name contains ``nccl``
(``ncclDevKernel_AllReduce_Sum_bf16_RING_LL``, ``ncclDevKernel_SendRecv``...) is communication;
memcpy and memset activities are their own category; every other kernel, on any stream, is
compute. A communication kernel's interval includes the time it spins waiting for a late peer,
and kernels that overlap share the SMs, so overlapped communication is not free.

``"cpu_ops"``: a CPU has no device timeline, so the intervals are the profiler's operator events
(measured in torch 2.13 with gloo, 2 ranks):

* communication is every event named by c10d or a backend. ``gloo:all_reduce``, ``gloo:all_gather``...
  run on gloo's worker threads, from when a worker starts the collective until it completes, peer
  waits included (FSDP2's reduce-scatter shows as ``gloo:all_reduce``: gloo has none);
  ``gloo:send``/``gloo:recv`` are asynchronous spans on the calling thread, from posting the
  operation until its completion is observed, so a send in flight while the pipeline computes
  counts as overlapped; ``c10d::allreduce_``, ``c10d::_allgather_base_``, ``c10d::send``... are the
  caller enqueueing an operation (sometimes milliseconds); ``_c10d_functional::*`` are DTensor's
  collectives and their ``wait_tensor``.
* compute is every ``aten::`` operator, on any thread but gloo's workers (the copies a worker
  makes inside a collective are communication), minus the parts inside a synchronous
  communication event on the same thread (the copies ``c10d::*`` makes while enqueueing).
  Only operators count: the events that wrap them (autograd nodes such as ``MmBackward0``, custom
  autograd functions such as ``_ReduceFromTP``, ``PythonSubclass``, FSDP's and the optimizer's
  annotations) are spans of Python and C++ that can block on a collective inside (a tensor-parallel
  all-reduce waits inside its autograd function), so their time is compute only where an operator
  runs within them.

So on a CPU, "overlapped" means that an operator ran on some thread while a collective was in
flight: concurrency in wall time, on cores that compute and gloo share (with few cores, overlapped
communication still slows compute down). Exposed communication is collective time with no
operator running in the process: waiting, and also Python between operators. Work outside torch's
operators (Python, a pybind extension) is idle time here, not compute.

Ranks are lined up with a barrier after the profiler starts and before the step (outside the
measured window): a rank whose profiler started late would otherwise make its peers' first
collective look long. Still, any skew between ranks shows up as communication on the early rank.

On GPUs the profiler may leave CUPTI attached after it stops (kineto without ``TEARDOWN_CUPTI``,
pytorch/pytorch#144455), slowing later kernels: the runner gives each profiled GPU case a launch of
its own, and the profiled step comes after the case's timed steps.

The profiler costs time per operator (on the host), so ``step_s`` is longer than a timed step
(on CPUs, where every operator is a host event, much longer); compare the fractions, and take
step times from the timed steps. The events are read from the profiler in memory
(``prof.profiler.kineto_results.events()``), with start and end in ns; nothing is written to disk
unless the case also asks for ``trace`` (``parabench.meters.traces``), which exports this step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parabench.distributed import synchronize

STEP_MARK = "parabench::step_breakdown"
COMM_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:", "c10d::", "_c10d_functional::", "c10d_functional::")
COMM_NAMES = ("record_param_comms",)
COMPUTE_PREFIXES = ("aten::",)  # operators; what wraps them may be waiting (see the docstring)
TOP_NAMES = 20  # enough to name the small kernels of a host-light step, not only its GEMMs
NAME_CHARS = 160  # templated kernel names run to hundreds of characters

# Kineto's activity types (``_KinetoEvent.activity_type()``) mapped to what they are here.
_ACTIVITY_KIND = {
    "cpu_op": "cpu_op",
    "user_annotation": "annotation",
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "gpu_memset": "memcpy",
}
# Device-timeline events that are not kernels, for builds without ``activity_type()``.
_DEVICE_NON_KERNEL_WORDS = ("Sync", "Wait", "Overhead", "Instrumentation", "Resource")


@dataclass(frozen=True)
class Span:
    """One profiler event as an interval: ``kind`` is cpu_op, annotation, kernel or memcpy.
    ``asynchronous``: the event started and ended in different calls (gloo's spans), so it does
    not nest in its thread's call stack."""

    name: str
    start_s: float
    end_s: float
    kind: str
    thread: int = 0
    asynchronous: bool = False


# --- interval arithmetic (lists of (start, end); "merged" = sorted, disjoint, non-empty) -------------


def merge(intervals) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted disjoint intervals; empty and reversed ones dropped,
    touching ones joined."""
    out: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(merged) -> float:
    return sum(e - s for s, e in merged)


def subtract(a, b) -> list[tuple[float, float]]:
    """The parts of merged set ``a`` outside merged set ``b`` (one sweep: both are sorted)."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cur = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def clip(merged, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in merged if min(e, hi) > max(s, lo)]


# --- classification ---------------------------------------------------------------------------------


def is_comm_name(name: str) -> bool:
    return name.startswith(COMM_PREFIXES) or name in COMM_NAMES


def is_compute_op(name: str) -> bool:
    return name.startswith(COMPUTE_PREFIXES)


def _cpu_sets(spans: list[Span], step_thread: int | None) -> tuple[list, list, list]:
    """(compute, comm, comm spans) from operator events; see the module docstring."""
    comm_spans = [sp for sp in spans if sp.kind in ("cpu_op", "annotation") and is_comm_name(sp.name)]
    # gloo's workers: threads other than the step's that run communication.
    workers = {sp.thread for sp in comm_spans if sp.thread != step_thread} if step_thread is not None else set()
    nested_comm: dict = defaultdict(list)  # synchronous communication calls, by thread
    for sp in comm_spans:
        if not sp.asynchronous:
            nested_comm[sp.thread].append((sp.start_s, sp.end_s))
    ops: dict = defaultdict(list)
    for sp in spans:
        if sp.kind == "cpu_op" and is_compute_op(sp.name) and sp.thread not in workers:
            ops[sp.thread].append((sp.start_s, sp.end_s))
    compute = merge(iv for t, ivs in ops.items() for iv in subtract(merge(ivs), merge(nested_comm.get(t, ()))))
    comm = merge((sp.start_s, sp.end_s) for sp in comm_spans)
    return compute, comm, comm_spans


def _cuda_sets(spans: list[Span]) -> tuple[list, list, list, list, list]:
    compute, comm, memcpy, comm_spans, compute_spans = [], [], [], [], []
    for sp in spans:
        if sp.kind == "kernel":
            if "nccl" in sp.name.lower():
                comm.append((sp.start_s, sp.end_s))
                comm_spans.append(sp)
            else:
                compute.append((sp.start_s, sp.end_s))
                compute_spans.append(sp)
        elif sp.kind == "memcpy":
            memcpy.append((sp.start_s, sp.end_s))
    return merge(compute), merge(comm), merge(memcpy), comm_spans, compute_spans


def _top(named_spans: list[Span], lo: float, hi: float) -> list[dict]:
    calls: dict = defaultdict(int)
    total: dict = defaultdict(float)
    for sp in named_spans:
        d = min(sp.end_s, hi) - max(sp.start_s, lo)
        if d > 0:
            name = sp.name[:NAME_CHARS]
            calls[name] += 1
            total[name] += d
    ranked = sorted(total, key=lambda n: -total[n])[:TOP_NAMES]
    return [{"name": n, "calls": calls[n], "total_s": total[n]} for n in ranked]


def breakdown(spans: list[Span], source: str, mark: Span | None = None) -> dict:
    """The step's breakdown from its events. ``source``: "cuda_kernels" or "cpu_ops"; ``mark``: the
    annotation around the step, which gives its window and the thread that ran it (without one:
    from the first event to the last, and no thread is taken for a communication worker)."""
    if source not in ("cuda_kernels", "cpu_ops"):
        raise ValueError(f"unknown source {source!r}")
    if mark is not None:
        lo, hi = mark.start_s, mark.end_s
    else:
        lo, hi = min((s.start_s for s in spans), default=0.0), max((s.end_s for s in spans), default=0.0)
    if source == "cpu_ops":
        compute, comm, comm_spans = _cpu_sets(spans, mark.thread if mark is not None else None)
        memcpy: list = []
        compute_spans = None
    else:
        compute, comm, memcpy, comm_spans, compute_spans = _cuda_sets(spans)
    compute, comm, memcpy = clip(compute, lo, hi), clip(comm, lo, hi), clip(memcpy, lo, hi)
    exposed = length(subtract(comm, compute))
    comm_s = length(comm)
    busy = length(merge(compute + comm + memcpy))
    return {
        "source": source,
        "step_s": hi - lo,
        "compute_s": length(compute),
        "comm_s": comm_s,
        "exposed_comm_s": exposed,
        "overlapped_comm_s": comm_s - exposed,
        "overlap_fraction": 1.0 - exposed / comm_s if comm_s > 0 else None,
        "memcpy_s": length(memcpy) if source == "cuda_kernels" else None,
        "idle_s": max(0.0, (hi - lo) - busy),
        "top_comm": _top(comm_spans, lo, hi),
        "top_compute": _top(compute_spans, lo, hi) if compute_spans is not None else None,
    }


# --- reading the profiler ---------------------------------------------------------------------------


def _activity(event) -> str | None:
    """Kineto's activity type as its name ("kernel", "cpu_op"...), None where the build does not
    give it as a string (some builds have no ``activity_type()``, one proposal returns the enum's int)."""
    fn = getattr(event, "activity_type", None)
    value = fn() if callable(fn) else fn
    return value if isinstance(value, str) else None


def _kind(event, on_cuda_device: bool, annotation_names: set) -> str:
    """What a kineto event is. ``activity_type()`` says it directly where the build has it (torch
    2.13); otherwise device-timeline events are told apart by name (see ``classified_by``)."""
    activity = _activity(event)
    if activity is not None:
        return _ACTIVITY_KIND.get(activity, "other")
    name = event.name()
    if not on_cuda_device:
        return "annotation" if event.is_user_annotation() else "cpu_op"
    if event.is_user_annotation() or name in annotation_names:  # GPU projections of annotations
        return "other"
    if name.startswith(("Memcpy", "Memset")):
        return "memcpy"
    if any(w in name for w in _DEVICE_NON_KERNEL_WORDS):
        return "other"
    return "kernel"


def spans_from_profile(prof, device: torch.device) -> tuple[list[Span], Span | None, str]:
    """The profiler's events as spans (seconds), the step's mark, and how events were classified."""
    events = prof.profiler.kineto_results.events()
    cuda = device.type == "cuda"
    our_index = device.index if device.index is not None else (torch.cuda.current_device() if cuda else None)
    has_activity = bool(events) and _activity(events[0]) is not None
    annotation_names = {e.name() for e in events if str(e.device_type()).endswith("CPU") and e.is_user_annotation()}
    # Seconds from the first event: epoch nanoseconds as floats would keep only ~0.4 us.
    base_ns = min((e.start_ns() for e in events), default=0)
    spans, mark = [], None
    for e in events:
        on_device = str(e.device_type()).endswith("CUDA")
        if on_device and (not cuda or (our_index is not None and e.device_index() != our_index)):
            continue
        kind = _kind(e, on_device, annotation_names)
        if kind == "other":
            continue
        asynchronous = bool(e.is_async()) if hasattr(e, "is_async") else False
        span = Span(
            e.name(),
            (e.start_ns() - base_ns) * 1e-9,
            (e.end_ns() - base_ns) * 1e-9,
            kind,
            e.start_thread_id(),
            asynchronous,
        )
        if span.name == STEP_MARK and not on_device:
            mark = span
        else:
            spans.append(span)
    return spans, mark, "activity_type" if has_activity else "name_heuristic"


def measure_step(trainer, inputs, targets, on_profile=None) -> tuple[object, dict]:
    """Run one ``train_step`` under ``torch.profiler``; return (loss, breakdown dict).
    ``on_profile(prof)``: called with the finished profile before it is freed (the ``trace``
    option exports it, ``parabench.meters.traces``); what it returns goes under the key "trace"."""
    from torch.profiler import ProfilerActivity, profile, record_function

    device = inputs.device
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # outside the window: see the module docstring
        synchronize(device)
        with record_function(STEP_MARK):
            loss = trainer.train_step(inputs, targets)
            synchronize(device)
    spans, mark, classified_by = spans_from_profile(prof, device)
    exported = on_profile(prof) if on_profile is not None else None
    del prof
    source = "cuda_kernels" if cuda else "cpu_ops"
    result = breakdown(spans, source, mark)
    result["classified_by"] = classified_by
    result["window"] = "step_mark" if mark is not None else "first_to_last_event"
    result["n_events"] = len(spans)
    if cuda and not any(s.kind == "kernel" for s in spans):  # CUPTI gave nothing: say so, not 0 %
        result["warning"] = "no device kernels in the profile (CUPTI unavailable?)"
    if on_profile is not None:
        result["trace"] = exported
    return loss, result
