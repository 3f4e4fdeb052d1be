"""The send/recv collectives in reference_impls.collectives against the backend, and the bench.

One spawned gloo process group per world size runs every check and returns what it saw; the
assertions are made here, in the test process, so a failure names the algorithm and the size.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap

import pytest
import torch
import torch.distributed as dist

from parabench import collectives_bench as bench
from parabench import collectives_config
from parabench.distributed import run_on_gloo
from reference_impls import collectives as C
from reference_impls._compat import all_gather_into, reduce_scatter_into

ALLREDUCES = {
    "ps": C.ps_allreduce,
    "ring": C.ring_allreduce,
    "halving_doubling": C.recursive_halving_doubling_allreduce,
    "tree": C.tree_allreduce,
}
# sizes smaller than any world size, not divisible by 2, 3 or 4, and a few ordinary ones
SIZES = [1, 2, 3, 5, 7, 16, 97, 1000, 4099]
SHARDS = [1, 3, 17, 250]


def _broken_ring_allreduce(tensor, group=None):
    """ring_allreduce with its last all-gather step left out: one chunk stays a partial sum."""
    rank, n = C._rank_and_size(group)
    flat = tensor.view(-1)
    off = C._bounds(flat.numel(), n)

    def chunk(i):
        i %= n
        return flat[off[i] : off[i + 1]]

    left, right = (rank - 1) % n, (rank + 1) % n
    for s in range(n - 1):
        mine = chunk(rank - s - 1)
        incoming = torch.empty_like(mine)
        C._exchange([(chunk(rank - s), right)], [(incoming, left)], group)
        mine.add_(incoming)
    for s in range(n - 2):  # should be n - 1
        C._exchange([(chunk(rank + 1 - s), right)], [(chunk(rank - s), left)], group)
    return tensor


def _compare_with_backend(group=None, tag: str = "") -> list[str]:
    """Every reference algorithm vs. the backend on random fp32 data; returns the mismatches."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    bad = []
    for size in SIZES:
        torch.manual_seed(1000 * size + dist.get_rank())
        x = torch.randn(size)
        want = x.clone()
        dist.all_reduce(want, group=group)
        for name, fn in ALLREDUCES.items():
            got = x.clone()
            fn(got, group=group)
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                bad.append(f"{tag}all_reduce/{name} n={n} size={size} rank={rank}")
    for shard in SHARDS:
        inp = torch.randn(shard)
        got, want = torch.empty(n * shard), torch.empty(n * shard)
        C.ring_allgather(got, inp, group=group)
        all_gather_into(want, inp, group=group)
        if not torch.equal(got, want):
            bad.append(f"{tag}all_gather/ring n={n} shard={shard} rank={rank}")
        inp = torch.randn(n * shard)
        got, want = torch.empty(shard), torch.empty(shard)
        C.ring_reduce_scatter(got, inp, group=group)
        reduce_scatter_into(want, inp, group=group)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            bad.append(f"{tag}reduce_scatter/ring n={n} shard={shard} rank={rank}")
    return bad


def _worker() -> dict:
    n = dist.get_world_size()
    out = {"mismatches": _compare_with_backend()}
    # process groups: peers must be translated to global ranks
    if n == 4:
        for ranks in ([1, 3], [0, 2, 3]):
            g = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                out["mismatches"] += _compare_with_backend(g, tag=f"group{ranks} ")
    # the bench's own check, exact on integer data, on uneven sizes
    out["bench_check"] = {name: bench.check_algorithm("all_reduce", fn, 4099)[:2] for name, fn in ALLREDUCES.items()}
    out["bench_check"]["all_gather/ring"] = bench.check_algorithm("all_gather", C.ring_allgather, 33)[:2]
    out["bench_check"]["reduce_scatter/ring"] = bench.check_algorithm("reduce_scatter", C.ring_reduce_scatter, 33 * n)[
        :2
    ]
    # a deliberately broken ring must be caught, by allclose and by the bench
    torch.manual_seed(dist.get_rank())
    x = torch.randn(1000)
    want, got = x.clone(), x.clone()
    dist.all_reduce(want)
    _broken_ring_allreduce(got)
    local_ok = torch.tensor([float(torch.allclose(got, want, rtol=1e-5, atol=1e-5))])
    dist.all_reduce(local_ok, op=dist.ReduceOp.MIN)
    out["broken_allclose"] = bool(local_ok.item())
    out["broken_bench_check"] = bench.check_algorithm("all_reduce", _broken_ring_allreduce, 1000)[0]
    # and the whole bench reports it as a failure
    if n == 3:
        saved = bench.IMPLS["all_reduce"]["ring"]
        bench.IMPLS["all_reduce"]["ring"] = _broken_ring_allreduce
        try:
            cfg = bench.validate_config(
                {
                    "ops": ["all_reduce"],
                    "algorithms": ["backend", "ring"],
                    "min_bytes": 256,
                    "max_bytes": 512,
                    "iters": 2,
                    "warmup": 1,
                    "device": "cpu",
                }
            )
            result = bench.run_bench(cfg, torch.device("cpu"))
        finally:
            bench.IMPLS["all_reduce"]["ring"] = saved
        out["bench_failures"] = result["failures"]
        out["bench_ok"] = result["ok"]
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reference_collectives_match_backend(world_size):
    for rank, res in enumerate(run_on_gloo(_worker, world_size)):
        assert res["mismatches"] == [], res["mismatches"]
        for name, (ok, err) in res["bench_check"].items():
            assert ok and err == 0.0, f"rank {rank}: bench check of {name} failed (max err {err})"
        assert not res["broken_allclose"], "the broken ring went unnoticed by allclose"
        assert not res["broken_bench_check"], "the broken ring went unnoticed by the bench's check"
        if world_size == 3:
            assert res["bench_ok"] is False
            assert {f["algorithm"] for f in res["bench_failures"]} == {"ring"}
            assert {f["bytes"] for f in res["bench_failures"]} == {256, 512}


def test_random_input_is_nonzero_and_rank_dependent():
    a = bench.random_input(3, 0, 10_000, torch.float32, torch.device("cpu"))
    b = bench.random_input(3, 1, 10_000, torch.float32, torch.device("cpu"))
    assert (a != 0).all() and set(a.unique().tolist()) == {-4, -3, -2, -1, 1, 2, 3, 4}
    assert not torch.equal(a, b)
    assert torch.equal(a, bench.random_input(3, 0, 10_000, torch.float32, torch.device("cpu")))


def test_config_validation_and_sizes():
    from parabench.suite import load_suite

    suite = load_suite("collectives")
    assert suite.kind == "collectives"
    cfg = bench.suite_config(suite)
    assert cfg["world_sizes"] == [2] and cfg["max_bytes"] == 64 << 20 and cfg["max_bytes_gpu"] == 1 << 30
    assert bench.message_sizes(cfg, "cpu") == [1024 << k for k in range(17)]
    assert bench.message_sizes(cfg, "cuda")[-1] == 1 << 30
    assert bench.iterations_for(cfg, 1024) == (cfg["warmup"], cfg["iters"])
    assert bench.iterations_for(cfg, 64 << 20) == (1, cfg["min_iters"])
    for bad in (
        {"ops": ["all_to_all"]},
        {"algorithms": ["magic"]},
        {"dtype": "fp8"},
        {"iters": 0},
        {"typo_key": 1},
        {"ops": ["all_gather"], "algorithms": ["tree"]},
        {"burst_calls": 1},
        {"burst_calls": -2},
        {"burst_calls": True},
    ):
        with pytest.raises(collectives_config.ConfigError):
            bench.validate_config(bad)


def test_config_knows_the_algorithms_the_bench_implements():
    """Suites are validated without the benchmark's code: its table of (op, algorithm) pairs and
    dtypes must be the code's."""
    assert {op: tuple(bench.IMPLS[op]) for op in bench.OPS} == collectives_config.IMPLEMENTED
    assert tuple(bench.DTYPES) == collectives_config.DTYPE_NAMES


def test_bench_end_to_end_under_torchrun(tmp_path):
    """The module as the runner launches it: torchrun, 2 ranks, tiny sizes, one JSON."""
    from parabench.results import SCHEMA_VERSION
    from parabench.suite import load_suite

    suite_file = tmp_path / "tiny-collectives.toml"
    suite_file.write_text(
        textwrap.dedent("""
        [suite]
        name = "tiny-collectives"
        kind = "collectives"
        description = "test"
        [collectives]
        world_sizes = [2]
        ops = ["all_reduce", "all_gather", "reduce_scatter"]
        algorithms = ["backend", "ps", "ring", "halving_doubling", "tree"]
        min_bytes = 64
        max_bytes = 4096
        iters = 3
        warmup = 1
        burst_calls = 4
        dtype = "fp32"
        device = "cpu"
    """)
    )
    path = bench.run_collectives_suite(load_suite(str(suite_file)), tmp_path, 2, timeout_s=240)
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["kind"] == "collectives" and data["ok"]
    assert data["world_size"] == 2 and data["backend"] == "gloo" and data["config"]["max_bytes"] == 4096
    cells = {(r["op"], r["algorithm"], r["bytes"]) for r in data["rows"]}
    sizes = [64 << k for k in range(7)]
    want = {("all_reduce", a, b) for a in bench.ALGORITHMS for b in sizes}
    want |= {(op, a, b) for op in ("all_gather", "reduce_scatter") for a in ("backend", "ring") for b in sizes}
    want |= {(op, "backend_burst", b) for op in bench.OPS for b in sizes}  # backend calls queued 4 at a time
    assert cells == want
    assert {r["burst_calls"] for r in data["rows"] if r["algorithm"] == "backend_burst"} == {4}
    assert all("burst_calls" not in r for r in data["rows"] if r["algorithm"] != "backend_burst")
    for r in data["rows"]:
        assert r["skipped"] is None and r["correct"] is True, r
        assert len(r["time_s_all"]) == r["iters"] == 3
        assert r["busbw_GBps"] > 0 and r["time_s_median"] > 0
        factor = 2 * (2 - 1) / 2 if r["op"] == "all_reduce" else (2 - 1) / 2
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s_median"] / 1e9)


def _busy_suite(tmp_path):
    """A collectives suite whose one launch runs far longer than any test waits for it."""
    from parabench.suite import load_suite

    suite_file = tmp_path / "busy-collectives.toml"
    suite_file.write_text(
        textwrap.dedent("""
        [suite]
        name = "busy-collectives"
        kind = "collectives"
        description = "test"
        [collectives]
        world_sizes = [2]
        ops = ["all_reduce"]
        algorithms = ["backend"]
        min_bytes = 65536
        max_bytes = 65536
        iters = 10000000
        warmup = 0
        cell_budget_s = 100000.0
        device = "cpu"
    """)
    )
    return load_suite(str(suite_file))


class _MarkedProcessWatch:
    """Counts the live processes of ``invocation``'s launches from a thread; ``then`` runs once
    torchrun and both ranks are up."""

    def __init__(self, invocation: str, then=None):
        import threading

        self.invocation, self.then, self.most = invocation, then, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        from parabench.launch import marked_processes

        while not self.stop.wait(0.2):
            self.most = max(self.most, len(marked_processes(self.invocation)))
            if self.most >= 3 and self.then is not None:
                self.then()
                self.then = None

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


@pytest.mark.parametrize("stop_by", ["timeout", "sigterm"])
def test_a_collectives_launch_is_ended_completely_on_timeout_and_on_sigterm(tmp_path, stop_by):
    """The runner's launch ownership: torchrun and the ranks (in sessions of their own) all end,
    the scratch goes, the lock and the signal handlers are given back."""
    from parabench.launch import LaunchOwner, RunFolderLock, Stopped, marked_processes

    suite = _busy_suite(tmp_path)
    owner = LaunchOwner(tmp_path / "run")
    handler_before = signal.getsignal(signal.SIGTERM)
    if stop_by == "timeout":
        # 12 s: torchrun and both ranks are up within about 3 s here (the sigterm variant's whole
        # run); the watch below fails the test if they were not before the timeout.
        with _MarkedProcessWatch(owner.invocation) as watch, owner.owning():
            with pytest.raises(RuntimeError, match=r"collectives bench \(world 2\) timed out after 12 s"):
                bench.run_collectives_suite(suite, owner.run_dir, 2, timeout_s=12, owner=owner)
            assert marked_processes(owner.invocation) == []
            assert not (owner.scratch / "launch.json").exists()
    else:

        def sigterm():
            os.kill(os.getpid(), signal.SIGTERM)

        with _MarkedProcessWatch(owner.invocation, then=sigterm) as watch, pytest.raises(Stopped), owner.owning():
            bench.run_collectives_suite(suite, owner.run_dir, 2, timeout_s=600, owner=owner)
    assert watch.most >= 3, "torchrun and its 2 ranks were never seen running: the test proved nothing"
    assert marked_processes(owner.invocation) == []
    assert not (owner.run_dir / ".scratch").exists()
    assert not (owner.run_dir / "collectives-w2.json").exists()
    assert signal.getsignal(signal.SIGTERM) is handler_before
    lock = RunFolderLock(owner.run_dir)
    lock.acquire()  # given back
    lock.release()


def test_a_second_runner_on_a_collectives_run_folder_exits_2(tmp_path, capsys):
    from parabench import cli
    from parabench.launch import RunFolderLock

    suite = _busy_suite(tmp_path)
    run_dir = tmp_path / "out" / suite.name / "r"
    run_dir.mkdir(parents=True)
    held = RunFolderLock(run_dir)
    held.acquire()
    try:
        rc = cli.main(["run", "suite", str(suite.path), "--out", str(tmp_path / "out"), "--run-id", "r", "--no-report"])
    finally:
        held.release()
    assert rc == 2
    assert f"run folder {run_dir} is in use by another parabench runner (pid {os.getpid()})" in capsys.readouterr().err
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # nothing written, nothing launched
