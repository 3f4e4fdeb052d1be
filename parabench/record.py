"""The case record: one JSON object per case launch, ``cases/<hash>.json`` in a run folder.

It is built here and nowhere else (``build_record`` for the runner, ``theory_for`` and
``checks_for`` for ``parabench recheck`` as well), and its shape is written down once, in
``CaseRecord`` and ``RECORD_KEYS``: the report and the regression gate read these keys and no
other spellings. ``results.load_json`` refuses a file of any schema version but
``version.SCHEMA_VERSION``, naming the file, so every record a reader sees has this shape.

Which keys a record carries depends on how far its case got, not on guesswork: every record has
the identity keys, the outcome and ``model``/``theory``; a case that ran to the end (``status``
ok) adds the measured sections; a failed or skipped case has ``error`` instead.

The builders import the theory, models and strategies (and with them torch) when called: the
report and ``parabench compare`` read records through this module without torch.
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any, TypedDict

from parabench.version import SCHEMA_VERSION

if TYPE_CHECKING:
    from parabench.case import Case

# Every top-level key a case record may carry, in the order ``build_record`` writes them, with
# its meaning. Keys marked "(ok)" are present only when the case ran (the worker returned).
RECORD_KEYS: dict[str, str] = {
    "schema_version": "version.SCHEMA_VERSION when written",
    "kind": 'always "case"',
    "case": "Case.to_dict(): the case spec as run",
    "case_hash": "Case.case_hash: hash of the spec and the strategy's version (compare matches on it)",
    "label": "Case.label: the human-readable name",
    "strategy_version": "the strategy's version when it ran (part of case_hash); absent in records made before it was written",
    "status": "one of runner.STATUSES: ok, oom, crashed, timeout, skipped, error",
    "error": "None when ok; else {message, type, first_failing_rank, traceback_tail, log_tail, diagnosis, ...}",
    "started_at": "epoch seconds rank 0 started the case, or None",
    "duration_s": "wall seconds of the case, or None",
    "launch": "the torchrun launch that ran it (command, pid, ...); {} when none",
    "model": "metrics.model_section: name, config, params{total, ...}, tied_head, FLOP convention",
    "caveats": "list of sentences a reader must see beside the figures (absent in records made before caveats existed)",
    "debug_slowdown": "fraction the timed steps were slowed on purpose (PARABENCH_DEBUG_SLOWDOWN); absent otherwise",
    "theory": "theory_for(): the analytic expectation, or None where there is none (see THEORY_KEYS)",
    "device": "(ok) {name, type}",
    "topology": "(ok) {dp, pp, tp}",
    "metrics": "(ok) metrics.summarize: tokens/s, step times, peaks, MFU, losses, ...",
    "per_rank": "(ok) one dict per rank as the worker gathered it (see PER_RANK_KEYS)",
    "loss_scale": "(ok) per step {step, loss, scale_used, scale, overflow, skipped, skipped_on_ranks} "
    "(fp16 cases), else None",
    "checks": "(ok) checks_for(): measured vs theory, with ok / comm_ok / state_ok and per-kind comm rows",
    "theory_recheck": "set by parabench recheck: {at, parabench_commit, original_checks}",
    "leftover_after_case": "set by the runner when this case left memory allocated and ended its launch",
}

# The parts of ``theory`` the report reads. A byte figure is an int or a [low, high] range where
# the implementation may legitimately do either (``byte_high`` reads both).
THEORY_KEYS: dict[str, str] = {
    "state_bytes": "model-state bytes by part ({params, grads, optimizer, ...}), or a list of such dicts, "
    "one per rank, where ranks differ (pipeline stages), or None",
    "paper_state_bytes": "the paper's figure (ZeRO's 16 psi...), or None",
    "comm_payload_bytes": "rank 0's payload bytes per collective kind",
    "comm_payload_bytes_per_rank": "the same per rank where ranks differ",
    "comm_exact_from": "set when routed traffic was made exact from the recorded routing",
    "pipeline": "{schedule, microbatches, bubble_fraction, peak_live_microbatches_per_stage, "
    "stage_imbalance_flops (one stage per rank)} for pp > 1",
    "notes": "what the expectation assumes",
}

# The parts of a ``per_rank`` entry the report and the gate read.
PER_RANK_KEYS: dict[str, str] = {
    "rank": "global rank",
    "comm": "{payload_bytes, by_kind{kind: {calls, payload_bytes, wire_bytes, dtypes}}} of the instrumented step",
    "pipeline": "pipeline ranks: reference_impls.pipeline stats (bubble_fraction_measured, "
    "bubble_fraction_theory, timeline_clock, timeline_step_s, ...); absent or None elsewhere",
    "step_breakdown": "profiler time per category, when the case asked for it",
    "trace": "option trace: {path (relative to the run folder), bytes} of the profiled step's gzipped Chrome trace",
    "memory_snapshot": "option memory_snapshot: {path, bytes} of the CUDA memory snapshot, or {path: None, reason}",
    "strategy_stats": "what a strategy reports of its own (expert routing, context-parallel load; recipe fp8: "
    "float8 = {fp8_filter, float8_linears, float8_linears_per_block, block_modules, float8_numel})",
}


class CaseRecord(TypedDict, total=False):
    """The keys of ``RECORD_KEYS`` with their types (the record stays a plain dict on disk)."""

    schema_version: int
    kind: str
    case: dict[str, Any]
    case_hash: str
    label: str
    strategy_version: str
    status: str
    error: dict[str, Any] | None
    started_at: float | None
    duration_s: float | None
    launch: dict[str, Any]
    model: dict[str, Any]
    caveats: list[str]
    debug_slowdown: float
    theory: dict[str, Any] | None
    device: dict[str, Any]
    topology: dict[str, int]
    metrics: dict[str, Any]
    per_rank: list[dict[str, Any]]
    loss_scale: list[dict[str, Any]] | None
    checks: dict[str, Any]
    theory_recheck: dict[str, Any]
    leftover_after_case: dict[str, Any]


def _base_record(case: Case, strategy_version: str) -> CaseRecord:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "case",
        "case": case.to_dict(),
        "case_hash": case.case_hash,
        "label": case.label,
        "strategy_version": strategy_version,
    }


def theory_for(case: Case, per_rank: list[dict] | None = None) -> dict | None:
    """The analytic expectation of a case (``parabench.registry.expected``), as the record stores it. Given
    the measured per-rank records, traffic that depends on a data-dependent decision (expert
    routing) is made exact per rank from what the ranks recorded of that decision."""
    from parabench.fp8 import TorchaoMissing
    from parabench.registry import expected, routed_comm_per_rank

    cfg = case.model_config()
    try:
        expect = expected(case, cfg, case.dp)
    except TorchaoMissing:  # which linears "auto" converts is torchao's answer: none here, no theory
        return None
    if expect is None:
        return None
    out = dict(expect)
    routed = routed_comm_per_rank(case, cfg, per_rank) if per_rank else None
    if routed:
        out["comm_payload_bytes_range"] = out.get("comm_payload_bytes")
        out["comm_payload_bytes"], out["comm_payload_bytes_per_rank"] = routed[0], routed
        out["comm_exact_from"] = "the routing each rank recorded on the instrumented step (strategy_stats)"
    return out


def checks_for(expect: dict | None, per_rank: list[dict], loss_scale_steps: list | None) -> dict:
    """Measured per-rank figures against the expectation (``metrics.check_against_theory``)."""
    from parabench.metrics import check_against_theory

    checks = check_against_theory(expect, per_rank)
    steps = loss_scale_steps or []
    if steps and steps[-1].get("skipped_on_ranks") and checks.get("comm_ok") is False:
        # An fp16 overflow on the instrumented step skips the update, and with it the parameter
        # all-gathers of the ZeRO stages: the theory describes an applied step, so no verdict.
        checks["comm_ok"] = None
        checks["comm_note"] = (
            f"instrumented step skipped on ranks {steps[-1]['skipped_on_ranks']} (fp16 overflow): theory not applicable"
        )
        checks["ok"] = checks.get("state_ok", True)
    return checks


def build_record(
    case: Case,
    status: str,
    raw: dict | None = None,
    error: dict | None = None,
    started_at: float | None = None,
    duration_s: float | None = None,
    launch: dict | None = None,
) -> CaseRecord:
    """The record of one case launch: ``raw`` is what the worker returned (rank 0), None when the
    case did not finish (then ``error`` says why)."""
    from parabench.metrics import model_section, summarize
    from parabench.registry import get_strategy

    strategy = get_strategy(case.strategy)
    rec = _base_record(case, strategy.version)
    rec.update(status=status, error=error, started_at=started_at, duration_s=duration_s, launch=launch or {})
    rec["model"] = model_section(case)
    rec["caveats"] = strategy.caveats_for(case.precision)
    if raw is not None and raw.get("debug_slowdown"):  # PARABENCH_DEBUG_SLOWDOWN (worker.py): not the code's speed
        rec["debug_slowdown"] = raw["debug_slowdown"]
        rec["caveats"] = [
            *rec["caveats"],
            (
                f"timed steps deliberately slowed by {raw['debug_slowdown']:.1%} "
                "(PARABENCH_DEBUG_SLOWDOWN, a regression-gate check)"
            ),
        ]
    rec["theory"] = theory_for(case, raw["per_rank"] if raw is not None else None)
    if raw is not None:
        rec["device"] = {"name": raw["device_name"], "type": raw["device_type"]}
        rec["topology"] = raw["topology"]
        rec["metrics"] = summarize(case, raw)
        if rec["metrics"].get("throttled"):
            rec["caveats"].append(
                "the GPU held its clocks down during the timed steps ("
                + ", ".join(rec["metrics"]["clocks_event_reasons"])
                + "): its tokens/s describe a throttled card, not only the strategy"
            )
        gc_note = gc_caveat(rec["metrics"], raw["per_rank"])
        if gc_note:
            rec["caveats"].append(gc_note)
        rec["per_rank"] = raw["per_rank"]
        if "loss_scale" in raw:
            rec["loss_scale"] = raw["loss_scale"]
        rec["checks"] = checks_for(rec["theory"], rec["per_rank"], rec.get("loss_scale"))
    return rec


# Python's collections over the timed steps that a reader must see: at least this share of the step.
GC_CAVEAT_SHARE = 0.02


def gc_caveat(metrics: dict, per_rank: list[dict]) -> str | None:
    """A sentence when Python's garbage collections took GC_CAVEAT_SHARE of a rank's timed steps or
    more: in a synchronous job the other ranks wait for the pause in their next collective."""
    per_step, step = metrics.get("host_gc_pause_s_per_step_max"), metrics.get("step_time_s_median")
    if not per_step or not step or per_step < GC_CAVEAT_SHARE * step:
        return None
    longest = max((r.get("host_gc") or {}).get("max_pause_s", 0.0) for r in per_rank)
    full = metrics.get("host_gc_full_collections_max") or 0
    return (
        f"Python's garbage collector took {per_step * 1e3:.1f} ms per timed step on the slowest rank "
        f"({full} full collection{'s' if full != 1 else ''}, the longest pause {longest * 1e3:.0f} ms), and the "
        'other ranks wait for a pause in their next collective; option python_gc = "scheduled" keeps '
        "collections out of the timed steps"
    )


# --- reading ----------------------------------------------------------------------------------


def _number(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def byte_high(v):
    """A theory byte figure (an int, or a [low, high] range): its high end, or None."""
    if isinstance(v, list):
        nums = [x for x in v if _number(x) is not None]
        return max(nums) if nums else None
    return _number(v)


def theory_state_total(rec: CaseRecord):
    """Expected model-state bytes of the heaviest rank (``theory.state_bytes`` summed), or None."""
    state = (rec.get("theory") or {}).get("state_bytes")
    if isinstance(state, list):  # per rank
        totals = [
            sum(byte_high(v) for v in s.values()) for s in state if all(byte_high(v) is not None for v in s.values())
        ]
        return max(totals) if totals else None
    if state and all(byte_high(v) is not None for v in state.values()):
        return sum(byte_high(v) for v in state.values())
    return None


def rank0_comm(rec: CaseRecord) -> dict | None:
    """Rank 0's communication on the instrumented step (``per_rank[0].comm``), or None."""
    per_rank = rec.get("per_rank") or []
    return per_rank[0].get("comm") if per_rank else None


def pipeline_stages(rec: CaseRecord) -> list[tuple[int, dict]]:
    """(rank, per-rank pipeline stats) of every pipeline rank. On a GPU a stage whose timeline did
    not synchronise measured kernel launches only: its ``bubble_fraction_measured`` is dropped (the
    worker has recorded None there since it learnt this; older records carry the host-clock figure)."""
    on_gpu = (rec.get("device") or {}).get("type") == "cuda"
    out = []
    for pr in rec.get("per_rank") or []:
        p = pr.get("pipeline")
        if not p:
            continue
        if on_gpu and p.get("timeline_synchronized") is False:
            p = {**p, "bubble_fraction_measured": None}
        out.append((pr.get("rank"), p))
    return out


# --- validation: a record read from a run folder is untrusted input ------------------------------

# runner.STATUSES, repeated here so that readers need not import the runner (and torch)
STATUSES = ("ok", "oom", "crashed", "timeout", "skipped", "error")
# A case hash names files (cases/<hash>.json, fidelity/<hash>.json): hex digits only, so it can never
# be a path. Case.case_hash writes 16; the range leaves room for a longer hash without allowing a path.
CASE_HASH_PATTERN = re.compile(r"[0-9a-f]{8,64}")
# Metrics the gate (compare.METRICS) and the launch statistics (stats.TIMING_METRICS, ...) read as
# numbers: each must be a number or None. A non-finite or negative one is kept, with a notice.
GATED_METRICS = (
    "tokens_per_s",
    "tokens_per_s_per_device",
    "step_time_s_median",
    "mfu",
    "hfu",
    "model_flops_per_s_per_device",
    "hardware_flops_per_s_per_device",
    "roofline_fraction",
    "model_state_bytes_max",
    "peak_alloc_bytes",
    "peak_requested_bytes",
    "comm_payload_bytes",
    "peak_reserved_bytes",
    "device_used_bytes",
    "peak_rss_bytes",
    "final_loss",
)
_NUM = "number"
_INT = "int"
_STR = "str"
_BOOL = "bool"
_DICT = "dict"
_LIST = "list"
# key -> (accepted kinds, may be None): only keys present are checked (older records lack newer ones)
CASE_FIELDS = {
    "model": ((_STR,), False),
    "strategy": ((_STR,), False),
    "world_size": ((_INT,), False),
    "precision": ((_STR,), False),
    "recipe": ((_STR,), True),
    "layout": ((_STR,), False),
    "micro_batch": ((_INT,), False),
    "grad_accum": ((_INT,), False),
    "seq_len": ((_INT,), True),
    "steps": ((_INT,), False),
    "warmup": ((_INT,), False),
    "seed": ((_INT,), False),
    "lr": ((_NUM,), False),
    "device": ((_STR,), False),
    "options": ((_DICT,), False),
    "timeout_s": ((_NUM,), False),
    "comm_meter": ((_BOOL,), False),
    "own_launch": ((_BOOL,), False),
    "repeats": ((_INT,), False),
    "repeat": ((_INT,), False),
    "scaling": ((_LIST, _STR), False),
}
CASE_REQUIRED = ("model", "strategy", "world_size", "precision", "micro_batch", "grad_accum", "steps")
# what every record of this parabench has trained in (strategies.DP_PRECISIONS)
PRECISIONS = ("fp32", "bf16", "fp16")
MODEL_CONFIG_REQUIRED = ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len")
TOP_FIELDS = {
    "label": ((_STR,), False),
    "strategy_version": ((_STR,), True),
    "error": ((_DICT,), True),
    "started_at": ((_NUM,), True),
    "duration_s": ((_NUM,), True),
    "launch": ((_DICT,), True),
    "model": ((_DICT,), True),
    "caveats": ((_LIST,), True),
    "debug_slowdown": ((_NUM,), True),
    "theory": ((_DICT,), True),
    "device": ((_DICT,), True),
    "topology": ((_DICT,), True),
    "metrics": ((_DICT,), True),
    "per_rank": ((_LIST,), True),
    "loss_scale": ((_LIST,), True),
    "checks": ((_DICT,), True),
    "theory_recheck": ((_DICT,), True),
    "leftover_after_case": ((_DICT,), True),
}
# metrics that are not plain numbers; every other known metric is a number or None
METRIC_FIELDS = {
    "step_times_s": ((_LIST,), True),
    "losses": ((_LIST,), True),
    "hfu_convention": ((_STR,), True),
    "clocks_event_reasons": ((_LIST,), True),
    "throttled": ((_BOOL,), True),
    "loss_scale": ((_DICT,), True),
}
# per-rank entries: the parts readers index into
PER_RANK_FIELDS = {
    "rank": ((_INT,), True),
    "coords": ((_DICT,), True),
    "comm": ((_DICT,), True),
    "memory": ((_DICT,), True),
    "state_bytes": ((_DICT,), True),
    "step_times_s": ((_LIST,), True),
    "timed_window_s": ((_NUM,), True),
    "telemetry": ((_DICT,), True),
    "pipeline": ((_DICT,), True),
    "setup_s": ((_NUM,), True),
    "strategy_stats": ((_DICT,), True),
    "step_breakdown": ((_DICT,), True),
    "trace": ((_DICT,), True),
    "memory_snapshot": ((_DICT,), True),
}
# Sub-fields of dict sections that readers format or index, by the section's path.
NESTED_FIELDS = {
    "error": {"message": ((_STR,), True), "type": ((_STR,), True), "diagnosis": ((_STR,), True)},
    "device": {"name": ((_STR,), True), "type": ((_STR,), True)},
    "model": {"name": ((_STR,), True), "params": ((_DICT,), True), "config": ((_DICT,), True)},
    "checks": {
        "ok": ((_BOOL,), True),
        "comm_ok": ((_BOOL,), True),
        "state_ok": ((_BOOL,), True),
        "comm": ((_DICT, _LIST), True),
        "state": ((_DICT, _LIST), True),
    },
    "theory": {
        "state_bytes": ((_DICT, _LIST), True),
        "comm_payload_bytes": ((_DICT,), True),
        "comm_payload_bytes_per_rank": ((_LIST,), True),
        "pipeline": ((_DICT,), True),
        "notes": ((_STR, _LIST), True),
    },
}


def launch_file_name(rec: dict) -> str:
    """The file name a valid record has in ``cases/``: ``case.launch_key`` of its hash and repeat
    (here too, so that readers need not import the case module and torch)."""
    repeat = rec["case"].get("repeat") or 0
    return f"{rec['case_hash']}{f'.r{repeat}' if repeat else ''}.json"


class RecordProblem(ValueError):
    """One thing wrong in a record: the field (a dotted path) and why."""

    def __init__(self, field: str, why: str):
        super().__init__(f"field {field!r}: {why}")
        self.field, self.why = field, why


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _kind_ok(v, kind: str) -> bool:
    if kind == _NUM:
        return is_number(v)
    if kind == _INT:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, {_STR: str, _BOOL: bool, _DICT: dict, _LIST: list}[kind])


def _check_fields(d: dict, spec: dict, prefix: str) -> None:
    for key, (kinds, nullable) in spec.items():
        if key not in d:
            continue
        v = d[key]
        if v is None and nullable:
            continue
        if not any(_kind_ok(v, k) for k in kinds):
            wanted = " or ".join(kinds) + (" or null" if nullable else "")
            raise RecordProblem(f"{prefix}{key}", f"expected {wanted}, found {_show(v)}")
        if is_number(v) and not math.isfinite(v):
            raise RecordProblem(f"{prefix}{key}", f"not a finite number ({v})")


def _show(v) -> str:
    text = json.dumps(v, default=str) if not isinstance(v, float) else repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _finite_or_none(v, field: str) -> None:
    if v is not None and not is_number(v):
        raise RecordProblem(field, f"expected a number or null, found {_show(v)}")


def validate_record(rec) -> list[str]:
    """Check a record read from disk; raise ``RecordProblem`` naming the first bad field. Returns
    notices about values it keeps: non-finite or negative gated metrics (NaN tokens/s, a loss that
    became inf), which are the measurement's outcome and for the gate to judge, not a broken file."""
    if not isinstance(rec, dict):
        raise RecordProblem("(record)", f"expected a JSON object, found {type(rec).__name__}")
    if rec.get("kind") != "case":
        raise RecordProblem("kind", f'expected "case", found {_show(rec.get("kind"))}')
    h = rec.get("case_hash")
    if not isinstance(h, str) or not CASE_HASH_PATTERN.fullmatch(h):
        raise RecordProblem("case_hash", f"expected 8 to 64 lower-case hex digits, found {_show(h)}")
    if rec.get("status") not in STATUSES:
        raise RecordProblem("status", f"expected one of {', '.join(STATUSES)}, found {_show(rec.get('status'))}")
    if "label" not in rec:
        raise RecordProblem("label", "missing")
    _check_fields(rec, TOP_FIELDS, "")
    case = rec.get("case")
    if not isinstance(case, dict):
        raise RecordProblem("case", f"expected the case as an object, found {_show(case)}")
    for key in CASE_REQUIRED:
        if key not in case:
            raise RecordProblem(f"case.{key}", "missing")
    _check_fields(case, CASE_FIELDS, "case.")
    for key in ("world_size", "micro_batch", "grad_accum", "steps", "repeats"):
        if key in case and case[key] < 1:
            raise RecordProblem(f"case.{key}", f"must be at least 1, found {case[key]}")
    for key in ("repeat", "warmup"):
        if key in case and case[key] < 0:
            raise RecordProblem(f"case.{key}", f"must not be negative, found {case[key]}")
    from parabench.case import check_field_maximum

    for key, value in case.items():
        too_big = check_field_maximum(key, value)  # what a suite may hold, a record may hold
        if too_big:
            raise RecordProblem(f"case.{key}", too_big)
    if case["precision"] not in PRECISIONS:
        raise RecordProblem(
            "case.precision", f"expected one of {', '.join(PRECISIONS)}, found {_show(case['precision'])}"
        )
    config = (rec.get("model") or {}).get("config") if isinstance(rec.get("model"), dict) else None
    if isinstance(config, dict) and config:
        for key in MODEL_CONFIG_REQUIRED:
            if config.get(key) is None:
                raise RecordProblem(f"model.config.{key}", "missing")
    for section, spec in NESTED_FIELDS.items():
        if isinstance(rec.get(section), dict):
            _check_fields(rec[section], spec, f"{section}.")
    notices = []
    metrics = rec.get("metrics")
    if isinstance(metrics, dict):
        for key, v in metrics.items():
            if key in METRIC_FIELDS:
                _check_fields(metrics, {key: METRIC_FIELDS[key]}, "metrics.")
            elif key in GATED_METRICS:
                _finite_or_none(v, f"metrics.{key}")
                if v is not None and (not math.isfinite(v) or v < 0):
                    notices.append(f"field 'metrics.{key}': {v!r} is not a possible measurement")
            # any other metric is carried as it is: no reader takes it for a number it is not
        for key in ("step_times_s", "losses"):
            for i, v in enumerate(metrics.get(key) or []):
                _finite_or_none(v, f"metrics.{key}[{i}]")
        if rec["status"] == "ok" and not is_number(metrics.get("step_time_s_median")):
            # every reader of an ok launch starts from its median step time (the launch's sample)
            raise RecordProblem(
                "metrics.step_time_s_median",
                f"status ok needs a number, found {_show(metrics.get('step_time_s_median'))}",
            )
    for i, pr in enumerate(rec.get("per_rank") or []):
        if not isinstance(pr, dict):
            raise RecordProblem(f"per_rank[{i}]", f"expected an object, found {_show(pr)}")
        _check_fields(pr, PER_RANK_FIELDS, f"per_rank[{i}].")
    for i, c in enumerate(rec.get("caveats") or []):
        if not isinstance(c, str):
            raise RecordProblem(f"caveats[{i}]", f"expected a sentence, found {_show(c)}")
    _check_numbers(rec)
    for key, shape in RECORD_SHAPES.items():
        if key in rec:
            _check_shape(rec[key], shape, key)
    _check_options(case)
    return notices


# The nested parts readers index into, as shapes: a type name, {key: shape} ("*": any key), a list
# ("list", shape) or several shapes a value may take; None is allowed everywhere (older records
# leave parts out). Checked so that a report, an export or the gate never meets a string where it
# does arithmetic, or a list where it calls .get.
_BYTES = ["num", ("list", "num")]
_POSITIVE_INT = "positive int"
_COMM_CHECK = {"expected_bytes": _BYTES, "measured_bytes": _BYTES, "ratio": "num", "ok": "bool"}
RECORD_SHAPES: dict[str, Any] = {
    "per_rank": (
        "list",
        {
            "coords": {"*": "int"},
            "comm": {
                "payload_bytes": "num",
                "wire_bytes": "num",
                "by_kind": {
                    "*": {"calls": "num", "payload_bytes": "num", "wire_bytes": "num", "dtypes": ("list", "any")}
                },
            },
            "memory": {"*": ["num", "str", "bool"]},
            "state_bytes": {"*": "num"},
            "telemetry": "dict",
            "pipeline": "dict",
            "step_times_s": ("list", "num"),
            "losses": ("list", "num"),
        },
    ),
    "model": {
        "name": "str",
        "params": {"total": "num", "*": ["num", "dict", "str", "bool"]},
        "flops_per_token": "num",
        "hw_flops_per_token": "num",
        "config": {
            "n_layers": _POSITIVE_INT,
            "d_model": _POSITIVE_INT,
            "n_heads": _POSITIVE_INT,
            "vocab_size": _POSITIVE_INT,
            "seq_len": _POSITIVE_INT,
            "mlp_ratio": _POSITIVE_INT,
            "n_experts": "int",
            "top_k": _POSITIVE_INT,
            "moe_every": _POSITIVE_INT,
        },
    },
    "theory": {
        "state_bytes": [{"*": _BYTES}, ("list", {"*": _BYTES})],
        "paper_state_bytes": _BYTES,
        "comm_payload_bytes": {"*": _BYTES},
        "comm_payload_bytes_per_rank": ("list", {"*": _BYTES}),
        "pipeline": "dict",
    },
    "checks": {
        "ok": "bool",
        "comm_ok": "bool",
        "state_ok": "bool",
        "allowance": "num",
        "comm": {"*": _COMM_CHECK},
        "comm_per_rank": ("list", {"*": _COMM_CHECK}),
        "state": ("list", {"*": {"expected_bytes": _BYTES, "measured_bytes": _BYTES, "ratio": "num", "ok": "bool"}}),
    },
    "topology": {"*": "int"},
    "loss_scale": ("list", "dict"),
    "launch": "dict",
}
_SCALARS = {"num": is_number, "int": lambda v: isinstance(v, int) and not isinstance(v, bool)}


def _shape_ok(value, shape, where: str) -> bool:
    """Whether ``value`` has ``shape``; raises RecordProblem from inside a matching container."""
    if value is None or shape == "any":
        return True
    if isinstance(shape, list):
        return any(_shape_ok(value, s, where) for s in shape if _matches_outer(value, s))
    if isinstance(shape, tuple):
        if not isinstance(value, list):
            return False
        for i, v in enumerate(value):
            _check_shape(v, shape[1], f"{where}[{i}]")
        return True
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return False
        for k, v in value.items():
            sub = shape.get(k, shape.get("*"))
            if v is None and k not in shape and isinstance(sub, dict):  # a row of a table: an object
                raise RecordProblem(f"{where}.{k}", "expected an object, found null")
            if sub is not None:
                _check_shape(v, sub, f"{where}.{k}")
        return True
    if shape == _POSITIVE_INT:  # a model dimension: up to 2**31, whatever model was measured
        return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 2**31
    if shape in _SCALARS:
        return _SCALARS[shape](value)
    return isinstance(value, {"str": str, "bool": bool, "dict": dict, "list": list}[shape])


# No count, size or byte figure of a training run comes near 2**63; a larger int is no measurement,
# and arithmetic on it ends in a float overflow somewhere downstream.
MAX_RECORD_INT = 2**63
# The sections whose numbers are what a launch measured: a NaN or inf there is an outcome (a loss
# that diverged) that readers show and the gate fails, not a damaged file.
MEASURED_SECTIONS = ("metrics", "per_rank", "loss_scale")


def _check_numbers(rec: dict) -> None:
    """Every int within MAX_RECORD_INT; outside the measured sections, every float finite and within it too."""
    stack = [(v, k) for k, v in rec.items()]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            stack += [(v, f"{where}.{k}") for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, f"{where}[{i}]") for i, v in enumerate(value)]
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= MAX_RECORD_INT:
            raise RecordProblem(where, f"{value:.3g} is beyond any count or byte figure (2**63)")
        elif isinstance(value, float) and not where.startswith(MEASURED_SECTIONS):
            if not math.isfinite(value):
                raise RecordProblem(where, f"not a finite number ({value})")
            if abs(value) >= MAX_RECORD_INT:
                raise RecordProblem(where, f"{value:.3g} is beyond any count or byte figure (2**63)")


def _matches_outer(value, shape) -> bool:
    """Whether ``value`` is the kind of thing ``shape`` describes at its top (list, dict or scalar)."""
    if isinstance(shape, tuple):
        return isinstance(value, list)
    if isinstance(shape, dict):
        return isinstance(value, dict)
    return True


def _check_shape(value, shape, where: str) -> None:
    if not _shape_ok(value, shape, where):
        raise RecordProblem(where, f"expected {_shape_name(shape)}, found {_show(value)}")


def _shape_name(shape) -> str:
    if isinstance(shape, list):
        return " or ".join(_shape_name(s) for s in shape)
    if isinstance(shape, tuple):
        return "a list"
    if isinstance(shape, dict):
        return "an object"
    return {"num": "a number", "int": "an int", _POSITIVE_INT: "an int from 1 to 2**31"}.get(shape, shape)


def _check_options(case: dict) -> None:
    """The case's options as its strategy reads them (types, ranges, finite numbers), where this
    parabench knows the strategy; a record of a strategy it no longer has keeps its options."""
    options = case.get("options")
    if not options:
        return
    try:
        from parabench.registry import STRATEGIES
    except ImportError:
        return
    spec = STRATEGIES.get(case["strategy"])
    if spec is None:
        return
    try:
        spec.options.parse(options, case["strategy"])
    except (TypeError, ValueError) as exc:
        raise RecordProblem("case.options", str(exc)) from None
