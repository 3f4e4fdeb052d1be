"""What every rank executes: ``torchrun ... -m parabench.worker --cases CASES.json --scratch DIR``.

One launch may run several cases in a row (same world size and device), which saves the
start-up of torch, NCCL and the rendezvous for each. Per case, every rank:

1. builds the rank grid and the strategy's trainer from the shared model and seed;
2. runs ``warmup`` untimed steps (the first of them timed on its own, synchronised: compilation
   and other first-call costs, ``first_step_s``), then ``steps`` timed steps with nothing else on them
   (device events on GPU, the host clock on CPU; peak memory reset just before);
3. runs one more, instrumented step: communication meter on, model-state bytes sampled; then,
   when the case asks, one more step that records the pipeline timeline (``record_timeline``,
   ``timeline_step``), one under the memory-breakdown meter (``memory_breakdown``), one
   under ``torch.profiler`` (``step_breakdown``: compute, communication, exposed communication;
   ``trace``: the same step exported as a Chrome trace) and one with the CUDA allocator's history
   on (``memory_snapshot``), see ``parabench.meters.traces``;
4. sends its measurements to rank 0, which writes ``<case_hash>.json`` in the scratch folder.

Rank 0 keeps ``<case_hash>.status.json`` there up to date with its phase and step counter, which
the runner shows live (``parabench.progress``: host-side writes only, none inside a timed step).

A rank that fails writes ``<case_hash>.rank<r>.error.json`` (type, message, traceback, time)
and exits non-zero; the runner picks the earliest such file as the first failure.

Before each case after the first, the ranks agree on how much device memory is still allocated. A
case that leaves more than ``LEFTOVER_LIMIT_BYTES`` behind (a library holding its engine in a
global) would add it to the peak memory of every later case of the launch, so the launch ends
there: the worker writes ``--retired`` (which case, which rank, how much) and exits cleanly, and the
runner starts the remaining cases in a fresh launch.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from parabench.case import Case
from parabench.distributed import init_process_group, pick_device, synchronize
from parabench.fp8 import recorded_conversions
from parabench.hardware import device_name, measured_matmul_flops, peak_flops
from parabench.meters import flight_recorder, host, memory, telemetry
from parabench.meters.comm import CommMeter
from parabench.meters.traces import TraceFiles
from parabench.models import compiled_loss, global_batch
from parabench.multinode import check_nodes_agree
from parabench.progress import PhaseReporter, status_path
from parabench.registry import get_strategy
from parabench.results import write_json_atomic
from parabench.topology import build_topology
from parabench.trainer import OptimConfig, TrainSpec

# What the CUDA caching allocator holds between cases of one launch, from cuBLAS workspaces and the
# like, is ~65 MiB on H100; a library that keeps a model or its buffers alive leaves gigabytes.
LEFTOVER_LIMIT_BYTES = 256 << 20
GC_EVERY_STEPS = 50  # python_gc scheduled: torchtitan's training.gc_freq default

# Tensors kept alive on purpose by the "leak" fault: what a library holding its engine does.
_INJECTED_LEAKS: list[torch.Tensor] = []


def leftover_bytes(device: torch.device) -> int | None:
    """Bytes still allocated on this rank's device between cases (after a collection). The CPU has
    no allocator counter: there only the test hook's injected leaks are seen."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return int(torch.cuda.memory_allocated(device))
    return sum(t.numel() * t.element_size() for t in _INJECTED_LEAKS) if _INJECTED_LEAKS else None


def _inject_fault(case: Case, step: int) -> None:
    """Test hook: options.inject_fault = {kind: oom|cpu_oom|memory_error|crash|abort|hang|leak,
    rank: r, step: k}; "leak" keeps ``bytes`` (default 512 MiB) allocated on the device after the
    case ends; "cpu_oom" and "memory_error" make a real allocation the host cannot satisfy (torch's
    CPU allocator, Python's)."""
    fault = case.options.get("inject_fault")
    if not fault or fault.get("step", 0) != step or fault.get("rank", 0) != dist.get_rank():
        return
    kind = fault["kind"]
    if kind in ("startup_abort", "startup_kill"):  # fired before the process group forms: _inject_startup_fault
        return
    if kind == "leak":
        _INJECTED_LEAKS.append(
            torch.empty(int(fault.get("bytes", 512 << 20)), dtype=torch.uint8, device=pick_device(case.device))
        )
        return
    if kind == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 EiB (injected by parabench)")
    if kind == "cpu_oom":
        torch.empty(1 << 62, dtype=torch.uint8)  # 4 EiB: DefaultCPUAllocator: can't allocate memory
    if kind == "memory_error":
        bytearray(1 << 62)  # MemoryError
    if kind == "crash":
        raise RuntimeError("injected crash (parabench fault injection)")
    if kind == "abort":
        os.abort()
    if kind == "hang":
        time.sleep(10**6)
    raise ValueError(f"unknown injected fault kind {kind!r}")


def _inject_startup_fault(cases: list[Case], keys: list[str], scratch: str) -> None:
    """Test hook: options.inject_fault = {kind: "startup_abort", rank: r, launches: n} aborts rank
    r before the process group forms, in the first n launches of the case (counted in a file
    beside the launches' folders), the death ``Runner._settle`` launches again once;
    "startup_kill" sends the rank SIGKILL instead, as the out-of-memory killer would, which is
    never launched again."""
    for case, key in zip(cases, keys):
        fault = case.options.get("inject_fault") or {}
        kind = fault.get("kind")
        if kind not in ("startup_abort", "startup_kill") or fault.get("rank", 0) != int(os.environ.get("RANK", "0")):
            continue
        count_path = os.path.join(os.path.dirname(os.path.abspath(scratch)), f"{key}.startup-aborts")
        aborted = os.path.getsize(count_path) if os.path.exists(count_path) else 0
        if aborted < fault.get("launches", 1):
            with open(count_path, "a") as f:
                f.write("x")
            if kind == "startup_kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os.abort()


def debug_slowdown() -> float:
    """``PARABENCH_DEBUG_SLOWDOWN`` (a fraction, e.g. 0.05): every timed step is lengthened by that
    fraction of itself, on every rank, to prove the regression gate flags a known slowdown. The
    step is synchronised, timed on the host and followed by an idle sleep before its end mark, so
    the device clock sees the sleep too; the synchronisation itself may add a little more. Not in
    the case hash, so the slowed run pairs with its baseline; the record says it (``debug_slowdown``
    and a caveat) and ``parabench compare`` prints a note."""
    value = os.environ.get("PARABENCH_DEBUG_SLOWDOWN", "").strip()
    if not value:
        return 0.0
    slowdown = float(value)
    if not 0 <= slowdown <= 10:
        raise ValueError(f"PARABENCH_DEBUG_SLOWDOWN must be a fraction in [0, 10], got {value!r}")
    return slowdown


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory on any device: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU
    allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    text = str(exc).lower()
    return (
        isinstance(exc, (torch.OutOfMemoryError, MemoryError))
        or "out of memory" in text
        or "can't allocate memory" in text
    )


def compile_failure(case: Case, exc: BaseException) -> str | None:
    """The cause to record when ``exc`` (or an exception it came from) is torch.compile's own
    (dynamo, AOTAutograd or inductor: ``torch._dynamo.exc.TorchDynamoException``) in a case with
    option ``compile``, else None. Compilation runs at the first call of a compiled block, inside
    a training step, so without this the record would name only the step that failed."""
    if not case.options.get("compile"):
        return None
    from torch._dynamo.exc import TorchDynamoException

    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        if isinstance(e, TorchDynamoException):
            text = str(e).strip()
            return f"compilation failed (option compile = true, torch.compile per block): {type(e).__name__}: {text}"
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def eager_under_meter(case: Case):
    """Around a step under a meter that is a ``TorchDispatchMode`` (communication, memory
    breakdown): the compiled blocks run their eager code. Dynamo does not compile while such a mode
    is active ("non-infra torch dispatch mode present"), and with ``fullgraph`` that is an error;
    eager blocks issue the same collectives on the same tensors, and those steps are untimed."""
    if not (case.options.get("compile") or case.options.get("compile_loss")):
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


class StepClock:
    """Per-step durations that do not stall the device: CUDA events read once at the end."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def durations_s(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def loss_scale_steps(per_rank: list[dict]) -> list[dict] | None:
    """Rank 0's per-step loss-scale entries, each with the step's loss (mean over ranks) and the
    ranks that skipped it (they differ only under a local overflow check); None for non-fp16 cases."""
    mine = per_rank[0].get("loss_scale")
    if mine is None:
        return None
    out = []
    for step, entry in enumerate(mine):
        seen = [r["losses"][step] for r in per_rank if r["losses"][step] is not None]
        ranks = [r.get("loss_scale") or [] for r in per_rank]
        skipped_on = [i for i, r in enumerate(ranks) if step < len(r) and r[step] and r[step].get("skipped")]
        out.append(
            {
                "step": step,
                "loss": sum(seen) / len(seen) if seen else None,
                **(entry or {"scale": None, "overflow": None, "skipped": None}),
                "skipped_on_ranks": skipped_on,
            }
        )
    return out


_TOPOLOGIES: dict = {}


def timeline_step(trainer, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> dict | None:
    """One more untimed step with the pipeline timeline on (option ``record_timeline``), its loss
    not recorded; the trainer's pipeline stats of that step, or None without a pipeline.

    Its own step, not the instrumented one: the communication meter's dispatch overhead and the
    state sampling would stretch the ops whose times the timeline records. The stats gain
    ``timeline_step_s``, the whole step on the timed steps' clock, so a report can tell how far
    the timeline step ran from the timed ones."""
    synchronize(device)
    dist.barrier()  # every stage starts together, as in the timed loop
    measure_state = trainer.measure_state
    trainer.measure_state, trainer.record_timeline = False, True
    clock = StepClock(device)
    try:
        clock.mark()
        trainer.train_step(*batch)
        clock.mark()
    finally:
        trainer.measure_state, trainer.record_timeline = measure_state, False
    (step_s,) = clock.durations_s()
    stats = trainer.pipeline_stats()
    return None if stats is None else {**stats, "timeline_step_s": step_s}


def _topology(device: torch.device, pp: int, tp: int):
    """The rank grid for (pp, tp), built once per launch: cases that share a launch reuse its
    process groups instead of creating new communicators (seconds each on NCCL)."""
    key = (device.type, pp, tp)
    if key not in _TOPOLOGIES:
        _TOPOLOGIES[key] = build_topology(device.type, pp, tp)
    return _TOPOLOGIES[key]


def make_spec(case: Case, device: torch.device) -> TrainSpec:
    """The strategy's view of ``case`` on this rank (builds the rank grid: a collective)."""
    cfg = case.model_config()
    topo = _topology(device, case.options.get("pp", 1), case.options.get("tp", 1))
    return TrainSpec(
        model=cfg,
        seed=case.seed,
        device=device,
        precision=case.precision,
        recipe=case.recipe,
        topology=topo,
        micro_batch=case.micro_batch,
        grad_accum=case.grad_accum,
        optim=OptimConfig(lr=case.lr, **case.options.get("optim", {})),
        options=case.options,
    )


def local_batches(case: Case, spec: TrainSpec, n_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's data-parallel slice of each step's global batch, already on the device."""
    per_rank = case.micro_batch * case.grad_accum
    lo = spec.topology.dp_rank * per_rank
    out = []
    for step in range(n_steps):
        x, y = global_batch(step, case.global_batch, spec.model, case.seed)
        out.append((x[lo : lo + per_rank].to(spec.device), y[lo : lo + per_rank].to(spec.device)))
    return out


def run_case(
    case: Case,
    device: torch.device,
    leftover: int | None = None,
    progress: PhaseReporter | None = None,
    trace_files: TraceFiles | None = None,
) -> dict | None:
    """:func:`train_case` with the loss that option ``compile_loss`` asks for (``models.compiled_loss``):
    a case that asked for it and never ran it is an error, not a record under the option's label."""
    compile_loss = bool(case.options.get("compile_loss"))
    with compiled_loss(compile_loss) as compiled_calls:
        result = train_case(case, device, leftover, progress, trace_files)
        if compile_loss and compiled_calls() == 0:
            raise RuntimeError(
                f"option compile_loss = true, but {case.strategy} never called parabench.models.lm_loss "
                "(its loss is its own): set own_loss in its registry entry"
            )
    return result


def train_case(
    case: Case,
    device: torch.device,
    leftover: int | None = None,
    progress: PhaseReporter | None = None,
    trace_files: TraceFiles | None = None,
) -> dict | None:
    """Train ``case`` on this rank; return the gathered measurements on rank 0, None elsewhere.
    ``leftover``: what earlier cases of the launch left allocated (``leftover_bytes``, measured by
    ``main`` before it decided to run this case; ~0, or the launch would have ended), recorded.
    ``progress``: where rank 0 reports its phase and step counter (None: nowhere);
    ``trace_files``: where the ``trace`` and ``memory_snapshot`` options write their files."""
    rank = dist.get_rank()
    progress = progress or PhaseReporter(None)
    trace_on, snapshot_on = bool(case.options.get("trace")), bool(case.options.get("memory_snapshot"))
    if (trace_on or snapshot_on) and trace_files is None:
        raise ValueError("the trace and memory_snapshot options need a folder for their files (trace_files)")
    progress.phase("build")
    spec = make_spec(case, device)
    topo = spec.topology
    t_setup = time.perf_counter()
    with recorded_conversions() as conversions:  # recipe fp8: the linears the builder swaps (parabench.fp8.convert)
        trainer = get_strategy(case.strategy).build(spec)
    float8 = conversions[-1] if conversions else None
    synchronize(device)
    setup_s = time.perf_counter() - t_setup

    n_steps = case.warmup + case.steps + 1  # + the instrumented step
    breakdown_on = bool(case.options.get("memory_breakdown"))
    step_breakdown_on = bool(case.options.get("step_breakdown"))
    profiled_on = step_breakdown_on or trace_on  # one profiled step serves both
    snapshot_step_on = snapshot_on and device.type == "cuda"
    timeline_on = bool(case.options.get("record_timeline"))
    # + the timeline step, the memory-breakdown step, the profiled step and the memory-snapshot
    # step, each when asked for
    extra_steps = timeline_on + breakdown_on + profiled_on + snapshot_step_on
    batches = local_batches(case, spec, n_steps + extra_steps)

    losses: list = []
    # fp16 only: the loss scaler's outcome after every step (warm-up, timed, instrumented). Reading
    # it may sync the host with the device (GradScaler keeps its scale on the GPU): a small cost on
    # the timed steps of fp16 cases, and none at all on other cases, which never call it.
    scales: list | None = [] if case.precision == "fp16" else None
    host_before = host.probe(device)  # the host's speed around the timed steps, off the clock
    gc_scheduled = case.options.get("python_gc", "auto") == "scheduled"
    if gc_scheduled:  # torchtitan's policy (CommonOptions.python_gc)
        gc.disable()
    progress.phase("warm-up", case.warmup)
    # The first warm-up step alone, synchronised on both ends: it carries torch.compile's
    # compilation (option compile) and every other first-call cost, kept out of the timed steps.
    first_step_s = None
    for step in range(case.warmup):
        _inject_fault(case, step)
        if step == 0:
            synchronize(device)
            t_first = time.perf_counter()
        losses.append(trainer.train_step(*batches[step]))
        if step == 0:
            synchronize(device)
            first_step_s = time.perf_counter() - t_first
        scales is not None and scales.append(trainer.loss_scale())
        progress.step(step + 1)

    synchronize(device)
    if gc_scheduled:
        gc.collect(1)
    dist.barrier()
    memory.reset_peak(device)
    progress.phase("timed", case.steps)
    clock = StepClock(device)
    sampler = telemetry.sampler_for(device) if case.options.get("telemetry", True) else None
    sampler is not None and sampler.start()
    timed_meters = bool(case.options.get("timed_meters", True))
    cpu_start = host.cpu_times()
    threads_start = host.thread_cpu_s()
    gc_pauses = host.GcPauses()
    timed_meters and gc_pauses.start()
    synchronize(device)  # the window's wall clock starts on an idle device (ended by the sync after the loop)
    window_start = time.perf_counter()
    clock.mark()
    slowdown = debug_slowdown()
    step_sync = bool(case.options.get("step_sync"))
    for step in range(case.warmup, case.warmup + case.steps):
        _inject_fault(case, step)
        t_step = time.perf_counter()
        if gc_scheduled and (step - case.warmup + 1) % GC_EVERY_STEPS == 0:
            gc.collect(1)
        losses.append(trainer.train_step(*batches[step]))
        scales is not None and scales.append(trainer.loss_scale())
        if step_sync:
            synchronize(device)
        if slowdown:  # idle the device for that fraction of the step before the step's end mark
            synchronize(device)
            time.sleep(slowdown * (time.perf_counter() - t_step))
        clock.mark()
        # After the mark, host only, at most twice a second: see parabench.progress for why this
        # does not distort the step times.
        timed_meters and progress.step(step - case.warmup + 1)
    cpu_end, threads_end = host.cpu_times(), host.thread_cpu_s()  # the host's own work, before the wait below
    synchronize(device)
    timed_window_s = time.perf_counter() - window_start
    host_cpu = host.cpu_use(cpu_start, cpu_end, case.steps)
    if host_cpu is not None:
        host_cpu["threads"] = host.busiest_threads(threads_start, threads_end, host_cpu["wall_s"])
    host_gc = None
    if timed_meters:
        gc_pauses.stop()
        host_gc = gc_pauses.summary(case.steps)
    if gc_scheduled:
        gc.enable()
    step_times = clock.durations_s()
    device_telemetry = sampler.stop() if sampler is not None else None
    peak = memory.read_peak(device)
    host_probe = {"before": host_before, "after": host.probe(device)}

    # The instrumented step: communication meter on and state bytes sampled, off the clock.
    progress.phase("instrumented")
    step = n_steps - 1
    _inject_fault(case, step)
    trainer.measure_state = True
    fr_start = flight_recorder.last_record_id() if flight_recorder.enabled() else None
    if case.comm_meter:
        with eager_under_meter(case), CommMeter() as meter:
            losses.append(trainer.train_step(*batches[step]))
        comm = meter.summary()
    else:
        losses.append(trainer.train_step(*batches[step]))
        comm = None
    scales is not None and scales.append(trainer.loss_scale())
    synchronize(device)
    fr = flight_recorder.summary_since(fr_start) if fr_start is not None else None
    state = trainer.state_bytes()
    # Per-step statistics describe the last step run: read them before any extra meter step
    # (a pipeline's timeline, when asked for, comes from its own step instead).
    pipeline = trainer.pipeline_stats()
    strategy_stats = trainer.strategy_stats()  # attention work, routing
    if float8 is not None:
        strategy_stats = {**(strategy_stats or {}), "float8": float8}
    if timeline_on:
        progress.phase("meters", detail="pipeline timeline")
        pipeline = timeline_step(trainer, batches[n_steps], device)
    breakdown = None
    if breakdown_on:  # one more untimed step under the memory-breakdown meter (its loss is not recorded)
        from parabench.meters.memory_breakdown import measure_step

        progress.phase("meters", detail="memory breakdown")
        with eager_under_meter(case):
            _, breakdown = measure_step(trainer, *batches[n_steps + timeline_on])
    step_breakdown = trace = snapshot = None
    if profiled_on:  # one more untimed step under torch.profiler (its loss is not recorded)
        from parabench.meters import step_breakdown as step_meter
        from parabench.meters import traces

        progress.phase("meters", detail="profiler")
        trainer.measure_state = False  # state bytes are read: profile a step like the timed ones
        export = (lambda prof: traces.export_trace(prof, trace_files, rank)) if trace_on else None
        batch = batches[n_steps + timeline_on + breakdown_on]
        _, step_breakdown = step_meter.measure_step(trainer, *batch, on_profile=export)
        trace = step_breakdown.pop("trace", None)
        step_breakdown = step_breakdown if step_breakdown_on else None
    if snapshot_on:  # one more untimed step with the allocator's history on (its loss is not recorded)
        from parabench.meters import traces

        snapshot = traces.snapshot_unavailable(device)  # a CPU: no step, the reason recorded
        if snapshot_step_on:
            progress.phase("meters", detail="memory snapshot")
            trainer.measure_state = False
            batch = batches[n_steps + timeline_on + breakdown_on + profiled_on]
            _, snapshot = traces.memory_snapshot_step(trainer, *batch, trace_files, rank)
    loss_values = [None if l is None else float(l) for l in losses]

    mine = {
        "rank": rank,
        "coords": dict(zip(("dp", "pp", "tp"), topo.coords)),
        "step_times_s": step_times,
        "timed_window_s": timed_window_s,
        "losses": loss_values,
        "memory": peak,
        "state_bytes": state,
        "comm": comm,
        "flight_recorder": fr,
        "setup_s": setup_s,
        "first_step_s": first_step_s,
        "allocated_at_start_bytes": leftover,
        "loss_scale": scales,
        "telemetry": device_telemetry,
        "host_probe": host_probe,
        "host_cpu": host_cpu,
        "host_gc": host_gc,
        "host_process": host.process_facts(),
    }
    if breakdown is not None:
        # what the meter's step ran: compiled blocks run their eager code under it (eager_under_meter)
        mine["memory_breakdown"] = {**breakdown, "blocks": "eager" if case.options.get("compile") else "as timed"}
    if step_breakdown is not None:
        mine["step_breakdown"] = step_breakdown
    if trace is not None:
        mine["trace"] = trace
    if snapshot is not None:
        mine["memory_snapshot"] = snapshot
    if pipeline is not None:
        mine["pipeline"] = pipeline
    if strategy_stats is not None:
        mine["strategy_stats"] = strategy_stats
    progress.phase("gather")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    trainer.close()
    # The case's memory goes back in ``leftover_bytes``, which collects and (on CUDA) empties the cache
    # before the next case of the launch: one full collection between cases, not two (each costs a
    # quarter of a second with Dynamo's objects in the process).
    del trainer, batches
    if rank != 0:
        return None
    return {
        "per_rank": gathered,
        "device_name": device_name(device),
        "device_type": device.type,
        "peak_flops_per_device": peak_flops(device, case.precision),
        "matmul_roofline_flops": measured_matmul_flops(device, case.precision)
        if case.options.get("roofline", device.type != "cuda")
        else None,
        "topology": {"dp": topo.dp, "pp": topo.pp, "tp": topo.tp},
        "loss_scale": loss_scale_steps(gathered),
        **({"debug_slowdown": slowdown} if slowdown else {}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="parabench.worker")
    ap.add_argument("--cases", required=True, help="JSON file with a list of case dicts")
    ap.add_argument("--scratch", required=True, help="folder for per-case measurements and errors")
    ap.add_argument("--retired", help="where to say why the launch ended before its last case")
    args = ap.parse_args(argv)
    entries = json.loads(open(args.cases).read())
    keys = [d.pop("scratch_key", None) for d in entries]  # the runner's names for the scratch files
    cases = [Case.from_dict(d) for d in entries]
    keys = [key or case.case_hash for key, case in zip(keys, cases)]
    device = pick_device(cases[0].device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    _inject_startup_fault(cases, keys, args.scratch)
    # The collective timeout fires before the runner's case timeout, so a hang ends in the
    # watchdog's error naming the stuck collective (op, sequence number, sizes) in the case's log
    # rather than in a bare kill.
    init_process_group(device, timeout_s=max(30.0, 0.8 * min(c.timeout_s for c in cases)))
    check_nodes_agree(keys, args.scratch)  # several nodes: the same suite and the same cases, or every node stops
    rank = dist.get_rank()
    # Every node's runner reads its own node's files: its local rank 0 stamps what the launch started and finished.
    node_leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    for i, (case, key) in enumerate(zip(cases, keys)):
        leftover = leftover_bytes(device)
        if i > 0 and _retire_launch(leftover, cases[i - 1], keys[i - 1], args.retired):
            break
        if node_leader:
            with open(os.path.join(args.scratch, f"{key}.started"), "w") as f:
                f.write(repr(time.time()))
        try:
            progress = PhaseReporter(status_path(args.scratch, key) if rank == 0 else None)
            os.environ["PARABENCH_CASE_SCRATCH"] = os.path.join(args.scratch, key)  # per-case files (NVMe swap)
            result = run_case(case, device, leftover, progress, TraceFiles(args.scratch, key))
        except BaseException as exc:
            compile_cause = compile_failure(case, exc)
            err = {
                "rank": rank,
                "type": type(exc).__name__,
                "message": (compile_cause or str(exc))[:2000],
                "traceback": traceback.format_exc()[-4000:],
                "time": time.time(),
                "oom": is_oom(exc),
                "compile_failed": compile_cause is not None,
            }
            write_json_atomic(os.path.join(args.scratch, f"{key}.rank{rank}.error.json"), err)
            raise
        if result is not None:
            write_json_atomic(os.path.join(args.scratch, f"{key}.json"), result)
        elif node_leader and rank != 0:
            with open(os.path.join(args.scratch, f"{key}.done"), "w") as f:
                f.write(repr(time.time()))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _retire_launch(leftover: int | None, previous: Case, previous_key: str, retired_path: str | None) -> bool:
    """True (on every rank) when some rank kept more than LEFTOVER_LIMIT_BYTES allocated after
    ``previous`` (this rank: ``leftover``); rank 0 then writes ``retired_path`` for the runner."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, leftover or 0)
    worst = max(range(len(everyone)), key=lambda r: everyone[r])
    if everyone[worst] <= LEFTOVER_LIMIT_BYTES:
        return False
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and retired_path:
        write_json_atomic(
            retired_path,
            {
                "after_case": previous_key,
                "after_label": previous.label,
                "rank": worst,
                "leftover_bytes": everyone[worst],
                "leftover_bytes_per_rank": everyone,
                "limit_bytes": LEFTOVER_LIMIT_BYTES,
            },
        )
    return True


if __name__ == "__main__":
    sys.exit(main())
