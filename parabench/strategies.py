"""A strategy's registry row (``StrategySpec``) and the typed options every row's options extend.

A strategy is a builder ``build(spec: TrainSpec) -> Trainer`` (``parabench.trainer``). The runner never
special-cases a library: it builds a trainer, feeds it this rank's slice of every global batch, and
asks it for the memory it holds. Builders are named by import path and imported only when used, so
a case with ``torch.ddp`` never imports DeepSpeed, and reading the rows imports no torch. The rows
live in ``parabench.families``; ``parabench.registry`` looks them up by name.
"""

from __future__ import annotations

import functools
import importlib
import math
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Callable, ClassVar, Literal

from parabench.names import closest_names
from parabench.recipes import RECIPE_PRECISIONS, RECIPES, recipe_name, wire_precision  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from parabench.trainer import Trainer, TrainSpec

# Every precision a case may name; data-parallel strategies train in all three (fp16: fp32 master
# weights + dynamic loss scaling), the others in fp32 and bf16.
DP_PRECISIONS = ("fp32", "bf16", "fp16")

# Recipe declarations of the rows in parabench/families/ (StrategySpec keywords; ``parabench.recipes``).
# torch peers: bf16 parameters with fp32 masters where asked; fp16 only as torch.amp documents it
# (GradScaler unscales fp32 gradients).
TORCH_PEER_RECIPES = dict(recipes=("master", "amp"), fp16_recipes=("amp",), legacy_recipe="amp")
# Context and expert parallelism train under autocast only; DeepSpeed's engines keep bf16/fp16
# parameters with fp32 masters (its ``torch_autocast`` mode reduces some gradients in bf16: not modelled).
AMP_ONLY = dict(recipes=("amp",), legacy_recipe="amp")
MASTER_ONLY = dict(recipes=("master",), legacy_recipe="master")


# The layouts of every strategy that treats the model as a bag of tensors (StrategySpec keyword).
ANY_LAYOUT = ("separate", "fused")


def with_fp8(declared: dict) -> dict:
    """A row's recipe keywords plus ``fp8`` (bf16 only, ``parabench.fp8``): for the strategies
    whose builder converts the model's linears (``fp8.convert``)."""
    return {**declared, "recipes": declared.get("recipes", ("master", "amp")) + ("fp8",)}


# --- typed options ------------------------------------------------------------------------------
# A case's ``options`` stay the dict the suite gave (it is hashed as given, so old records keep
# their hashes); reading goes through the strategy's options dataclass, which holds each option's
# one default and its meaning.

_NONE = type(None)


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not _NONE)
    return {int: "an int", float: "a number", bool: "true or false", str: "a string", dict: "a table"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _fits(value, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(tp))
    if tp is _NONE:
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(tp) or tp)


def _string_choices(tp) -> list[str]:
    """The strings a type admits (its Literal arguments, inside a union too)."""
    if typing.get_origin(tp) is Literal:
        return [a for a in typing.get_args(tp) if isinstance(a, str)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [c for a in typing.get_args(tp) for c in _string_choices(a)]
    return []


# What an option's string form means, where a number or a word may be given (the error names it).
_NODE_NOTE = "'node' means the data-parallel ranks of one node, resolved when the run starts"
OPTION_VALUE_NOTES = {"shard_size": _NODE_NOTE, "hpz_partition_size": _NODE_NOTE}


@functools.cache
def _option_fields(cls) -> tuple[dict, frozenset]:
    """An options class's resolved type hints and field names, resolved once per class (string
    annotations are evaluated on each call of ``typing.get_type_hints``; every case parses)."""
    return typing.get_type_hints(cls), frozenset(f.name for f in fields(cls))


# Closed ranges of numeric options, by name. A number an option does not list must be finite and
# within DEFAULT_OPTION_RANGE: a degree, a count or a size, never negative, never big enough to
# exhaust the machine before the case starts. Numbers inside table options (optim, inject_fault)
# must be finite.
DEFAULT_OPTION_RANGE = (0, 2**31)
OPTION_RANGES: dict[str, tuple[float, float]] = {
    "tp": (1, 4096),
    "pp": (1, 4096),
    "ep": (1, 4096),
    "cp": (1, 4096),
    "microbatches": (1, 65536),
    "virtual_stages": (1, 1024),
    "shard_size": (1, 4096),
    "hpz_partition_size": (1, 4096),
    "in_flight": (1, 1024),
    "powersgd_rank": (1, 65536),
    "sync_every": (1, 2**20),
    "growth_interval": (1, 2**31),
    "quant_block": (1, 2**31),
    "bucket_mb": (0.001, 1048576),
    "disk_probe_mb": (0, 1048576),
    "topk_ratio": (1e-9, 1.0),
    "init_scale": (2.0**-24, 2.0**64),
}


def check_option_range(key: str, value) -> None:
    """ValueError, with the valid range, for an option number that is not finite or out of range."""
    if isinstance(value, dict):
        for k, v in value.items():
            check_option_range(f"{key}.{k}", v)
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            check_option_range(f"{key}[{i}]", v)
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if "." in key or "[" in key:  # inside a table: any finite number
        if not math.isfinite(value):
            raise ValueError(f"option {key} must be a finite number, got {value!r}")
        return
    low, high = OPTION_RANGES.get(key, DEFAULT_OPTION_RANGE)
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"option {key} must be a finite number from {low} to {high}, got {value!r}")


@dataclass(frozen=True)
class CommonOptions:
    """Options every strategy accepts: the worker and the meters read them, whatever the strategy."""

    step_breakdown: bool = False  # one more untimed step under torch.profiler: compute / communication split
    memory_breakdown: bool = False  # one more untimed step under the memory-breakdown meter
    # the profiled step (step_breakdown's, run when either asks) saved per rank as a gzipped
    # Chrome/Perfetto trace, traces/<case>.rank<r>.json.gz in the run folder (meters/traces.py)
    trace: bool = False
    # one more untimed step with the CUDA allocator's history on, saved per rank as a snapshot for
    # PyTorch's memory visualiser (traces/<case>.rank<r>.memory.pickle); on a CPU the record says why not
    memory_snapshot: bool = False
    roofline: bool | None = None  # measure a matmul roofline; None: on every device but CUDA ones
    optim: dict = field(default_factory=dict)  # AdamW overrides: lr, beta1, beta2, eps, weight_decay
    # test hook {kind: oom|cpu_oom|memory_error|crash|abort|hang|leak|startup_abort|startup_kill, rank, step}
    inject_fault: dict | None = None
    telemetry: bool = True  # NVML power, energy, clocks and throttle reasons sampled during the timed steps (GPU)
    # The garbage-collection pause meter and the live progress counter on the timed steps; false
    # leaves the timed loop bare (with telemetry = false, nothing of parabench's runs beside it),
    # the A/B that tells the harness's cost on a host-bound step from the library's.
    timed_meters: bool = True
    # Synchronise the device after every step, as a loop that reads its loss each step does
    # (DeepSpeed's throughput timer does too); off, the host may run ahead into the next step.
    step_sync: bool = False
    # Python's garbage collector. "auto": Python's own thresholds, so a collection may land in any
    # rank's step at any time and the other ranks wait for it in the next collective. "scheduled":
    # torchtitan's policy against such stragglers (torchtitan.tools.utils.GarbageCollection, its
    # training.gc_freq = 50): automatic collection off, a generation-1 collection after the warm-up,
    # off the clock, and one every 50 timed steps, on it.
    python_gc: Literal["auto", "scheduled"] = "auto"
    compile: bool = False  # torch.compile every transformer block (torchtitan's order); see peers.common.compile_blocks
    compile_loss: bool = False  # torch.compile the loss (torchtitan's component "loss"); see models.compiled_loss

    # Options that every case of the strategy carries explicitly, default or not (``Case`` fills
    # them in): their default changed what is measured, so a record must say which value it ran.
    RECORDED_DEFAULTS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def parse(cls, options: dict, strategy: str = "") -> "CommonOptions":
        """The typed options of a dict; an unknown key or a value of the wrong type is a ValueError
        that names the valid keys (or the wanted type)."""
        hints, known = _option_fields(cls)
        for key, value in options.items():
            if key not in known:
                raise ValueError(
                    f"{strategy + ': ' if strategy else ''}unknown option {key!r}; valid options: "
                    f"{', '.join(sorted(known))}"
                )
            if not _fits(value, hints[key]):
                close = closest_names(value, _string_choices(hints[key])) if isinstance(value, str) else []
                hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
                note = f" ({OPTION_VALUE_NOTES[key]})" if key in OPTION_VALUE_NOTES else ""
                raise ValueError(f"option {key} must be {_type_name(hints[key])}{note}, got {value!r}{hint}")
            check_option_range(key, value)
        return cls(**options)

    @classmethod
    def read(cls, options: dict) -> "CommonOptions":
        """The typed options of an already validated dict (keys of other strategies, kept by
        hand-made test cases, are left aside)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in known})

    def as_dict(self) -> dict:
        return asdict(self)


PeerProfile = Literal["tuned", "matched"]
PEER_PROFILE_HELP = (
    "peer configuration: 'tuned' = the library's documented best practice for throughput (sources in "
    "the adapter's docstring), 'matched' = aligned with the references' memory and traffic"
)


NO_COMPILE_HOOK = (
    "its builder has no torch.compile hook (parabench.peers.common.compile_blocks), or compiled training "
    "is not verified for it (tests/test_compile.py)"
)


def option_defaults(cls: type) -> dict:
    return {f.name: (f.default if f.default is not MISSING else f.default_factory()) for f in fields(cls)}


# --- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanFacts:
    """How the planner (``parabench.plan``) models a strategy: the family whose terms price it and
    the mechanisms of its implementation that those terms read. The default is a strategy the
    planner does not model (``family`` None)."""

    # "data_parallel" | "sharded" | "model_parallel": whose terms price it; None: not modelled
    family: str | None = None
    # The planner's search proposes it in these groups ("one_gpu", "data_parallel", "offload",
    # "tensor", "pipeline", "tensor_pipeline"), in ``search_order`` within a group.
    search: tuple[str, ...] = ()
    search_order: int = 0
    # Gradient synchronisation as it overlaps backward: "all_reduce" (bucketed, from the gradient
    # hooks), "reduce_scatter" (bucketed), "per_unit" (a gather and a reduce-scatter per block and
    # pass, prefetched); None: issued after backward, serial.
    grad_sync: str | None = None
    grad_sync_once_per_step: bool = False  # reduces on the last micro-batch only (no_sync before it)
    per_unit_launches: bool = False  # one collective launch per unit and pass, whatever its size
    own_exposure: bool = False  # its sharded traffic costs a fitted exposure of its own (DeepSpeed's engine)
    zero_stage: int = 0  # what the ZeRO paper's split shards (the theory's fallback)
    fp32_sharded_params: bool = False  # sharded parameters kept in fp32 in every recipe (FSDP2)
    offload: str | None = None  # "cpu" | "nvme": where optimizer states live
    sequence_parallel: bool = False
    pipeline_schedule: str | None = None  # "gpipe" | "1f1b" | "interleaved" | "zb_h1"
    pipeline_engine: str | None = None  # "ref" | "torch": whose stage bookkeeping is priced
    ddp_stages_from_version: int | None = None  # DDP-wrapped pipeline stages from this version on
    # host: step = max(device, host) where its Python runs per parameter tensor on the critical path
    host_bound: bool = False
    host_bound_versions: tuple[str, ...] | None = None  # host-bound in these versions only
    host_bound_eager_only: bool = False  # torch.compile traces the per-op dispatch away
    host_floor_profiles: tuple[str, ...] = ()  # profiles whose step waits on the host where device work is short
    host_analogue: str | None = None  # a strategy whose host cost stands in where it has none calibrated
    time_factor_cause: str | None = None  # why its step time keeps a fitted factor (None: physics alone)
    # memory and device copies, read off its code
    stage0_fp16_optimizer: bool = False  # DeepSpeed stage 0's FP16_Optimizer under master recipes
    persistent_grads: str | None = None  # "flat" | "server" | "buckets" | "flat_partitions": kept between steps
    accumulates_into_copy: bool = False  # gradient accumulation keeps a param-sized copy beside its buffers
    whole_grad_beside_shard: bool = False
    master_grad_buffer: bool = False  # "master": MasterWeightOptimizer's persistent fp32 gradient copy
    step_grad_copies: bool = False  # DeepSpeed ZeRO-1/2's 16-bit partition, flat and fp32 copies in the step
    sharded_units: str | None = None  # the references' flat units: "reshard_root" | "keep_root"
    device_copies: str | None = None  # "bucket_div" | "flat_grad_zero" | "slot_cast" | "fsdp2" | "torch_pipeline"
    compiled_bucket_split: bool = False  # compiled, option ddp_optimizer cuts the blocks at its buckets
    done_graphs_kept_versions: tuple[str, ...] = ()  # ZB-H1: finished graphs kept to the step's end
    compiled_gc_remedy: bool = False  # compiled launches erratic where Python's GC runs unscheduled


@dataclass(frozen=True)
class StrategySpec:
    """One strategy: how to build it, what it accepts, what it is expected to measure.

    ``options`` is the typed options dataclass; ``validate(case, options, cfg)`` raises ValueError
    for a case that cannot run; ``expect(cfg, case, options, dp)`` is the analytic expectation
    (``parabench.theory.Expectation``) or None; ``routed_comm(case, cfg, per_rank)`` makes
    data-dependent traffic exact from what the ranks recorded."""

    name: str
    family: str
    builder: str  # "module:function"
    kind: str  # "peer" or "reference"
    description: str
    precisions: tuple[str, ...] = ("fp32", "bf16")
    # The recipes it trains bf16/fp16 in (RECIPES); the first is a case's default.
    recipes: tuple[str, ...] = ("master", "amp")
    fp16_recipes: tuple[str, ...] | None = None  # where fp16 has fewer (None: ``recipes``)
    # What its bf16/fp16 records meant before cases recorded a recipe (reading old runs).
    legacy_recipe: str = "master"
    # The model layouts it trains (``parabench.models.LAYOUTS``). Data-parallel and sharded strategies
    # treat the GPT as a bag of tensors and take both; tensor, context and pipeline parallelism
    # split the separate q, k, v linears by heads, or name the separate layout's modules, and
    # take "separate" only.
    layouts: tuple[str, ...] = ("separate",)
    min_world_size: int = 1
    version: str = "1"  # bump when the implementation changes what it measures
    # False for strategies that leave state behind in the process (device memory, global hooks)
    # after close(): the runner then gives each of their cases a launch of its own on GPUs, and
    # the last place of a shared launch on CPU, so no case is measured on a contaminated process.
    shares_launch: bool = True
    # (precision, text): known behaviour of the implementation a reader of its numbers must know,
    # copied into every record of that precision and shown in the report beside the case.
    caveats: tuple[tuple[str, str], ...] = ()
    # Why option ``compile = true`` is refused for this strategy, or None where its builder compiles
    # the blocks (``peers.common.compile_blocks``). Refusing is the default: a strategy whose builder
    # never calls the hook would otherwise record eager numbers under a compiled label.
    compile_unsupported: str | None = NO_COMPILE_HOOK
    # Why option ``compile_loss`` is refused: the strategy's loss is not ``models.lm_loss`` over whole
    # logits (vocabulary-parallel or per-stage losses). None: it calls lm_loss, which the worker checks.
    own_loss: str | None = None
    options: type = CommonOptions
    validate: Callable | None = None
    expect: Callable | None = None
    routed_comm: Callable | None = None
    # ``unsupported(case, device) -> str | None``: why the case cannot run on that device ("cpu" or
    # "cuda"); the runner records it as skipped with that reason instead of launching it.
    unsupported: Callable | None = None
    # How the planner models it (parabench.plan).
    plan: PlanFacts = PlanFacts()
    # A reference's production peers: the library strategies doing the same work, which the report
    # pairs it with (parabench.report.spread).
    peers: tuple[str, ...] = ()
    # ``grad_reduce(precision, recipe, options) -> "fp32" | "bf16" | "fp16"``: the dtype its gradients
    # are reduced in (``grad_reduce_dtype``); None: the dtype they live in, the recipe's
    # (``wire_precision``), as every strategy without a reduce-dtype setting of its own.
    grad_reduce: Callable | None = None
    # The report's sections beyond the common tables that read its records ("cp_balance",
    # "moe_routing", "nvme": parabench/report/<section>.py).
    report_sections: tuple[str, ...] = ()
    # How its data-parallel collectives fall on nodes, for the intra/inter-node split of its bytes
    # (parabench.multinode): None, one group of the whole data-parallel world per collective kind;
    # "hybrid_shard", gathers and reduce-scatters within shard_size consecutive ranks and all-reduces
    # across them; "secondary_partition", ZeRO++'s hpZ gathers within hpz_partition_size ranks when hpz
    # is on; "two_hop_reduce", as secondary_partition, and its gradients reduced in two hops (qgZ), so
    # no one group carries a kind.
    link_groups: str | None = None

    def recipes_for(self, precision: str) -> tuple[str, ...]:
        """The recipes a case of ``precision`` may name; the first is its default (none for fp32)."""
        if precision == "fp32":
            return ()
        declared = self.fp16_recipes if precision == "fp16" and self.fp16_recipes is not None else self.recipes
        return tuple(r for r in declared if precision in RECIPE_PRECISIONS[r])

    def grad_reduce_dtype(self, precision: str, recipe: str | None, options: dict) -> str:
        """The dtype a case of this strategy reduces its gradients in (data-parallel reduction)."""
        if self.grad_reduce is not None:
            return self.grad_reduce(precision, recipe, self.options.read(options))
        return wire_precision(precision, recipe)

    def caveats_for(self, precision: str) -> list[str]:
        return [text for p, text in self.caveats if p == precision]

    def parse_options(self, options: dict) -> CommonOptions:
        opts = self.options.parse(options, self.name)
        if getattr(opts, "compile", False) and self.compile_unsupported:
            raise ValueError(f"{self.name} does not support compile = true: {self.compile_unsupported}")
        if getattr(opts, "compile_loss", False) and self.own_loss:
            raise ValueError(f"{self.name} does not support compile_loss = true: {self.own_loss}")
        return opts

    def build(self, spec: TrainSpec) -> Trainer:
        module, func = self.builder.split(":")
        return getattr(importlib.import_module(module), func)(spec)
