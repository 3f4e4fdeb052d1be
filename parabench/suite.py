"""Suite files (TOML) → validated Case objects.

A suite file is flat TOML::

    [suite]                      # name, description, defaults for every case
    name = "smoke"
    steps = 6
    warmup = 2

    [[matrix]]                   # each key a value or a list; the cartesian product is taken
    model = ["tiny"]
    strategy = ["torch.ddp", "torch.fsdp2"]
    world_size = [2]
    precision = ["fp32", "bf16"]

    [[exclude]]                  # drop every expanded case matching all keys given
    strategy = "torch.fsdp2"
    precision = "bf16"

``recipe`` ("master", "amp" or "fp8", ``parabench.strategies.RECIPES``) picks how a bf16/fp16 case
keeps its parameters (fp8: bf16 cases, float8 linears, ``parabench.fp8``); left out, each strategy's
default (master where it has it). As a list it is an axis that runs each strategy in the recipes it
supports (DeepSpeed: master only); a single value a strategy lacks is an error.

Several ``[[matrix]]`` tables are expanded one by one and concatenated, which is how a suite
gives each model size its own micro-batch. Every error names the file, the line and the field.

Scaling series (``scaling``, one mode per matrix, listing at least two world sizes):

* ``scaling = "weak"``: the per-rank micro-batch is fixed (``micro_batch`` as usual), so the global
  batch grows with the world size;
* ``scaling = "strong"`` with ``global_batch = G``: the global batch is fixed and each case's
  micro-batch is derived as G / (dp × grad_accum), dp the data-parallel degree at that world size
  (world size over pp × tp); a G that does not divide is an error naming the line. ``micro_batch``
  in such a matrix is an error (a ``[suite]`` default is not applied to it).

The mode is recorded in each case (``Case.scaling``) for the report's scaling section, outside
the hash: a case in both a strong and a weak series runs once and belongs to both.

``layout`` ("separate" or "fused", ``parabench.models.LAYOUTS``) picks the model's parameter layout:
separate q, k, v linears (the default) or one fused qkv linear. As a list it is an axis that runs
each strategy in the layouts it takes (``StrategySpec.layouts``: tensor, context, pipeline and
expert parallelism take "separate" only); a single value a strategy lacks is an error.

``repeats = N`` (in ``[suite]`` or a matrix) runs each case in N separate torchrun launches,
interleaved across the suite (every case's first launch, then every case's second...), so that
drift over the run hits every case alike; the regression gate and the report's intervals need
N >= 3 (``parabench.compare``).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from parabench.case import FIELD_MAXIMA, SCALING_MODES, Case, check_field_maximum
from parabench.fp8 import filter_option_error
from parabench.names import unknown_name_message
from parabench.recipes import RECIPES
from parabench.registry import STRATEGIES, get_strategy
from parabench.results import UnsafeNameError, check_path_component
from parabench.shapes import LAYOUTS, is_model_name, model_config, unknown_model_message
from parabench.strategies import DP_PRECISIONS
from parabench.topology import Topology, TopologyError

SUITES_DIR = Path(__file__).resolve().parent.parent / "suites"
# One-off studies (a planner check, a profile, an A/B) sit one folder down, so that suites/ holds what
# a user runs; a study loads by its bare name too, and its runs go to <out>/studies/<name>.
STUDIES = "studies"
STUDIES_DIR = SUITES_DIR / STUDIES


class SuiteError(ValueError):
    """A suite that cannot run, with file, line and field in the message."""


CASE_FIELDS = {f.name: f for f in fields(Case) if f.name != "repeat"}  # what suite files may set
# keys that shape cases without being a Case field: global_batch gives strong scaling its micro-batches
MATRIX_KEYS = set(CASE_FIELDS) | {"global_batch"}
SUITE_KEYS = {"name", "description", "kind"} | (MATRIX_KEYS - {"model", "strategy", "world_size"})
_TYPES = {
    "world_size": int,
    "micro_batch": int,
    "grad_accum": int,
    "seq_len": int,
    "steps": int,
    "warmup": int,
    "seed": int,
    "lr": (int, float),
    "timeout_s": (int, float),
    "comm_meter": bool,
    "own_launch": bool,
    "repeats": int,
    "global_batch": int,
    "scaling": str,
    "model": str,
    "strategy": str,
    "precision": str,
    "recipe": str,
    "layout": str,
    "device": str,
    "options": dict,
}


@dataclass
class Suite:
    name: str
    path: Path
    description: str
    cases: list[Case]
    kind: str = "training"
    raw: dict = field(default_factory=dict)

    @property
    def file_hash(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]

    @property
    def is_study(self) -> bool:
        """Whether the suite file lies in suites/studies/ (of any checkout: device runs use a copy)."""
        return self.path.parent.name == STUDIES and self.path.parent.parent.name == SUITES_DIR.name

    @property
    def results_folder(self) -> str:
        """Its runs' folder below an output root: its name, under studies/ for a study."""
        return f"{STUDIES}/{self.name}" if self.is_study else self.name


def _line_of(text: str, key: str, table: str | None, index: int = 0) -> int | None:
    """Line (1-based) of ``key = ...`` inside the ``index``-th ``[table]``/``[[table]]``; best effort."""
    lines = text.splitlines()
    start, seen = 0, -1
    if table is not None:
        header = re.compile(r"^\s*\[\[?\s*" + re.escape(table) + r"\s*\]\]?\s*(#.*)?$")
        for i, line in enumerate(lines):
            if header.match(line):
                seen += 1
                if seen == index:
                    start = i
                    break
        else:
            return None
    key_re = re.compile(r"^\s*" + re.escape(key) + r"\s*=")
    for i in range(start, len(lines)):
        if i > start and table is not None and lines[i].lstrip().startswith("["):
            break
        if key_re.match(lines[i]):
            return i + 1
    return start + 1 if table is not None else None


def _read_suite_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SuiteError(f"{path}: cannot read the suite file: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SuiteError(
            f"{path}:{line}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
            f"suite files are UTF-8 TOML"
        ) from None


def list_suites(studies: bool = False) -> list[str]:
    """The user suites' names (suites/*.toml); with ``studies``, the studies' as ``studies/<name>``."""
    if studies:
        return sorted(f"{STUDIES}/{p.stem}" for p in STUDIES_DIR.glob("*.toml"))
    return sorted(p.stem for p in SUITES_DIR.glob("*.toml"))


def resolve_suite_path(name_or_path: str) -> Path:
    """A suite file from a path, a name in suites/, ``studies/<name>``, or a study's bare name."""
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.exists():
            raise SuiteError(f"suite file {p} does not exist")
        if not p.is_file():
            raise SuiteError(
                f"suite path {p} is a folder (or not a regular file); give a .toml suite file or a suite name"
            )
        return p
    for candidate in (SUITES_DIR / f"{name_or_path}.toml", STUDIES_DIR / f"{name_or_path}.toml"):
        if candidate.is_file():
            return candidate
    studies = [name.removeprefix("studies/") for name in list_suites(studies=True)]
    raise SuiteError(
        unknown_name_message(
            "suite", name_or_path, list_suites() + studies, listing="`parabench list`, studies `parabench list --all`"
        )
    )


def load_suite(name_or_path: str) -> Suite:
    path = resolve_suite_path(name_or_path)
    text = _read_suite_text(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SuiteError(f"{path}: malformed TOML: {exc}") from None

    def fail(msg: str, key: str, table: str | None, index: int = 0):
        line = _line_of(text, key, table, index)
        where = f"{path}:{line}" if line else str(path)
        raise SuiteError(f"{where}: field '{key}'{f' in [{table}]' if table else ''}: {msg}")

    for top in data:
        if top not in ("suite", "matrix", "exclude", "collectives"):
            fail("unknown table; expected [suite], [[matrix]], [[exclude]] or [collectives]", top, None)
    head = data.get("suite", {})
    for key in head:
        if key not in SUITE_KEYS:
            fail(f"unknown key; valid keys: {', '.join(sorted(SUITE_KEYS))}", key, "suite")
    kind = head.get("kind", "training")
    if kind not in ("training", "collectives"):
        fail("kind must be 'training' or 'collectives'", "kind", "suite")
    name = head.get("name", path.stem)
    try:
        check_path_component(name, "suite name")
    except UnsafeNameError as exc:
        if "name" in head:
            fail(str(exc), "name", "suite")
        raise SuiteError(f"{path}: {exc} (from the file name; set [suite] name)") from None
    defaults = {k: v for k, v in head.items() if k in MATRIX_KEYS}
    for key, value in defaults.items():
        _check_value(key, value, lambda m, k=key: fail(m, k, "suite"))

    if kind == "collectives":
        from parabench.collectives_config import ConfigError, validate_config

        if not isinstance(data.get("collectives"), dict):
            raise SuiteError(f"{path}: a collectives suite needs a [collectives] table")
        try:
            validate_config(dict(data["collectives"]))
        except ConfigError as exc:
            fail(str(exc), str(exc).split("'")[1] if "'" in str(exc) else "collectives", "collectives")
        return Suite(name=name, path=path, description=head.get("description", ""), cases=[], kind=kind, raw=data)

    if "collectives" in data:
        fail('a [collectives] table needs kind = "collectives" in [suite]', "collectives", None)
    matrices = data.get("matrix", [])
    if not isinstance(matrices, list) or not matrices:
        raise SuiteError(f"{path}: a training suite needs at least one [[matrix]] table")
    cases: list[Case] = []
    for mi, matrix in enumerate(matrices):
        for key, value in matrix.items():
            if key not in MATRIX_KEYS:
                fail(f"unknown key; valid keys: {', '.join(sorted(MATRIX_KEYS))}", key, "matrix", mi)
            for v in value if isinstance(value, list) else [value]:
                _check_value(key, v, lambda m, k=key: fail(m, k, "matrix", mi))
        for key in ("model", "strategy", "world_size"):
            if key not in matrix:
                fail("required key missing", key, "matrix", mi)
        mode = _scaling_mode(matrix, defaults, lambda m, k: fail(m, k, "matrix", mi))
        keys = list(matrix)
        axes = [v if isinstance(v, list) else [v] for v in matrix.values()]
        if math.prod(len(a) for a in axes) > MAX_MATRIX_CASES:
            fail(
                f"the matrix expands to {math.prod(len(a) for a in axes):,} cases, more than {MAX_MATRIX_CASES:,}",
                "model",
                "matrix",
                mi,
            )
        recipe_axis = isinstance(matrix.get("recipe"), list)
        layout_axis = isinstance(matrix.get("layout"), list)
        for combo in itertools.product(*axes):
            spec = {**defaults, **dict(zip(keys, combo))}
            spec.pop("scaling", None)
            global_batch = spec.pop("global_batch", None)
            if mode == "strong":
                spec["micro_batch"] = _strong_micro_batch(
                    spec, global_batch, lambda m: fail(m, "global_batch", "matrix", mi)
                )
            if mode is not None:
                spec["scaling"] = (mode,)
            if (
                recipe_axis
                and spec.get("precision", "fp32") != "fp32"
                and spec.get("recipe") not in get_strategy(spec["strategy"]).recipes_for(spec.get("precision"))
            ):
                continue  # a recipe axis runs each strategy in the recipes it has
            if layout_axis and spec.get("layout", "separate") not in get_strategy(spec["strategy"]).layouts:
                continue  # ... and a layout axis in the model layouts it takes
            try:
                case = Case(**spec)
            except ValueError as exc:  # an option the case resolves when it is made (stage_layers)
                fail(str(exc), "options", "matrix", mi)
            try:
                validate_case(case)
            except (SuiteError, TopologyError) as exc:
                fail(str(exc), "strategy", "matrix", mi)
            cases.append(case)

    excludes = data.get("exclude", [])
    for ei, ex in enumerate(excludes):
        for key in ex:
            if key not in CASE_FIELDS:
                fail(f"unknown key; valid keys: {', '.join(sorted(CASE_FIELDS))}", key, "exclude", ei)
    cases = [c for c in cases if not any(all(_excludes(c, k, v) for k, v in ex.items()) for ex in excludes)]
    return Suite(name=name, path=path, description=head.get("description", ""), cases=merge_duplicates(cases), raw=data)


def merge_duplicates(cases: list[Case]) -> list[Case]:
    """The same case (one hash) from two matrices, or two resolutions, runs once, in every scaling
    series that lists it; first-seen order."""
    seen: dict[str, Case] = {}
    for c in cases:
        first = seen.setdefault(c.case_hash, c)
        if first.scaling != c.scaling:
            seen[c.case_hash] = replace(first, scaling=first.scaling + c.scaling)
    return list(seen.values())


def _scaling_mode(matrix: dict, defaults: dict, fail) -> str | None:
    """The matrix's scaling mode (None outside a series), after the checks that need the whole
    matrix: one mode, at least two world sizes, global_batch with strong scaling and only there."""
    mode = matrix.get("scaling", defaults.get("scaling"))
    where = "scaling" if "scaling" in matrix else "world_size"
    if isinstance(mode, list):
        fail("one scaling mode per [[matrix]] (a strong and a weak series are two matrices)", "scaling")
    has_gb = "global_batch" in matrix or "global_batch" in defaults
    if mode is None:
        if has_gb:
            fail('global_batch sets a strong-scaling series: add scaling = "strong"', "global_batch")
        return None
    sizes = matrix["world_size"] if isinstance(matrix["world_size"], list) else [matrix["world_size"]]
    if len(set(sizes)) < 2:
        fail(f"a {mode}-scaling series needs at least two world sizes (e.g. [1, 2, 4])", "world_size")
    if mode == "strong":
        if not has_gb:
            fail('scaling = "strong" fixes the global batch: give global_batch = N', where)
        if "micro_batch" in matrix:
            fail("strong scaling derives micro_batch from global_batch / (dp × grad_accum): remove it", "micro_batch")
    elif has_gb:
        fail(
            f'global_batch belongs to scaling = "strong", not {mode!r} (weak scaling fixes micro_batch)', "global_batch"
        )
    return mode


def _strong_micro_batch(spec: dict, global_batch: int, fail) -> int:
    """The micro-batch that keeps ``global_batch`` at this case's world size: G / (dp × grad_accum)."""
    world = spec["world_size"]
    opts = spec.get("options") or {}
    pp, tp = opts.get("pp", 1), opts.get("tp", 1)
    try:
        dp = Topology.check(world, pp, tp)
    except TopologyError as exc:
        fail(str(exc))
    accum = spec.get("grad_accum", 1)
    if global_batch % (dp * accum):
        fail(
            f"global_batch {global_batch} is not divisible by dp × grad_accum = {dp} × {accum} at "
            f"world_size {world}" + (f" (pp {pp}, tp {tp})" if pp * tp > 1 else "")
        )
    return global_batch // (dp * accum)


def _matches(actual, wanted) -> bool:
    return actual in wanted if isinstance(wanted, list) else actual == wanted


def _excludes(case: Case, key: str, wanted) -> bool:
    if key == "options":  # as written: a peer's recorded default (its profile) is not in the file
        return _matches(case.options, wanted) or _matches(case.options_as_written(), wanted)
    if key == "scaling":  # a case in two series matches either mode
        return any(_matches(mode, wanted) for mode in case.scaling)
    return _matches(getattr(case, key), wanted)


DEVICES = ("auto", "cpu", "cuda")
# The most cases one [[matrix]] may expand to (the product of its lists' lengths)
MAX_MATRIX_CASES = 10000


def _check_value(key: str, value, fail) -> None:
    want = _TYPES.get(key)
    if want is not None and (not isinstance(value, want) or (want is int and isinstance(value, bool))):
        fail(f"expected {getattr(want, '__name__', 'a number')}, got {type(value).__name__} {value!r}")
    if key == "model" and not is_model_name(value):
        fail(unknown_model_message(value))
    if key == "strategy" and value not in STRATEGIES:
        fail(unknown_name_message("strategy", value, sorted(STRATEGIES)))
    if key == "precision" and value not in DP_PRECISIONS:
        fail(unknown_name_message("precision", value, DP_PRECISIONS))
    if key == "scaling" and value not in SCALING_MODES:
        fail(unknown_name_message("scaling mode", value, SCALING_MODES, plural="modes"))
    if key == "recipe" and value not in RECIPES:
        fail(unknown_name_message("recipe", value, RECIPES))
    if key == "layout" and value not in LAYOUTS:
        fail(unknown_name_message("model layout", value, LAYOUTS, plural="layouts"))
    if key == "device" and value not in DEVICES:
        fail(unknown_name_message("device", value, DEVICES))
    if (
        key in ("world_size", "micro_batch", "grad_accum", "steps", "seq_len", "repeats", "global_batch")
        and isinstance(value, int)
        and value < 1
    ):
        fail("must be >= 1")
    if key == "warmup" and isinstance(value, int) and value < 0:
        fail("must be >= 0")
    too_big = check_field_maximum(key, value)
    if too_big:
        fail(too_big)
    if key in ("lr", "timeout_s") and isinstance(value, float) and not math.isfinite(value):
        fail(f"must be a finite number, got {value!r}")
    if key == "timeout_s" and isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
        fail(f"must be > 0 seconds, got {value!r}")


def validate_case(case: Case) -> None:
    """Reject what cannot run, before anything launches: the generic limits here, the strategy's
    options (unknown keys, wrong types) and its own limits in its family (``parabench/families/``)."""
    info = get_strategy(case.strategy)
    if case.repeats < 1:
        raise SuiteError(f"repeats must be >= 1 (got {case.repeats})")
    for key in FIELD_MAXIMA.keys() & {f.name for f in fields(Case)}:  # global_batch is the suite's, not a field
        too_big = check_field_maximum(key, getattr(case, key))
        if too_big:
            raise SuiteError(f"{key} {too_big}")
    if case.precision not in info.precisions:
        raise SuiteError(
            f"{case.strategy} does not support precision {case.precision} (supported: {', '.join(info.precisions)})"
        )
    if case.recipe is not None and case.recipe not in info.recipes_for(case.precision):
        raise SuiteError(
            f"{case.strategy} does not train {case.precision} in the {case.recipe!r} recipe "
            f"(supported: {', '.join(info.recipes_for(case.precision))})"
        )
    if case.layout not in info.layouts:
        takers = sorted(name for name, spec in STRATEGIES.items() if case.layout in spec.layouts)
        raise SuiteError(
            f"{case.strategy} does not train the {case.layout!r} model layout (it takes {', '.join(info.layouts)}): "
            + (
                "a column split of a fused qkv weight is not a split by heads, and its parallelism splits or names "
                "the separate q, k, v linears. "
                if case.layout == "fused"
                else ""
            )
            + f"Strategies that take {case.layout!r}: {', '.join(takers)}"
        )
    if case.world_size < info.min_world_size:
        raise SuiteError(f"{case.strategy} needs world_size >= {info.min_world_size}")
    if case.seq_len is not None and case.seq_len > 1 << 20:
        raise SuiteError("seq_len is unreasonably large")
    try:
        opts = info.parse_options(case.options)
        fp8_filter_error = filter_option_error(case)
        if fp8_filter_error:
            raise ValueError(fp8_filter_error)
        Topology.check(case.world_size, getattr(opts, "pp", 1), getattr(opts, "tp", 1))
        if info.validate is not None:
            info.validate(case, opts, model_config(case.model, layout=case.layout))
    except TopologyError:
        raise
    except ValueError as exc:
        raise SuiteError(str(exc)) from None
