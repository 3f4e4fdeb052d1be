"""Report section: predicted vs measured. Each case of a GPU run beside what the planner's
calibrated model (``parabench.plan``) predicts for it from the record's own theory, with the error;
misses beyond ``MISS`` are flagged, so each run shows where the model must improve. The calibration
is the committed one of the run's device kind (``results/calibration/<kind>.json``), which may have
been fitted on this very run: the honest out-of-sample figures are in
``results/calibration/validation-<kind>.json``. Imports no torch.
"""

from __future__ import annotations

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
    ("flag", "miss > 25 %", "str"),
]


def prediction_rows(runs, calibration_dir=None) -> tuple[list[dict], list[str]]:
    """(rows, device names without a calibration) for every ok record the model covers."""
    from parabench.plan import calibrate as C
    from parabench.plan import model as M
    from parabench.plan.workload import from_record

    cals: dict = {}
    missing: set[str] = set()
    rows = []
    for manifest, records in runs:
        for r in records:
            if r.get("status") != "ok":
                continue
            name = dig(r, "device", "name") or "unknown device"
            kind = C.device_kind(name)
            if kind not in cals:
                cals[kind] = C.load_kind(kind, calibration_dir) if kind else None
            cal = cals[kind]
            if cal is None:
                missing.add(name)
                continue
            w = from_record(r)
            step = dig(r, "metrics", "step_time_s_median")
            if w is None or not step:
                continue
            p = M.predict(w, cal)
            peak = dig(r, "metrics", "peak_alloc_bytes")
            step_err = (p.step_s - step) / step
            peak_err = (p.peak_bytes - peak) / peak if peak and p.peak_bytes else None
            miss = abs(step_err) > MISS or (peak_err is not None and abs(peak_err) > MISS)
            rows.append(
                {
                    "run": run_name(manifest),
                    "label": r.get("label"),
                    "step_ms": step * 1e3,
                    "pred_step_ms": p.step_s * 1e3,
                    "step_err_pct": step_err * 100,
                    "peak_gib": peak / M.GIB if peak else None,
                    "pred_peak_gib": p.peak_bytes / M.GIB if p.peak_bytes else None,
                    "peak_err_pct": peak_err * 100 if peak_err is not None else None,
                    "bottleneck": p.bottleneck,
                    "flag": "MISS" if miss else "",
                    "miss": miss,
                }
            )
    return rows, sorted(missing)


def table_specs(runs, run_col: list, calibration_dir=None) -> list[dict]:
    """The section as keyword arguments of ``parabench.report.html._table``: the table, or one line
    saying no calibration covers the run's device (CPU runs)."""
    rows, missing = prediction_rows(runs, calibration_dir)
    if not rows and not missing:
        return []
    note = (
        "Each case beside the calibrated planner's prediction (parabench plan), from the record's own theory. "
        f"Rows flagged MISS are off by more than {MISS:.0%} in step time or peak memory. The calibration may "
        "include this run: see results/calibration/validation-*.json for leave-one-out errors."
    )
    if not rows:
        note = f"No planner calibration for {', '.join(missing)}: no predictions (calibrated GPU kinds only)."
    elif missing:
        note += f" No calibration for {', '.join(missing)}: those cases are left out."
    return [
        {
            "id_": "predicted",
            "title": "Predicted vs measured",
            "columns": run_col + COLUMNS,
            "rows": rows,
            "note": note,
            "row_class": lambda r: "bad-row" if r.get("miss") else "",
        }
    ]
