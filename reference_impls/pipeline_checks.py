"""The limits of the reference pipeline schedules, in plain Python: a suite's cases are checked
against them when it loads (``parabench.families.model_parallel``), which must not import torch
(``parabench list`` loads every suite), and each schedule checks them again when it is built."""

from __future__ import annotations


def check_stage_layers(stage_layers, n_layers: int, n_stages: int) -> None:
    """Raise a ValueError unless ``stage_layers`` gives one block count per stage, each at least
    one, summing to the model's ``n_layers``."""
    ok = (
        isinstance(stage_layers, (list, tuple))
        and len(stage_layers) == n_stages
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in stage_layers)
        and sum(stage_layers) == n_layers
    )
    if not ok:
        shown = list(stage_layers) if isinstance(stage_layers, (list, tuple)) else stage_layers
        raise ValueError(
            f"option stage_layers={shown!r} "
            f"must list the blocks of each of the {n_stages} pipeline stages: {n_stages} integers, "
            f"each >= 1, summing to the model's {n_layers} layers"
        )


def check_interleaving(n_stages: int, virtual_stages: int, m: int) -> None:
    if virtual_stages < 2:
        raise ValueError(f"interleaved 1F1B needs virtual_stages >= 2 (got {virtual_stages}); one chunk is plain 1F1B")
    if m < 1 or m % n_stages:
        raise ValueError(
            f"interleaved 1F1B needs the micro-batches to be a multiple of the pipeline stages "
            f"(Megatron-LM's schedule takes them in groups of p): {m} micro-batches, p={n_stages}"
        )


def check_zero_bubble(n_stages: int, m: int) -> None:
    if m < n_stages:
        raise ValueError(
            f"ZB-H1 needs at least as many micro-batches as pipeline stages (the paper's setting; "
            f"its bubble formula assumes it): {m} micro-batches, p={n_stages}"
        )
