"""Train a case in-process on N gloo ranks and return what equivalence tests compare; run a
suite through the real CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from parabench.distributed import run_on_gloo
from parabench.strategies import get_strategy
from parabench.suite import Case
from parabench.worker import local_batches, make_spec


def _train(case_dict: dict, n_steps: int, want_params: bool):
    case = Case.from_dict(case_dict)
    device = torch.device("cpu")
    spec = make_spec(case, device)
    trainer = get_strategy(case.strategy).build(spec)
    losses = []
    for x, y in local_batches(case, spec, n_steps):
        loss = trainer.train_step(x, y)
        losses.append(None if loss is None else float(loss))
    params = trainer.full_parameters() if want_params else None
    state = trainer.state_bytes()
    trainer.close()
    return {"rank": dist.get_rank(), "coords": spec.topology.coords, "losses": losses,
            "params": params if dist.get_rank() == 0 else None, "state_bytes": state}


def train(case: Case, n_steps: int = 5, want_params: bool = True) -> dict:
    """Losses per step (averaged over the ranks that see the loss), rank 0's gathered parameters,
    and every rank's state bytes."""
    per_rank = run_on_gloo(_train, case.world_size, case.to_dict(), n_steps, want_params)
    losses = []
    for step in range(n_steps):
        vals = [r["losses"][step] for r in per_rank if r["losses"][step] is not None]
        losses.append(sum(vals) / len(vals))
    return {"losses": losses, "params": per_rank[0]["params"], "per_rank": per_rank}


def single_reference(case: Case, n_steps: int = 5) -> dict:
    """The same model, data and global batch on one process: the ground truth."""
    from dataclasses import replace

    dp = case.global_batch // (case.micro_batch * case.grad_accum)
    ref = replace(case, strategy="single", world_size=1, micro_batch=case.micro_batch * dp,
                  options={k: v for k, v in case.options.items() if k in ("optim",)})
    return train(ref, n_steps)


def single_inprocess(case: Case, n_steps: int) -> dict:
    """:func:`single_reference` without spawning (inside a rank that is already running): same
    model, data and global batch on one process; losses and full parameters."""
    from parabench.models import global_batch, model_config
    from parabench.strategies import OptimConfig, TrainSpec
    from parabench.topology import Topology

    cfg = model_config(case.model, case.seq_len)
    spec = TrainSpec(model=cfg, seed=case.seed, device=torch.device("cpu"), precision=case.precision,
                     topology=Topology(world_size=1, rank=0), micro_batch=case.global_batch // case.grad_accum,
                     grad_accum=case.grad_accum, optim=OptimConfig(lr=case.lr, **case.options.get("optim", {})))
    trainer = get_strategy("single").build(spec)
    losses = []
    for step in range(n_steps):
        x, y = global_batch(step, case.global_batch, cfg, case.seed)
        losses.append(float(trainer.train_step(x, y)))
    return {"losses": losses, "params": trainer.full_parameters()}


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def params_close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """Names of parameters that differ (empty when all match)."""
    assert a.keys() == b.keys(), (sorted(a)[:5], sorted(b)[:5])
    return [n for n in a if not torch.allclose(a[n], b[n], rtol=rtol, atol=atol)]


ROOT = Path(__file__).resolve().parent.parent


def run_suite_cli(suite: str, out: Path, *args: str, run_id: str = "t", timeout: int = 600) -> Path:
    """``parabench run suite SUITE`` (a name or a file) through the real CLI and torchrun; the
    run folder it wrote under ``out``."""
    proc = subprocess.run([sys.executable, "-m", "parabench.cli", "run", "suite", suite, "--out", str(out),
                           "--run-id", run_id, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = Path(out).glob(f"*/{run_id}")
    return run_dir
