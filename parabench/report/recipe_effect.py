"""Report section: the precision recipe's effect, kept apart from the strategies' comparison.

The overview and every reference/peer ratio pair like recipes only. Where a run has the same case
(strategy, model, GPU count, micro-batch, options) in two recipes, this table sets them side by
side: tokens/s per device and peak memory of ``bf16-master`` over ``bf16-amp``. That ratio is what
the recipe does to one strategy, never a result about the strategy. Reads records only.
"""

from __future__ import annotations

import json

from parabench.recipes import recipe_of
from parabench.report.frames import as_number, dig, run_name

COLUMNS = [
    ("strategy", "strategy", "str"),
    ("model", "model", "str"),
    ("world_size", "devices", "int"),
    ("micro_batch", "micro-batch", "int"),
    ("precision", "precision", "str"),
    ("master_tps", "master tok/s/device", "int"),
    ("amp_tps", "amp tok/s/device", "int"),
    ("tps_ratio", "master / amp tok/s", "f3"),
    ("master_gib", "master peak GiB", "f2"),
    ("amp_gib", "amp peak GiB", "f2"),
    ("mem_ratio", "master / amp peak", "f3"),
]
NOTE = (
    "The same case in both precision recipes: master keeps bf16 parameters and gradients with fp32 "
    "master weights; amp keeps fp32 parameters under torch.autocast. The ratio is the recipe's effect on "
    "that strategy, not a comparison between strategies (those pair like recipes only)."
)


def _key(r: dict):
    c = r.get("case") or {}
    opts = json.dumps(c.get("options") or {}, sort_keys=True)
    return (c.get("strategy"), c.get("model"), c.get("world_size"), c.get("micro_batch"), c.get("grad_accum"), opts)


def effect_rows(runs) -> list[dict]:
    rows = []
    for manifest, records in runs:
        pairs: dict = {}
        for r in records:
            c = r.get("case") or {}
            if r.get("status") != "ok" or c.get("precision") == "fp32" or int(c.get("repeat") or 0):
                continue
            pairs.setdefault(_key(r), {})[recipe_of(c)] = r
        for (strategy, model, world, mb, _, _), by in sorted(pairs.items(), key=lambda kv: str(kv[0])):
            if "master" not in by or "amp" not in by:
                continue
            m, a = by["master"], by["amp"]
            mt, at = (as_number(dig(x, "metrics", "tokens_per_s_per_device")) for x in (m, a))
            mm, am = (as_number(dig(x, "metrics", "peak_alloc_bytes")) for x in (m, a))
            rows.append(
                {
                    "run": run_name(manifest),
                    "strategy": strategy,
                    "model": model,
                    "world_size": world,
                    "micro_batch": mb,
                    "precision": dig(m, "case", "precision"),
                    "master_tps": mt,
                    "amp_tps": at,
                    "tps_ratio": mt / at if mt and at else None,
                    "master_gib": mm / 2**30 if mm else None,
                    "amp_gib": am / 2**30 if am else None,
                    "mem_ratio": mm / am if mm and am else None,
                }
            )
    return rows


def table_specs(runs, run_col: list) -> list[dict]:
    """The section's table as keyword arguments of ``parabench.report.html._table`` (none without pairs)."""
    rows = effect_rows(runs)
    if not rows:
        return []
    return [
        {
            "id_": "recipe-effect",
            "title": "Precision recipe effect",
            "columns": run_col + COLUMNS,
            "rows": rows,
            "note": NOTE,
        }
    ]
