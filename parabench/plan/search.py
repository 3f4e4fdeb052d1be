"""Enumerate the configurations of a model on N GPUs, predict each, rank the ones that fit.

The strategies are the registry's (``parabench.registry.STRATEGIES``) of the families the model
covers; each candidate is checked with the suite's own validation (``suite.validate_case``), so a
configuration the planner proposes is one ``parabench run`` accepts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parabench.plan import model as M
from parabench.plan.workload import for_config  # noqa: F401 (tests compare against it)

# GPU names the CLI may accept: calibration kind and device memory (what torch reports as total).
# A name is accepted only where its kind has a calibration, its own or derived from a calibrated
# kind's (``accepted_gpus``): a kind of another architecture (A100: other matmul rate, no committed
# record) is not listed, since no derivation by HBM speed alone would describe it.
GPUS = {
    "h100-80g": ("h100", 79.2 * M.GIB),
    "h200-141g": ("h200", 139.8 * M.GIB),
}
# Allocated bytes may reach this share of the card: the caching allocator's reserve and
# fragmentation, the CUDA context and NCCL buffers take the rest (records: reserved is 5-15 %
# above allocated, the context about 0.5 GiB).
USABLE = 0.88
# CPU offload keeps its optimizer states in host memory; they may take this share of a host's RAM:
# the OS, page cache, each rank's Python and CUDA runtime and pinned staging buffers take the rest.
HOST_USABLE = 0.8
# Host RAM per GPU assumed where neither --host-ram-gib nor this machine tells it: every host the
# committed H100 and H200 runs used had 126 GiB per GPU (manifests' host.memory_bytes: 126, 252
# and 504 GiB beside 1, 2 and 4 GPUs).
DEFAULT_HOST_RAM_PER_GPU = 126 * M.GIB
# GPUs per host where neither --gpus-per-node nor this machine tells it (an HGX board).
DEFAULT_GPUS_PER_HOST = 8
# A prediction under this MFU is dropped: its step leaves the GPU idle, waiting on an offloaded
# optimizer, the network or memory traffic, far below the utilisation of the configurations the
# calibration was fitted on. Steps bound by the host's per-layer launches or per-tensor hooks are
# kept: those costs do not grow with the model's width, so a low MFU there says the model is too
# small to occupy the GPU (a test shape), not that the configuration starves it.
MFU_FLOOR = 0.01
MFU_FLOOR_EXEMPT = ("host", "host_wait")
# How far the smallest working GPU count is searched (the CLI's own --gpus limit).
MIN_GPUS_SEARCH_MAX = 4096


def accepted_gpus(calibration_dir=None) -> dict[str, str]:
    """GPU name -> how it is calibrated ("calibrated" or "derived from <kind>"), for the names whose
    kind has a calibration in ``calibration_dir`` (default: the committed one) or is derived from
    a kind that has one (``calibrate.DERIVED_FROM``)."""
    from parabench.plan import calibrate as C

    out = {}
    for name, (kind, _) in GPUS.items():
        path = C.calibration_path(kind, calibration_dir)
        source = C.DERIVED_FROM.get(kind)
        if path.is_file():
            try:
                derived = (C.load(path).get("derived_from") or {}).get("kind")
            except (OSError, ValueError, C.CalibrationError):
                continue
            out[name] = f"derived from {derived}" if derived else "calibrated"
        elif source and C.calibration_path(source, calibration_dir).is_file():
            out[name] = f"derived from {source}"
    return out


@dataclass(frozen=True)
class HostLimits:
    """What one host gives the ranks on it: its RAM (CPU offload's states), its NVMe capacity
    (NVMe offload's), and how many GPUs share them. ``source`` says where the RAM figure came from."""

    ram_bytes: float
    gpus_per_host: int
    nvme_bytes: float | None = None
    source: str = ""

    def ranks_on_host(self, world_size: int) -> int:
        return max(1, min(world_size, self.gpus_per_host))


def usable_bytes(manifest: dict) -> float | None:
    """The bytes a run's configurations may allocate: ``USABLE`` of its smallest GPU's memory (its
    manifest's devices); None where the manifest names no GPU memory."""
    sizes = [d.get("memory_bytes") for d in manifest.get("devices") or () if d.get("memory_bytes")]
    return USABLE * min(sizes) if sizes else None


def searched(group: str) -> list[str]:
    """The strategies the search proposes in ``group`` (their rows' ``PlanFacts.search``: "one_gpu",
    "data_parallel", "offload", "tensor", "pipeline", "tensor_pipeline"), in their search order."""
    from parabench.registry import STRATEGIES

    rows = [row for row in STRATEGIES.values() if group in row.plan.search]
    return [row.name for row in sorted(rows, key=lambda row: row.plan.search_order)]


MICRO_BATCHES = (1, 2, 4, 8, 16)


@dataclass
class Candidate:
    strategy: str
    world_size: int
    micro_batch: int
    grad_accum: int
    options: dict
    recipe: str | None
    workload: M.Workload | None = None
    prediction: M.Prediction | None = None
    dropped: str | None = None
    notes: list = field(default_factory=list)

    @property
    def degrees(self) -> str:
        w = self.workload
        return f"dp{w.dp} tp{w.tp} pp{w.pp}" if w else "-"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _has_option(strategy: str, name: str) -> bool:
    from dataclasses import fields

    from parabench.registry import STRATEGIES

    return name in {f.name for f in fields(STRATEGIES[strategy].options)}


def candidates(cfg, gpus: int, recipe: str, global_batch: int | None) -> list[Candidate]:
    from parabench.registry import STRATEGIES

    out: list[Candidate] = []

    def add(strategy, micro_batch, options, dp):
        if strategy not in STRATEGIES:
            return
        if global_batch is not None:
            if global_batch % (micro_batch * dp):
                return
            ga = global_batch // (micro_batch * dp)
        else:
            ga = 1
        if recipe == "fp8":  # the float8 terms describe compiled blocks only (model.FP8_EAGER)
            options = {**options, "compile": True}
        out.append(Candidate(strategy, gpus, micro_batch, ga, options, recipe))

    for mb in MICRO_BATCHES:
        for ac in (False, True):
            acopt = {"activation_checkpointing": True} if ac else {}
            for s in (searched("one_gpu") if gpus == 1 else []) + searched("data_parallel") + searched("offload"):
                if ac and not _has_option(s, "activation_checkpointing"):
                    continue
                add(s, mb, dict(acopt), gpus)
        for tp in _divisors(gpus):
            for pp in _divisors(gpus // tp):
                if tp == 1 and pp == 1 or tp > 8:
                    continue
                dp = gpus // (tp * pp)
                if pp == 1:
                    for s in searched("tensor"):
                        add(s, mb, {"tp": tp}, dp)
                    continue
                for m in sorted({pp, 2 * pp, 4 * pp}):
                    if mb % m:
                        continue
                    if tp == 1:
                        for s in searched("pipeline"):
                            add(s, mb, {"pp": pp, "microbatches": m}, dp)
                    else:
                        for s in searched("tensor_pipeline"):
                            add(s, mb, {"tp": tp, "pp": pp, "microbatches": m}, dp)
    return out


_EXPECTATIONS: dict = {}


def _workload(model: str, cfg, c: Candidate) -> M.Workload | None:
    """The theory's workload of ``c``. The theory builds the model (on the meta device) for every
    expectation, so it is asked at two batch sizes per strategy and options only: model states do
    not depend on the batch, and every traffic figure is affine in the sequences a rank processes
    per micro-batch at a fixed accumulation (gradients and gathered parameters: constant; activations:
    proportional), so two points per accumulation give the rest exactly."""
    from dataclasses import replace

    options = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in c.options.items()))
    key = (model, cfg, c.strategy, c.world_size, c.recipe, c.grad_accum, options)
    m = int(c.options.get("microbatches") or 1)
    points = _EXPECTATIONS.setdefault(key, {})
    for rows in (m, 2 * m):
        if rows not in points:
            points[rows] = for_config(
                model=model,
                cfg=cfg,
                strategy=c.strategy,
                world_size=c.world_size,
                recipe=c.recipe,
                micro_batch=rows,
                grad_accum=c.grad_accum,
                options=c.options,
            )
    w1, w2 = points[m], points[2 * m]
    if w1 is None:
        return None
    rows = c.micro_batch
    comm = {
        k: w1.comm_bytes.get(k, 0.0) + (w2.comm_bytes.get(k, 0.0) - w1.comm_bytes.get(k, 0.0)) * (rows - m) / m
        for k in sorted(set(w1.comm_bytes) | set(w2.comm_bytes))  # sorted: the notes' order follows it
    }
    return replace(w1, micro_batch=c.micro_batch, grad_accum=c.grad_accum, comm_bytes=comm)


def candidate_case(model: str, cfg, c: Candidate):
    """The GPU case a candidate would run as (bf16, the candidate's recipe and degrees)."""
    from parabench.case import Case

    return Case(
        model=model,
        strategy=c.strategy,
        world_size=c.world_size,
        precision="bf16",
        recipe=c.recipe,
        micro_batch=c.micro_batch,
        grad_accum=c.grad_accum,
        seq_len=cfg.seq_len,
        options=c.options,
        device="cuda",
    )


def nvme_need(model: str, cfg, c: Candidate) -> float | None:
    """Bytes one rank of ``c`` keeps on NVMe (its theory's ``nvme_state_bytes``), or None."""
    from parabench.registry import expected

    exp = expected(candidate_case(model, cfg, c), cfg, c.world_size) or {}
    parts = exp.get("nvme_state_bytes") or {}
    return float(sum(parts.values())) if parts else None


def host_reason(c: Candidate, limits: HostLimits, nvme_bytes: float | None = None) -> str | None:
    """Why ``c`` cannot run on hosts of ``limits``: its CPU-offloaded states beyond the host's RAM,
    or (``nvme_bytes``: one rank's) its NVMe-offloaded states beyond the host's NVMe; else None."""
    ranks = limits.ranks_on_host(c.world_size)
    w = c.workload
    if w is not None and w.offload and w.cpu_state_bytes:
        need, usable = ranks * w.cpu_state_bytes, HOST_USABLE * limits.ram_bytes
        if need > usable:
            return (
                f"host memory: {ranks} rank{'s' if ranks > 1 else ''} x {w.cpu_state_bytes / M.GIB:.1f} GiB of CPU-offloaded states = "
                f"{need / M.GIB:.1f} GiB > {usable / M.GIB:.1f} GiB usable ({HOST_USABLE:.0%} of the host's "
                f"{limits.ram_bytes / M.GIB:.0f} GiB, {limits.source or '--host-ram-gib'})"
            )
    if nvme_bytes:
        need = ranks * nvme_bytes
        if limits.nvme_bytes is None:
            return f"NVMe offload: needs {need / M.GIB:.1f} GiB of NVMe per host; give its capacity (--nvme-gib)"
        if need > limits.nvme_bytes:
            return (
                f"NVMe: {ranks} rank{'s' if ranks > 1 else ''} x {nvme_bytes / M.GIB:.1f} GiB of offloaded states = {need / M.GIB:.1f} GiB "
                f"> the host's {limits.nvme_bytes / M.GIB:.0f} GiB (--nvme-gib)"
            )
    return None


def evaluate(c: Candidate, model: str, cfg, cal: dict, capacity: float, limits: HostLimits | None = None) -> Candidate:
    """``c`` predicted, or dropped with the reason: invalid, not modelled, beyond the GPU's memory,
    beyond the host's RAM or NVMe (``limits``; unchecked without), or under ``MFU_FLOOR``."""
    from parabench.registry import STRATEGIES
    from parabench.suite import validate_case

    spec = STRATEGIES[c.strategy]
    if c.recipe not in spec.recipes_for("bf16"):
        c.dropped = f"trains the {'/'.join(spec.recipes_for('bf16'))} recipe only"
        return c
    if c.world_size < spec.min_world_size:
        c.dropped = f"needs at least {spec.min_world_size} GPUs"
        return c
    try:
        if model != "custom":
            validate_case(candidate_case(model, cfg, c))
        w = _workload(model, cfg, c)
    except (ValueError, KeyError) as exc:
        c.dropped = f"invalid: {exc}"
        return c
    if w is None:
        reason = host_reason(c, limits, nvme_need(model, cfg, c)) if limits and spec.plan.offload == "nvme" else None
        c.dropped = reason or "not modelled by the planner"
        return c
    c.workload = w
    p = M.predict(w, cal)
    c.prediction = p
    if p.peak_bytes is None:
        c.dropped = "no memory prediction (the theory has no state expectation)"
    elif p.peak_bytes > USABLE * capacity:
        c.dropped = f"does not fit: {peak_parts(p, w)} > {USABLE * capacity / M.GIB:.1f} GiB usable"
    elif limits is not None and host_reason(c, limits):
        c.dropped = host_reason(c, limits)
    elif p.mfu is not None and p.mfu < MFU_FLOOR and p.bottleneck not in MFU_FLOOR_EXEMPT:
        c.dropped = (
            f"below the {MFU_FLOOR:.0%} MFU floor: predicted {p.mfu:.2%} MFU, "
            f"{p.tokens_per_s_per_gpu:.3g} tokens/s per GPU ({p.bottleneck}-bound)"
        )
    return c


def peak_split(p: M.Prediction) -> dict:
    """The predicted peak in the parts ``plan`` prints; they sum to the peak exactly."""
    m = p.memory_bytes
    states = m["model_states"] + m["master_grad_buffer"] + m.get("step_copies", 0.0)
    acts = m["activations"] + m["logits"] + m.get("retained_logits", 0.0) + m.get("split_graphs", 0.0)
    overhead = m["implementation"]
    return {
        "states at peak": states,
        "activations": acts,
        "other": p.peak_bytes - states - acts - overhead,  # casts, working set, fixed
        "implementation overhead": overhead,
    }


def peak_parts(p: M.Prediction, w: M.Workload) -> str:
    s = peak_split(p)
    g = {k: v / M.GIB for k, v in s.items()}
    buf = p.memory_bytes["master_grad_buffer"] / M.GIB
    copies = p.memory_bytes.get("step_copies", 0.0) / M.GIB
    of = f"of {w.state_bytes / M.GIB:.1f} at the update" + (f", + {buf:.1f} fp32 gradient buffer" if buf else "")
    of += f", + {copies:.1f} gradient copies of the step" if copies else ""
    return (
        f"predicted peak {p.peak_bytes / M.GIB:.1f} GiB at the {p.peak_phase} = states at peak "
        f"{g['states at peak']:.1f} ({of}) + activations {g['activations']:.1f} + "
        f"casts/working set/fixed {g['other']:.1f} + implementation overhead {g['implementation overhead']:.1f} GiB"
    )


def balanced(c: Candidate, cal: dict) -> Candidate | None:
    """``c`` with option ``stage_layers`` set to the split that evens its pipeline stages' predicted
    cost (``model.balanced_stage_layers``: the last stage also runs the head and the loss); None
    where ``c`` has no such option, is interleaved (chunks are split equally), has no workload, or
    the balanced split is the equal one."""
    w = c.workload
    if w is None or w.pp <= 1 or w.virtual_stages != 1 or "stage_layers" in c.options:
        return None
    if not _has_option(c.strategy, "stage_layers"):
        return None
    from reference_impls.pipeline import partition_layers

    split = M.balanced_stage_layers(w, M.time_constants(cal["time"]))
    if split is None or split == [hi - lo for lo, hi in partition_layers(w.n_layers, w.pp)]:
        return None
    return Candidate(
        c.strategy, c.world_size, c.micro_batch, c.grad_accum, {**c.options, "stage_layers": split}, c.recipe
    )


def is_reference(c: Candidate) -> bool:
    """Whether ``c``'s strategy is a from-scratch reference (its row's ``kind``), not a library."""
    from parabench.registry import STRATEGIES

    return STRATEGIES[c.strategy].kind == "reference"


def plan(
    model: str,
    cfg,
    gpus: int,
    gpu: str,
    cal: dict,
    recipe: str = "master",
    global_batch: int | None = None,
    include_references: bool = True,
    limits: HostLimits | None = None,
    layouts: str = "all",
) -> tuple[list[Candidate], list[Candidate]]:
    """(feasible ranked by predicted tokens/s per GPU, dropped with reasons). Each pipeline
    candidate on the equal split is followed by its balanced split where that differs. Without
    ``include_references`` only the production libraries are proposed; ``layouts="flat"`` proposes
    no tensor or pipeline layout (their theory lists every rank's traffic, slow at large counts)."""
    _, capacity = GPUS[gpu]
    evaluated = []
    for c in candidates(cfg, gpus, recipe, global_batch):
        if not include_references and is_reference(c):
            continue
        if layouts == "flat" and (c.options.get("tp") or c.options.get("pp")):
            continue
        evaluated.append(evaluate(c, model, cfg, cal, capacity, limits))
        uneven = balanced(evaluated[-1], cal)
        if uneven is not None:
            evaluated.append(evaluate(uneven, model, cfg, cal, capacity, limits))
    ok = [c for c in evaluated if c.dropped is None]
    ok.sort(key=lambda c: -c.prediction.tokens_per_s_per_gpu)
    return ok, [c for c in evaluated if c.dropped is not None]


def smallest_working_count(
    model: str,
    cfg,
    gpus: int,
    gpu: str,
    cal: dict,
    limits_for,
    recipe: str = "master",
    global_batch: int | None = None,
    include_references: bool = False,
    most: int = MIN_GPUS_SEARCH_MAX,
) -> tuple[int, Candidate] | None:
    """The smallest GPU count above ``gpus`` (up to ``most``) at which a configuration works (fits
    the GPU and the host, ``limits_for(count)``, and clears the MFU floor), with its best one; None
    if none does by ``most``. Counts double until one works, then bisect between the last two, in
    whole hosts where a host holds several GPUs. Data-parallel, sharded and offload layouts only:
    the tensor and pipeline layouts' theory lists every rank's traffic, minutes at a thousand GPUs.
    Their memory per GPU falls as the count grows, which the bisection takes as given."""

    def works(n: int) -> Candidate | None:
        ok, _ = plan(model, cfg, n, gpu, cal, recipe, global_batch, include_references, limits_for(n), "flat")
        return ok[0] if ok else None

    low, n = gpus, gpus * 2
    while True:
        n = min(n, most)
        best = works(n) if n > low else None
        if best is not None:
            break
        if n >= most:
            return None
        low, n = n, n * 2
    step = limits_for(n).gpus_per_host if low >= limits_for(n).gpus_per_host else 1
    high = n
    while high - low > step:
        mid = low + max(step, (high - low) // 2 // step * step)
        if mid >= high:
            break
        found = works(mid)
        if found is not None:
            high, best = mid, found
        else:
            low = mid
    return high, best


def _shown(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def describe(c: Candidate) -> str:
    opts = " ".join(f"{k}={_shown(v)}" for k, v in c.options.items() if k != "activation_checkpointing")
    ac = " +ckpt" if c.options.get("activation_checkpointing") else ""
    return f"{c.strategy}{ac}{' ' + opts if opts else ''}"


def labelled(c: Candidate) -> str:
    """``describe(c)``, marked where it is a from-scratch reference rather than a library."""
    return describe(c) + (" [reference]" if is_reference(c) else "")


def table(ok: list[Candidate], top: int) -> str:
    width = max([42] + [len(labelled(c)) for c in ok[:top]])
    head = (
        f"{'#':>3} {'configuration':{width}s} {'degrees':13s} {'mb':>3} {'ga':>3} {'tok/s/GPU':>10} {'of #1':>6} "
        f"{'MFU':>6} {'peak GiB':>9}  bottleneck"
    )
    lines = [head, "-" * len(head)]
    best = ok[0].prediction.tokens_per_s_per_gpu if ok else 0.0
    for i, c in enumerate(ok[:top], 1):
        p = c.prediction
        mfu = f"{p.mfu * 100:5.1f}%" if p.mfu is not None else "   - "
        lines.append(
            f"{i:>3} {labelled(c):{width}s} {c.degrees:13s} {c.micro_batch:>3} {c.grad_accum:>3} "
            f"{p.tokens_per_s_per_gpu:>10.0f} {100 * p.tokens_per_s_per_gpu / best:>5.1f}% {mfu:>6} "
            f"{p.peak_bytes / M.GIB:>9.1f}  {p.bottleneck}"
        )
    # what a row's prediction borrows or lacks (an uncalibrated implementation or host cost)
    rows_of: dict[str, list[int]] = {}
    for i, c in enumerate(ok[:top], 1):
        for note in c.prediction.notes:
            rows_of.setdefault(note, []).append(i)
    if rows_of:
        lines += ["", "notes:"] + [f"  #{', #'.join(map(str, rows))}: {note}" for note, rows in rows_of.items()]
    return "\n".join(lines)


def suite_toml(name: str, model: str, cfg, chosen: list[Candidate], gpu: str) -> str:
    """A suite of the chosen configurations, one [[matrix]] each, so one ``parabench run suite``
    measures what the planner predicted."""

    def val(v):
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v) if isinstance(v, (int, float)) else f'"{v}"'

    lines = [
        f"# Written by `parabench plan` for {model} on {chosen[0].world_size if chosen else 0}x {gpu}: "
        "the top configurations, to check the predictions.",
        "[suite]",
        f'name = "{name}"',
        f'description = "parabench plan: top {len(chosen)} configurations of {model}"',
        'device = "cuda"',
        'precision = "bf16"',
        f"seq_len = {cfg.seq_len}",
        "steps = 10",
        "warmup = 3",
        "",
    ]
    for c in chosen:
        p = c.prediction
        lines += [
            f"# predicted {p.tokens_per_s_per_gpu:.0f} tok/s/GPU, peak {p.peak_bytes / M.GIB:.1f} GiB, "
            f"step {p.step_s * 1e3:.0f} ms",
            "[[matrix]]",
            f'model = "{model}"',
            f'strategy = "{c.strategy}"',
            f"world_size = {c.world_size}",
            f'recipe = "{c.recipe}"',
            f"micro_batch = {c.micro_batch}",
            f"grad_accum = {c.grad_accum}",
        ]
        if c.options:
            lines.append("options = {" + ", ".join(f"{k} = {val(v)}" for k, v in c.options.items()) + "}")
        lines.append("")
    return "\n".join(lines)


def mfu_ok(x) -> bool:
    return x is not None and math.isfinite(x)
