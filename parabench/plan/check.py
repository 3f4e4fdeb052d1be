"""``parabench check`` and ``parabench calibrate``: the planner's predictions set against a run, and
the planner's calibration refitted from the committed records.

The flow: ``parabench plan ... --write-suite F.toml`` writes the suite and, beside it, the
predictions of its cases (``F.predictions.json``, ``predictions_path``); ``parabench run suite
F.toml`` measures them; ``parabench check RUN`` finds the predictions beside the suite the run's
manifest names and prints predicted against measured, with the validation's metrics
(``parabench.plan.validate.summarize``) beside the measurements' own retest (``retest_figures``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# numpy and the model load only when a command runs: the CLI builds its parser for every command.

PREDICTIONS_SCHEMA = 1


def predictions_path(suite_path) -> Path:
    """Where ``parabench plan --write-suite`` puts the predictions of a suite: beside it,
    ``<stem>.predictions.json``."""
    suite_path = Path(suite_path)
    return suite_path.with_name(f"{suite_path.stem}.predictions.json")


def stored_path(kind: str, directory=None) -> Path:
    """The calibration file ``load_kind`` reads for ``kind``: its own, else its source's."""
    from parabench.plan import calibrate as C

    path = C.calibration_path(kind, directory)
    if path.is_file() or kind not in C.DERIVED_FROM:
        return path
    return stored_path(C.DERIVED_FROM[kind], directory)


def _relative(path) -> str:
    """The calibration's path from the repository root where it lies inside it (the file is committed)."""
    from parabench.plan import calibrate as C

    root = C.CALIBRATION_DIR.parents[1]
    path = Path(path).resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def predict_suite(path, kind: str = "h100", calibration: str | None = None, calibration_dir=None) -> dict:
    """Every case of the suite at ``path`` predicted by ``kind``'s calibration (or the calibration
    file ``calibration``; or the kind's in ``calibration_dir``), keyed by case hash."""
    from parabench.multinode import resolve_node_options
    from parabench.plan import calibrate as C
    from parabench.plan import model as M
    from parabench.plan import workload as W
    from parabench.results import git_output
    from parabench.shapes import model_config
    from parabench.suite import load_suite

    cal = C.load(calibration) if calibration else C.load_kind(kind, calibration_dir)
    if cal is None:
        raise C.CalibrationError(f"no calibration for {kind!r} (parabench calibrate --gpu ...)")
    suite = load_suite(str(path))
    # the calibration prices one machine: options "node" are its whole data-parallel degree
    suite.cases = resolve_node_options(suite.cases, 1)
    rows = []
    for case in suite.cases:
        cfg = model_config(case.model, case.seq_len, layout=case.layout)
        w = W.for_config(
            model=case.model,
            cfg=cfg,
            strategy=case.strategy,
            world_size=case.world_size,
            precision=case.precision,
            recipe=case.recipe,
            micro_batch=case.micro_batch,
            grad_accum=case.grad_accum,
            options=case.options,
        )
        p = M.predict(w, cal) if w is not None else None
        rows.append(
            {
                "case_hash": case.case_hash,
                "case": case.to_dict(),
                "label": case.label,
                "tokens_per_s_per_device": p.tokens_per_s_per_gpu if p else None,
                "mfu": p.mfu if p else None,
                "peak_bytes": p.peak_bytes if p else None,
                "step_time_s": p.step_s if p else None,
                "bottleneck": p.bottleneck if p else None,
                "time_s": p.time_s if p else None,
                "notes": p.notes if p else ["no workload for this strategy"],
            }
        )
    devices = sorted({c.device for c in suite.cases})
    return {
        "schema": PREDICTIONS_SCHEMA,
        "suite": suite.name,
        "suite_file": str(path),
        "suite_file_sha256": suite.file_hash,
        "device": devices[0] if len(devices) == 1 else "cuda",
        "device_kind": cal["device_kind"],
        "calibration": _relative(calibration or stored_path(kind, calibration_dir)),
        "derived": cal["derived_from"]["doc"] if "derived_from" in cal else None,
        "calibration_schema": cal["schema_version"],
        "calibration_configurations": cal["configurations"],
        "calibration_runs": cal["runs"],
        "commit": git_output("rev-parse", "HEAD") or "",
        "predictions": rows,
    }


def write_predictions(suite_path, kind: str, calibration_dir=None) -> Path:
    """The predictions of the suite at ``suite_path``, written beside it (``predictions_path``)."""
    from parabench.plan import calibrate as C

    out = predict_suite(suite_path, kind, calibration_dir=calibration_dir)
    return C.save(out, predictions_path(suite_path))


# --- check -----------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def retest_figures(rows: list[dict], raw: list[dict]) -> dict | None:
    """The measurements' own figures for each metric ``check`` reports: the run's second launch of
    each case "predicting" its first. Step and peak: median and p90 of |second / first - 1|; pairs
    more than 5 % apart (by the first launch) that the second orders the same; groups whose fastest
    by the second launch is within 3 % of the fastest by the first. None where no case was launched
    twice (``--repeats``)."""
    from parabench.plan import validate as V
    from parabench.stats import launch_index

    by_case: dict[str, list[dict]] = {}
    for r in raw:
        if r.get("status") == "ok" and (r.get("metrics") or {}).get("step_time_s_median"):
            by_case.setdefault(r.get("case_hash"), []).append(r)
    pairs = []
    for row in rows:
        launches = sorted(by_case.get(row["key"], ()), key=launch_index)
        if len(launches) >= 2:
            pairs.append((row, launches[0]["metrics"], launches[1]["metrics"]))
    if not pairs:
        return None
    step = [abs(b["step_time_s_median"] / a["step_time_s_median"] - 1) * 100 for _, a, b in pairs]
    peak = [
        abs(b["peak_alloc_bytes"] / a["peak_alloc_bytes"] - 1) * 100
        for _, a, b in pairs
        if a.get("peak_alloc_bytes") and b.get("peak_alloc_bytes")
    ]
    as_rows = [
        {
            "key": row["key"],
            "label": row["label"],
            "group": row["group"],
            "tokens_per_step": row["tokens_per_step"],
            "step_s": a["step_time_s_median"],
            "pred_step_s": b["step_time_s_median"],
            "peak_bytes": a.get("peak_alloc_bytes"),
            "pred_peak_bytes": b.get("peak_alloc_bytes"),
        }
        for row, a, b in pairs
    ]
    s = V.summarize(as_rows)
    return {
        "configurations": len(pairs),
        "step_median_pct": _pct(step, 50),
        "step_p90_pct": _pct(step, 90),
        "peak_median_pct": _pct(peak, 50),
        "peak_p90_pct": _pct(peak, 90),
        "resolved_pairs": s["resolved_pairs"],
        "resolved_pairs_ordered_share": s["resolved_pairs_ordered_share"],
        "fastest_groups": s["fastest_groups"],
        "fastest_share": s["fastest_share"],
        "spearman_median": s["spearman_median"],
    }


def check(run_dir, predictions=None) -> dict:
    """``validate.preregistered`` of ``run_dir`` against its predictions (``predictions``, else the
    file beside the suite its manifest names), with ``retest_figures`` and the predictions' origin."""
    from parabench.plan import calibrate as C
    from parabench.plan import validate as V
    from parabench.results import load_run

    manifest, raw = load_run(Path(run_dir))
    if predictions is None:
        suite_file = Path(manifest.get("suite_file") or "")
        predictions = predictions_path(suite_file)
        if not suite_file.name or not predictions.is_file():
            raise FileNotFoundError(
                f"no predictions beside the run's suite ({predictions}); `parabench plan ... --write-suite` "
                "writes them there, or give --predictions FILE"
            )
    rep = V.preregistered(predictions, run_dir)
    doc = json.loads(Path(predictions).read_text())
    rep["retest"] = retest_figures(rep["cases"], raw)
    # files written before predictions named their kind name it by their calibration file
    stem = Path(doc.get("calibration") or "").stem
    rep["predicted_device_kind"] = doc.get("device_kind") or (stem if stem in C.DEVICE_KINDS else None)
    measured = sorted({d.get("name") for d in manifest.get("devices") or () if d.get("name")})
    rep["measured_devices"] = measured
    rep["suite_changed"] = bool(
        doc.get("suite_file_sha256") and doc["suite_file_sha256"] != manifest.get("suite_file_sha256")
    )
    return rep


def _f(v, unit: str = " %") -> str:
    return "-" if v is None else f"{v:.1f}{unit}"


def _r(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _share(good, total) -> str:
    return "-" if not total or good is None else f"{good:.0%} of {total}"


def check_lines(rep: dict) -> list[str]:
    """``check``'s report as printed lines: one per case, then the metrics beside the retest."""
    from parabench.plan import calibrate as C
    from parabench.plan import model as M

    lines = []
    kind = rep.get("predicted_device_kind")
    measured = rep.get("measured_devices") or []
    if kind and not any(C.device_kind(name) == kind for name in measured):
        lines.append(
            f"note: predicted for {kind}, measured on {', '.join(measured) or 'CPU processes'}: "
            "the errors below compare different machines"
        )
    if rep.get("suite_changed"):
        lines.append("note: the suite file changed after the predictions were written")
    width = max([40] + [len(r["label"] or "") for r in rep["cases"]])
    lines.append(
        f"{'case':{width}s} {'pred tok/s/GPU':>14} {'meas':>10} {'step err':>9} {'pred GiB':>9} {'meas':>7} {'err':>7}"
    )
    for r in rep["cases"]:
        tokens = r["tokens_per_step"] / max(1, int(r.get("world_size") or 1))
        pred_peak = r["pred_peak_bytes"] / M.GIB if r["pred_peak_bytes"] else None
        meas_peak = r["peak_bytes"] / M.GIB if r["peak_bytes"] else None
        lines.append(
            f"{r['label']:{width}s} {tokens / r['pred_step_s']:>14,.0f} {tokens / r['step_s']:>10,.0f} "
            f"{r['step_err_pct']:>+8.1f}% {_f(pred_peak, ''):>9} {_f(meas_peak, ''):>7} "
            f"{_f(r['peak_err_pct'], '%'):>7}"
        )
    s, rt = rep["all_cases"], rep.get("retest") or {}
    retest = (
        f"  retest: the run's second launch of each of {rt['configurations']} cases set against its first"
        if rt
        else "  no retest: run the suite with --repeats 2 or more for the measurements' own figures"
    )
    lines += [
        "",
        f"{s['configurations']} cases predicted and measured"
        + (f"; {len(rep['unmatched'])} without a prediction" if rep["unmatched"] else ""),
        f"  step time error: median {_f(s['step_median_pct'])}, p90 {_f(s['step_p90_pct'])}"
        + (f"; retest {_f(rt['step_median_pct'])}, {_f(rt['step_p90_pct'])}" if rt else ""),
        f"  peak memory error: median {_f(s['peak_median_pct'])}, p90 {_f(s['peak_p90_pct'])}"
        + (f"; retest {_f(rt['peak_median_pct'])}, {_f(rt['peak_p90_pct'])}" if rt else ""),
        f"  pairs more than 5 % apart ordered correctly: {_share(s['resolved_pairs_ordered_share'], s['resolved_pairs'])}"
        + (f"; retest {_share(rt['resolved_pairs_ordered_share'], rt['resolved_pairs'])}" if rt else ""),
        f"  fastest named (within 3 %): {_share(s['fastest_share'], s['fastest_groups'])} groups"
        + (f"; retest {_share(rt['fastest_share'], rt['fastest_groups'])}" if rt else ""),
        f"  Spearman within groups (reported, not a target): median {_r(s['spearman_median'])} over "
        f"{s['spearman_groups']} groups" + (f"; retest {_r(rt.get('spearman_median'))}" if rt else ""),
        retest,
    ]
    fits = rep["fits"]
    if fits["cases"]:
        lines.append(f"  fit or ran out of memory as predicted: {fits['as_predicted']} of {fits['cases']}")
        for r in fits["wrong"]:
            lines.append(f"    {r['label']}: predicted {r['predicted']}, ran {r['status']}")
    return lines


def add_check_arguments(p) -> None:
    p.add_argument("run", help="a run folder of a suite written by `parabench plan --write-suite`")
    p.add_argument("--predictions", metavar="FILE", help="the predictions file (default: beside the run's suite)")
    p.add_argument("--out", metavar="FILE", help="also write the comparison as JSON")


def check_main(args) -> int:
    from parabench.plan import calibrate as C

    try:
        rep = check(args.run, args.predictions)
    except (OSError, ValueError, KeyError) as exc:
        print(f"parabench check: {exc}", file=sys.stderr)
        return 2
    if not rep["cases"]:
        print(f"parabench check: no finished case of {args.run} has a prediction", file=sys.stderr)
        return 1
    print("\n".join(check_lines(rep)))
    if args.out:
        C.save(rep, args.out)
        print(f"written {args.out}")
    return 0


# --- calibrate -------------------------------------------------------------------------------------


def add_calibrate_arguments(p) -> None:
    p.add_argument(
        "--gpu",
        default="h100-80g",
        help="the GPU kind to refit, as `parabench plan --gpu` names it; the kinds derived from it follow "
        "(default h100-80g)",
    )
    p.add_argument("--results", default="results", help="the folder of committed runs (default results)")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write <kind>.json (and validation-<kind>.json) here instead of <results>/calibration",
    )
    p.add_argument(
        "--validate",
        choices=("derived", "all"),
        help="also validate: 'derived' scores the derived kinds on their own records (under a minute); "
        "'all' adds leave-one-configuration-out and out-of-scale fits (over 20 minutes on 2 cores)",
    )


def calibrate_main(args) -> int:
    import os

    from parabench.plan import calibrate as C
    from parabench.plan import validate as V
    from parabench.plan.search import GPUS

    if args.gpu not in GPUS:
        print(f"parabench calibrate: unknown GPU {args.gpu!r}; GPUs: {', '.join(GPUS)}", file=sys.stderr)
        return 2
    kind = GPUS[args.gpu][0]
    out_dir = Path(args.out or Path(args.results) / "calibration")
    try:
        cal = C.calibrate(args.results, kind)
    except C.CalibrationError as exc:
        print(f"parabench calibrate: {exc}", file=sys.stderr)
        return 2
    path = C.save(cal, C.calibration_path(kind, out_dir))
    print(f"{path}: {cal['configurations']} configurations from {cal['records']} records")
    for other in (k for k, src in C.DERIVED_FROM.items() if src == kind):
        derived = C.derive(cal, other, C.observations(args.results, other))
        print(f"{C.save(derived, C.calibration_path(other, out_dir))}: {derived['derived_from']['doc']}")
    if args.validate:
        target = out_dir / f"validation-{kind}.json"
        if args.validate == "all":
            rep = V.validate(args.results, kind, os.cpu_count() or 1)
        else:
            rep = json.loads(target.read_text()) if target.is_file() else None
            if rep is None or rep.get("kind") != "plan-validation":
                print(f"parabench calibrate: --validate derived updates a stored {target}: none", file=sys.stderr)
                return 2
            rep["peaks_on_other_parts"] = V.peaks_on_other_parts(args.results, kind, cal)
            rep["derived_parts"] = V.derived_parts(args.results, kind, cal)
        C.save(rep, target)
        if args.validate == "all":
            print(V.table(rep))
        V.derived_lines(rep["derived_parts"])
        print(f"written {target}")
    return 0
