"""Case: one measured training run, validated and hashed. Everything that changes what is
measured is in its hash (``case_hash``); suite files (``parabench.suite``) and ``parabench run
case`` make them, the runner launches them, and every record carries one."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields

from parabench.names import unknown_name
from parabench.recipes import RECIPES, recipe_name
from parabench.registry import STRATEGIES, get_strategy
from parabench.shapes import LAYOUTS
from parabench.strategies import DP_PRECISIONS
from parabench.topology import Topology

SCALING_MODES = ("strong", "weak")


@dataclass(frozen=True)
class Case:
    """One measured training run. Everything that changes what is measured is in the hash."""

    model: str
    strategy: str
    world_size: int
    precision: str = "fp32"
    # bf16/fp16: "master", "amp" or (bf16) "fp8" (``strategies.RECIPES``); None picks the strategy's default and
    # is resolved here, so every low-precision case names the recipe it ran. fp32 has none.
    recipe: str | None = None
    # The model's parameter layout (``parabench.models.LAYOUTS``): "separate" q, k, v linears, or one
    # "fused" qkv linear (GPT-2 / nanoGPT / Megatron-LM). Only a non-default layout enters the hash.
    layout: str = "separate"
    micro_batch: int = 2
    grad_accum: int = 1
    seq_len: int | None = None
    steps: int = 5
    warmup: int = 1
    seed: int = 1234
    lr: float = 3e-4
    device: str = "auto"  # "cpu", "cuda" or "auto" (cuda when present)
    options: dict = field(default_factory=dict, hash=False)
    # Not part of the identity of the measurement:
    timeout_s: float = 600.0
    comm_meter: bool = True
    # A torchrun launch of its own (no earlier case's allocator, caches or CUDA context): for
    # A/B pairs whose difference is smaller than what a shared launch could leave behind.
    own_launch: bool = False
    # Separate torchrun launches of the same measurement (``parabench.stats``): each launch's
    # median step time is one sample of the launch-to-launch variance the regression gate tests.
    # ``repeat`` is which launch this is, set by the runner (not in suite files); the launches
    # share the case hash, and each writes its own record (``record_key``).
    repeats: int = 1
    repeat: int = 0
    # The scaling series this case belongs to (``SCALING_MODES``; ``parabench.suite``): "strong"
    # (global batch fixed across world sizes), "weak" (micro-batch per rank fixed), or both when two
    # series share a point. It groups cases in the report and never changes what is measured, so it
    # is not in the hash: a weak-series case pairs with the same shape run outside any series.
    scaling: tuple = ()

    IDENTITY_EXCLUDES = ("timeout_s", "own_launch", "repeats", "repeat", "scaling")

    def __post_init__(self):
        modes = (self.scaling,) if isinstance(self.scaling, str) else tuple(self.scaling or ())
        unknown = [m for m in modes if m not in SCALING_MODES]
        if unknown:
            raise unknown_name("scaling mode", unknown[0], SCALING_MODES, plural="modes")
        object.__setattr__(self, "scaling", tuple(sorted(set(modes))))
        if self.layout not in LAYOUTS:
            raise unknown_name("model layout", self.layout, LAYOUTS, plural="layouts")
        if self.precision not in DP_PRECISIONS:
            raise unknown_name("precision", self.precision, DP_PRECISIONS)
        if self.recipe is not None and self.recipe not in RECIPES:  # a misspelt recipe, even where fp32 drops it
            raise unknown_name("recipe", self.recipe, RECIPES)
        if self.precision == "fp32":  # nothing to choose (a suite's recipe axis collapses here)
            object.__setattr__(self, "recipe", None)
        elif self.recipe is None:
            spec = STRATEGIES.get(self.strategy)
            object.__setattr__(self, "recipe", spec.recipes_for(self.precision)[0] if spec is not None else RECIPES[0])
        # Options whose default changed what a strategy measures (a peer's ``profile``) are written
        # into the case itself, so its hash, label and record name the value that ran, and a record
        # made before the option existed (which lacks it) never pairs with a case made now.
        missing = {k: v for k, v in self.recorded_defaults().items() if k not in self.options}
        if missing:
            object.__setattr__(self, "options", {**missing, **self.options})
        if isinstance(self.options.get("stage_layers"), str):
            # the split is the case's: its hash, label and record name the block counts that ran
            object.__setattr__(self, "options", {**self.options, "stage_layers": self._balanced_stage_layers()})

    def _balanced_stage_layers(self) -> list[int]:
        """Option ``stage_layers = "balanced"``: the FLOP-balanced blocks per pipeline stage
        (``reference_impls.pipeline_balance``) of this model, sequence and ``pp``."""
        from reference_impls.pipeline_balance import BALANCED, flop_balanced_layers

        value = self.options["stage_layers"]
        if value != BALANCED:
            raise ValueError(
                f"option stage_layers={value!r}: give the blocks of each pipeline stage, e.g. [7, 6, 6, 5], "
                f"or {BALANCED!r} for the split that evens the stages' FLOPs"
            )
        cfg, pp = self.model_config(), self.options.get("pp", 1)
        if cfg.n_experts:
            raise ValueError(f"option stage_layers={BALANCED!r} counts dense blocks; {self.model} has experts")
        if not isinstance(pp, int) or isinstance(pp, bool) or not 1 <= pp <= cfg.n_layers:
            raise ValueError(f"option stage_layers={BALANCED!r} needs pp from 1 to {cfg.n_layers}, not {pp!r}")
        return flop_balanced_layers(cfg.n_layers, pp, cfg.d_model, cfg.seq_len, cfg.vocab_size, cfg.mlp_ratio)

    def recorded_defaults(self) -> dict:
        """The strategy's options that every case records even when left at their default."""
        spec = STRATEGIES.get(self.strategy)
        if spec is None:
            return {}
        keys = getattr(spec.options, "RECORDED_DEFAULTS", ())
        return {f.name: f.default for f in fields(spec.options) if f.name in keys}

    def options_as_written(self) -> dict:
        """``options`` without the recorded defaults that sit at their default value: what a suite
        file states for this case (its ``[[exclude]]`` tables match on this)."""
        defaults = self.recorded_defaults()
        return {k: v for k, v in self.options.items() if not (k in defaults and defaults[k] == v)}

    def identity(self) -> dict:
        # Field values as they are (no deep copy): the hash serialises them, never keeps them.
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in self.IDENTITY_EXCLUDES:
            d.pop(k)
        # A case that trains as its strategy did before cases named a recipe keeps the hash it
        # had (fp32 cases, and bf16/fp16 in the strategy's legacy recipe); a recipe that is new
        # to the strategy is part of the identity.
        if d["recipe"] is None or d["recipe"] == get_strategy(self.strategy).legacy_recipe:
            d.pop("recipe")
        if d["layout"] == "separate":  # the model every case trained before layouts were an axis
            d.pop("layout")
        d["strategy_version"] = get_strategy(self.strategy).version
        return d

    @property
    def case_hash(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def record_key(self) -> str:
        """The name of this launch's record and scratch files (``launch_key``)."""
        return launch_key(self.case_hash, self.repeat)

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return (
            f"{self.strategy} {self.model}{'' if self.layout == 'separate' else ' ' + self.layout} w{self.world_size} {self.precision_recipe} mb{self.micro_batch}"
            + (f" ga{self.grad_accum}" if self.grad_accum > 1 else "")
            + (f" [{opts}]" if opts else "")
            + (f" scaling={'+'.join(self.scaling)}" if self.scaling else "")
        )

    def model_config(self):
        """The GPT this case trains (``parabench.models.model_config`` with its seq_len and layout)."""
        from parabench.shapes import model_config

        return model_config(self.model, self.seq_len, layout=self.layout)

    @property
    def precision_recipe(self) -> str:
        """``fp32``, ``bf16-master``, ``bf16-amp``, ... (``strategies.recipe_name``)."""
        return recipe_name(self.precision, self.recipe)

    @property
    def param_precision(self) -> str:
        """The precision parameters and gradients live and travel in: fp32 under "amp" and "fp8"."""
        return "fp32" if self.recipe in ("amp", "fp8") else self.precision

    @property
    def dp(self) -> int:
        """The data-parallel degree: world size over the pipeline and tensor-parallel degrees."""
        return Topology.check(self.world_size, self.options.get("pp", 1), self.options.get("tp", 1))

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["scaling"]:  # records of cases outside a series read as they always have
            del d["scaling"]
        if d["layout"] == "separate":  # ... and so do records of the default model layout
            del d["layout"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        """A case as a record stored it. Records made before cases named their recipe get the one
        their strategy trained low-precision cases in then (``StrategySpec.legacy_recipe``)."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if "recipe" not in d and kw.get("precision", "fp32") != "fp32":
            spec = STRATEGIES.get(kw.get("strategy"))
            kw["recipe"] = spec.legacy_recipe if spec is not None else None
        return cls(**kw)


def launch_key(case_hash: str, repeat: int = 0) -> str:
    """``<hash>`` for a case's first launch, ``<hash>.r<k>`` for launch k >= 1: a run of repeats = 1
    keeps the layout every earlier run has (``cases/<hash>.json``), and raising repeats on
    ``--resume`` adds launches beside the one already recorded."""
    return case_hash if not repeat else f"{case_hash}.r{repeat}"


# The largest value a case field may take: beyond them a case cannot be what anyone meant, and the
# runner would spend minutes and gigabytes on the case list (one entry per launch) or a world of
# processes before anything ran. The CPU world is bounded by the host as well (runner.too_many_cpu_ranks).
FIELD_MAXIMA = {
    "world_size": 65536,
    "micro_batch": 65536,
    "grad_accum": 65536,
    "global_batch": 1 << 24,
    "seq_len": 1 << 21,
    "steps": 100000,
    "warmup": 100000,
    "repeats": 100,
    "timeout_s": 7 * 24 * 3600,
}


def check_field_maximum(key: str, value) -> str | None:
    """Why a case field is above its FIELD_MAXIMA entry, or None."""
    high = FIELD_MAXIMA.get(key)
    if high is None or not isinstance(value, (int, float)) or isinstance(value, bool) or value <= high:
        return None
    if isinstance(value, float) and math.isnan(value):  # not finite: its own message (suite._check_value)
        return None
    return f"must be <= {high}, got {value!r}"
