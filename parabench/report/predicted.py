"""Report section: predicted vs measured. Each case of a GPU run beside what the planner's
calibrated model (``parabench.plan``) predicts for it from the record's own theory, with the error;
misses beyond ``MISS`` are flagged, so each run shows where the model must improve. A case that ran
out of memory is shown beside its predicted peak, flagged where the planner would have kept it (its
peak within ``search.usable_bytes`` of the run's GPU memory); a case that ran where the planner would
have dropped it is flagged too. The calibration is the committed one of the run's device kind
(``results/calibration/<kind>.json``), which may have been fitted on this very run: the honest
out-of-sample figures are in ``results/calibration/validation-<kind>.json``. Imports no torch.
"""

from __future__ import annotations

import json

from parabench.plan.validate import scale_cell
from parabench.report.frames import dig, run_name

MISS = 0.25
COLUMNS = [
    ("label", "case", "str"),
    ("step_ms", "step ms", "f1"),
    ("pred_step_ms", "predicted ms", "f1"),
    ("step_err_pct", "step error %", "f1"),
    ("peak_gib", "peak GiB", "f2"),
    ("pred_peak_gib", "predicted GiB", "f2"),
    ("peak_err_pct", "peak error %", "f1"),
    ("bottleneck", "predicted bottleneck", "str"),
    ("flag", "flag (miss > 25 %, fit)", "str"),
]


def prediction_rows(runs, calibration_dir=None) -> tuple[list[dict], list[str], list[tuple[str, str]]]:
    """(rows, device names without a calibration, (kind, what it says of itself) of each calibration
    derived from another part's) for every ok or out-of-memory record the model covers."""
    from parabench.plan import calibrate as C
    from parabench.plan import model as M
    from parabench.plan.search import usable_bytes
    from parabench.plan.workload import from_record

    cals: dict = {}
    missing: set[str] = set()
    rows = []
    for manifest, records in runs:
        usable = usable_bytes(manifest)
        for r in records:
            status = r.get("status")
            if status not in ("ok", "oom"):
                continue
            # a failed case's record has no device section: the run's GPUs
            name = dig(r, "device", "name") or next(
                (d["name"] for d in manifest.get("devices") or () if d.get("name")), "unknown device"
            )
            kind = C.device_kind(name)
            if kind not in cals:
                cals[kind] = C.load_kind(kind, calibration_dir) if kind else None
            cal = cals[kind]
            if cal is None:
                missing.add(name)
                continue
            w = from_record(r)
            step = dig(r, "metrics", "step_time_s_median") if status == "ok" else None
            if w is None or w.unmodelled or (status == "ok" and not step):
                continue
            p = M.predict(w, cal)
            fits = None if usable is None or p.peak_bytes is None else p.peak_bytes <= usable
            peak = dig(r, "metrics", "peak_alloc_bytes") if step else None
            step_err = (p.step_s - step) / step if step else None
            peak_err = (p.peak_bytes - peak) / peak if peak and p.peak_bytes else None
            if status == "oom":
                miss = fits is not False
                flag = "OOM, predicted to fit" if fits else "OOM, as predicted" if fits is False else "OOM"
            else:
                off = abs(step_err) > MISS or (peak_err is not None and abs(peak_err) > MISS)
                miss = off or fits is False
                flag = " ".join(
                    f for f in ("MISS" if off else "", "ran, predicted not to fit" if fits is False else "") if f
                )
            rows.append(
                {
                    "run": run_name(manifest),
                    "label": r.get("label"),
                    "step_ms": step * 1e3 if step else None,
                    "pred_step_ms": p.step_s * 1e3,
                    "step_err_pct": step_err * 100 if step_err is not None else None,
                    "peak_gib": peak / M.GIB if peak else None,
                    "pred_peak_gib": p.peak_bytes / M.GIB if p.peak_bytes else None,
                    "peak_err_pct": peak_err * 100 if peak_err is not None else None,
                    "bottleneck": p.bottleneck,
                    "flag": flag,
                    "miss": miss,
                    "kind": kind,
                }
            )
    used = {r["kind"] for r in rows}
    derived = [(k, cals[k]["derived_from"]["doc"]) for k in sorted(used) if "derived_from" in cals[k]]
    return rows, sorted(missing), derived


VALIDATION_COLUMNS = [
    ("test", "test", "wrap"),
    ("configs", "configurations", "int"),
    ("step_median", "step error median %", "f1"),
    ("step_p90", "step error p90 %", "f1"),
    ("peak_median", "peak error median %", "f1"),
    ("peak_p90", "peak error p90 %", "f1"),
    ("spearman", "Spearman within groups, median (groups)", "str"),
    ("spearman_tied", "Spearman, runs within 5 % merged", "f2"),
    ("spearman_scale", "Spearman within (model, GPUs): median, groups below 0.9", "str"),
    ("pairs", "pairs > 5 % apart ordered", "str"),
    ("fastest", "fastest named (3 % band; exactly)", "str"),
]
VALIDATION_TESTS = {
    "leave_one_out": "leave one configuration out",
    "out_of_scale": "out of scale: 1-GPU calibration, 2-GPU configurations",
    "out_of_scale_4": "out of scale: 1-2-GPU calibration, 4-GPU configurations",
}


def _pct(v):
    return v * 100 if v is not None else None


def validation_rows(report: dict) -> list[dict]:
    """The planner's own validation (``parabench.plan.validate``'s file) as table rows: each test,
    the measurements' retest (the ceiling of the Spearman column) and the issue's targets."""
    rows = []
    for key, name in VALIDATION_TESTS.items():
        s = report.get(key) or {}
        if not s.get("configurations"):
            continue
        fast = s.get("fastest_share")
        rows.append(
            {
                "test": name,
                "configs": s["configurations"],
                "step_median": s.get("step_median_pct"),
                "step_p90": s.get("step_p90_pct"),
                "peak_median": s.get("peak_median_pct"),
                "peak_p90": s.get("peak_p90_pct"),
                "spearman": "–"
                if s.get("spearman_median") is None
                else f"{s['spearman_median']:.2f} ({s['spearman_groups']})",
                "spearman_tied": s.get("spearman_noise_tied_median"),
                "spearman_scale": scale_cell(s.get("by_model_and_gpus"), empty="–"),
                "pairs": "–"
                if s.get("resolved_pairs_ordered_share") is None
                else f"{_pct(s['resolved_pairs_ordered_share']):.0f} % of {s['resolved_pairs']}",
                "fastest": "–"
                if fast is None
                else f"{_pct(fast):.0f} %; {_pct(s['fastest_strict_share']):.0f} % of {s['fastest_groups']}",
            }
        )
    rt = report.get("retest") or {}
    if rt.get("groups"):
        rows.append(
            {
                "test": "the measurements themselves: two launches of each configuration ranked against each "
                f"other; the model's leave-one-out on the same configurations {rt['model_median']:.2f}",
                "configs": sum(g["configs"] for g in rt["per_group"]),
                "spearman": f"{rt['retest_median']:.2f} ({rt['groups']})",
            }
        )
    t = report.get("targets") or {}
    if t:
        rows.append(
            {
                "test": "target",
                "step_median": t.get("step_median_pct"),
                "peak_median": t.get("peak_median_pct"),
                # retired as a target: the measurements' own retest reaches a median of about 0.9
                "spearman": "reported beside the retest, not a target",
                "spearman_scale": "reported, not a target",
                "fastest": f">= {_pct(t.get('fastest_share')):.0f} %",
            }
        )
    return rows


def validation_spec(kinds: list[str], calibration_dir=None) -> list[dict]:
    """The validation table of each device kind the run's predictions came from, where its file exists."""
    from parabench.plan import calibrate as C

    specs = []
    for kind in kinds:
        path = C.calibration_path(f"validation-{kind}", calibration_dir)
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if report.get("kind") != "plan-validation":
            continue
        specs.append(
            {
                "id_": f"plan-validation-{kind}",
                "title": f"Planner validation ({kind})",
                "columns": VALIDATION_COLUMNS,
                "rows": validation_rows(report),
                "note": f"How far the predictions above can be trusted: {path.name}, written by parabench "
                "calibrate --validate all from the committed quiet-host runs of this device kind. Leave one out "
                "predicts each configuration from a calibration without it; out of scale predicts larger GPU "
                "counts from smaller ones. The Spearman is the rank correlation of the configurations within "
                "each (model, GPU count, recipe, micro-batch) group; the measurements' own row is its ceiling.",
            }
        )
    return specs


def table_specs(runs, run_col: list, calibration_dir=None) -> list[dict]:
    """The section as keyword arguments of ``parabench.report.html._table``: the table, or nothing
    where no calibration covers the run's devices (CPU runs)."""
    rows, missing, derived = prediction_rows(runs, calibration_dir)
    if not rows:  # a section with no data is left out (a CPU run: no calibration covers its device)
        return []
    note = (
        "Each case beside the calibrated planner's prediction (parabench plan), from the record's own theory. "
        f"Rows flagged MISS are off by more than {MISS:.0%} in step time or peak memory; a case that ran out of "
        "memory, or ran where the planner would drop it, is flagged by whether the planner said it fits. "
        "The calibration may "
        "include this run: the validation table below gives the out-of-sample errors."
    )
    if missing:
        note += f" No calibration for {', '.join(missing)}: those cases are left out."
    for kind, doc in derived:
        note += f" {doc[0].upper()}{doc[1:]}; it includes no {kind} run."
    return [
        {
            "id_": "predicted",
            "title": "Predicted vs measured",
            "columns": run_col + COLUMNS,
            "rows": rows,
            "note": note,
            "row_class": lambda r: "bad-row" if r.get("miss") else "",
        }
    ] + (validation_spec(sorted({r["kind"] for r in rows}), calibration_dir) if rows else [])
