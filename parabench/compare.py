"""The regression gate: compare a candidate run with a baseline run, case by case.

Cases are matched by ``case_hash`` (the hash of the case spec and the strategy's version): only
like is compared with like (asv's rule). Cases present on one side only are listed, never
dropped silently. Every compared metric has a direction and a decision rule (asv, pytest-benchmark):

``timing``  tokens/s, tokens/s per device, MFU (higher is better) and the median step time
            (lower is better), tested at the LAUNCH level: one sample per torchrun launch (its
            median step time, or the figure derived from it), never the steps of one launch,
            which share that launch's allocator layout, NCCL channels and clocks and so say
            nothing about where the next launch lands. A case with ``repeats = N`` has N
            launch samples; the case-level figure is the median over them
            (``parabench.stats.combine_launches``). A regression needs BOTH

            - a change of the median of launch medians beyond ``threshold`` (default 3 %), AND
            - a one-sided Mann-Whitney U test on the launch samples with p <= ``alpha``
              (default 0.05), exact for untied samples.

            The smallest p that n and m launches can give is 1 / C(n+m, n): 0.05 for 3 vs 3
            (every candidate launch slower than every baseline launch), 0.014 for 4 vs 4, 0.004
            for 5 vs 5; 0.17 for 2 vs 2 and 0.5 for 1 vs 1. When that smallest p is above
            ``alpha`` the test cannot speak, and the noise model judges a change beyond the
            threshold (``parabench.noise.judge``; docs/gate.md): where both sides are GPU-bound,
            a change beyond the implementation's measured launch-to-launch spread (its 95th
            percentile, at least the 4 % that runs moved between each other) is a regression,
            one within it ``noise``; otherwise, or without a model (``--no-noise-model``, a CPU
            run), the change is ``unjudged``, never a regression. Cross-validated on the
            committed runs (one launch a side, each run left out in turn; the model's
            ``cross_validation``, tabled in docs/gate.md): no false alarm in 1,410 same-code launch
            pairs, a 10 % slowdown of a GPU-bound case caught in 490 of 490. An unjudged metric does not fail the gate unless ``--fail-unjudged`` is given
            (for a CI job that must not pass because someone ran with repeats = 1). A change
            within the threshold is ``same`` whatever the repeats.

            False-alarm rate (identical code, simulated with lognormal launch noise of the
            given coefficient of variation, 3 launches per side, the defaults; see
            tests/test_repeats.py): launch CV 1 %: 0.03 %; 2 %: 1.7 %; 5 %: 4.3 %; 30 %: 4.8 %.
            It never exceeds ``alpha`` per case and direction, whatever the distribution (the
            Mann-Whitney level is exact); the threshold pulls it far below that when the
            launch noise is small against it. Over K independent noisy cases the chance of at
            least one false alarm grows as 1 - (1 - rate)^K: a suite of 20 cases whose launches
            scatter by 5 % or more fails about 1 run in 2.5, so fix or exclude such cases (their
            CV is in the report) rather than widen the gate. Detection of a real 5 % slowdown
            with the defaults: 98 % at 1 % launch CV and 3 launches per side, 71 % at 2 %
            (89 % with 5 launches), about 25 % at 5 % (the noise then hides it).
            The threshold is 3 % rather than 5 % because a 5 % slowdown measured with noise
            lands below 5 % half of the time.
            The derived throughput figures are monotone in the launch's median step time, so
            they rank launches alike and share its verdict.
``exact``   model-state bytes (the largest rank's and every rank's), the peak of the bytes tensors
            requested from the CUDA allocator (``peak_requested_bytes``) and communication payload
            bytes (rank 0's instrumented step, total and per kind; every other rank's total):
            deterministic for a given code path, so ANY growth is a regression and any shrink is
            reported (with ``exact_only``, the CPU smoke gate, a ``mismatch`` that fails).
``loss``    the loss series of every step, held to ``LOSS_TOLERANCE`` of the device type: exact
            on CPU (same CPU model and torch build), 5 % on CUDA. Beyond it: ``mismatch``.
``valid``   a candidate figure no ok launch can have measured (a timing that is NaN, infinite,
            zero, negative or beyond the float range; a NaN, infinite or negative loss): a
            regression naming the metric, whatever the launch count (``impossible_values``).
``slack``   the CUDA allocator's block peak (``peak_alloc_bytes``): it counts whole blocks, and
            which cached block a tensor lands in depends on what ran before in the process, so the
            same code measured 2026-11-26 on H100 moved by up to 18.6 MiB between launches (and ref
            vs DeepSpeed ZeRO-2, with requested peaks 508 B apart, by 62 MiB). A regression is
            growth beyond ``ALLOCATOR_SLACK_BYTES``; smaller changes are reported as noise.
``noisy``   CPU peak RSS, the allocator's reserved peak and NVML's device-wide figure: the
            timing rule with ``mem_threshold`` (default 5 %) in place of ``threshold``. They move
            between launches of the same code (reserved and NVML by 10-13 % between the two
            h100x2 runs of 2026-11-26), so one launch per side cannot tell growth from noise:
            single-launch changes beyond the threshold are ``unjudged``.
``info``    the final loss: a change beyond ``INFO_TOLERANCE`` (0.1 %) is reported as ``changed``,
            never gated on; smaller ones are ``same``. GPU kernels are not bitwise
            deterministic: the same code's final loss moved by up to 4e-5 (relative) between
            the h100x2 runs of 2026-11-26, which printed to 4 digits reads "11.09 → 11.09".

A status change from ``ok`` to anything else (failed, oom, timeout, skipped) is a regression;
the reverse is an improvement. Exit status (``main``): 1 on any regression or on missing data
(``missing_data``: baseline cases or gated metrics the candidate lacks; ``--allow-missing``
accepts them), 0 otherwise, 2 on unreadable input. The closing line names which (``gate_verdict``):
REGRESSION, MISSING DATA and why (no case in common, or what the candidate lacks), or no regression,
never the last on a comparison that failed. Missing cases are counted in cases, as the summary counts.

This module reads result files only (``parabench.results``); the report imports it to build
its cross-run comparison table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from parabench import noise
from parabench.record import rank0_comm
from parabench.results import SchemaError, load_run
from parabench.stats import combine_launches, finite, launch_samples, mann_whitney_greater, smallest_p

# name, direction (+1 higher is better, -1 lower is better), rule, unit
METRICS: list[tuple[str, int, str, str]] = [
    ("tokens_per_s", +1, "timing", "tok/s"),
    ("tokens_per_s_per_device", +1, "timing", "tok/s"),
    ("step_time_s_median", -1, "timing", "s"),
    ("mfu", +1, "timing", ""),
    ("model_state_bytes_max", -1, "exact", "B"),
    ("peak_alloc_bytes", -1, "slack", "B"),
    ("peak_requested_bytes", -1, "exact", "B"),
    ("comm_payload_bytes", -1, "exact", "B"),
    ("peak_reserved_bytes", -1, "noisy", "B"),
    ("device_used_bytes", -1, "noisy", "B"),
    ("peak_rss_bytes", -1, "noisy", "B"),
    ("final_loss", -1, "info", ""),
]
STATUS_OK = "ok"
ALLOCATOR_SLACK_BYTES = 64 << 20
INFO_TOLERANCE = 1e-3  # relative; beyond it a 4-significant-digit display shows the change
# The loss series (``metrics.losses``, every step of warm-up and timed steps) by device type: the
# largest relative difference at any step that still counts as equal. CPU: 0, exact, when both runs
# name the same CPU model and torch build (the smoke suite's losses are bit-identical run to run
# there); on another CPU model or torch build 1 % (other vector kernels round otherwise, and bf16's
# step is 0.8 %). CUDA: GPU kernels are not bitwise deterministic; two launches of the same code
# moved by up to 1.9 % at one step (378 launch pairs of the committed runs, bf16), so only a gross
# change (wrong data, a lost gradient reduction, divergence) is caught there. Another device type:
# not gated (``final_loss`` stays informational).
LOSS_TOLERANCE = {"cpu": 0.0, "cpu on another platform": 0.01, "cuda": 0.05}
# Verdicts that fail the gate: a regression, and an exactly held figure that moved either way
# (``mismatch``: a loss series beyond its tolerance; any exact byte figure that moved, under
# ``exact_only``, the CPU smoke gate).
FAILING = ("regression", "mismatch")
# Figures that cannot be what an ok launch measured when they are not finite or not positive (loss:
# negative); the candidate fails on them, naming the metric, whatever its launch count.
POSITIVE_TIMINGS = ("tokens_per_s", "tokens_per_s_per_device", "step_time_s_median", "mfu")


# --- statistics: parabench.stats (no scipy: the gate must run wherever parabench does) --------

# --- the comparison ---------------------------------------------------------------------------


@dataclass
class MetricDelta:
    metric: str
    rule: str
    direction: int
    baseline: float | None
    candidate: float | None
    rel_change: float | None  # (candidate - baseline) / baseline
    verdict: str  # same | regression | mismatch | improvement | changed | noise | unjudged | n/a
    p_value: float | None = None
    note: str = ""


@dataclass
class CaseComparison:
    case_hash: str
    label: str
    baseline_status: str | None
    candidate_status: str | None
    verdict: str  # regression | mismatch | improvement | unjudged | same | only-baseline | only-candidate
    metrics: list[MetricDelta] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def case_as_dict(c: CaseComparison) -> dict:
    """``dataclasses.asdict`` without its deep copy (every field is a scalar, a string list or the
    list of MetricDelta): the gate builds one per case."""
    return {**vars(c), "metrics": [dict(vars(m)) for m in c.metrics], "notes": list(c.notes)}


def _number(v):
    """A metric value as the gate computes with it: ints stay ints (exact byte figures), an int
    beyond the float range becomes +-inf (so the change can be computed), anything that is not a
    number is None."""
    if type(v) is float:
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, int) and finite(v) is None:
        return math.inf if v > 0 else -math.inf
    return v


def _per_rank(record: dict) -> list[dict]:
    return [pr for pr in record.get("per_rank") or [] if isinstance(pr, dict)]


def _rank_of(pr: dict, i: int):
    r = pr.get("rank")
    return r if isinstance(r, int) and not isinstance(r, bool) else i


def metric_value(record: dict, name: str):
    """A metric of a record by the gate's name (a few live outside ``metrics``): rank 0's
    communication (``comm_payload_bytes``, ``comm_bytes[KIND]``), another rank's
    (``comm_payload_bytes[rank N]``), each rank's model state (``model_state_bytes[rank N]``: params,
    gradients and optimizer state it holds)."""
    m = record.get("metrics") if isinstance(record.get("metrics"), dict) else {}
    if "[" not in name and name != "comm_payload_bytes":
        return _number(m.get(name))
    comm = rank0_comm(record) if _per_rank(record) else None
    comm = comm if isinstance(comm, dict) else None
    if name == "comm_payload_bytes":
        return _number(comm.get("payload_bytes")) if comm else None
    if name.startswith("comm_bytes[") and name.endswith("]"):
        if not comm:
            return None
        return _number((comm.get("by_kind", {}).get(name[11:-1]) or {}).get("payload_bytes", 0))
    if "[rank " in name:
        return rank_figures(record).get(name)
    return _number(m.get(name))


def rank_figures(record: dict) -> dict:
    """Every rank's exact figures by the gate's name: ``comm_payload_bytes[rank N]`` for every rank
    but 0 (rank 0's is ``comm_payload_bytes``) and ``model_state_bytes[rank N]`` (the params,
    gradients and optimizer state the rank holds) for every rank that measured them."""
    out = {}
    for i, pr in enumerate(_per_rank(record)):
        rank = _rank_of(pr, i)
        comm, state = pr.get("comm"), pr.get("state_bytes")
        if rank != 0 and isinstance(comm, dict):
            out[f"comm_payload_bytes[rank {rank}]"] = _number(comm.get("payload_bytes"))
        if isinstance(state, dict):
            values = [_number(v) for v in state.values()]
            out[f"model_state_bytes[rank {rank}]"] = (
                sum(values) if values and all(v is not None for v in values) else None
            )
    return out


def _comm_kinds(*records: dict) -> list[str]:
    kinds: set[str] = set()
    for r in records:
        comm = rank0_comm(r) if _per_rank(r) else None
        if isinstance(comm, dict) and isinstance(comm.get("by_kind"), dict):
            kinds |= set(comm["by_kind"])
    return sorted(kinds)


def _rank_order(name: str) -> tuple:
    return name.split("[")[0], int(name.split(" ")[-1][:-1])


def _device_type(record: dict) -> str | None:
    return (record.get("device") or {}).get("type") if isinstance(record.get("device"), dict) else None


def compare_losses(base: dict, cand: dict, same_platform: bool = True) -> MetricDelta | None:
    """The loss series held to ``LOSS_TOLERANCE`` of the device (None when the records ran on
    different device types, the device has no tolerance, or a side has no series).
    ``same_platform``: both runs on one CPU model and torch build."""
    device = _device_type(base)
    if device == "cpu" and not same_platform:
        device = "cpu on another platform"
    tol = LOSS_TOLERANCE.get(device) if _device_type(base) == _device_type(cand) else None
    bl, cl = ((r.get("metrics") or {}).get("losses") for r in (base, cand))
    if tol is None or not isinstance(bl, list) or not isinstance(cl, list) or not bl:
        return None
    d = MetricDelta("losses", "loss", 0, len(bl), len(cl), None, "same")
    d.baseline, d.candidate = _number(bl[-1]), _number(cl[-1])
    if len(bl) != len(cl):
        d.verdict, d.note = "mismatch", f"{len(bl)} losses in the baseline, {len(cl)} in the candidate"
        return d
    worst, at = 0.0, None
    for k, (b, c) in enumerate(zip(bl, cl)):
        b, c = _number(b), _number(c)
        if b is None and c is None:
            continue  # a step neither side recorded (a pipeline rank without the loss)
        if b is None or c is None or not (math.isfinite(b) and math.isfinite(c)):
            if b != c:
                worst, at = math.inf, k
            continue
        rel = abs(c - b) / abs(b) if b else (0.0 if c == b else math.inf)
        if rel > worst:
            worst, at = rel, k
    d.rel_change = worst if worst != math.inf else None
    if worst > tol:
        d.verdict = "mismatch"
        limit = "exactly equal" if tol == 0 else f"within {tol:.0%}"
        d.note = (
            f"step {at}: {_fmt(_number(bl[at]))} -> {_fmt(_number(cl[at]))} (loss series on {device} must be {limit}: "
            f"the same strategy version computes the same losses)"
        )
    return d


def impossible_values(record: dict) -> list[MetricDelta]:
    """What an ok record cannot have measured: a timing figure (tokens/s, step time, MFU) of any of
    its launches that is not a finite positive number, or a final loss or loss series entry that is
    NaN, infinite or negative. One failing MetricDelta per metric, naming launch or step."""
    if record.get("status") != STATUS_OK:
        return []
    metrics = record.get("metrics") if isinstance(record.get("metrics"), dict) else {}
    launches = (
        record.get("launches") if isinstance(record.get("launches"), list) else [{"status": STATUS_OK, **metrics}]
    )
    out = []
    for name in POSITIVE_TIMINGS:
        for k, launch in enumerate(launches):
            if not isinstance(launch, dict) or launch.get("status") != STATUS_OK or launch.get(name) is None:
                continue
            v = launch[name]
            if finite(v) is None or finite(v) <= 0:
                where = f"launch {launch.get('repeat', k)}" if len(launches) > 1 else "the launch"
                out.append(_impossible(name, v, f"{where} recorded {_fmt_raw(v)}: not a finite positive number"))
                break
    losses = [("final_loss", launch.get("final_loss")) for launch in launches if isinstance(launch, dict)]
    losses.append(("final_loss", metrics.get("final_loss")))
    bad = next((v for _, v in losses if v is not None and (finite(v) is None or finite(v) < 0)), None)
    if bad is not None:
        out.append(_impossible("final_loss", bad, f"recorded {_fmt_raw(bad)}: a loss is a finite non-negative number"))
    series = metrics.get("losses") if isinstance(metrics.get("losses"), list) else []
    steps = [k for k, v in enumerate(series) if v is not None and (finite(v) is None or finite(v) < 0)]
    if steps:
        out.append(
            _impossible(
                "losses",
                series[steps[0]],
                f"{len(steps)} of {len(series)} steps recorded a loss that is not a finite non-negative number "
                f"(first: step {steps[0]}, {_fmt_raw(series[steps[0]])})",
            )
        )
    return out


def _impossible(name: str, value, note: str) -> MetricDelta:
    return MetricDelta(
        name, "valid", 0, None, _number(value) if _number(value) is not None else None, None, "regression", note=note
    )


def _fmt_raw(v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and finite(v) is None:
        return f"an integer of {len(str(abs(v)))} digits"
    return repr(v)


def _launch_test(name: str, base: dict, cand: dict, cand_larger: bool, alpha: float) -> tuple[float | None, str]:
    """One-sided p of "the candidate's launch values are larger" (``cand_larger``) or smaller,
    over the launch samples; (None, why) when the launch counts cannot reach ``alpha``."""
    b, c = launch_samples(base, name), launch_samples(cand, name)
    if smallest_p(len(b), len(c)) > alpha:
        return None, (
            f"not enough repeats to judge: {len(b)} vs {len(c)} launches (the launch-level test needs "
            f"a smallest possible p <= {alpha}: 3 launches per side at 0.05)"
        )
    return (mann_whitney_greater(c, b) if cand_larger else mann_whitney_greater(b, c)), ""


def compare_metric(
    name: str,
    direction: int,
    rule: str,
    base: dict,
    cand: dict,
    *,
    threshold: float,
    mem_threshold: float,
    alpha: float,
    noise_model: dict | None = None,
    exact_only: bool = False,
    values: tuple | None = None,
) -> MetricDelta:
    """One metric's verdict; ``values``: (baseline, candidate) where the caller has them already."""
    bv, cv = values if values is not None else (metric_value(base, name), metric_value(cand, name))
    if bv is None or cv is None:
        return MetricDelta(
            name,
            rule,
            direction,
            bv,
            cv,
            None,
            "n/a" if bv is None and cv is None else "changed",
            note="" if bv is None and cv is None else "measured on one side only",
        )
    rel = _relative(bv, cv)
    worse = (cv - bv) * direction < 0 if cv == cv and bv == bv else True
    d = MetricDelta(name, rule, direction, bv, cv, rel, "same")
    if rule == "exact":
        if cv != bv:
            d.verdict = "regression" if worse else ("mismatch" if exact_only else "improvement")
            d.note = f"{cv - bv:+,} bytes" if isinstance(cv, int) and isinstance(bv, int) else ""
            if exact_only and not worse:
                d.note += " (exact figures must not move either way: update the baseline deliberately)"
        return d
    if rule == "slack":
        if cv != bv:
            beyond = abs(cv - bv) > ALLOCATOR_SLACK_BYTES
            d.verdict = ("regression" if worse else "improvement") if beyond else "noise"
            d.note = f"{cv - bv:+,} bytes" + (
                "" if beyond else f" (within the allocator's {ALLOCATOR_SLACK_BYTES >> 20} MiB slack)"
            )
        return d
    if rule == "info":
        both_nan = cv != cv and bv != bv
        if not (cv == bv or both_nan or abs(rel) <= INFO_TOLERANCE):  # NaN against a number: changed
            d.verdict = "changed"
        return d
    # timing and noisy memory: threshold AND a significant launch-level test
    if rel == rel and abs(rel) <= (mem_threshold if rule == "noisy" else threshold):
        return d
    p, why = _launch_test(name, base, cand, cand_larger=cv > bv, alpha=alpha)
    d.p_value = p
    judged = noise.judge(noise_model, base, cand, name, direction) if p is None and rule == "timing" else None
    if judged is not None:
        d.verdict, d.note = judged
    elif p is None:
        d.verdict = "unjudged"
        d.note = why
    elif p <= alpha:
        d.verdict = "regression" if worse else "improvement"
    else:
        d.verdict = "noise"
        d.note = f"beyond the threshold but not significant over launches (p={p:.3g} > {alpha})"
    return d


def _relative(bv, cv) -> float:
    """(cv - bv) / |bv| without overflow (huge ints) or a crash (NaN, inf); NaN where undefined."""
    try:
        if bv:
            return (cv - bv) / abs(bv)
        return 0.0 if cv == bv else math.copysign(math.inf, cv - bv)
    except (OverflowError, ZeroDivisionError, ValueError):
        fb, fc = float(bv) if finite(bv) is not None else bv, float(cv) if finite(cv) is not None else cv
        try:
            return (fc - fb) / abs(fb) if fb else math.nan
        except (OverflowError, ZeroDivisionError, TypeError, ValueError):
            return math.nan


DEFAULT_THRESHOLD = 0.03
DEFAULT_MEM_THRESHOLD = 0.05
DEFAULT_ALPHA = 0.05
TEST_NAME = (
    "one-sided Mann-Whitney U on launch medians (one sample per launch) and the threshold "
    "on the median of launch medians"
)


def compare_records(
    base: dict | None,
    cand: dict | None,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    mem_threshold: float | None = None,
    alpha: float = DEFAULT_ALPHA,
    noise_model: dict | None = None,
    exact_only: bool = False,
    same_platform: bool = True,
) -> CaseComparison:
    """Compare two case-level records (``parabench.stats.combine_launches``: one per case hash).
    ``noise_model`` (``parabench.noise``) judges timings the launch counts cannot. ``exact_only``
    compares statuses and the deterministic figures only (loss series, communication and
    model-state bytes, requested peak) and fails them when they moved either way: the CPU smoke
    gate, whose timings and RSS move with whatever else runs on the machine."""
    mem_threshold = DEFAULT_MEM_THRESHOLD if mem_threshold is None else mem_threshold
    ref = base or cand
    out = CaseComparison(
        ref["case_hash"], ref.get("label", ""), base and base.get("status"), cand and cand.get("status"), "same"
    )
    if base is None:
        out.verdict = "only-candidate"
        return out
    if cand is None:
        out.verdict = "only-baseline"
        return out
    bs, cs = base.get("status"), cand.get("status")
    if bs != cs:
        out.notes.append(f"status {bs} -> {cs}")
        if bs == STATUS_OK:
            out.verdict = "regression"
            return out
        if cs == STATUS_OK:
            out.verdict = "improvement"
            return out
    if bs != STATUS_OK or cs != STATUS_OK:
        return out
    impossible = impossible_values(cand)
    for d in impossible:
        d.baseline = metric_value(base, "final_loss" if d.metric == "losses" else d.metric)
    bd, cd = (base.get("device") or {}).get("name"), (cand.get("device") or {}).get("name")
    if bd != cd:
        out.notes.append(f"different devices: {bd} vs {cd}; timings are not comparable")
    names = [(n, d, r) for n, d, r, _ in METRICS]
    names += [(f"comm_bytes[{k}]", -1, "exact") for k in _comm_kinds(base, cand)]
    brank, crank = rank_figures(base), rank_figures(cand)
    names += [(n, -1, "exact") for n in sorted(brank.keys() | crank.keys(), key=_rank_order)]
    failed = {d.metric for d in impossible}
    out.metrics += impossible
    for name, direction, rule in names:
        if name in failed or (exact_only and rule != "exact"):
            continue
        d = compare_metric(
            name,
            direction,
            rule,
            base,
            cand,
            threshold=threshold,
            mem_threshold=mem_threshold,
            alpha=alpha,
            noise_model=noise_model,
            exact_only=exact_only,
            values=(brank.get(name), crank.get(name)) if "[rank " in name else None,
        )
        if d.verdict != "n/a":
            out.metrics.append(d)
    losses = None if "losses" in failed else compare_losses(base, cand, same_platform)
    if losses is not None:
        out.metrics.append(losses)
    verdicts = {d.verdict for d in out.metrics}
    out.verdict = next((v for v in (*FAILING, "improvement", "unjudged") if v in verdicts), "same")
    nb, nc = ((r.get("launch_stats") or {}).get("n") for r in (base, cand))
    if nb is not None and nc is not None:
        out.notes.append(f"launches {nb} vs {nc}")
    return out


def compare_runs(
    baseline: tuple[dict, list[dict]],
    candidate: tuple[dict, list[dict]],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    mem_threshold: float | None = None,
    alpha: float = DEFAULT_ALPHA,
    fail_unjudged: bool = False,
    noise_model: dict | None = None,
    exact_only: bool = False,
) -> dict:
    """The whole comparison as plain data (what ``--json`` writes). Takes runs as ``load_run``
    gives them (one record per launch) and compares them case by case. ``regression`` is true on
    any regression, and with ``fail_unjudged`` also on any timing change the launches cannot judge."""
    (bm, brecs), (cm, crecs) = baseline, candidate
    brecs, crecs = combine_launches(brecs), combine_launches(crecs)
    same_platform = _platform(bm) == _platform(cm)
    bmap = {r["case_hash"]: r for r in brecs}
    cmap = {r["case_hash"]: r for r in crecs}
    hashes = sorted(set(bmap) | set(cmap), key=lambda h: ((bmap.get(h) or cmap.get(h)).get("label", ""), h))
    cases = [
        compare_records(
            bmap.get(h),
            cmap.get(h),
            threshold=threshold,
            mem_threshold=mem_threshold,
            alpha=alpha,
            noise_model=noise_model,
            exact_only=exact_only,
            same_platform=same_platform,
        )
        for h in hashes
    ]
    counts: dict[str, int] = {}
    for c in cases:
        counts[c.verdict] = counts.get(c.verdict, 0) + 1
    notes = []
    bdev = [d.get("name") for d in bm.get("devices", [])]
    cdev = [d.get("name") for d in cm.get("devices", [])]
    if bdev != cdev:
        notes.append(f"the runs used different devices ({bdev} vs {cdev})")
    if not same_platform:
        notes.append(
            f"the runs used different CPU models or torch builds ({_platform(bm)} vs {_platform(cm)}): CPU loss "
            f"series are held to {LOSS_TOLERANCE['cpu on another platform']:.0%}, not exactly"
        )
    if counts.get("unjudged"):
        notes.append(
            f"{counts['unjudged']} case(s) changed beyond the threshold with too few launches to judge"
            + ("" if noise_model else " and no noise model")
            + "; run both sides with repeats >= 3 (suite [suite] repeats = 3, or run case --repeats 3)"
        )
    for side, recs in (("baseline", brecs), ("candidate", crecs)):
        slowed = sorted({r["debug_slowdown"] for r in recs if r.get("debug_slowdown")})
        if slowed:
            notes.append(
                f"the {side} ran with a deliberate debug slowdown (PARABENCH_DEBUG_SLOWDOWN = "
                f"{', '.join(f'{x:g}' for x in slowed)}): its timings are not the code's"
            )
    return {
        "baseline": {"suite": bm.get("suite"), "run_id": bm.get("run_id"), "git": bm.get("git"), "devices": bdev},
        "candidate": {"suite": cm.get("suite"), "run_id": cm.get("run_id"), "git": cm.get("git"), "devices": cdev},
        "settings": {
            "threshold": threshold,
            "mem_threshold": DEFAULT_MEM_THRESHOLD if mem_threshold is None else mem_threshold,
            "alpha": alpha,
            "test": TEST_NAME,
            "fail_unjudged": fail_unjudged,
            "noise_model": bool(noise_model),
            "exact_only": exact_only,
            "loss_tolerance": LOSS_TOLERANCE,
        },
        "counts": counts,
        "common": len(bmap.keys() & cmap.keys()),
        "regression": any(counts.get(v, 0) for v in FAILING) or (fail_unjudged and counts.get("unjudged", 0) > 0),
        "notes": notes,
        "cases": [case_as_dict(c) for c in cases],
    }


def _platform(manifest: dict) -> tuple:
    """What decides a CPU's rounding: its model and the torch build."""
    host = manifest.get("host") if isinstance(manifest.get("host"), dict) else {}
    versions = manifest.get("versions") if isinstance(manifest.get("versions"), dict) else {}
    return host.get("cpu_model"), versions.get("torch")


def missing_data(baseline: tuple[dict, list[dict]], candidate: tuple[dict, list[dict]]) -> list[str]:
    """What the candidate lacks that the baseline has: a gate that compares nothing must not pass.
    Baseline cases absent from the candidate (a candidate of 0 cases, another suite), and
    candidate records whose status is ok but that carry no metrics, or lack a gated metric the
    baseline measured."""
    (_, brecs), (_, crecs) = baseline, candidate
    cmap = {r.get("case_hash"): r for r in crecs}
    problems = []
    if not brecs:
        problems.append("the baseline has no cases: nothing to compare")
    if not crecs:
        problems.append("the candidate has no cases")
    # Counted in cases, as the summary counts them: a case of 3 launches is one case, not three.
    bcases = list({r.get("case_hash"): r for r in brecs}.values())
    absent = [r.get("label") or r.get("case_hash") for r in bcases if r.get("case_hash") not in cmap]
    if absent and crecs:
        matched = len(bcases) - len(absent)
        clabels = {r.get("label") for r in crecs}
        renamed = sum(label in clabels for label in absent)
        why = (
            f"{renamed} of them under a label the candidate holds with another case hash: "
            "a case field or the strategy's version changed"
            if renamed
            else "another suite or changed case hashes?"
        )
        problems.append(
            f"{len(absent)} of {len(bcases)} baseline cases are not in the candidate"
            + (f" (no case in common: {why})" if not matched else f" ({why})" if renamed else "")
            + ": "
            + ", ".join(map(str, absent[:5]))
            + (", ..." if len(absent) > 5 else "")
        )
    elif absent:
        problems.append(f"all {len(bcases)} baseline cases are missing from the candidate")
    gated = [name for name, _, rule, _ in METRICS if rule != "info"]
    for base in brecs:
        cand = cmap.get(base.get("case_hash"))
        if cand is None or cand.get("status") != STATUS_OK:
            continue  # a status change is the comparison's own verdict
        label = cand.get("label") or cand.get("case_hash")
        if not isinstance(cand.get("metrics"), dict) or not cand["metrics"]:
            problems.append(f"{label}: status ok but the candidate record has no metrics")
            continue
        if base.get("status") == STATUS_OK:
            lost = [n for n in gated if metric_value(base, n) is not None and metric_value(cand, n) is None]
            if lost:
                problems.append(f"{label}: the candidate lacks {', '.join(lost)} (measured in the baseline)")
    return list(dict.fromkeys(problems))  # a case's launches that lack the same figure: one problem


# --- output -----------------------------------------------------------------------------------


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 1e3:  # as integers print: 5,322 beside 10,936, not 5322
            return f"{v:,.0f}"
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _rows(result: dict, everything: bool = False) -> list[list[str]]:
    rows = []
    for c in result["cases"]:
        if c["verdict"] in ("only-baseline", "only-candidate"):
            rows.append([c["label"], "", c["verdict"], "", "", "", "", c["case_hash"]])
            continue
        shown = [m for m in c["metrics"] if everything or m["verdict"] not in ("same",)]
        if not shown:
            rows.append([c["label"], "", c["verdict"], "", "", "", "", "; ".join(c["notes"])])
        for m in shown:
            rel = "" if m["rel_change"] is None else f"{m['rel_change'] * 100:+.2f}%"
            p = "" if m["p_value"] is None else f"{m['p_value']:.3g}"
            rows.append(
                [
                    c["label"],
                    m["metric"],
                    m["verdict"],
                    _fmt(m["baseline"]),
                    _fmt(m["candidate"]),
                    rel,
                    p,
                    "; ".join(x for x in [m["note"], *c["notes"]] if x),
                ]
            )
    return rows


HEADER = ["case", "metric", "verdict", "baseline", "candidate", "change", "p", "note"]


def format_table(result: dict, everything: bool = False) -> str:
    rows = [HEADER] + _rows(result, everything)
    widths = [min(max(len(r[i]) for r in rows), 60) for i in range(len(HEADER))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(cell[:60].ljust(w) for cell, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _summary(result: dict) -> str:
    b, c = result["baseline"], result["candidate"]
    s = result["settings"]
    if result.get("common", 1) == 0:
        only = result["counts"]
        counts = (
            f"no case in common, nothing compared ({only.get('only-baseline', 0)} baseline cases, "
            f"{only.get('only-candidate', 0)} candidate cases)"
        )
    else:
        counts = ", ".join(f"{v} {k}" for k, v in sorted(result["counts"].items()))
    return (
        f"baseline {b['suite']}/{b['run_id']} vs candidate {c['suite']}/{c['run_id']}: {counts} "
        f"(threshold {s['threshold'] * 100:g}%, memory {s['mem_threshold'] * 100:g}%, alpha {s['alpha']})"
    )


def gate_verdict(result: dict, allow_missing: bool = False) -> tuple[str, int]:
    """The gate's one closing line and its exit status. A comparison that failed for missing data
    never reads "no regression": it compared less than the baseline holds, so it cannot vouch for it."""
    missing = result.get("missing") or []
    if result["regression"]:
        return "REGRESSION", 1
    if missing and not allow_missing:
        what = (
            "no case in common, nothing was compared (another suite, or changed case hashes?)"
            if result.get("common", 1) == 0
            else f"the candidate lacks what the baseline measured ({len(missing)} "
            f"problem{'s' if len(missing) != 1 else ''}, listed above)"
        )
        return f"MISSING DATA: {what}; --allow-missing accepts that", 1
    if result.get("common", 1) == 0:
        return "nothing compared: no case in common (allowed by --allow-missing)", 0
    return "no regression", 0


def format_markdown(result: dict) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    out = ["## parabench compare", "", esc(_summary(result)), ""]
    out += [f"> {esc(n)}" for n in result["notes"]]
    verdict = result.get("verdict") or gate_verdict(result)[0]
    if verdict != "no regression":
        verdict = f"**{verdict}**"
    out += [f"Result: {esc(verdict)}", "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in _rows(result):
        out.append("| " + " | ".join(esc(x) for x in r) + " |")
    return "\n".join(out) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("baseline", help="baseline run folder (with manifest.json)")
    p.add_argument("candidate", help="candidate run folder")
    p.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help="relative change of the median of launch medians that counts for timings (default 3%%)",
    )
    p.add_argument(
        "--mem-threshold",
        type=float,
        default=None,
        help="relative growth that counts for noisy memory figures (peak RSS, reserved, NVML); default 5%%",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=DEFAULT_ALPHA,
        help="level of the launch-level timing test (default 0.05; 3 launches per side reach it exactly)",
    )
    p.add_argument(
        "--fail-unjudged",
        action="store_true",
        help="exit 1 also when a timing changed beyond the threshold with too few launches to judge",
    )
    p.add_argument(
        "--noise-model",
        default=None,
        help="noise model that judges single-launch timings (default: results/baselines/noise-model.json "
        "where it exists; parabench noise-model rebuilds it)",
    )
    p.add_argument(
        "--no-noise-model",
        action="store_true",
        help="judge timings by the launch-level test only (fewer than 3 launches a side: unjudged)",
    )
    p.add_argument(
        "--exact-only",
        action="store_true",
        help="compare statuses and deterministic figures only (loss series, communication and model-state bytes) "
        "and fail any move of them, either way: the CPU smoke gate (a change comes with a deliberately updated "
        "baseline)",
    )
    p.add_argument("--json", help="write the comparison as JSON here")
    p.add_argument("--markdown", help="write the comparison as a Markdown table here")
    p.add_argument("--all", action="store_true", help="print unchanged metrics too")
    p.add_argument(
        "--allow-missing",
        action="store_true",
        help="pass even when the candidate lacks baseline cases or metrics (by default that exits 1)",
    )


def main(args) -> int:
    try:
        base = load_run(args.baseline)
        cand = load_run(args.candidate)
        model = None if getattr(args, "no_noise_model", False) else noise.load(getattr(args, "noise_model", None))
    except (FileNotFoundError, SchemaError, json.JSONDecodeError, KeyError, ValueError) as exc:
        print(f"parabench compare: error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "noise_model", None) and model is None:
        print(f"parabench compare: error: no noise model at {args.noise_model}", file=sys.stderr)
        return 2
    result = compare_runs(
        base,
        cand,
        threshold=args.threshold,
        mem_threshold=getattr(args, "mem_threshold", None),
        alpha=getattr(args, "alpha", DEFAULT_ALPHA),
        fail_unjudged=getattr(args, "fail_unjudged", False),
        noise_model=model,
        exact_only=getattr(args, "exact_only", False),
    )
    allow_missing = getattr(args, "allow_missing", False)
    result["missing"] = missing_data(base, cand)
    result["notes"] += [f"missing data{' (allowed)' if allow_missing else ''}: {m}" for m in result["missing"]]
    result["verdict"], status = gate_verdict(result, allow_missing)
    print(_summary(result))
    for n in result["notes"]:
        print(f"note: {n}")
    print(format_table(result, everything=getattr(args, "all", False)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(format_markdown(result))
    if result["regression"] and result["missing"] and not allow_missing:
        print(f"parabench compare: {gate_verdict({**result, 'regression': False})[0]}", file=sys.stderr)
    missing_failed = result["verdict"].startswith("MISSING DATA")
    print(f"parabench compare: {result['verdict']}", file=sys.stderr if missing_failed else sys.stdout)
    return status


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="python -m parabench.compare", description="regression gate")
    add_arguments(_p)
    sys.exit(main(_p.parse_args()))
