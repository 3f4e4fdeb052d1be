"""Fit the planner's device constants from committed GPU runs.

Observations are configurations, not records: every record of one configuration (same model,
shape, strategy, options that change the run, recipe, batch, GPU count; meter options ignored)
is one observation whose step time and peak are the medians over its records. Collective costs
come from the collectives suite (``results/collectives-gpu``): alpha-beta per op, nccl-tests bus
bandwidth. The rest is a weighted (relative-error) non-negative least-squares fit of the few
constants in ``parabench.plan.model``; implementation factors are fitted last, from the residuals
of each implementation's own configurations, shrunk toward "no difference".

    parabench calibrate [--gpu h100-80g] (parabench.plan.check.calibrate_main)
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from parabench.plan import attention
from parabench.plan import model as M
from parabench.plan.least_squares import nnls
from parabench.plan.workload import config_options, from_record
from parabench.results import host_shared

SCHEMA_VERSION = 1
CALIBRATION_DIR = Path(__file__).resolve().parents[2] / "results" / "calibration"
# Device kinds: the substring of the CUDA device name, its dense bf16 peak (parabench.hardware).
DEVICE_KINDS = {"h100": ("H100", 989.4e12), "h200": ("H200", 989.4e12), "a100": ("A100", 312e12)}
# The large-GEMM ceiling R is measured, not fitted: fitted freely it trades against the per-layer
# host term and lands above the vendor peak. bf16 8192^3 matmul on the 2x H100 machine
# (docs/facts.md: about 790 TFLOP/s per GPU).
MATMUL_CEILING = {"h100": 790e12, "h200": 790e12}
# Parts predicted from another part's calibration until runs of their own calibrate them: the same
# architecture (SMs, clocks, tensor cores: the same dense bf16 peak), NVLink generation, kernels and
# allocator, with other HBM. The memory-bound time constants change by the ratio of the parts' HBM
# speeds: the datasheets' (H100 SXM 3.35 TB/s HBM3, H200 4.8 TB/s HBM3e), or the one the part's own
# records show where it has enough (``fit_hbm_ratio``); the collectives' and every memory constant
# carry over (H100 and H200 records of one configuration peak at the same byte count). The host is
# another machine: the per-tensor host costs of the libraries that wait on it are refitted from the
# part's own records where they show it (``refit_host``), on the derived device times; the H200
# hosts ran DeepSpeed's and FSDP2's hooks 12 % faster at the median.
DERIVED_FROM = {"h200": "h100"}
HBM_BYTES_PER_S = {"h100": 3.35e12, "h200": 4.8e12}


# Records that do not measure what their configuration says, and folders of copies: each with its
# reason, kept as data beside the calibrations.
EXCLUSIONS_FILE = CALIBRATION_DIR / "excluded.toml"


@functools.cache
def exclusions(path: Path = EXCLUSIONS_FILE) -> dict:
    """``{"run": [...], "case": [...], "folder": [...]}`` of ``path``, each entry with its ``reason``."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    unknown = set(data) - {"run", "case", "folder"}
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {sorted(unknown)}; valid: run, case, folder")
    for kind, keys in (("run", {"path"}), ("case", {"run", "strategy_prefix"}), ("folder", {"name"})):
        for entry in data.setdefault(kind, []):
            if not isinstance(entry.get("reason"), str) or not entry["reason"] or not keys <= set(entry):
                raise ValueError(f"{path}: every [[{kind}]] needs {', '.join(sorted(keys))} and a reason: {entry}")
    return data


def excluded(run: str, strategy: str) -> str | None:
    """Why a record of ``run`` (a path ending in suite/run_id) is left out, or None."""
    data = exclusions()
    for folder in data["folder"]:
        if Path(run).parent.name == folder["name"]:
            return folder["reason"]
    for entry in data["run"]:
        if run.endswith(entry["path"]):
            return entry["reason"]
    for entry in data["case"]:
        if run.endswith(entry["run"]) and strategy.startswith(entry["strategy_prefix"]):
            return entry["reason"]
    return None


class CalibrationError(RuntimeError):
    pass


def device_kind(name: str | None) -> str | None:
    """``h100`` for "NVIDIA H100 80GB HBM3"; None for a CPU or an unknown device."""
    if not name or "PCIe" in name:
        return None
    for kind, (sub, _) in DEVICE_KINDS.items():
        if sub in name:
            return kind
    return None


@dataclass
class Observation:
    key: str
    workload: M.Workload
    step_s: float
    peak_bytes: float | None
    runs: list = field(default_factory=list)
    n_records: int = 0
    run_steps: dict = field(default_factory=dict)  # run -> median step of its records (one launch each)
    launch_steps: list = field(default_factory=list)  # every record's median step (one launch each)


def config_key(record: dict) -> str:
    c = record["case"]
    layout = c.get("layout") or ((record.get("model") or {}).get("config") or {}).get("layout") or "separate"
    # versions of a strategy that run different code (ref.pp_zb 1 and 2) are different configurations
    version = M.modelled_version(c.get("strategy") or "", record.get("strategy_version"))
    # the default layout (and a version the model does not tell apart) adds nothing, so keys of the
    # records before layouts and versions existed stay as they were
    return json.dumps(
        ([] if layout == "separate" else [layout])
        + ([] if version is None else [f"v{version}"])
        + [
            c.get("model"),
            c.get("seq_len") or (record.get("model") or {}).get("config", {}).get("seq_len"),
            c.get("world_size"),
            c.get("precision"),
            _recipe(c),
            c.get("micro_batch"),
            c.get("grad_accum") or 1,
            c.get("strategy"),
            config_options(c.get("options")),
        ],
        sort_keys=True,
    )


def _recipe(case: dict):
    from parabench.registry import recipe_of

    return recipe_of(case)


# Why a shared host's records stay out: the neighbours' streams share the host's CPU cores, PCIe
# and NVMe (and, for NVLink collectives, nothing isolates them), so a step measures the contention
# as much as the configuration; the planner predicts a host that runs one job.
HOST_SHARED_REASON = (
    "ran beside other streams on the same host (manifest env PARABENCH_HOST_SHARED): contended CPU, PCIe, NVMe"
)


def _runs(results_dir):
    """(run name, manifest, records) of every run folder below ``results_dir``."""
    from parabench.results import load_run

    root = Path(results_dir)
    for manifest_path in sorted(root.rglob("manifest.json")):
        run = manifest_path.parent
        if not (run / "cases").is_dir():
            continue
        manifest, records = load_run(run)
        yield str(run.relative_to(root.parent) if root.parent in run.parents else run), manifest, records


def gpu_records(results_dir, kind: str = "h100"):
    """(run dir, record) of every ok record of device ``kind`` below ``results_dir``, from runs
    that had their host to themselves (``host_shared``)."""
    for run, manifest, records in _runs(results_dir):
        if host_shared(manifest):
            continue
        for r in records:
            if r.get("status") != "ok" or device_kind((r.get("device") or {}).get("name")) != kind:
                continue
            yield run, r


def left_out_runs(results_dir, kind: str = "h100") -> dict[str, str]:
    """Runs with records of device ``kind`` that the calibration leaves out whole, with the reason."""
    out = {}
    for run, manifest, records in _runs(results_dir):
        if not any(device_kind((r.get("device") or {}).get("name")) == kind for r in records):
            continue
        why = (HOST_SHARED_REASON if host_shared(manifest) else None) or excluded(run, "")
        if why:
            out[run] = why
    return out


def observations(results_dir="results", kind: str = "h100") -> list[Observation]:
    by_key: dict[str, list] = {}
    for run, r in gpu_records(results_dir, kind):
        m = r.get("metrics") or {}
        if not m.get("step_time_s_median"):
            continue
        w = from_record(r)
        if w is None or w.unmodelled or excluded(run, r["case"].get("strategy") or ""):
            continue
        by_key.setdefault(config_key(r), []).append((run, r, w))
    out = []
    for key, items in sorted(by_key.items()):
        steps_by_run: dict[str, list[float]] = {}
        for run, r, _ in items:
            steps_by_run.setdefault(run, []).append(r["metrics"]["step_time_s_median"])
        peaks = [r["metrics"].get("peak_alloc_bytes") for _, r, _ in items if r["metrics"].get("peak_alloc_bytes")]
        out.append(
            Observation(
                key,
                items[0][2],
                statistics.median(s for steps in steps_by_run.values() for s in steps),
                statistics.median(peaks) if peaks else None,
                sorted(steps_by_run),
                len(items),
                {run: statistics.median(steps) for run, steps in steps_by_run.items()},
                [s for steps in steps_by_run.values() for s in steps],
            )
        )
    return out


# A trainer whose launches of one configuration differ by more than this is named beside a plan.
ERRATIC_LAUNCH_SPREAD = 0.05


def launch_spread(obs: list[Observation]) -> dict:
    """Per implementation, how far its launches of one configuration lie apart ((slowest - fastest) /
    mean step), over the configurations it ran twice or more: the median, the largest and how many.
    The model predicts one step time per configuration; this says how far a launch may land from it."""
    spreads: dict[str, list[float]] = {}
    for o in obs:
        if len(o.launch_steps) >= 2:
            steps = o.launch_steps
            spreads.setdefault(o.workload.impl, []).append((max(steps) - min(steps)) / statistics.fmean(steps))
    return {
        impl: {"configurations": len(v), "median": statistics.median(v), "max": max(v)}
        for impl, v in sorted(spreads.items())
    }


# --- collectives ----------------------------------------------------------------------------------


# The collectives bench's rows of calls enqueued back to back (``burst_calls``), one row per call's share.
QUEUED_ALGORITHM = "backend_burst"


def _alpha_beta(pts: list) -> tuple[float, float]:
    """alpha (s) and beta (s/B) of t = alpha + beta * bytes, least squares on relative error."""
    b = np.array([p[0] for p in pts], float)
    t = np.array([p[1] for p in pts], float)
    a = np.stack([np.ones_like(b), b], 1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 1e-15)


def fit_collectives(results_dir="results", kind: str = "h100") -> dict:
    """alpha (s) and bus bandwidth (B/s) per op and group size from the backend rows of the
    collectives suite, fitted on relative error so small and large messages both count. The rows of
    every run at one group size are pooled. Each op's top level holds its largest group size's fit
    (what a group larger than any measured gets) and ``by_group`` every measured size's:
    NCCL's bus bandwidth grows with the group on one NVSwitch host (collectives-h100x4: all-gather of
    128 MiB at 173 GB/s over 2 ranks, 242 over 4), so one size's constants would misprice the other.

    A call queued behind others (rows "backend_burst": calls enqueued back to back, as a bucket loop
    issues them) costs less than an isolated one: ``alpha_queued_s`` and ``busbw_queued_Bps`` are
    fitted from those rows. Where ``kind`` has none at a group size, the queued-to-isolated ratios
    measured on another kind at that size are applied to this kind's isolated fit (the same NVLink
    generation and NCCL; ``queued_source`` says which run)."""
    # (kind, algorithm, op, group size) -> {run: [(bytes, seconds)]}
    points: dict[tuple[str, str, str, int], dict[str, list]] = {}
    for path in sorted(Path(results_dir).glob("collectives*/*/collectives-w*.json")):
        doc = json.loads(path.read_text())
        device = doc.get("device")
        row_kind = device_kind(device.get("name") if isinstance(device, dict) else None)
        if not doc.get("ok") or row_kind is None:
            continue
        n = int(doc["world_size"])
        for row in doc.get("rows") or []:
            if row.get("algorithm") in ("backend", QUEUED_ALGORITHM) and row.get("time_s_median"):
                runs = points.setdefault((row_kind, row["algorithm"], row["op"], n), {})
                runs.setdefault(str(path.parent), []).append((row["bytes"], row["time_s_median"]))
    out: dict = {}
    for (k, alg, op, n), runs in sorted(points.items(), key=lambda kv: kv[0]):
        if k != kind or alg != "backend":
            continue
        pts = [p for run in runs.values() for p in run]
        alpha, beta = _alpha_beta(pts)
        fit = {
            "alpha_s": alpha,
            "busbw_Bps": M.bus_factor(op, n) / beta,
            "group_size": n,
            "source": ", ".join(runs),
            "points": len(pts),
        }
        fit.update(_queued_fit(points, kind, op, n, alpha, beta))
        by_group = {**(out.get(op) or {}).get("by_group", {}), str(n): fit}
        out[op] = {**fit, "by_group": by_group}  # sizes ascend: the largest ends on top
    if not out:
        raise CalibrationError(f"no collectives-suite result for {kind} under {results_dir}")
    return out


def _queued_fit(points: dict, kind: str, op: str, n: int, alpha: float, beta: float) -> dict:
    """The queued call's alpha and bus bandwidth for (op, n) on ``kind``: from its own burst rows,
    else by other kinds' queued-to-isolated ratios (each run's bursts set against the same run's
    isolated calls, the median over runs); {} where no run has bursts at that size."""
    own = points.get((kind, QUEUED_ALGORITHM, op, n))
    if own:
        q_alpha, q_beta = _alpha_beta([p for run in own.values() for p in run])
        return {
            "alpha_queued_s": q_alpha,
            "busbw_queued_Bps": M.bus_factor(op, n) / q_beta,
            "queued_source": ", ".join(own),
        }
    paired = [
        (other, run, pts, points.get((other, "backend", op, n), {}).get(run))
        for (other, alg, o, m), runs in sorted(points.items())
        if alg == QUEUED_ALGORITHM and o == op and m == n
        for run, pts in runs.items()
    ]
    ratios = []  # (alpha ratio, busbw ratio) per run with both kinds of rows
    for _, _, burst, isolated in (p for p in paired if p[3]):
        (iso_alpha, iso_beta), (bur_alpha, bur_beta) = _alpha_beta(isolated), _alpha_beta(burst)
        ratios.append((bur_alpha / max(iso_alpha, 1e-12), iso_beta / bur_beta))
    if not ratios:
        return {}
    alpha_ratio = statistics.median(r[0] for r in ratios)
    bw_ratio = statistics.median(r[1] for r in ratios)
    runs = ", ".join(f"{run} ({other})" for other, run, _, isolated in paired if isolated)
    return {
        "alpha_queued_s": alpha * alpha_ratio,
        "busbw_queued_Bps": M.bus_factor(op, n) / beta * bw_ratio,
        "queued_source": f"{runs}: alpha x{alpha_ratio:.2f}, busbw x{bw_ratio:.2f} of the same runs' isolated calls",
    }


# --- fitting ---------------------------------------------------------------------------------------


def _pseudo_count_shrinkage(samples: dict[str, list[float]]) -> dict[str, float]:
    """Per implementation, n / (n + ``M.SHRINK``): as if ``M.SHRINK`` more configurations had shown
    no difference."""
    return {k: len(v) / (len(v) + M.SHRINK) for k, v in samples.items()}


def _shrinkage(samples: dict[str, list[float]]) -> dict[str, float]:
    """Per implementation, the share of its median residual to keep: empirical Bayes (James and
    Stein), m_j x tau^2 / (tau^2 + s^2 / n_j). s^2 is the residuals' variance within an
    implementation, pooled over those with two or more configurations; tau^2 the spread of the
    implementations' medians about none, less what s^2 / n_j alone would spread them. Without two
    configurations of any implementation, ``M.SHRINK`` pseudo-configurations of no difference."""
    within = [(len(v) - 1, statistics.variance(v)) for v in samples.values() if len(v) > 1]
    dof = sum(d for d, _ in within)
    if not dof:
        return _pseudo_count_shrinkage(samples)
    s2 = sum(d * var for d, var in within) / dof
    medians = {k: statistics.median(v) for k, v in samples.items()}
    tau2 = max(0.0, statistics.fmean(m * m - s2 / len(samples[k]) for k, m in medians.items()))
    return {k: tau2 / (tau2 + s2 / len(v)) if tau2 > 0 else 0.0 for k, v in samples.items()}


def _impl_factors(ratios: dict[str, list[float]], log: bool) -> dict[str, float]:
    """Per implementation, the median residual (a log ratio for time, a fraction for memory), shrunk
    toward none: time by ``_shrinkage``, memory by ``M.SHRINK`` pseudo-configurations. The median
    because one launch that stalled must not set a library's factor."""
    samples = {k: [math.log(r) for r in rs] if log else list(rs) for k, rs in ratios.items()}
    keep = _shrinkage(samples) if log else _pseudo_count_shrinkage(samples)
    out = {}
    for impl, v in samples.items():
        m = statistics.median(v) * keep[impl]
        out[impl] = math.exp(m) if log else m
    return out


def fit_host(obs: list[Observation], device_s: list[float]) -> dict[str, float]:
    """Per library that waits on its host (``M.waits_on_host``), the cost per parameter tensor c
    minimising the summed |log error| of step = max(device, c x tensors x passes) over its
    configurations (a 1-D search over the values each configuration alone would imply: robust to
    one stalled launch). ``device_s``: each configuration's device time, with its factor."""
    by_impl: dict[str, list] = {}
    for o, d in zip(obs, device_s):
        if M.waits_on_host(o.workload):
            # per library, and per library and recipe: autocast adds cast ops each hook/dispatch sees
            for key in (o.workload.impl, M.host_key(o.workload)):
                by_impl.setdefault(key, []).append((o.step_s, d, M.host_units(o.workload)))
    out = {}
    for impl, pts in by_impl.items():
        candidates = [y / u for y, _, u in pts]
        out[impl] = min(candidates, key=lambda c: sum(abs(math.log(max(d, c * u) / y)) for y, d, u in pts))
    return out


# Golden-section search bounds of the host seconds per block per pipeline action (0 to 3 ms: a GPT
# block's launches and module calls, forward or backward, take well under that).
PIPELINE_HOST_RANGE = (0.0, 3e-3)


def device_time(o: Observation, collectives: dict, consts: dict, impl: dict) -> float:
    """Seconds of ``o``'s device work under ``consts`` (each constant times its feature), times its
    implementation's factor in ``impl``."""
    c = M.time_constants(consts)
    f = M.time_features(o.workload, collectives, c)
    return sum(c[k] * v for k, v in f.items()) * impl.get(o.workload.impl, 1.0)


def fit_pipeline_host(obs: list[Observation], collectives: dict, consts: dict, impl: dict) -> float:
    """``pp_host_block_s`` minimising the summed |log error| over every pipeline configuration with
    the other constants held (one value for all of them: a 1-D golden-section search, robust to one
    stalled launch, as ``fit_host``); 0 without a pipeline record."""
    pipes = [o for o in obs if o.workload.pp > 1]
    if not pipes:
        return 0.0

    def loss(h: float) -> float:
        c = {**consts, "pp_host_block_s": h}
        return sum(abs(math.log(device_time(o, collectives, c, impl) / o.step_s)) for o in pipes)

    a, b = PIPELINE_HOST_RANGE
    g = (math.sqrt(5) - 1) / 2
    x1, x2 = b - g * (b - a), a + g * (b - a)
    f1, f2 = loss(x1), loss(x2)
    for _ in range(14):
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - g * (b - a)
            f1 = loss(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + g * (b - a)
            f2 = loss(x2)
    best = (a + b) / 2
    # the floor may not pay at all: then none
    return best if loss(best) < loss(0.0) else 0.0


# fit_time's rounds stop at the fixed point: no constant or factor moved by more than this (relative)
# and the same host-floor configurations bind; else after FIT_MAX_ROUNDS.
FIT_TOLERANCE = 1e-6
FIT_MAX_ROUNDS = 60


def _moved(before: dict, after: dict) -> float:
    """The largest relative change between two dicts of numbers (a key on one side only: infinite)."""
    if before.keys() != after.keys():
        return math.inf
    return max((abs(after[k] - v) / max(abs(v), 1e-300) for k, v in before.items() if after[k] != v), default=0.0)


def fit_time(
    obs: list[Observation],
    collectives: dict,
    kind: str = "h100",
    rounds: int = FIT_MAX_ROUNDS,
    attention_rate: dict | None = None,
) -> tuple[dict, dict, dict]:
    """Device constants from the configurations not bound by host hooks (NNLS on relative error),
    implementation factors from their residuals, then the host cost of each hook-driven library.

    A library with a host floor (``M.has_host_floor``) enters the device fit only where its floor,
    fitted against the previous round's device times, does not bind: the first round fits without
    any of them (factor 1), so a host-bound step never inflates the factor of its device work.
    The constants and the factors depend on each other, so the rounds repeat until neither moves
    (``FIT_TOLERANCE``: a dozen rounds on the committed runs, where the first four left the
    constants up to 23 % from where they settle), at most ``rounds`` times. ``attention_rate``
    (``fit_attention``), where given, prices attention apart and rides along in the constants."""
    cols = M.TIME_CONSTANTS
    floor_obs = [o for o in obs if M.has_host_floor(o.workload)]
    held = {id(o) for o in floor_obs}
    # without the compiled elementwise constant until a compiled record fits it: until then (and in
    # the calibration written) it is derived from inv_act_bw (``M.time_constants``)
    consts = dict(M.TIME_DEFAULTS)
    if kind in MATMUL_CEILING:
        consts["inv_rate"] = 1 / MATMUL_CEILING[kind]
    if attention_rate:
        consts["attention"] = attention_rate
    impl: dict[str, float] = {}
    used: list[int] = []
    for _ in range(rounds):
        before = (dict(consts), dict(impl), set(held))
        device_obs = [o for o in obs if not M.is_host_bound(o.workload) and id(o) not in held]
        if not device_obs:
            break
        # a pipeline's stretch depends on its stages' costs, i.e. on the constants: refit on the
        # features the previous round's constants give (the first round: matmul FLOPs only)
        feats = [M.time_features(o.workload, collectives, consts) for o in device_obs]
        x = np.array([[f[c] for c in cols] for f in feats]).reshape(len(device_obs), len(cols))
        used = [
            j
            for j, c in enumerate(cols)
            if np.any(x[:, j]) and not (c == "inv_rate" and kind in MATMUL_CEILING) and c not in M.FIXED_TIME_CONSTANTS
        ]
        y = np.array([o.step_s / impl.get(o.workload.impl, 1.0) for o in device_obs])
        tc = M.time_constants(consts)
        fixed = np.array([sum(tc[c] * f[c] for j, c in enumerate(cols) if j not in used) for f in feats])
        sol = nnls(x[:, used] / y[:, None], (y - fixed) / y)
        for j, v in zip(used, sol):
            consts[cols[j]] = float(v)
        ratios: dict[str, list] = {}
        tc = M.time_constants(consts)
        for o, f in zip(device_obs, feats):
            pred = sum(tc[c] * f[c] for c in cols)
            ratios.setdefault(o.workload.impl, []).append(o.step_s / pred)
        lo, hi = M.IMPL_TIME_BOUNDS
        caused = {k: v for k, v in ratios.items() if M.time_factor_cause(k)}
        impl = {k: min(max(v, lo), hi) for k, v in _impl_factors(caused, log=True).items()}
        consts["pp_host_block_s"] = fit_pipeline_host(device_obs, collectives, consts, impl)
        if floor_obs:
            dev = [device_time(o, collectives, consts, impl) for o in floor_obs]
            floor = fit_host(floor_obs, dev)
            held = {id(o) for o, d in zip(floor_obs, dev) if floor[o.workload.impl] * M.host_units(o.workload) >= d}
        if held == before[2] and max(_moved(before[0], consts), _moved(before[1], impl)) < FIT_TOLERANCE:
            break
    host = fit_host(obs, [device_time(o, collectives, consts, impl) for o in obs])
    # A constant no observation exercises keeps its default and says so.
    fitted = [cols[j] for j in used] + (["pp_host_block_s"] if consts["pp_host_block_s"] > 0 else [])
    return consts, impl | {"_fitted": fitted}, host


def fit_memory(obs: list[Observation]) -> tuple[dict, dict]:
    """Activation, logit, cast and fixed constants by NNLS on relative error, each configuration at
    its peak phase (``model.memory_features``: states alive at the start of backward + activations,
    or every state at the update); then per implementation the median of what the physics leaves,
    as a fraction of its states, never below 0 (an implementation cannot hold less than the states
    alive at its peak)."""
    obs = [o for o in obs if o.peak_bytes and o.workload.state_bytes is not None]
    cols = M.MEMORY_CONSTANTS
    consts = dict(M.MEMORY_DEFAULTS)
    impl: dict[str, float] = {}
    if not obs:
        return consts, {"_fitted": []}
    used: list[int] = []
    for _ in range(4):
        rows = [M.peak_phase(o.workload, consts) for o in obs]
        x = np.array([[f[c] for c in cols] for _, f in rows])
        used = [j for j, c in enumerate(cols) if np.any(x[:, j])]
        y = np.array(
            [
                o.peak_bytes - fixed - impl.get(o.workload.impl, 0.0) * M.memory_unit(o.workload)
                for o, (fixed, _) in zip(obs, rows)
            ]
        )
        peak = np.array([o.peak_bytes for o in obs])
        sol = nnls(x[:, used] / peak[:, None], y / peak)
        for j, v in zip(used, sol):
            consts[cols[j]] = float(v)
        resid: dict[str, list] = {}
        for o in obs:
            fixed, f = M.peak_phase(o.workload, consts)
            pred = fixed + M._dot(consts, f)
            resid.setdefault(o.workload.impl, []).append((o.peak_bytes - pred) / M.memory_unit(o.workload))
        impl = {k: min(max(0.0, v), M.IMPL_MEMORY_MAX) for k, v in _impl_factors(resid, log=False).items()}
    return consts, impl | {"_fitted": [cols[j] for j in used]}


def fit(
    obs: list[Observation],
    collectives: dict,
    kind: str = "h100",
    device_name: str | None = None,
    attention_rate: dict | None = None,
) -> dict:
    if not obs:
        raise CalibrationError(f"no {kind} records to calibrate from")
    time_c, impl_t, host = fit_time(obs, collectives, kind, attention_rate=attention_rate)
    mem_c, impl_m = fit_memory(obs)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "plan-calibration",
        "device_kind": kind,
        "device_name": device_name,
        "peak_flops": DEVICE_KINDS[kind][1],
        "time": time_c,
        "time_fitted": impl_t.pop("_fitted"),
        "time_doc": M.TIME_DOC,
        "memory": mem_c,
        "memory_fitted": impl_m.pop("_fitted"),
        "memory_doc": M.MEMORY_DOC,
        "collectives": collectives,
        "impl_time": dict(sorted(impl_t.items())),
        "host_tensor_s": dict(sorted(host.items())),
        "host_tensor_doc": "s of host (Python hook / DTensor dispatch) time per parameter tensor per pass; "
        "step = max(device, this x tensors x passes)",
        "impl_memory": dict(sorted(impl_m.items())),
        "launch_spread": launch_spread(obs),
        "launch_spread_doc": "per implementation, over its configurations launched twice or more: "
        "(slowest - fastest launch's median step) / their mean",
        "configurations": len(obs),
        "widths": [min(o.workload.d_model for o in obs), max(o.workload.d_model for o in obs)],
        "records": sum(o.n_records for o in obs),
        "runs": sorted({r for o in obs for r in o.runs} | {c["source"] for c in collectives.values() if "source" in c}),
    }


def fit_attention(results_dir="results", kind: str = "h100") -> dict | None:
    """Attention's rate on ``kind`` (parabench.plan.attention) from its sdpa-head-width timings, or
    None where none was measured (attention FLOPs then cost the matmul rate)."""
    return attention.fit_kind(results_dir, kind, device_kind)


def calibrate(results_dir="results", kind: str = "h100") -> dict:
    if kind in DERIVED_FROM:
        return derive(calibrate(results_dir, DERIVED_FROM[kind]), kind, observations(results_dir, kind))
    cal = fit(
        observations(results_dir, kind),
        fit_collectives(results_dir, kind),
        kind,
        DEVICE_KINDS[kind][0],
        fit_attention(results_dir, kind),
    )
    cal["left_out_runs"] = left_out_runs(results_dir, kind)
    return cal


# --- storage ---------------------------------------------------------------------------------------


def save(cal: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(cal, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load(path) -> dict:
    path = Path(path)
    cal = json.loads(path.read_text())
    if cal.get("kind") != "plan-calibration" or cal.get("schema_version") != SCHEMA_VERSION:
        raise CalibrationError(
            f"{path}: not a plan calibration of schema {SCHEMA_VERSION} "
            f"(got kind={cal.get('kind')!r}, schema_version={cal.get('schema_version')!r})"
        )
    return cal


def calibration_path(kind: str, directory=None) -> Path:
    return Path(directory or CALIBRATION_DIR) / f"{kind}.json"


# The ratio of the parts' HBM speeds their memory-bound kernels reach is fitted from the derived part's
# own records that do not wait on their host, to 0.01 within this range, once it has this many of
# them: the datasheets' ratio (H100 3.35, H200 4.8 TB/s: 0.698) is the peak's, and the kernels of
# the H200 records reached less of that gain (fitted 0.75, docs/planner.md).
HBM_RATIO_RANGE = (0.5, 1.0)
HBM_RATIO_MIN_CONFIGURATIONS = 20


def _scaled_time(source: dict, ratio: float) -> dict:
    return {k: v * ratio if k in M.MEMORY_BOUND_TIME_CONSTANTS else v for k, v in source["time"].items()}


# Predicted steps under a scaled calibration, by (calibration, ratio, workload): leaving each of a
# part's configurations out in turn (``validate.derived_parts``) fits the ratio again over the others,
# whose predictions at each ratio do not change. The workload object is kept beside its step, so an
# id is never read for another object.
_SCALED_STEPS: dict[tuple, tuple[object, float]] = {}
_SCALED_STEPS_MAX = 100_000


def _scaled_step_s(source_key: str, ratio: float, cal: dict, workload) -> float:
    key = (source_key, ratio, id(workload))
    hit = _SCALED_STEPS.get(key)
    if hit is not None and hit[0] is workload:
        return hit[1]
    if len(_SCALED_STEPS) >= _SCALED_STEPS_MAX:
        _SCALED_STEPS.clear()
    step_s = M.predict(workload, cal).step_s
    _SCALED_STEPS[key] = (workload, step_s)
    return step_s


def fit_hbm_ratio(source: dict, own: list[Observation]) -> float | None:
    """The memory-bound time constants' factor (in ``HBM_RATIO_RANGE``, to 0.01: a 0.05 grid, then
    0.01 steps around its best) with the least summed |log error| over ``own``'s configurations
    that do not wait on their host, or None with fewer than ``HBM_RATIO_MIN_CONFIGURATIONS``."""
    device_bound = [o for o in own if not M.waits_on_host(o.workload)]
    if len(device_bound) < HBM_RATIO_MIN_CONFIGURATIONS:
        return None

    source_key = json.dumps(source, sort_keys=True, default=str)

    def loss(ratio: float) -> float:
        cal = {**source, "time": _scaled_time(source, ratio)}
        return sum(abs(math.log(_scaled_step_s(source_key, ratio, cal, o.workload) / o.step_s)) for o in device_bound)

    lo, hi = HBM_RATIO_RANGE
    coarse = min((round(lo + 0.05 * i, 2) for i in range(int(round((hi - lo) / 0.05)) + 1)), key=loss)
    fine = (round(coarse + 0.01 * i, 2) for i in range(-4, 5))
    return min((r for r in fine if lo <= r <= hi), key=loss)


def derive(source: dict, kind: str, own: list[Observation] | None = None) -> dict:
    """``source`` (a calibration of another part of the same architecture) for ``kind``: its
    memory-bound time constants times the parts' HBM ratio, fitted from ``own`` (the part's own
    observations, ``fit_hbm_ratio``) where it has enough, else the datasheets'; and from ``own``
    the host costs of each library that waits on its host there (``refit_host``) and DeepSpeed stage
    0's per-tensor wait (``refit_stage0_tensor``); all else as fitted on ``source``."""
    datasheet = HBM_BYTES_PER_S[source["device_kind"]] / HBM_BYTES_PER_S[kind]
    fitted = fit_hbm_ratio(source, own or [])
    ratio = datasheet if fitted is None else fitted
    scaled = [k for k in M.MEMORY_BOUND_TIME_CONSTANTS if k in source["time"]]
    why = (
        f"{source['device_kind']} / {kind} HBM bandwidth"
        if fitted is None
        else f"fitted on its own records; the datasheets' {datasheet:.3f}"
    )
    doc = (
        f"{kind} has no calibration of its own: the {source['device_kind']} one, its memory-bound "
        f"time constants x {ratio:.3f} ({why})"
    )
    derived = {
        **source,
        "device_kind": kind,
        "device_name": DEVICE_KINDS[kind][0],
        "peak_flops": DEVICE_KINDS[kind][1],
        "time": _scaled_time(source, ratio),
        "derived_from": {"kind": source["device_kind"], "hbm_ratio": ratio, "scaled": scaled, "doc": doc},
    }
    if fitted is not None:
        derived["derived_from"] |= {
            "hbm_ratio_datasheet": datasheet,
            "hbm_ratio_configurations": sum(not M.waits_on_host(o.workload) for o in own),
        }
    stage0 = refit_stage0_tensor(derived, own or [])
    if stage0 is not None:
        derived["time"] = {**derived["time"], "ds_stage0_tensor_s": stage0}
        derived["derived_from"] |= {
            "stage0_refit_configurations": sum(M.uses_fp16_optimizer(o.workload) for o in own),
            "doc": derived["derived_from"]["doc"] + "; DeepSpeed stage 0's per-tensor wait from its own records",
        }
    host = refit_host(derived, own or [])
    if host:
        derived["host_tensor_s"] = dict(sorted({**source["host_tensor_s"], **host}.items()))
        runs = sorted({r for o in own for r in o.runs})
        derived["derived_from"] |= {
            "host_refit": sorted(host),
            "host_refit_configurations": sum(M.waits_on_host(o.workload) for o in own),
            "host_refit_runs": runs,
            "doc": derived["derived_from"]["doc"]
            + f"; host costs of {', '.join(sorted(k for k in host if '|' not in k))} "
            f"from its own {len(runs)} runs",
        }
    return derived


# A configuration of a library that waits on its host shows its host's speed only where its step
# outlasts the derived device time by more than the device model's own error (p90 about 12 % on
# H200): a step within that says nothing of the host, and refitting on it would turn a device
# miss into a host cost that the source's records had identified better.
HOST_EVIDENCE = 0.12


def refit_host(derived: dict, own: list[Observation]) -> dict[str, float]:
    """Per-tensor host costs (``fit_host``) from the configurations of ``own`` that wait on their
    host, on the device times ``derived`` predicts for them: the host is the part's machine, not
    the one the source calibration ran on. A library is refitted only from configurations whose
    step shows the host (``HOST_EVIDENCE``)."""
    waiting = [o for o in own if M.waits_on_host(o.workload)]
    dev = [device_time(o, derived["collectives"], derived["time"], derived["impl_time"]) for o in waiting]
    shown = {o.workload.impl for o, d in zip(waiting, dev) if o.step_s > d * (1 + HOST_EVIDENCE)}
    pairs = [(o, d) for o, d in zip(waiting, dev) if o.workload.impl in shown]
    return fit_host([o for o, _ in pairs], [d for _, d in pairs])


# Stage-0 configurations a derived part needs of its own before its per-tensor wait is refitted.
STAGE0_MIN_CONFIGURATIONS = 3


def refit_stage0_tensor(derived: dict, own: list[Observation]) -> float | None:
    """``ds_stage0_tensor_s`` from ``own``'s DeepSpeed stage-0 configurations (at least
    ``STAGE0_MIN_CONFIGURATIONS``), or None: each waits on its host once per parameter tensor
    (``M.ds_stage0_tensors``), so the wait is the part's machine's, as the per-tensor host costs of
    ``refit_host`` are. The value minimising the summed |log error| among those each configuration
    alone would imply (robust to one stalled launch); the step is linear in it."""
    obs = [o for o in own if M.uses_fp16_optimizer(o.workload)]
    if len(obs) < STAGE0_MIN_CONFIGURATIONS:
        return None
    c0 = derived["time"].get("ds_stage0_tensor_s", 0.0)
    rows = []
    for o in obs:
        p = M.predict(o.workload, derived)
        factor, _ = M.impl_factor(o.workload, derived.get("impl_time") or {})
        rows.append((o.step_s, p.step_s, factor * M.ds_stage0_tensors(o.workload)))
    candidates = [max(0.0, c0 + (y - pred) / slope) for y, pred, slope in rows]

    def loss(c: float) -> float:
        return sum(abs(math.log((pred + (c - c0) * slope) / y)) for y, pred, slope in rows)

    return min(candidates, key=loss)


def load_kind(kind: str, directory=None) -> dict | None:
    """The stored calibration of a device kind; else, for a kind in ``DERIVED_FROM``, the one it is
    derived from (``derive``); else None."""
    path = calibration_path(kind, directory)
    if path.is_file():
        return load(path)
    source = load_kind(DERIVED_FROM[kind], directory) if kind in DERIVED_FROM else None
    return derive(source, kind) if source else None
