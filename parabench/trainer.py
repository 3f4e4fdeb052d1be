"""The trainer interface: what the worker drives on every rank, whatever the strategy.

A strategy's builder (``StrategySpec.builder``, ``parabench.strategies``) turns a ``TrainSpec``
into a ``Trainer``. This is the torch side of a strategy; its registry row imports no torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from parabench.shapes import GPTConfig
from parabench.topology import Topology


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, every hyperparameter explicit: library defaults differ (weight decay above all)."""

    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)


@dataclass
class TrainSpec:
    """Everything a strategy needs to build its trainer on this rank."""

    model: GPTConfig
    seed: int
    device: torch.device
    precision: str
    topology: Topology
    micro_batch: int
    grad_accum: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)
    options: dict = field(default_factory=dict)
    recipe: str | None = None  # "master" | "amp" | "fp8" (RECIPES) for bf16/fp16, None for fp32

    @property
    def compute_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.precision]

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype parameters and gradients are kept (and communicated) in: the compute dtype
        under "master", fp32 under "amp" and "fp8" (autocast casts the matmul inputs)."""
        return torch.float32 if self.recipe in ("amp", "fp8") else self.compute_dtype  # None: as before recipes

    @property
    def autocast_on(self) -> bool:
        """Forward under torch.autocast: the "amp" and "fp8" recipes (and a spec made without a recipe)."""
        return self.recipe != "master" and self.precision != "fp32"


class Trainer(ABC):
    """One rank's view of a training run under some strategy.

    Every hook the worker calls is declared here; a strategy overrides what it has."""

    # Set by the worker for the instrumented (untimed) step: sample the state bytes then.
    measure_state: bool = False
    # Set by the worker for the timeline step (option record_timeline): pipelines time every op then.
    record_timeline: bool = False

    @abstractmethod
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step over this rank's data-parallel slice, ``[grad_accum * micro_batch, s]``.

        Returns the mean loss over the slice as a detached 0-d tensor (not synchronised to the
        host, so the step does not stall), or None on ranks that never see the loss (pipeline
        stages before the last).
        """

    @abstractmethod
    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds: keys ``params``, ``grads``, ``optimizer``
        (master weights count under optimizer)."""

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        """Every parameter of the full model as fp32 CPU tensors keyed by the GPT's own names.

        A collective: call it on every rank. Used by equivalence tests; None if unsupported.
        """
        return None

    def loss_scale(self) -> dict | None:
        """For fp16 runs: ``{"scale": float, "skipped": bool}`` for the last step, else None."""
        return None

    def pipeline_stats(self) -> dict | None:
        """This stage's schedule record of the last step (pipelines), else None."""
        return None

    def strategy_stats(self) -> dict | None:
        """Strategy-specific measurements of the last step (attention work, expert routing), else None."""
        return None

    def close(self) -> None:
        """Release what the strategy holds (called between cases that share a launch)."""


def as_trainer(cls: type) -> type:
    """A plain-torch reference class (``reference_impls``, which imports nothing from parabench) as a
    Trainer subclass, so it inherits the hooks it does not define."""
    if issubclass(cls, Trainer):
        return cls
    cached = _TRAINER_CLASSES.get(cls)
    if cached is None:
        cached = _TRAINER_CLASSES[cls] = type(cls.__name__, (cls, Trainer), {"__module__": cls.__module__})
    return cached


_TRAINER_CLASSES: dict[type, type] = {}
