"""Process-group set-up shared by the torchrun worker and the in-process test launcher."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def pick_device(requested: str = "auto") -> torch.device:
    """cuda:LOCAL_RANK when asked for (or when present and 'auto'), else the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously; CPU work is done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def init_process_group(device: torch.device, timeout_s: float = 300.0) -> None:
    """NCCL for GPUs, gloo for CPUs; the timeout turns a lost peer into an error, not a hang."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(rank, world_size, port, fn, args, result_dir, environ):
    # The caller's environment as it is now (the fork server's is the one it started with).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    path = os.path.join(result_dir, f"{rank}.pt")
    try:
        init_process_group(torch.device("cpu"), timeout_s=120)
        out = fn(*args)
        torch.save({"ok": out}, path)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_CONTEXT = None


def _gloo_context():
    """Processes forked from a server that has imported torch once (``forkserver`` with torch
    preloaded): a rank starts in well under a second instead of importing torch anew, which on a
    2-core machine is most of what a small spawned test costs. Safe here because nothing in the
    server touches a device or starts a thread; CUDA runs go through torchrun, never this.

    The preload goes past torch itself: every rank's first ``nn.init`` call imports Dynamo (torch
    wraps those functions in ``torch._disable_dynamo``, which imports it on first use), and Dynamo
    pulls in Inductor, DTensor and FSDP; tensor and pipeline parallelism add their packages. Without
    them a rank spends some 3-5 s of CPU importing what the server could have imported once
    (tests/test_reference_mp.py: 60 against 45 CPU-s). DeepSpeed stays out: its import picks an
    accelerator, which a server shared by every later test must not fix. What the preloaded modules
    read from the environment at import (Inductor's ``CXX``, for one) is read once, when the server
    starts: a test that changes such a setting sets it in the child."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(
            [
                "torch",
                "torch.distributed",
                "torch._dynamo",
                "torch.distributed.tensor",
                "torch.distributed.tensor.parallel",
                "torch.distributed.fsdp",
                "torch.distributed.pipelining",
                "parabench.distributed",
                "parabench.models",
                "parabench.worker",
            ]
        )
        _CONTEXT = ctx
    return _CONTEXT


def run_on_gloo(fn, world_size: int, *args):
    """Run ``fn(*args)`` on ``world_size`` fresh CPU processes over gloo; return each rank's result.

    ``fn`` must be importable (module level). Used by tests: the same code that torchrun runs,
    without the launcher's start-up cost.
    """
    with tempfile.TemporaryDirectory() as result_dir:
        ctx = _gloo_context()
        port = free_port()
        procs = [
            ctx.Process(target=_spawn_entry, args=(r, world_size, port, fn, args, result_dir, dict(os.environ)))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world_size):
            path = os.path.join(result_dir, f"{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            res = torch.load(path, weights_only=False)
            if "error" in res:
                raise RuntimeError(f"rank {r} failed:\n{res['error']}")
            results.append(res["ok"])
        return results
