"""Report section: the precision recipe's effect, kept apart from the strategies' comparison.

The overview and every reference/peer ratio pair like recipes only. Where a run has the same case
(strategy, model, GPU count, micro-batch, options) in two recipes, this table sets them side by
side: tokens/s per device and peak memory of ``bf16-master`` over ``bf16-amp``. That ratio is what
the recipe does to one strategy, never a result about the strategy. A second table sets the ``fp8``
recipe (``parabench.fp8``) beside each bf16 recipe of the same case: tokens/s, peak memory and the
loss reached on the same data (the mean of the last ``LOSS_TAIL`` steps' losses). Reads records only.
"""

from __future__ import annotations

import json

from parabench.registry import recipe_of
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


FP8_COLUMNS = [
    ("strategy", "strategy", "str"),
    ("model", "model", "str"),
    ("world_size", "devices", "int"),
    ("micro_batch", "micro-batch", "int"),
    ("fp8_options", "fp8 options", "str"),
    ("base", "beside", "str"),
    ("base_tps", "beside tok/s/device", "int"),
    ("fp8_tps", "fp8 tok/s/device", "int"),
    ("tps_ratio", "fp8 / beside tok/s", "f3"),
    ("base_gib", "beside peak GiB", "f2"),
    ("fp8_gib", "fp8 peak GiB", "f2"),
    ("mem_ratio", "fp8 / beside peak", "f3"),
    ("base_loss", "beside loss", "f3"),
    ("fp8_loss", "fp8 loss", "f3"),
    ("loss_diff", "fp8 − beside loss", "g4"),
]
LOSS_TAIL = 10
FP8_NOTE = (
    "The same case in the fp8 recipe (torchao Float8Linear on the transformer blocks' linears, dynamic "
    "tensorwise scaling, fp32 parameters under bf16 autocast) beside each bf16 recipe it also ran in. Loss: "
    f"the mean over the last {LOSS_TAIL} steps' losses on the same data (same seed), so the difference is "
    "what float8 matmuls cost in accuracy over that many steps. Same-strategy effect, not a strategy result."
)


def tail_loss(r: dict, n: int = LOSS_TAIL) -> float | None:
    """The mean of the last ``n`` recorded losses (a single step's loss is too noisy to compare)."""
    losses = [as_number(x) for x in (dig(r, "metrics", "losses") or [])]
    losses = [x for x in losses if x is not None]
    if not losses:
        return as_number(dig(r, "metrics", "final_loss"))
    return sum(losses[-n:]) / len(losses[-n:])


# Options that configure the fp8 recipe itself (``parabench.fp8``, torch.fsdp2): an fp8 case with them
# still sits beside the bf16 recipes of the case without them, as its own fp8 row.
FP8_RECIPE_OPTIONS = ("fp8_filter", "fp8_all_gather")


def _fp8_options(c: dict) -> str:
    opts = c.get("options") or {}
    return ",".join(f"{k}={opts[k]}" for k in sorted(opts) if k in FP8_RECIPE_OPTIONS)


def _key(r: dict):
    c = r.get("case") or {}
    opts = json.dumps(
        {k: v for k, v in (c.get("options") or {}).items() if k not in FP8_RECIPE_OPTIONS}, sort_keys=True
    )
    layout = c.get("layout") or "separate"  # a fused-qkv model is a different model
    return (
        c.get("strategy"),
        c.get("model"),
        c.get("world_size"),
        c.get("micro_batch"),
        c.get("grad_accum"),
        opts,
        layout,
    )


def _shape(r: dict) -> dict:
    """The case columns both tables show."""
    c = r.get("case") or {}
    return {k: c.get(k) for k in ("strategy", "model", "world_size", "micro_batch")}


def _side_by_side(x: dict, y: dict, x_name: str, y_name: str) -> dict:
    """Tokens/s per device and peak memory of records ``x`` and ``y``, and x over y."""
    xt, yt = (as_number(dig(r, "metrics", "tokens_per_s_per_device")) for r in (x, y))
    xm, ym = (as_number(dig(r, "metrics", "peak_alloc_bytes")) for r in (x, y))
    return {
        f"{x_name}_tps": xt,
        f"{y_name}_tps": yt,
        "tps_ratio": xt / yt if xt and yt else None,
        f"{x_name}_gib": xm / 2**30 if xm else None,
        f"{y_name}_gib": ym / 2**30 if ym else None,
        "mem_ratio": xm / ym if xm and ym else None,
    }


def _pairs(records) -> list[dict]:
    """The run's ok bf16/fp16 first launches grouped by case (``_key``): recipe -> record, in key order."""
    pairs: dict = {}
    for r in records:
        c = r.get("case") or {}
        if r.get("status") != "ok" or c.get("precision") == "fp32" or int(c.get("repeat") or 0):
            continue
        recipe = recipe_of(c)
        variant = _fp8_options(c) if recipe == "fp8" else ""
        pairs.setdefault(_key(r), {})[recipe + (f" [{variant}]" if variant else "")] = r
    return [by for _, by in sorted(pairs.items(), key=lambda kv: str(kv[0]))]


def effect_rows(runs) -> list[dict]:
    rows = []
    for manifest, records in runs:
        for by in _pairs(records):
            if "master" not in by or "amp" not in by:
                continue
            m, a = by["master"], by["amp"]
            rows.append(
                {
                    "run": run_name(manifest),
                    **_shape(m),
                    "precision": dig(m, "case", "precision"),
                    **_side_by_side(m, a, "master", "amp"),
                }
            )
    return rows


def fp8_rows(runs) -> list[dict]:
    rows = []
    for manifest, records in runs:
        for by in _pairs(records):
            fp8_cases = [r for name, r in by.items() if name.split(" ")[0] == "fp8"]
            for f, base in ((f, base) for f in fp8_cases for base in ("amp", "master")):
                if base not in by:
                    continue
                b = by[base]
                bl, fl = tail_loss(b), tail_loss(f)
                rows.append(
                    {
                        "run": run_name(manifest),
                        **_shape(f),
                        "fp8_options": _fp8_options(f.get("case") or {}),
                        "base": f"bf16-{base}",
                        **_side_by_side(f, b, "fp8", "base"),
                        "base_loss": bl,
                        "fp8_loss": fl,
                        "loss_diff": fl - bl if fl is not None and bl is not None else None,
                    }
                )
    return rows


def table_specs(runs, run_col: list) -> list[dict]:
    """The section's table as keyword arguments of ``parabench.report.html._table`` (none without pairs)."""
    specs = []
    rows = effect_rows(runs)
    if rows:
        specs.append(
            {
                "id_": "recipe-effect",
                "title": "Precision recipe effect",
                "columns": run_col + COLUMNS,
                "rows": rows,
                "note": NOTE,
            }
        )
    rows = fp8_rows(runs)
    if rows:
        specs.append(
            {
                "id_": "fp8-effect",
                "title": "FP8 recipe effect",
                "columns": run_col + FP8_COLUMNS,
                "rows": rows,
                "note": FP8_NOTE,
            }
        )
    return specs
