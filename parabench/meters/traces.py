"""Traces you can open: the profiled step's timeline and a CUDA memory snapshot, one file per rank.

``trace = true``: the extra untimed step that ``torch.profiler`` records (the one ``step_breakdown``
reduces to fractions; with both options on, one step serves both) is exported as a Chrome trace,
gzipped: ``traces/<key>.rank<r>.json.gz``. It opens in Perfetto (https://ui.perfetto.dev) and in
``chrome://tracing``. On a CPU it holds the operators (``aten::``), gloo's collectives and the
Python annotations of every thread; on a GPU the kernels and memory copies too.

``memory_snapshot = true``: one more untimed step runs with the CUDA caching allocator's history
on (``torch.cuda.memory._record_memory_history``), then ``_dump_snapshot`` writes a pickle of every
segment, block and alloc/free event with its stack: ``traces/<key>.rank<r>.memory.pickle``, for
PyTorch's memory visualiser (https://pytorch.org/memory_viz). The history records stacks at every
allocation and free (microseconds each, on the host), so it gets a step of its own rather than
the profiled one, whose timeline it would stretch. A CPU has no caching allocator to record: there
the record says so (``path`` None and a ``reason``), which is not a failure.

The worker writes the files into its launch's scratch folder; the runner moves them into the run
folder beside ``cases/`` when it writes the case's record, so each rank's entry (``per_rank[r]
["trace"]``, ``["memory_snapshot"]``) holds a path relative to the run folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from parabench.distributed import synchronize

FOLDER = "traces"
# Alloc/free events the allocator keeps (a ring buffer: the last ones win); each is a few KB with
# its stack, so this bounds the history at a few hundred MB even for a large model's step.
MAX_HISTORY_ENTRIES = 100_000


@dataclass(frozen=True)
class TraceFiles:
    """Where one case's trace files go: ``root`` / ``traces`` / ``<key>.rank<r>...``. Paths are
    recorded relative to ``root`` (the launch's scratch folder, then the run folder)."""

    root: Path
    key: str

    def trace(self, rank: int) -> str:
        return f"{FOLDER}/{self.key}.rank{rank}.json.gz"

    def memory_snapshot(self, rank: int) -> str:
        return f"{FOLDER}/{self.key}.rank{rank}.memory.pickle"

    def absolute(self, relative: str) -> Path:
        path = Path(self.root) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        return path


def _written(files: TraceFiles, relative: str, tmp: Path) -> dict:
    final = files.absolute(relative)
    os.replace(tmp, final)
    return {"path": relative, "bytes": final.stat().st_size}


def export_trace(prof, files: TraceFiles, rank: int) -> dict:
    """Write the finished profile ``prof`` as a gzipped Chrome trace; its entry for the record."""
    relative = files.trace(rank)
    tmp = files.absolute(relative).with_name(f".{Path(relative).name}.tmp.gz")  # ".gz": torch gzips it
    try:
        prof.export_chrome_trace(str(tmp))
        return _written(files, relative, tmp)
    finally:
        tmp.unlink(missing_ok=True)


def snapshot_unavailable(device: torch.device) -> dict | None:
    """Why ``device`` gives no memory snapshot (the record's entry), None where it does."""
    if device.type == "cuda":
        return None
    return {
        "path": None,
        "reason": f"a memory snapshot records the CUDA caching allocator; this case ran on {device.type}, "
        "which has none",
    }


def memory_snapshot_step(trainer, inputs, targets, files: TraceFiles, rank: int) -> tuple[object, dict]:
    """One ``train_step`` with the CUDA allocator's history on; (loss, the snapshot's entry)."""
    device = inputs.device
    relative = files.memory_snapshot(rank)
    tmp = files.absolute(relative).with_name(f".{Path(relative).name}.tmp")
    synchronize(device)
    # Allocations made before the history starts still appear (as the snapshot's segments and
    # blocks), without the stack that made them: the model, its gradients and optimizer state.
    torch.cuda.memory._record_memory_history(max_entries=MAX_HISTORY_ENTRIES)
    try:
        loss = trainer.train_step(inputs, targets)
        synchronize(device)
        torch.cuda.memory._dump_snapshot(str(tmp))
        return loss, _written(files, relative, tmp)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        tmp.unlink(missing_ok=True)
