"""Train one case on N spawned gloo ranks and return what equivalence tests compare; run a suite
through the real CLI. The shared training loop itself is ``harness.py``."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path
from unittest import mock

import torch.distributed as dist
from harness import max_rel_diff, params_close, train_rank  # noqa: F401  (re-exported for the tests)

from parabench.case import Case
from parabench.distributed import run_on_gloo


def _train(case_dict: dict, n_steps: int, want_params: bool):
    record, params = train_rank(Case.from_dict(case_dict), n_steps, want_params=want_params)
    return {
        "rank": dist.get_rank(),
        "coords": record["coords"],
        "losses": record["losses"],
        "params": params if dist.get_rank() == 0 else None,
        "state_bytes": record["state"],
    }


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
    """The same model, data and global batch on one spawned process: the ground truth, through
    the same path as every strategy (``harness.single_truth`` computes it without spawning)."""
    from dataclasses import replace

    dp = case.global_batch // (case.micro_batch * case.grad_accum)
    ref = replace(
        case,
        strategy="single",
        world_size=1,
        micro_batch=case.micro_batch * dp,
        options={k: v for k, v in case.options.items() if k in ("optim",)},
    )
    return train(ref, n_steps)


def parabench(*args) -> subprocess.CompletedProcess:
    """``parabench ARGS`` in this process: its exit status, stdout and stderr (argparse's own errors
    exit by SystemExit). The runner's torchrun launches are real processes all the same; in-process,
    each call saves the ~3 s a fresh interpreter spends importing torch and DeepSpeed. (conftest's
    smoke run and tests/test_faults_runner.py run the CLI as a process of its own.)"""
    from parabench.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.object(sys, "argv", ["parabench", *argv]),  # the manifest records the command line
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def run_suite_cli(suite: str, out: Path, *args: str, run_id: str = "t") -> Path:
    """``parabench run suite SUITE`` (a name or a file) through the CLI (in this process, see
    :func:`parabench`) and torchrun; the run folder it wrote under ``out``."""
    proc = parabench("run", "suite", suite, "--out", str(out), "--run-id", run_id, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = Path(out).glob(f"*/{run_id}")
    return run_dir
