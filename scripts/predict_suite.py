"""Predict every case of a suite with the calibrated planner (``parabench.plan``) and write the
predictions as JSON, so a later run of the suite can be set against what was predicted before it ran.

    python scripts/predict_suite.py suites/h100x8.toml --out results/predictions/h100x8.json

``--calibration FILE`` predicts from another calibration file than the kind's committed one (a
model's earlier calibration, say, to pre-register two models' predictions side by side).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from parabench.models import model_config
from parabench.plan import model as M
from parabench.plan import workload as W
from parabench.plan.calibrate import DERIVED_FROM, calibration_path, load, load_kind
from parabench.suite import load_suite


def _relative(path) -> str:
    """The calibration's path from the repository root where it lies inside it (the file is committed)."""
    root = Path(__file__).resolve().parent.parent
    path = Path(path).resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def predict_suite(path: str, kind: str = "h100", calibration: str | None = None) -> dict:
    cal = load(calibration) if calibration else load_kind(kind)
    if cal is None:
        raise SystemExit(f"no calibration for {kind!r}: run python -m parabench.plan.calibrate results")
    suite = load_suite(path)
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
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "schema": 1,
        "suite": suite.name,
        "suite_file": path,
        "calibration": _relative(calibration or stored_path(kind)),
        "derived": cal["derived_from"]["doc"] if "derived_from" in cal else None,
        "calibration_schema": cal["schema_version"],
        "calibration_configurations": cal["configurations"],
        "calibration_runs": cal["runs"],
        "commit": commit,
        "predictions": rows,
    }


def stored_path(kind: str) -> Path:
    """The calibration file ``load_kind`` read for ``kind``: its own, else its source's."""
    path = calibration_path(kind)
    return path if path.is_file() or kind not in DERIVED_FROM else stored_path(DERIVED_FROM[kind])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite")
    ap.add_argument("--kind", default="h100")
    ap.add_argument("--calibration", help="a calibration file in place of the kind's committed one")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = predict_suite(args.suite, args.kind, args.calibration)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for r in out["predictions"]:
        tps, peak = r["tokens_per_s_per_device"], r["peak_bytes"]
        print(
            f"{r['label'][:78]:78s} {tps or 0:9,.0f} tok/s/GPU  peak {(peak or 0) / 2**30:6.1f} GiB  {r['bottleneck']}",
            file=sys.stdout,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
