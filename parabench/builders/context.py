"""Builders of the reference context parallelism: ring attention, Ulysses and the all-gather of K
and V (``reference_impls/context_parallel.py``, ``cp_allgather.py``), through ``peers.common.CPTrainer``."""

from __future__ import annotations

from parabench.families.context import ContextOptions
from parabench.peers.common import CPTrainer
from parabench.trainer import TrainSpec


def _build(spec: TrainSpec, mode: str) -> CPTrainer:
    o = ContextOptions.read(spec.options)
    # ``break`` is a test hook (a deliberately broken ring or Ulysses step), never a suite option.
    return CPTrainer(spec, mode, o.cp, o.cp_split, broken=spec.options.get("break"))


def build_cp_ring(spec: TrainSpec) -> CPTrainer:
    return _build(spec, "ring")


def build_cp_ulysses(spec: TrainSpec) -> CPTrainer:
    return _build(spec, "ulysses")


def build_cp_allgather(spec: TrainSpec) -> CPTrainer:
    return _build(spec, "allgather")
