"""Validation that cannot flatter itself.

- Leave-one-configuration-out: every configuration (all its records) is predicted from a
  calibration fitted without it, implementation factors included.
- Out-of-scale: calibrate on the 1-GPU configurations only (collectives from the suite, which
  is not a training record), predict every 2-GPU configuration; and calibrate on 1- and 2-GPU
  configurations, predict the 4-GPU ones (after the fact: the pre-registered version of that
  test is ``--predictions`` below).

Reported: median and 90th-percentile absolute % error of step time and peak memory; Spearman
rank correlation of the configurations within each (model, GPU count, recipe, micro-batch) group of
at least 3, and within each (model, GPU count) of at least 3 (the issue's grouping: every recipe
and micro-batch of a model on a GPU count, ranked by throughput); the share of groups (of at least
2) whose fastest configuration is named correctly.

    parabench calibrate --gpu h100-80g --validate all (parabench.plan.check.calibrate_main)

- Pre-registered: set a predictions file written before a run (``parabench plan --write-suite``
  beside its suite, or ``parabench.plan.check.predict_suite``) against that run's records, matched
  by case hash; the predictions are read, never refitted (``parabench check RUN``).
"""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from parabench.plan import calibrate as C
from parabench.plan import model as M

# The per-group Spearman is reported beside the measurements' retest, never a target: two launches of
# the same configurations rank each other at a median of 0.90 (docs/planner.md).
TARGETS = {"step_median_pct": 10.0, "peak_median_pct": 5.0, "fastest_share": 0.8}
# Launch-to-launch noise (docs/results.md): the references' step times move 0.3 % (median) between
# launches, the peers' up to several %. Two configurations closer than RANK_NOISE are tied for ranking;
# a predicted fastest within FASTEST_NOISE of the measured fastest is named correctly.
RANK_NOISE = 0.05
FASTEST_NOISE = 0.03


def noise_tied(x, band: float = RANK_NOISE) -> np.ndarray:
    """Values with ties where consecutive sorted values lie within ``band`` (relative) of each other,
    each tied run replaced by its smallest member, so ``_ranks`` gives them one shared rank."""
    x = np.asarray(x, float)
    order = x.argsort()
    out = np.empty(len(x))
    anchor = x[order[0]] if len(x) else 0.0
    prev = anchor
    for i in order:
        if x[i] > prev * (1 + band):
            anchor = x[i]
        out[i] = anchor
        prev = x[i]
    return out


def noise_merged(meas, pred, band: float = RANK_NOISE) -> tuple[np.ndarray, np.ndarray]:
    """Measured and predicted times with every run of measured values within the noise band merged
    into one entity: measured tied, predictions replaced by their mean, so order inside the noise
    counts neither for nor against the model."""
    tied = noise_tied(meas, band)
    pred = np.asarray(pred, float)
    merged = pred.copy()
    for v in np.unique(tied):
        merged[tied == v] = pred[tied == v].mean()
    return tied, merged


def resolved_pairs(meas, pred, band: float = RANK_NOISE) -> tuple[int, int]:
    """(pairs ordered as measured, pairs) over the pairs whose measured times differ by more than band."""
    good = total = 0
    for i in range(len(meas)):
        for j in range(i + 1, len(meas)):
            lo, hi = sorted((meas[i], meas[j]))
            if hi > lo * (1 + band):
                total += 1
                good += int((meas[i] - meas[j]) * (pred[i] - pred[j]) > 0)
    return good, total


def _ranks(x) -> np.ndarray:
    x = np.asarray(x, float)
    order = x.argsort()
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    for v in np.unique(x):  # ties share their mean rank
        r[x == v] = r[x == v].mean()
    return r


def spearman(a, b) -> float | None:
    ra, rb = _ranks(a), _ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def group_of(w: M.Workload) -> str:
    """Configurations ranked against each other (by time per token): one model (and layout), GPU count,
    recipe, micro-batch."""
    layout = "" if w.layout == "separate" else f" {w.layout}"
    return f"{w.model}{layout} w{w.world_size} {w.recipe} mb{w.micro_batch}"


def seconds_per_token(rows: list[dict]) -> tuple[list[float], list[float]]:
    """Measured and predicted step time per token of ``rows``: groups are ranked as the planner ranks,
    by throughput, since their configurations need not share a step's tokens (data-parallel degree,
    accumulation and, across a (model, GPU count), micro-batch differ)."""
    meas = [r["step_s"] / r.get("tokens_per_step", 1) for r in rows]
    pred = [r["pred_step_s"] / r.get("tokens_per_step", 1) for r in rows]
    return meas, pred


def scale_group(group: str) -> str:
    """The (model, GPU count) a ``group_of`` name belongs to: the name without recipe and micro-batch."""
    return group.rsplit(" ", 2)[0]


def misordered_pairs(rows: list[dict], spread: dict | None) -> list[dict]:
    """Pairs of ``rows`` the prediction orders against the measurement (by throughput), each with its
    measured gap and the larger of its two implementations' median launch spreads (``spread``:
    implementation -> (slowest - fastest) / mean over its configurations launched twice or more;
    None where neither has one): a gap within it is one the launches of those implementations
    cross between runs."""
    meas, pred = seconds_per_token(rows)
    out = []
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            if (meas[i] - meas[j]) * (pred[i] - pred[j]) >= 0:
                continue
            known = [spread[r["impl"]] for r in (rows[i], rows[j]) if spread and r.get("impl") in spread]
            out.append(
                {
                    "pair": [rows[i]["label"], rows[j]["label"]],
                    "gap_pct": (max(meas[i], meas[j]) / min(meas[i], meas[j]) - 1) * 100,
                    "launch_spread_pct": max(known) * 100 if known else None,
                }
            )
    return out


def scale_ranking(rows: list[dict], spread: dict | None = None) -> dict:
    """Spearman of throughput within each (model, GPU count) of at least 3 configurations, as
    measured and with runs within RANK_NOISE merged; in the groups below 0.9, the pairs ordered
    wrong and how many of them lie within their implementations' launch spread (``misordered_pairs``)."""
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(scale_group(r["group"]), []).append(r)
    per_group = []
    for g, rs in sorted(groups.items()):
        if len(rs) < 3:
            continue
        meas, pred = seconds_per_token(rs)
        rho = spearman(meas, pred)
        entry = {
            "group": g,
            "configs": len(rs),
            "spearman": rho,
            "spearman_noise_tied": spearman(*noise_merged(meas, pred)),
        }
        if rho is not None and rho < 0.9:
            entry["misordered_pairs"] = misordered_pairs(rs, spread)
        per_group.append(entry)
    rho = [x["spearman"] for x in per_group if x["spearman"] is not None]
    tied = [x["spearman_noise_tied"] for x in per_group if x["spearman_noise_tied"] is not None]
    wrong = [p for x in per_group for p in x.get("misordered_pairs", ())]
    within = [p for p in wrong if p["launch_spread_pct"] is not None and p["gap_pct"] <= p["launch_spread_pct"]]
    return {
        "misordered_pairs_below_0.9": len(wrong),
        "misordered_within_launch_spread": len(within) if spread else None,
        "groups": len(rho),
        "spearman_median": float(np.median(rho)) if rho else None,
        "spearman_min": min(rho) if rho else None,
        "below_0.9": sum(r < 0.9 for r in rho),
        "noise_tied_groups": len(tied),
        "noise_tied_median": float(np.median(tied)) if tied else None,
        "noise_tied_below_0.9": sum(r < 0.9 for r in tied),
        "per_group": per_group,
    }


def _pct(pred, meas):
    return abs(pred - meas) / meas * 100


def summarize(rows: list[dict], spread: dict | None = None) -> dict:
    """Error percentiles and within-group ranking of rows {key, group, step_s, pred_step_s, peak_bytes,
    pred_peak_bytes[, impl]}; ``spread``: each implementation's median launch spread (``scale_ranking``)."""
    step_err = [_pct(r["pred_step_s"], r["step_s"]) for r in rows]
    peak_err = [_pct(r["pred_peak_bytes"], r["peak_bytes"]) for r in rows if r["pred_peak_bytes"] and r["peak_bytes"]]
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    rho, rho_tied, fastest, fastest_strict, per_group = [], [], [], [], []
    pairs_good = pairs_total = 0
    for g, rs in sorted(groups.items()):
        if len(rs) < 2:
            continue
        meas, pred = seconds_per_token(rs)
        strict = int(np.argmin(meas)) == int(np.argmin(pred))
        ok = meas[int(np.argmin(pred))] <= min(meas) * (1 + FASTEST_NOISE)
        fastest.append(ok)
        fastest_strict.append(strict)
        s = spearman(meas, pred) if len(rs) >= 3 else None
        if s is not None:
            rho.append(s)
        st = spearman(*noise_merged(meas, pred)) if len(rs) >= 3 else None
        if st is not None:
            rho_tied.append(st)
        good, total = resolved_pairs(meas, pred)
        pairs_good += good
        pairs_total += total
        per_group.append(
            {
                "group": g,
                "configs": len(rs),
                "spearman": s,
                "spearman_noise_tied": st,
                "resolved_pairs": total,
                "resolved_pairs_ordered": good,
                "fastest_named": ok,
                "fastest_named_strict": strict,
                "fastest_measured": rs[int(np.argmin(meas))]["label"],
                "fastest_predicted": rs[int(np.argmin(pred))]["label"],
            }
        )
    pc = lambda v, q: float(np.percentile(v, q)) if v else None  # noqa: E731
    return {
        "configurations": len(rows),
        "step_median_pct": pc(step_err, 50),
        "step_p90_pct": pc(step_err, 90),
        "peak_configurations": len(peak_err),
        "peak_median_pct": pc(peak_err, 50),
        "peak_p90_pct": pc(peak_err, 90),
        "spearman_groups": len(rho),
        "spearman_median": pc(rho, 50),
        "spearman_min": min(rho) if rho else None,
        "spearman_share_ge_0.9": float(np.mean([r >= 0.9 for r in rho])) if rho else None,
        "spearman_noise_tied_groups": len(rho_tied),
        "spearman_noise_tied_median": pc(rho_tied, 50),
        "resolved_pairs": pairs_total,
        "resolved_pairs_ordered_share": pairs_good / pairs_total if pairs_total else None,
        "fastest_groups": len(fastest),
        "fastest_share": float(np.mean(fastest)) if fastest else None,
        "fastest_strict_share": float(np.mean(fastest_strict)) if fastest_strict else None,
        "groups": per_group,
        "by_model_and_gpus": scale_ranking(rows, spread),
    }


RETEST_DRAWS = 200


def retest_spearman(launches: list[list[float]], draws: int = RETEST_DRAWS, rng=None) -> float | None:
    """How well one group's measurements rank themselves: ``launches`` holds, per configuration, its
    per-token step times from separate launches (at least two each). A draw takes two launches of
    every configuration at random and ranks the configurations by the one against the other; the
    median over draws (from ``rng``, else seed 0, so a file written from it is reproducible). None
    under 3 configurations."""
    if len(launches) < 3:
        return None
    rng = rng if rng is not None else np.random.default_rng(0)
    rhos = []
    for _ in range(draws):
        picks = [rng.choice(len(x), size=2, replace=False) for x in launches]
        rho = spearman([x[i] for x, (i, _) in zip(launches, picks)], [x[j] for x, (_, j) in zip(launches, picks)])
        if rho is not None:
            rhos.append(rho)
    return float(np.median(rhos)) if rhos else None


def retest(obs: list[C.Observation], rows: list[dict], draws: int = RETEST_DRAWS, seed: int = 0) -> dict:
    """How well the measurements rank themselves: the ceiling a model's Spearman is judged against.

    Within each group, the configurations measured in at least two runs (separate launches, often
    on different hosts or days), ranked run against run (``retest_spearman``). Beside it, the
    Spearman of ``rows``' predictions against the median over runs on the same configurations. A
    group needs 3 such configurations."""
    rng = np.random.default_rng(seed)
    pred = {r["key"]: r["pred_step_s"] for r in rows}
    groups: dict[str, list] = {}
    for o in obs:
        if len(o.run_steps) >= 2 and o.key in pred:
            groups.setdefault(group_of(o.workload), []).append(o)
    per_group = []
    for g, os_ in sorted(groups.items()):
        if len(os_) < 3:
            continue
        launches = [[o.run_steps[r] / o.workload.tokens_per_step for r in sorted(o.run_steps)] for o in os_]
        per_group.append(
            {
                "group": g,
                "configs": len(os_),
                "retest_spearman": retest_spearman(launches, draws, rng),
                "model_spearman": spearman(
                    [o.step_s / o.workload.tokens_per_step for o in os_],
                    [pred[o.key] / o.workload.tokens_per_step for o in os_],
                ),
            }
        )
    ret = [x["retest_spearman"] for x in per_group if x["retest_spearman"] is not None]
    mod = [x["model_spearman"] for x in per_group if x["model_spearman"] is not None]
    return {
        **retest_metrics(obs),
        "groups": len(per_group),
        "retest_median": float(np.median(ret)) if ret else None,
        "retest_share_ge_0.9": float(np.mean([x >= 0.9 for x in ret])) if ret else None,
        "model_median": float(np.median(mod)) if mod else None,
        "model_at_or_above_retest": sum(
            1
            for x in per_group
            if None not in (x["retest_spearman"], x["model_spearman"]) and x["model_spearman"] >= x["retest_spearman"]
        ),
        "per_group": per_group,
    }


def retest_metrics(obs: list[C.Observation]) -> dict:
    """The validation's metrics scored by the measurements against themselves: every configuration
    measured in two runs or more, its second run (by name) "predicting" its first. Step error median
    and p90; pairs more than 5 % apart ordered alike; groups whose fastest is named within 3 %."""
    rows = []
    for o in obs:
        if len(o.run_steps) >= 2:
            first, second = (o.run_steps[r] for r in sorted(o.run_steps)[:2])
            w = o.workload
            rows.append(
                {
                    "key": o.key,
                    "label": o.key,
                    "group": group_of(w),
                    "step_s": first,
                    "pred_step_s": second,
                    "tokens_per_step": w.tokens_per_step,
                    "peak_bytes": None,
                    "pred_peak_bytes": None,
                }
            )
    s = summarize(rows) if rows else {}
    keys = ("step_median_pct", "step_p90_pct", "resolved_pairs", "resolved_pairs_ordered_share")
    return {
        "retest_configurations": len(rows),
        **{f"retest_{k}": s.get(k) for k in keys + ("fastest_groups", "fastest_share")},
    }


def label(o: C.Observation) -> str:
    w = o.workload
    opts = json.loads(o.key)[-1]
    extra = " ".join(f"{k}={v}" for k, v in opts.items())
    layout = "" if w.layout == "separate" else f"layout={w.layout}"
    version = M.modelled_version(w.strategy, w.strategy_version)
    return " ".join(x for x in (w.strategy, extra, layout, version and f"v{version}") if x)


def _row(o: C.Observation, p: M.Prediction) -> dict:
    return {
        "key": o.key,
        "label": label(o),
        "group": group_of(o.workload),
        "impl": o.workload.impl,
        "step_s": o.step_s,
        "pred_step_s": p.step_s,
        "tokens_per_step": o.workload.tokens_per_step,
        "peak_bytes": o.peak_bytes,
        "pred_peak_bytes": p.peak_bytes,
        "runs": o.runs,
    }


_LOO: tuple = ()


def _loo_init(obs, collectives, attention_rate) -> None:
    global _LOO
    _LOO = (obs, collectives, attention_rate)


def _loo_row(i: int) -> dict:
    """Configuration ``i`` predicted from a calibration fitted without it (the worker's ``_LOO``)."""
    obs, collectives, attention_rate = _LOO
    cal = C.fit(obs[:i] + obs[i + 1 :], collectives, attention_rate=attention_rate)
    return _row(obs[i], M.predict(obs[i].workload, cal))


def leave_one_out(
    obs: list[C.Observation], collectives: dict, attention_rate: dict | None = None, jobs: int = 1
) -> list[dict]:
    """Every configuration predicted from a calibration that excludes it, one fit each, over
    ``jobs`` worker processes (the fits are independent, so the rows do not depend on ``jobs``)."""
    if jobs <= 1:
        _loo_init(obs, collectives, attention_rate)
        return [_loo_row(i) for i in range(len(obs))]
    with ProcessPoolExecutor(jobs, initializer=_loo_init, initargs=(obs, collectives, attention_rate)) as pool:
        return list(pool.map(_loo_row, range(len(obs)), chunksize=4))


def out_of_scale(
    obs: list[C.Observation], collectives: dict, train_ws=(1,), test_ws=(2,), attention_rate: dict | None = None
) -> list[dict]:
    train = [o for o in obs if o.workload.world_size in train_ws]
    test = [o for o in obs if o.workload.world_size in test_ws]
    if not train or not test:
        return []
    cal = C.fit(train, collectives, attention_rate=attention_rate)
    return [_row(o, M.predict(o.workload, cal)) for o in test]


# Device kinds whose GPU memory a calibration's peaks should predict as its own: the same
# architecture, allocator and kernels on a different part (Hopper: H100 and H200 records of one
# configuration peak at the same byte count, docs/planner.md), so their records test the memory
# model out of sample; their step times do not (other bandwidths and clocks).
SAME_MEMORY_KINDS = {"h100": ("h200",), "h200": ("h100",)}


def peaks_on_other_parts(results_dir, kind: str, cal: dict) -> dict:
    """Per kind in ``SAME_MEMORY_KINDS[kind]`` with records: the peak error of ``cal``'s predictions
    of its configurations (none of which the calibration saw)."""
    out = {}
    for other in SAME_MEMORY_KINDS.get(kind, ()):
        obs = [o for o in C.observations(results_dir, other) if o.peak_bytes and o.workload.state_bytes is not None]
        errs = [_pct(M.predict(o.workload, cal).peak_bytes, o.peak_bytes) for o in obs]
        if errs:
            runs = sorted({r for o in obs for r in o.runs})
            out[other] = {
                "configurations": len(errs),
                "peak_median_pct": float(np.median(errs)),
                "peak_p90_pct": float(np.percentile(errs, 90)),
                "runs": runs,
            }
    return out


def _signed_summary(rows: list[dict], obs: list[C.Observation]) -> dict:
    """Step error of ``rows`` (predictions of ``obs``, in order): the signed median, and the median, p90
    and signed median over the configurations that wait on their host."""
    signed = [_signed_pct(r["pred_step_s"], r["step_s"]) for r in rows]
    waiting = [e for e, o in zip(signed, obs) if M.waits_on_host(o.workload)]
    return {
        "step_signed_median_pct": float(np.median(signed)),
        "host_waiting_configurations": len(waiting),
        "host_waiting_step_median_pct": float(np.median(np.abs(waiting))) if waiting else None,
        "host_waiting_step_p90_pct": float(np.percentile(np.abs(waiting), 90)) if waiting else None,
        "host_waiting_step_signed_median_pct": float(np.median(waiting)) if waiting else None,
    }


def derived_parts(results_dir, kind: str, cal: dict) -> dict:
    """Per kind derived from ``kind`` (``calibrate.DERIVED_FROM``) that has records: ``cal`` derived
    for it (``calibrate.derive``) against its configurations, none of which ``cal`` saw (step
    times, peaks, rankings). Each configuration is predicted with the HBM ratio and the host costs
    refitted from the part's other configurations (left out of its own refit); beside it, the
    derivation from the datasheets' HBM ratio without any of the part's records, and ``cal`` as
    fitted."""
    out = {}
    for other, source in C.DERIVED_FROM.items():
        obs = C.observations(results_dir, other) if source == kind else []
        if not obs:
            continue
        hbm_only = C.derive(cal, other)
        own = C.derive(cal, other, obs)["derived_from"]
        rows = [_row(o, M.predict(o.workload, C.derive(cal, other, obs[:i] + obs[i + 1 :]))) for i, o in enumerate(obs)]
        plain = [_row(o, M.predict(o.workload, hbm_only)) for o in obs]
        plain_summary = summarize(plain)
        as_fitted = [_signed_pct(M.predict(o.workload, cal).step_s, o.step_s) for o in obs]
        out[other] = {
            "derived_from": source,
            "hbm_ratio": own["hbm_ratio"],
            "hbm_ratio_datasheet": hbm_only["derived_from"]["hbm_ratio"],
            "scaled": own["scaled"],
            "refit": "each configuration predicted with the HBM ratio and host costs refitted from the others",
            **summarize(rows),
            **_signed_summary(rows, obs),
            "without_own_records": {
                **{
                    k: plain_summary[k] for k in ("step_median_pct", "step_p90_pct", "spearman_median", "fastest_share")
                },
                "below_0.9": plain_summary["by_model_and_gpus"]["below_0.9"],
                **_signed_summary(plain, obs),
            },
            "as_fitted_step_median_pct": float(np.median(np.abs(as_fitted))),
            "as_fitted_step_signed_median_pct": float(np.median(as_fitted)),
            "runs": sorted({r for o in obs for r in o.runs}),
            "predictions": rows,
        }
    return out


def validate(results_dir="results", kind="h100", jobs: int = 1) -> dict:
    obs = C.observations(results_dir, kind)
    coll = C.fit_collectives(results_dir, kind)
    att = C.fit_attention(results_dir, kind)
    full = C.fit(obs, coll, attention_rate=att)
    in_sample = [_row(o, M.predict(o.workload, full)) for o in obs]
    loo = leave_one_out(obs, coll, att, jobs)
    oos = out_of_scale(obs, coll, attention_rate=att)
    # after the fact (the pre-registered test is out-of-scale-h100x4.json): this model fitted on
    # the 1- and 2-GPU configurations, predicting the 4-GPU ones
    oos4 = out_of_scale(obs, coll, train_ws=(1, 2), test_ws=(4,), attention_rate=att)
    spread = {impl: v["median"] for impl, v in full["launch_spread"].items()}
    return {
        "schema_version": C.SCHEMA_VERSION,
        "kind": "plan-validation",
        "device_kind": kind,
        "targets": TARGETS,
        "in_sample": summarize(in_sample, spread),
        "leave_one_out": summarize(loo, spread),
        "out_of_scale": {"train": "1-GPU configurations", "test": "2-GPU configurations", **summarize(oos, spread)},
        "out_of_scale_4": {
            "train": "1- and 2-GPU configurations",
            "test": "4-GPU configurations",
            **summarize(oos4, spread),
        },
        "retest": retest(obs, loo),
        "peaks_on_other_parts": peaks_on_other_parts(results_dir, kind, full),
        "derived_parts": derived_parts(results_dir, kind, full),
        "predictions": loo,
        "out_of_scale_predictions": oos,
        "out_of_scale_4_predictions": oos4,
        "runs": full["runs"],
    }


def _signed_pct(pred, meas):
    return None if not pred or not meas else (pred / meas - 1) * 100


# Case fields a prediction does not depend on: the device it ran on (a planned GPU suite run on CPU
# processes to try it) and how many steps were timed after how many untimed ones.
UNPREDICTED_FIELDS = ("device", "steps", "warmup")


def configuration_key(case: dict) -> str | None:
    """A stored case's identity without ``UNPREDICTED_FIELDS``, or None where it is no valid case."""
    from parabench.case import Case

    try:
        identity = Case.from_dict(case).identity()
    except (KeyError, TypeError, ValueError):
        return None
    return json.dumps({k: v for k, v in identity.items() if k not in UNPREDICTED_FIELDS}, sort_keys=True, default=str)


def prediction_of(record: dict, by_hash: dict, by_configuration: dict | None = None) -> dict | None:
    """The prediction of ``record``'s case: by its hash, else (``by_configuration``: predictions by
    ``configuration_key`` of the case they were written for) by its configuration."""
    p = by_hash.get(record.get("case_hash"))
    if p is None and by_configuration and isinstance(record.get("case"), dict):
        p = by_configuration.get(configuration_key(record["case"]))
    return p


def preregistered(predictions_path, run_dir, worst: int = 8) -> dict:
    """Predictions written before ``run_dir`` ran, against its records (matched by case hash; a
    case with repeats by the medians over its launches).

    Summaries over every predicted case of the run and over its cases of the largest GPU count
    (the out-of-scale part when the calibration had none), with the worst misses (signed %,
    prediction over measurement) of step time and peak memory."""
    from parabench.plan.workload import from_record
    from parabench.results import load_run
    from parabench.stats import combine_launches

    doc = json.loads(Path(predictions_path).read_text())
    by_hash = {p["case_hash"]: p for p in doc["predictions"]}
    by_configuration = {configuration_key(p["case"]): p for p in doc["predictions"] if isinstance(p.get("case"), dict)}
    manifest, raw = load_run(Path(run_dir))
    # a case launched several times (repeats) is one configuration: its medians over launches
    records = combine_launches(raw)
    launch_steps = {
        r.get("case_hash"): [
            x["step_time_s_median"] for x in r.get("launches", ()) if x["status"] == "ok" and x["step_time_s_median"]
        ]
        for r in records
    }
    rows, unmatched = [], []
    for r in records:
        p = prediction_of(r, by_hash, by_configuration)
        m = r.get("metrics") or {}
        w = from_record(r)
        if r.get("status") != "ok" or not m.get("step_time_s_median"):
            continue
        if p is None or p.get("step_time_s") is None or w is None:
            unmatched.append(r.get("label"))
            continue
        rows.append(
            {
                "key": r["case_hash"],
                "label": r.get("label"),
                "group": group_of(w),
                "world_size": w.world_size,
                "step_s": m["step_time_s_median"],
                "pred_step_s": p["step_time_s"],
                "tokens_per_step": w.tokens_per_step,
                "step_err_pct": _signed_pct(p["step_time_s"], m["step_time_s_median"]),
                "peak_bytes": m.get("peak_alloc_bytes"),
                "pred_peak_bytes": p.get("peak_bytes"),
                "peak_err_pct": _signed_pct(p.get("peak_bytes"), m.get("peak_alloc_bytes")),
            }
        )
    rows.sort(key=lambda r: (r["group"], r["label"]))
    top_ws = max((r["world_size"] for r in rows), default=None)
    largest = [r for r in rows if r["world_size"] == top_ws]

    def worst_of(field: str) -> list:
        have = [r for r in rows if r[field] is not None]
        return [
            {"label": r["label"], field: round(r[field], 1)} for r in sorted(have, key=lambda r: -abs(r[field]))[:worst]
        ]

    return {
        "schema_version": C.SCHEMA_VERSION,
        "kind": "plan-preregistered",
        "launch_retest": launch_retest(rows, launch_steps),
        "predictions": str(predictions_path),
        "predictions_commit": doc.get("commit"),
        "calibration_runs": doc.get("calibration_runs"),
        "calibration_configurations": doc.get("calibration_configurations"),
        "run": str(run_dir),
        "targets": TARGETS,
        "largest_world_size": top_ws,
        f"world_size_{top_ws}": summarize(largest),
        "all_cases": summarize(rows),
        "worst_step": worst_of("step_err_pct"),
        "worst_peak": worst_of("peak_err_pct"),
        "unmatched": unmatched,
        "fits": fits_as_predicted(records, by_hash, manifest, by_configuration),
        "cases": rows,
    }


def fits_as_predicted(records: list[dict], by_hash: dict, manifest: dict, by_configuration: dict | None = None) -> dict:
    """Whether each case ran where the planner said it fits and ran out of memory where it said it
    does not: the predicted peak against ``search.USABLE`` of the run's smallest GPU memory, beside
    the record's status (ok or oom; other failures say nothing about memory)."""
    from parabench.plan.search import usable_bytes

    usable = usable_bytes(manifest)
    if usable is None:
        return {"cases": 0, "as_predicted": 0, "usable_bytes": None, "wrong": []}
    cases = []
    for r in records:
        p = prediction_of(r, by_hash, by_configuration) or {}
        if r.get("status") not in ("ok", "oom") or p.get("peak_bytes") is None:
            continue
        fits = p["peak_bytes"] <= usable
        cases.append((r.get("label"), fits, r["status"], p["peak_bytes"]))
    wrong = [
        {"label": label, "predicted": "fits" if fits else "does not fit", "status": status, "pred_peak_bytes": peak}
        for label, fits, status, peak in cases
        if fits != (status == "ok")
    ]
    return {"cases": len(cases), "as_predicted": len(cases) - len(wrong), "usable_bytes": usable, "wrong": wrong}


def launch_retest(rows: list[dict], launch_steps: dict[str, list[float]]) -> list[dict]:
    """Per group of a run with repeats: how its configurations launched at least twice (3 or more of
    them) rank themselves launch against launch (``retest_spearman``), beside the predictions'
    Spearman against their medians on the same configurations."""
    groups: dict[str, list] = {}
    for r in rows:
        if len(launch_steps.get(r["key"], ())) >= 2:
            groups.setdefault(r["group"], []).append(r)
    out = []
    for g, rs in sorted(groups.items()):
        if len(rs) < 3:
            continue
        launches = [[x / r["tokens_per_step"] for x in launch_steps[r["key"]]] for r in rs]
        out.append(
            {
                "group": g,
                "configs": len(rs),
                "retest_spearman": retest_spearman(launches),
                "model_spearman": spearman(*seconds_per_token(rs)),
            }
        )
    return out


def preregistered_table(rep: dict) -> str:
    lines = [
        "| cases | n | step err median | step err p90 | peak err median | peak err p90 "
        "| Spearman median, all (groups) | pairs > 5 % ordered | fastest named (3 % band) | strict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ws = rep["largest_world_size"]
    for name, s in ((f"{ws} GPUs", rep[f"world_size_{ws}"]), ("all of the run", rep["all_cases"])):
        pairs = (
            "-"
            if s["resolved_pairs_ordered_share"] is None
            else (f"{s['resolved_pairs_ordered_share'] * 100:.0f}% of {s['resolved_pairs']}")
        )
        fast = "-" if s["fastest_share"] is None else f"{s['fastest_share'] * 100:.0f}% of {s['fastest_groups']}"
        strict = "-" if s["fastest_strict_share"] is None else f"{s['fastest_strict_share'] * 100:.0f}%"
        lines.append(
            f"| {name} | {s['configurations']} | {_fmt(s['step_median_pct'], '%')} | {_fmt(s['step_p90_pct'], '%')} | "
            f"{_fmt(s['peak_median_pct'], '%')} | {_fmt(s['peak_p90_pct'], '%')} | "
            f"{_fmt(s['spearman_median'])} ({s['spearman_groups']}) | {pairs} | {fast} | {strict} |"
        )
    return "\n".join(lines)


def _fmt_share(v):
    return "-" if v is None else f"{v:.0%}"


def _fmt(v, unit=""):
    return "-" if v is None else (f"{v:.1f}{unit}" if unit == "%" else f"{v:.2f}")


def table(report: dict) -> str:
    lines = [
        "| test | configs | step err median | step err p90 | peak err median | peak err p90 | Spearman median, all (groups) "
        "| Spearman median, 5 % ties | Spearman within (model, GPUs): median, below 0.9 | pairs > 5 % ordered "
        "| fastest named (3 % band) | fastest named, strict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("in_sample", "leave_one_out", "out_of_scale", "out_of_scale_4"):
        s = report.get(name)
        if not s or not s["configurations"]:
            continue
        fast = "-" if s["fastest_share"] is None else f"{s['fastest_share'] * 100:.0f}% of {s['fastest_groups']}"
        strict = "-" if s["fastest_strict_share"] is None else f"{s['fastest_strict_share'] * 100:.0f}%"
        pairs = (
            "-"
            if s["resolved_pairs_ordered_share"] is None
            else f"{s['resolved_pairs_ordered_share'] * 100:.0f}% of {s['resolved_pairs']}"
        )
        lines.append(
            f"| {name.replace('_', ' ')} | {s['configurations']} | {_fmt(s['step_median_pct'], '%')} | "
            f"{_fmt(s['step_p90_pct'], '%')} | {_fmt(s['peak_median_pct'], '%')} | {_fmt(s['peak_p90_pct'], '%')} | "
            f"{_fmt(s['spearman_median'])} ({s['spearman_groups']}) | {_fmt(s['spearman_noise_tied_median'])} | "
            f"{scale_cell(s.get('by_model_and_gpus'))} | {pairs} | {fast} | {strict} |"
        )
    t = report["targets"]
    lines += retest_lines(report.get("retest"))
    lines.append(
        f"| target | | <= {t['step_median_pct']:.0f}% | | <= {t['peak_median_pct']:.0f}% | | reported beside the "
        f"retest, not a target | | | | >= {t['fastest_share'] * 100:.0f}% | |"
    )
    return "\n".join(lines)


def scale_cell(sc: dict | None, empty: str = "-") -> str:
    """The ranking within each (model, GPU count) in one table cell: median and groups below 0.9, as
    measured and with runs within 5 % merged; ``empty`` where a validation file predates it."""
    if not sc or not sc.get("groups"):
        return empty
    within = sc.get("misordered_within_launch_spread")
    pairs = (
        f"; pairs ordered wrong there within their launch spread: {within} of {sc['misordered_pairs_below_0.9']}"
        if within is not None and sc.get("below_0.9")
        else ""
    )
    return (
        f"{_fmt(sc['spearman_median'])}, {sc['below_0.9']} of {sc['groups']} "
        f"(merged: {_fmt(sc['noise_tied_median'])}, {sc['noise_tied_below_0.9']} of {sc['noise_tied_groups']}{pairs})"
    )


def retest_lines(rt: dict | None) -> list[str]:
    """The measurements' own ranking (``retest``) as a row of the table: the ceiling of its Spearman column."""
    if not rt or not rt["groups"]:
        return []
    share = rt["retest_share_ge_0.9"]
    return [
        f"| measurements' retest: two launches of each configuration ranked against each other "
        f"(groups with 3+ configurations run twice or more) | {sum(g['configs'] for g in rt['per_group'])} | | | | | "
        f"{_fmt(rt['retest_median'])} ({rt['groups']}; {share * 100:.0f}% >= 0.9); leave one out on the same: "
        f"{_fmt(rt['model_median'])}, at or above the retest in {rt['model_at_or_above_retest']} | | | | | |"
    ]


def derived_lines(parts: dict) -> None:
    for other, s in parts.items():
        plain = s["without_own_records"]
        print(
            f"steps of the {s['configurations']} {other} configurations, by this calibration derived for {other} "
            f"(memory-bound constants x {s['hbm_ratio']:.3f}, datasheets' {s['hbm_ratio_datasheet']:.3f}, and host "
            f"costs from the other {other} configurations): "
            f"median {s['step_median_pct']:.1f} %, p90 {s['step_p90_pct']:.1f} %, signed median "
            f"{s['step_signed_median_pct']:+.1f} %; the {s['host_waiting_configurations']} waiting on their host: "
            f"median {_fmt(s['host_waiting_step_median_pct'], '%')}, signed {_fmt(s['host_waiting_step_signed_median_pct'], '%')} "
            f"(from the datasheets, without its records: {plain['step_median_pct']:.1f} / {plain['step_p90_pct']:.1f} %, host-waiting "
            f"{_fmt(plain['host_waiting_step_median_pct'], '%')}, signed {_fmt(plain['host_waiting_step_signed_median_pct'], '%')}; "
            f"as fitted: median {s['as_fitted_step_median_pct']:.1f} %, signed {s['as_fitted_step_signed_median_pct']:+.1f} %); "
            f"Spearman median {_fmt(s['spearman_median'])} ({s['spearman_groups']} groups); fastest named "
            f"{_fmt_share(s['fastest_share'])} of {s['fastest_groups']} (exactly {_fmt_share(s['fastest_strict_share'])})"
        )
