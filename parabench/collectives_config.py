"""The collectives benchmark's configuration (``parabench.collectives_bench``): its keys, their
defaults and their checks, and the message sizes and iteration counts a config asks for. Suite files
of ``kind = "collectives"`` are validated with it when they load, so it imports neither torch nor the
benchmark; the config contract is in ``parabench/collectives_bench.py``'s docstring.
"""

from __future__ import annotations

import math

MiB = 1 << 20
OPS = ("all_reduce", "all_gather", "reduce_scatter")
ALGORITHMS = ("backend", "ps", "ring", "halving_doubling", "tree")
# The algorithms each op has (``collectives_bench.IMPLS`` holds their code).
IMPLEMENTED = {
    "all_reduce": ALGORITHMS,
    "all_gather": ("backend", "ring"),
    "reduce_scatter": ("backend", "ring"),
}
DTYPE_NAMES = ("fp32", "fp64", "bf16", "fp16")

DEFAULTS = {
    "ops": list(OPS),
    "algorithms": list(ALGORITHMS),
    "min_bytes": 1024,
    "max_bytes": 64 * MiB,
    "max_bytes_gpu": None,
    "dtype": "fp32",
    "iters": 20,
    "warmup": 5,
    "min_iters": 3,
    "iters_full_bytes": 1 * MiB,
    "cell_budget_s": 10.0,
    "burst_calls": 0,
    "device": "auto",
    "seed": 0,
    "timeout_s": 300.0,
    "world_sizes": None,
}


class ConfigError(ValueError):
    pass


def validate_config(raw: dict) -> dict:
    """Defaults filled in, every value checked; a ConfigError names the offending key."""
    unknown = set(raw) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown collectives config key(s) {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **raw}
    for key, valid in (("ops", OPS), ("algorithms", ALGORITHMS)):
        if not isinstance(cfg[key], list) or not cfg[key]:
            raise ConfigError(f"'{key}' must be a non-empty list")
        bad = [v for v in cfg[key] if v not in valid]
        if bad:
            raise ConfigError(f"'{key}': unknown {bad}; valid: {list(valid)}")
    if not any(a in IMPLEMENTED[op] for op in cfg["ops"] for a in cfg["algorithms"]):
        raise ConfigError(f"no algorithm of {cfg['algorithms']} implements any op of {cfg['ops']}")
    if cfg["dtype"] not in DTYPE_NAMES:
        raise ConfigError(f"'dtype' {cfg['dtype']!r}; valid: {list(DTYPE_NAMES)}")
    if cfg["device"] not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"'device' {cfg['device']!r}; valid: auto, cpu, cuda")
    for key, lo in (
        ("min_bytes", 1),
        ("max_bytes", 1),
        ("iters", 1),
        ("warmup", 0),
        ("min_iters", 1),
        ("iters_full_bytes", 1),
        ("seed", 0),
        ("burst_calls", 0),
    ):
        v = cfg[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ConfigError(f"'{key}' must be an integer >= {lo}, got {v!r}")
    if cfg["burst_calls"] == 1:
        raise ConfigError("'burst_calls' must be 0 (off) or an integer >= 2, got 1")
    if cfg["max_bytes_gpu"] is not None and (not isinstance(cfg["max_bytes_gpu"], int) or cfg["max_bytes_gpu"] < 1):
        raise ConfigError(f"'max_bytes_gpu' must be a positive integer, got {cfg['max_bytes_gpu']!r}")
    for key in ("cell_budget_s", "timeout_s"):
        if not isinstance(cfg[key], (int, float)) or isinstance(cfg[key], bool) or cfg[key] <= 0:
            raise ConfigError(f"'{key}' must be a positive number, got {cfg[key]!r}")
    if cfg["min_bytes"] > max(cfg["max_bytes"], cfg["max_bytes_gpu"] or 0):
        raise ConfigError("'min_bytes' is larger than 'max_bytes'")
    ws = cfg["world_sizes"]
    if ws is not None and (
        not isinstance(ws, list)
        or not ws
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in ws)
    ):
        raise ConfigError(f"'world_sizes' must be a non-empty list of positive integers, got {ws!r}")
    cfg["min_iters"] = min(cfg["min_iters"], cfg["iters"])
    return cfg


def message_sizes(cfg: dict, device_type: str) -> list[int]:
    top = cfg["max_bytes_gpu"] if device_type == "cuda" and cfg["max_bytes_gpu"] else cfg["max_bytes"]
    sizes, b = [], cfg["min_bytes"]
    while b <= top:
        sizes.append(b)
        b *= 2
    return sizes


def iterations_for(cfg: dict, nbytes: int) -> tuple[int, int]:
    """(warmup, iters) for a message of ``nbytes``: scaled down above ``iters_full_bytes``."""
    scale = min(1.0, cfg["iters_full_bytes"] / nbytes)
    iters = max(cfg["min_iters"], min(cfg["iters"], math.ceil(cfg["iters"] * scale)))
    warmup = min(cfg["warmup"], max(1, math.ceil(cfg["warmup"] * scale)))
    return warmup, iters


def suite_config(suite) -> dict:
    """The validated config of a ``kind = "collectives"`` suite (its ``[collectives]`` table)."""
    table = suite.raw.get("collectives")
    if not isinstance(table, dict):
        raise ConfigError(f"{suite.path}: a collectives suite needs a [collectives] table")
    try:
        cfg = validate_config(dict(table))
    except ConfigError as exc:
        raise ConfigError(f"{suite.path}: [collectives]: {exc}") from None
    device = suite.raw.get("suite", {}).get("device")
    if device is not None and "device" not in table:
        cfg["device"] = device
    return cfg
