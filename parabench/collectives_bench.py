"""Collective-algorithm benchmark: the backend's collectives beside ``reference_impls.collectives``.

Run on every rank under torchrun (gloo on CPU, NCCL on GPU)::

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m parabench.collectives_bench --config CONFIG.json --out RESULT.json

or from Python: :func:`run_collectives_suite` (one torchrun launch per world size of a suite
with ``[suite] kind = "collectives"``). With results at several world sizes in one run folder,
``python -m parabench.collectives_bench --fit RUN_DIR`` (and ``parabench run`` after its launches) writes
``collectives-scaling.json``: time against the number of ranks fitted to each algorithm's law
(``parabench.collectives_scaling``).

Config contract (``CONFIG.json``: one JSON object; the ``[collectives]`` table of a suite file
maps onto it key for key; unknown keys are an error)
----------------------------------------------------------------------------------------------
``ops``              list of "all_reduce", "all_gather", "reduce_scatter" (default: all three)
``algorithms``       list of "backend", "ps", "ring", "halving_doubling", "tree" (default: all).
                     all_reduce runs every one; all_gather and reduce_scatter only "backend" and
                     "ring"; pairs that do not exist are left out (no row).
``min_bytes``        smallest message, bytes (default 1024)
``max_bytes``        largest message, bytes, on CPU (default 64 MiB); sizes are min_bytes × 2^k
``max_bytes_gpu``    largest message when the device is a GPU (default: max_bytes)
``dtype``            "fp32" (default), "fp64", "bf16" or "fp16"
``iters``            timed iterations per cell (default 20)
``warmup``           untimed iterations before them (default 5)
``iters_full_bytes`` messages up to this size get the full iters/warmup; above it both are scaled
                     by iters_full_bytes/bytes (default 1 MiB), but never below ``min_iters``
                     timed (default 3) and 1 warmup iteration
``cell_budget_s``    time one (op, algorithm, size) cell may take (default 10 s): iterations are
                     cut to fit, and if even ``min_iters`` do not fit the cell is skipped with a
                     reason, as are the larger sizes of that algorithm
``burst_calls``      0 (default: off), or n >= 2: for the backend, also time n calls enqueued back to
                     back (async, one barrier before the burst, every wait after the last), the way
                     bucketed code issues them; a row with algorithm "backend_burst" per size, its
                     times per call (the burst's time / n) and ``burst_calls``
``device``           "auto" (default), "cpu" or "cuda"
``seed``             base of the input seeds (default 0)
``timeout_s``        process-group timeout (default 300)
``world_sizes``      ignored here (the launcher's business)

Sizes: all_reduce moves a ``bytes`` tensor; all_gather and reduce_scatter count the full
n × shard buffer (nccl-tests), so the shard is ``bytes // (n × itemsize)`` elements and the row
records the bytes actually moved (rounded down to a multiple of n elements).

Method, per (op, size): fresh random inputs, different on every rank, integer-valued in
{-4..-1, 1..4} so that every summation order gives the same bits (the check is exact while
|sum| stays representable: 4n ≤ 256 in bf16, 2048 in fp16, 2^24 in fp32; beyond that a relative
tolerance applies). The backend's result is checked against the sum computed locally from the
same seeds, each reference algorithm against the backend's result; a cell is ``correct`` only if
it matches on every rank. Then ``warmup`` untimed and ``iters`` timed calls, each preceded by a
barrier (and the input restored for in-place all-reduce, untimed); a call is timed with CUDA
events on GPU and ``perf_counter`` on CPU; each iteration's time is the max over ranks.

Result (``RESULT.json``, written by rank 0 with ``write_json_atomic``)::

    {schema_version, kind: "collectives", created_at, ok, config (with defaults filled in),
     world_size, backend, device: {type, name}, versions, env, wall_s,
     rows: [{op, algorithm, bytes, count, dtype, iters, time_s_median, time_s_all,
             algbw_GBps, busbw_GBps, correct, max_abs_err, skipped}],
     failures: [{op, algorithm, bytes, max_abs_err}]}

GB/s are 1e9 bytes/s. algbw = bytes / median time; busbw (nccl-tests) = algbw × 2(n-1)/n for
all_reduce, × (n-1)/n for all_gather and reduce_scatter. ``skipped`` is null or the reason;
skipped cells have null times. If any cell is incorrect the file is still written (``ok``:
false, ``failures`` listed) and every rank exits with status 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from parabench.collectives_config import (
    ALGORITHMS,
    OPS,
    iterations_for,
    message_sizes,
    suite_config,
    validate_config,
)
from parabench.distributed import init_process_group, pick_device, synchronize
from parabench.results import recorded_env, write_json_atomic
from parabench.version import SCHEMA_VERSION
from reference_impls import collectives as ref
from reference_impls._compat import all_gather_into, reduce_scatter_into

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
# largest integer every value up to which the dtype represents exactly
EXACT_INT = {torch.float32: 2**24, torch.float64: 2**53, torch.bfloat16: 256, torch.float16: 2048}
LOOSE_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 2e-3}

IMPLS = {
    "all_reduce": {
        "backend": lambda t: dist.all_reduce(t),
        "ps": ref.ps_allreduce,
        "ring": ref.ring_allreduce,
        "halving_doubling": ref.recursive_halving_doubling_allreduce,
        "tree": ref.tree_allreduce,
    },
    "all_gather": {"backend": lambda out, inp: all_gather_into(out, inp), "ring": ref.ring_allgather},
    "reduce_scatter": {"backend": lambda out, inp: reduce_scatter_into(out, inp), "ring": ref.ring_reduce_scatter},
}
BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}

# --------------------------------------------------------------------------- data and checks


def random_input(seed: int, rank: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Integers in {-4..-1, 1..4} (never zero), reproducible from (seed, rank) on any rank.

    Eight random bytes per 64-bit draw, 3 bits each: ~10x faster than ``torch.randint`` on a CPU,
    which matters when every rank regenerates every other rank's input for the check."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + rank)
    raw = torch.empty((count + 7) // 8, dtype=torch.int64, device=device).random_(generator=g)
    b = raw.view(torch.uint8)[:count]
    v = (b & 7).add_((b >> 2) & 1)  # 0,1,2,3,5,6,7,8
    return torch.empty(count, dtype=dtype, device=device).copy_(v).sub_(4)


def expected_output(op: str, seed: int, count: int, dtype, device, rank: int, world: int) -> torch.Tensor:
    """What rank ``rank`` must hold after ``op``, from every rank's regenerated input."""
    if op == "all_gather":
        return torch.cat([random_input(seed, r, count, dtype, device) for r in range(world)])
    total = None
    for r in range(world):
        x = random_input(seed, r, count, dtype, device)
        total = x if total is None else total.add_(x)
    if op == "reduce_scatter":
        shard = count // world
        return total[rank * shard : (rank + 1) * shard].clone()
    return total


def compare(got: torch.Tensor, want: torch.Tensor, world: int) -> tuple[bool, float]:
    """(equal, max |difference|): exact while 4·world is exactly representable, else rtol."""
    if got.shape != want.shape:
        return False, math.inf
    if torch.equal(got, want):
        return True, 0.0
    max_err = float((got.double() - want.double()).abs().max())
    if 4 * world <= EXACT_INT[got.dtype]:
        return False, max_err
    return bool(torch.allclose(got, want, rtol=LOOSE_RTOL[got.dtype], atol=0.0)), max_err


class Cell:
    """Buffers and the call for one (op, algorithm) on one rank; ``reset`` restores the input."""

    def __init__(self, op: str, fn, inp: torch.Tensor, world: int):
        self.op, self.inp = op, inp
        if op == "all_reduce":
            self.out = inp.clone()
            self.call = lambda: fn(self.out)
            self.reset = lambda: self.out.copy_(self.inp)
        elif op == "all_gather":
            self.out = torch.empty(inp.numel() * world, dtype=inp.dtype, device=inp.device)
            self.call = lambda: fn(self.out, self.inp)
            self.reset = lambda: None
        else:
            self.out = torch.empty(inp.numel() // world, dtype=inp.dtype, device=inp.device)
            self.call = lambda: fn(self.out, self.inp)
            self.reset = lambda: None


def check_algorithm(
    op: str,
    fn,
    count: int,
    dtype: torch.dtype = torch.float32,
    device=None,
    seed: int = 0,
    against: torch.Tensor | None = None,
):
    """Run ``fn`` once on fresh inputs on every rank of the default group.

    ``count`` is the element count of the input (all_reduce, reduce_scatter) or of the shard
    (all_gather). Compares with ``against`` when given (the backend's output), else with the
    locally computed expectation. Returns (correct on every rank, max error over ranks, seconds
    the call took (max over ranks), the :class:`Cell` holding this rank's input and output).
    Collective: call it on every rank.
    """
    device = device or torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    cell = Cell(op, fn, random_input(seed, rank, count, dtype, device), world)
    synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    cell.call()
    synchronize(device)
    seconds = time.perf_counter() - t0
    want = against if against is not None else expected_output(op, seed, count, dtype, device, rank, world)
    ok, err = compare(cell.out, want, world)
    flags = torch.tensor([0.0 if ok else 1.0, err, seconds], dtype=torch.float64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags[0].item() == 0.0, flags[1].item(), flags[2].item(), cell


def _time_each(cell: Cell, n: int, device: torch.device, issue, calls: int = 1) -> list[float]:
    """Seconds per call of each of ``n`` timed runs of ``issue`` (which makes ``calls`` calls) on
    this rank: barrier before each run, reset untimed."""
    times = []
    for _ in range(n):
        cell.reset()
        synchronize(device)
        dist.barrier()
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            issue()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            issue()
            seconds = time.perf_counter() - t0
        times.append(seconds / calls)
    return times


def time_calls(cell: Cell, n: int, device: torch.device) -> list[float]:
    """Seconds of each of ``n`` calls on this rank (barrier before each, reset untimed)."""
    return _time_each(cell, n, device, cell.call)


# enqueued without waiting: what a burst issues
ASYNC_BACKEND = {
    "all_reduce": lambda cell: dist.all_reduce(cell.out, async_op=True),
    "all_gather": lambda cell: all_gather_into(cell.out, cell.inp, async_op=True),
    "reduce_scatter": lambda cell: reduce_scatter_into(cell.out, cell.inp, async_op=True),
}


def time_bursts(cell: Cell, calls: int, n: int, device: torch.device) -> list[float]:
    """Seconds per call of each of ``n`` bursts on this rank: ``calls`` backend collectives enqueued
    back to back, then every wait (one barrier before the burst, reset untimed). An isolated call
    (``time_calls``) pays the collective's whole latency; a burst shows what each call costs once
    calls queue behind each other, as bucketed gradient and parameter traffic issues them."""

    def burst():
        for work in [ASYNC_BACKEND[cell.op](cell) for _ in range(calls)]:
            work.wait()

    return _time_each(cell, n, device, burst, calls)


# --------------------------------------------------------------------------- the benchmark


def run_bench(cfg: dict, device: torch.device) -> dict:
    """Every (op, algorithm, size) cell on every rank; returns the result document (all ranks)."""
    world = dist.get_world_size()
    dtype = DTYPES[cfg["dtype"]]
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows, failures = [], []
    over_budget: dict[tuple[str, str], int] = {}  # (op, algorithm) -> size that did not fit
    t_start = time.perf_counter()
    for oi, op in enumerate(o for o in OPS if o in cfg["ops"]):
        algos = [a for a in ALGORITHMS if a in cfg["algorithms"] and a in IMPLS[op]]
        if not algos:
            continue
        for si, nbytes in enumerate(message_sizes(cfg, device.type)):
            count = nbytes // itemsize if op == "all_reduce" else nbytes // (itemsize * world)
            moved = count * itemsize * (1 if op == "all_reduce" else world)
            base = {
                "op": op,
                "bytes": moved,
                "count": count * (1 if op == "all_reduce" else world),
                "dtype": cfg["dtype"],
            }
            if count == 0:
                for a in algos:
                    rows.append(
                        _skipped_row(base, a, f"{nbytes} bytes is less than one {cfg['dtype']} element per rank")
                    )
                continue
            seed = cfg["seed"] * 1_000 + oi * 100 + si + 1
            in_count = count * world if op == "reduce_scatter" else count
            # the backend first: its output is what the reference algorithms must reproduce
            ok, err, t_backend, backend_cell = check_algorithm(op, IMPLS[op]["backend"], in_count, dtype, device, seed)
            backend_out = backend_cell.out.clone()  # the timing below reuses backend_cell
            if not ok:
                failures.append({"op": op, "algorithm": "backend", "bytes": moved, "max_abs_err": err})
            for algo in algos:
                if (op, algo) in over_budget:
                    rows.append(
                        _skipped_row(
                            base,
                            algo,
                            f"a smaller message ({over_budget[op, algo]} bytes) "
                            f"exceeded cell_budget_s={cfg['cell_budget_s']}",
                        )
                    )
                    continue
                fn = IMPLS[op][algo]
                if algo == "backend":
                    correct, max_err, t_est, cell = ok, err, t_backend, backend_cell
                else:
                    correct, max_err, t_est, cell = check_algorithm(
                        op, fn, in_count, dtype, device, seed, against=backend_out
                    )
                    if not correct:
                        failures.append({"op": op, "algorithm": algo, "bytes": moved, "max_abs_err": max_err})
                # the checked call is the estimate of one call's time (first calls err on the slow side);
                # its cell (input intact, the output is overwritten) serves for the timing
                warmup, iters = iterations_for(cfg, nbytes)
                fit = int(cfg["cell_budget_s"] / max(t_est, 1e-9)) - warmup
                if fit < cfg["min_iters"]:
                    over_budget[op, algo] = moved
                    row = _skipped_row(
                        base,
                        algo,
                        f"one call took {t_est:.3g} s: {warmup} warmup + "
                        f"{cfg['min_iters']} iterations exceed cell_budget_s="
                        f"{cfg['cell_budget_s']}",
                    )
                    row.update(correct=correct, max_abs_err=max_err)
                    rows.append(row)
                    continue
                iters = min(iters, fit)
                time_calls(cell, warmup, device)
                row = _timed_row(base, algo, warmup, time_calls(cell, iters, device), correct, max_err, world, device)
                rows.append(row)
                if algo == "backend" and cfg["burst_calls"]:
                    rows.append(_burst_row(cfg, base, cell, row["time_s_median"], correct, max_err, world, device))
                del cell
            del backend_out, backend_cell
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "collectives",
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ok": not failures,
        "config": cfg,
        "world_size": world,
        "backend": dist.get_backend(),
        "device": {"type": device.type, "name": _device_name(device)},
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": _nccl_version(device),
            "python": platform.python_version(),
        },
        "env": recorded_env(),
        "wall_s": time.perf_counter() - t_start,
        "rows": rows,
        "failures": failures,
    }


def _burst_row(cfg: dict, base: dict, cell: Cell, one_call_s: float, correct, max_err, world: int, device) -> dict:
    """The "backend_burst" row of one size: bursts of ``burst_calls`` calls, as many as the cell
    budget holds (one untimed burst first), never fewer than ``min_iters``."""
    calls = cfg["burst_calls"]
    _, iters = iterations_for(cfg, base["bytes"])
    fit = int(cfg["cell_budget_s"] / max(calls * one_call_s, 1e-9)) - 1
    if fit < cfg["min_iters"]:
        row = _skipped_row(
            base,
            "backend_burst",
            f"a burst of {calls} calls takes about {calls * one_call_s:.3g} s: 1 warmup + "
            f"{cfg['min_iters']} bursts exceed cell_budget_s={cfg['cell_budget_s']}",
        )
        row.update(burst_calls=calls, correct=correct, max_abs_err=max_err)
        return row
    time_bursts(cell, calls, 1, device)
    times = time_bursts(cell, calls, min(iters, fit), device)
    return {**_timed_row(base, "backend_burst", 1, times, correct, max_err, world, device), "burst_calls": calls}


def _timed_row(base: dict, algo: str, warmup: int, local_times: list, correct, max_err, world: int, device) -> dict:
    """A timed cell's row: each iteration's time is the slowest rank's (collective: every rank)."""
    local = torch.tensor(local_times, dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    times = local.tolist()
    med = statistics.median(times)
    algbw = base["bytes"] / med / 1e9 if med > 0 else math.inf
    return {
        **base,
        "algorithm": algo,
        "iters": len(times),
        "warmup": warmup,
        "time_s_median": med,
        "time_s_all": times,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * BUSBW_FACTOR[base["op"]](world),
        "correct": correct,
        "max_abs_err": max_err,
        "skipped": None,
    }


def _skipped_row(base: dict, algo: str, reason: str) -> dict:
    return {
        **base,
        "algorithm": algo,
        "iters": 0,
        "warmup": 0,
        "time_s_median": None,
        "time_s_all": [],
        "algbw_GBps": None,
        "busbw_GBps": None,
        "correct": None,
        "max_abs_err": None,
        "skipped": reason,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _nccl_version(device: torch.device):
    if device.type != "cuda":
        return None
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parabench.collectives_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="JSON object (see the module docstring)")
    parser.add_argument("--out", help="result JSON, written by rank 0")
    parser.add_argument(
        "--fit",
        metavar="RUN_DIR",
        help="no benchmark: fit the run folder's collectives-w<K>.json against K (parabench.collectives_scaling) "
        "and write its collectives-scaling.json",
    )
    args = parser.parse_args(argv)
    if args.fit:
        from parabench.collectives_scaling import FIT_FILE, fit_run

        scaling = fit_run(Path(args.fit))
        if scaling is None:
            print(f"collectives_bench: {args.fit} has results at fewer than two world sizes", file=sys.stderr)
            return 2
        write_json_atomic(Path(args.fit) / FIT_FILE, scaling)
        return 0
    if not (args.config and args.out):
        parser.error("--config and --out are required (or --fit RUN_DIR)")
    cfg = validate_config(json.loads(Path(args.config).read_text()))
    device = pick_device(cfg["device"])
    init_process_group(device, timeout_s=cfg["timeout_s"])
    try:
        result = run_bench(cfg, device)
        if dist.get_rank() == 0:
            write_json_atomic(args.out, result)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if result["failures"]:
        cells = ", ".join(f"{f['op']}/{f['algorithm']}/{f['bytes']}B" for f in result["failures"])
        print(f"collectives_bench: INCORRECT results in {len(result['failures'])} cell(s): {cells}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------- launching a suite


def run_collectives_suite(
    suite,
    run_dir,
    world_size: int,
    *,
    device: str | None = None,
    timeout_s: float = 1800.0,
    python: str = sys.executable,
    owner=None,
) -> Path:
    """Launch torchrun with ``world_size`` ranks for ``suite``; return the result path.

    Writes ``run_dir/collectives-w{N}.config.json`` and ``run_dir/collectives-w{N}.json``
    (outside ``cases/``: it is not a training-case record). The launch is the runner's
    (``launch.LaunchOwner``): ``owner``, which must be inside ``owner.owning()``, or one made for
    this call, holding the run folder's lock (``RunFolderBusy`` when another runner has it). Every
    process of the launch is ended after ``timeout_s``, on SIGINT/SIGTERM/SIGHUP
    (``KeyboardInterrupt``) and when the call returns. Raises RuntimeError when torchrun fails,
    including when a cell is incorrect (the result file is still there in that case).
    """
    from parabench.launch import LaunchOptions, LaunchOwner

    if owner is None:
        owner = LaunchOwner(run_dir)
        with owner.owning():
            return run_collectives_suite(
                suite, run_dir, world_size, device=device, timeout_s=timeout_s, python=python, owner=owner
            )
    cfg = suite_config(suite)
    if device is not None:
        cfg["device"] = device
    run_dir = Path(run_dir).resolve()
    config_path = run_dir / f"collectives-w{world_size}.config.json"
    out_path = run_dir / f"collectives-w{world_size}.json"
    write_json_atomic(config_path, cfg)
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        *LaunchOptions().torchrun_args(world_size),
        "-m",
        "parabench.collectives_bench",
        "--config",
        str(config_path),
        "--out",
        str(out_path),
    ]
    log_path = owner.scratch / f"collectives-w{world_size}.log"  # its tail goes into the error
    rc, timed_out = owner.run_torchrun(cmd, owner.launch_env(cfg["device"]), log_path, timeout_s)
    if timed_out:
        raise RuntimeError(f"collectives bench (world {world_size}) timed out after {timeout_s} s")
    if rc != 0:
        try:
            log_tail = log_path.read_text(errors="replace")[-4000:]
        except OSError:
            log_tail = ""
        raise RuntimeError(f"collectives bench (world {world_size}) failed with exit code {rc}:\n" + log_tail)
    return out_path


if __name__ == "__main__":
    sys.exit(main())
