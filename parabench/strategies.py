"""The Strategy interface shared by reference implementations and peer adapters, and the registry.

A strategy is a builder ``build(spec: TrainSpec) -> Trainer``. The runner never special-cases
a library: it builds a trainer, feeds it this rank's slice of every global batch, and asks it
for the memory it holds. Builders are named by import path and imported only when used, so a
case with ``torch.ddp`` never imports DeepSpeed.
"""

from __future__ import annotations

import functools
import importlib
import types
import typing
from abc import ABC, abstractmethod
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Callable, ClassVar, Literal

import torch

from parabench.models import GPTConfig
from parabench.recipes import RECIPE_PRECISIONS, RECIPES, recipe_name  # noqa: F401 (re-exported)
from parabench.topology import Topology

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


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, every hyperparameter explicit: library defaults differ (weight decay above all)."""

    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)


@dataclass
class TrainSpec:
    """Everything a strategy needs to build its trainer on this rank."""

    model: GPTConfig
    seed: int
    device: torch.device
    precision: str
    topology: Topology
    micro_batch: int
    grad_accum: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)
    options: dict = field(default_factory=dict)
    recipe: str | None = None  # "master" | "amp" | "fp8" (RECIPES) for bf16/fp16, None for fp32

    @property
    def compute_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.precision]

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype parameters and gradients are kept (and communicated) in: the compute dtype
        under "master", fp32 under "amp" and "fp8" (autocast casts the matmul inputs)."""
        return torch.float32 if self.recipe in ("amp", "fp8") else self.compute_dtype  # None: as before recipes

    @property
    def autocast_on(self) -> bool:
        """Forward under torch.autocast: the "amp" and "fp8" recipes (and a spec made without a recipe)."""
        return self.recipe != "master" and self.precision != "fp32"


class Trainer(ABC):
    """One rank's view of a training run under some strategy.

    Every hook the worker calls is declared here; a strategy overrides what it has."""

    # Set by the worker for the instrumented (untimed) step: sample the state bytes then.
    measure_state: bool = False
    # Set by the worker for the timeline step (option record_timeline): pipelines time every op then.
    record_timeline: bool = False

    @abstractmethod
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step over this rank's data-parallel slice, ``[grad_accum * micro_batch, s]``.

        Returns the mean loss over the slice as a detached 0-d tensor (not synchronised to the
        host, so the step does not stall), or None on ranks that never see the loss (pipeline
        stages before the last).
        """

    @abstractmethod
    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds: keys ``params``, ``grads``, ``optimizer``
        (master weights count under optimizer)."""

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        """Every parameter of the full model as fp32 CPU tensors keyed by the GPT's own names.

        A collective: call it on every rank. Used by equivalence tests; None if unsupported.
        """
        return None

    def loss_scale(self) -> dict | None:
        """For fp16 runs: ``{"scale": float, "skipped": bool}`` for the last step, else None."""
        return None

    def pipeline_stats(self) -> dict | None:
        """This stage's schedule record of the last step (pipelines), else None."""
        return None

    def strategy_stats(self) -> dict | None:
        """Strategy-specific measurements of the last step (attention work, expert routing), else None."""
        return None

    def close(self) -> None:
        """Release what the strategy holds (called between cases that share a launch)."""


def as_trainer(cls: type) -> type:
    """A plain-torch reference class (``reference_impls``, which imports nothing from parabench) as a
    Trainer subclass, so it inherits the hooks it does not define."""
    if issubclass(cls, Trainer):
        return cls
    cached = _TRAINER_CLASSES.get(cls)
    if cached is None:
        cached = _TRAINER_CLASSES[cls] = type(cls.__name__, (cls, Trainer), {"__module__": cls.__module__})
    return cached


_TRAINER_CLASSES: dict[type, type] = {}


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


@functools.cache
def _option_fields(cls) -> tuple[dict, frozenset]:
    """An options class's resolved type hints and field names, resolved once per class (string
    annotations are evaluated on each call of ``typing.get_type_hints``; every case parses)."""
    return typing.get_type_hints(cls), frozenset(f.name for f in fields(cls))


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
    # test hook {kind: oom|cpu_oom|memory_error|crash|abort|hang|leak|startup_abort, rank, step}
    inject_fault: dict | None = None
    telemetry: bool = True  # NVML power, energy, clocks and throttle reasons sampled during the timed steps (GPU)
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
                raise ValueError(f"option {key} must be {_type_name(hints[key])}, got {value!r}")
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
    # after close(): the runner then gives each of their cases a launch of its own, so the
    # next case is not measured on a contaminated process.
    shares_launch: bool = True
    # (precision, text): known behaviour of the implementation a reader of its numbers must know,
    # copied into every record of that precision and shown in the report beside the case.
    caveats: tuple[tuple[str, str], ...] = ()
    # Why option ``compile = true`` is refused for this strategy, or None where its builder compiles
    # the blocks (``peers.common.compile_blocks``). Refusing is the default: a strategy whose builder
    # never calls the hook would otherwise record eager numbers under a compiled label.
    compile_unsupported: str | None = NO_COMPILE_HOOK
    options: type = CommonOptions
    validate: Callable | None = None
    expect: Callable | None = None
    routed_comm: Callable | None = None
    # ``unsupported(case, device) -> str | None``: why the case cannot run on that device ("cpu" or
    # "cuda"); the runner records it as skipped with that reason instead of launching it.
    unsupported: Callable | None = None

    def recipes_for(self, precision: str) -> tuple[str, ...]:
        """The recipes a case of ``precision`` may name; the first is its default (none for fp32)."""
        if precision == "fp32":
            return ()
        declared = self.fp16_recipes if precision == "fp16" and self.fp16_recipes is not None else self.recipes
        return tuple(r for r in declared if precision in RECIPE_PRECISIONS[r])

    def caveats_for(self, precision: str) -> list[str]:
        return [text for p, text in self.caveats if p == precision]

    def parse_options(self, options: dict) -> CommonOptions:
        opts = self.options.parse(options, self.name)
        if getattr(opts, "compile", False) and self.compile_unsupported:
            raise ValueError(f"{self.name} does not support compile = true: {self.compile_unsupported}")
        return opts

    def build(self, spec: TrainSpec) -> Trainer:
        module, func = self.builder.split(":")
        return getattr(importlib.import_module(module), func)(spec)


class _Registry(dict):
    """name -> StrategySpec, filled from the family modules on first use (they import this module,
    and the adapters they name import it too, so the rows cannot be collected at import time)."""

    _loaded = False

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            from parabench.families import ROWS

            for row in ROWS:
                if dict.__contains__(self, row.name):
                    raise ValueError(f"strategy {row.name!r} registered twice")
                dict.__setitem__(self, row.name, row)

    def __getitem__(self, key):
        self._load()
        return dict.__getitem__(self, key)

    def __contains__(self, key):
        self._load()
        return dict.__contains__(self, key)

    def __iter__(self):
        self._load()
        return dict.__iter__(self)

    def __len__(self):
        self._load()
        return dict.__len__(self)

    def get(self, key, default=None):
        self._load()
        return dict.get(self, key, default)

    def keys(self):
        self._load()
        return dict.keys(self)

    def values(self):
        self._load()
        return dict.values(self)

    def items(self):
        self._load()
        return dict.items(self)


# Each family module (parabench/families/) lists its strategies' rows; adding a strategy is a row there.
STRATEGIES: dict[str, StrategySpec] = _Registry()


def get_strategy(name: str) -> StrategySpec:
    if name not in STRATEGIES:
        raise KeyError(f"unknown strategy {name!r}; valid strategies: {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]
