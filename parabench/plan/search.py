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

# GPU names the CLI accepts: calibration kind and device memory (what torch reports as total).
GPUS = {
    "h100-80g": ("h100", 79.2 * M.GIB),
    "h200-141g": ("h200", 139.8 * M.GIB),
    "a100-80g": ("a100", 79.2 * M.GIB),
}
# Allocated bytes may reach this share of the card: the caching allocator's reserve and
# fragmentation, the CUDA context and NCCL buffers take the rest (records: reserved is 5-15 %
# above allocated, the context about 0.5 GiB).
USABLE = 0.88


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


def evaluate(c: Candidate, model: str, cfg, cal: dict, capacity: float) -> Candidate:
    from parabench.case import Case
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
            validate_case(
                Case(
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
            )
        w = _workload(model, cfg, c)
    except (ValueError, KeyError) as exc:
        c.dropped = f"invalid: {exc}"
        return c
    if w is None:
        c.dropped = "not modelled by the planner"
        return c
    c.workload = w
    p = M.predict(w, cal)
    c.prediction = p
    if p.peak_bytes is None:
        c.dropped = "no memory prediction (the theory has no state expectation)"
    elif p.peak_bytes > USABLE * capacity:
        c.dropped = f"does not fit: {peak_parts(p, w)} > {USABLE * capacity / M.GIB:.1f} GiB usable"
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


def plan(
    model: str, cfg, gpus: int, gpu: str, cal: dict, recipe: str = "master", global_batch: int | None = None
) -> tuple[list[Candidate], list[Candidate]]:
    """(feasible ranked by predicted tokens/s per GPU, dropped with reasons). Each pipeline
    candidate on the equal split is followed by its balanced split where that differs."""
    _, capacity = GPUS[gpu]
    evaluated = []
    for c in candidates(cfg, gpus, recipe, global_batch):
        evaluated.append(evaluate(c, model, cfg, cal, capacity))
        uneven = balanced(evaluated[-1], cal)
        if uneven is not None:
            evaluated.append(evaluate(uneven, model, cfg, cal, capacity))
    ok = [c for c in evaluated if c.dropped is None]
    ok.sort(key=lambda c: -c.prediction.tokens_per_s_per_gpu)
    return ok, [c for c in evaluated if c.dropped is not None]


def _shown(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def describe(c: Candidate) -> str:
    opts = " ".join(f"{k}={_shown(v)}" for k, v in c.options.items() if k != "activation_checkpointing")
    ac = " +ckpt" if c.options.get("activation_checkpointing") else ""
    return f"{c.strategy}{ac}{' ' + opts if opts else ''}"


def table(ok: list[Candidate], top: int) -> str:
    width = max([42] + [len(describe(c)) for c in ok[:top]])
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
            f"{i:>3} {describe(c):{width}s} {c.degrees:13s} {c.micro_batch:>3} {c.grad_accum:>3} "
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
