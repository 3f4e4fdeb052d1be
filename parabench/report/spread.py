"""Report section: run-to-run spread of repeated cases.

A case counts as repeated when several finished records share everything but the seed (a suite
repeats cases with ``seed = [1, 2]``) or the very same case hash appears in several runs of the
report. Different seeds draw different (equally learnable) data and initial weights, which does not
change the work of a step, so their tokens/s spread is the run-to-run noise a reader should hold
every other comparison in the report against.
"""

from __future__ import annotations

import json
import statistics

from parabench.report.frames import _get, _num, run_name

COLUMNS = [
    ("label", "case", "str"), ("n", "repeats", "int"), ("seeds", "seeds", "str"), ("runs", "runs", "str"),
    ("tokens_per_s_min", "tok/s min", "int"), ("tokens_per_s_mean", "tok/s mean", "int"),
    ("tokens_per_s_max", "tok/s max", "int"), ("spread_pct", "spread % (max-min)/mean", "f2"),
    ("cv_pct", "CV %", "f2"), ("peak_alloc_spread_pct", "peak memory spread %", "f2"),
]
NOTE = ("Cases that ran more than once in these runs: under other seeds (same work, other data and "
        "initial weights) or the same case hash in several runs. Spread is (max - min) / mean of the "
        "tokens/s; CV the sample standard deviation over the mean. A difference between two strategies "
        "smaller than these spreads is not a difference.")


def _key(case: dict) -> str:
    return json.dumps({k: v for k, v in case.items() if k != "seed"}, sort_keys=True, default=str)


def spread_rows(runs) -> list[dict]:
    groups: dict[str, list[tuple[str, dict]]] = {}
    for manifest, records in runs:
        run = run_name(manifest)
        for r in records:
            if r.get("status") == "ok" and isinstance(r.get("case"), dict):
                groups.setdefault(_key(r["case"]), []).append((run, r))
    rows = []
    for members in groups.values():
        tps = [_num(_get(r, "metrics", "tokens_per_s")) for _, r in members]
        tps = [t for t in tps if t]
        if len(tps) < 2:
            continue
        mean = statistics.fmean(tps)
        peaks = [p for p in (_num(_get(r, "metrics", "peak_alloc_bytes")) for _, r in members) if p]
        rows.append({
            "label": members[0][1].get("label", ""), "n": len(tps),
            "seeds": ", ".join(str(_get(r, "case", "seed")) for _, r in members),
            "runs": ", ".join(sorted({name for name, _ in members})),
            "tokens_per_s_min": min(tps), "tokens_per_s_mean": mean, "tokens_per_s_max": max(tps),
            "spread_pct": (max(tps) - min(tps)) / mean * 100,
            "cv_pct": statistics.stdev(tps) / mean * 100,
            "peak_alloc_spread_pct": (max(peaks) - min(peaks)) / statistics.fmean(peaks) * 100
            if len(peaks) >= 2 else None,
        })
    return sorted(rows, key=lambda r: r["label"])


def table_specs(runs) -> list[dict]:
    rows = spread_rows(runs)
    if not rows:
        return []
    return [{"id_": "spread-table", "title": "Run-to-run spread of repeated cases", "columns": COLUMNS,
             "rows": rows, "note": NOTE}]
