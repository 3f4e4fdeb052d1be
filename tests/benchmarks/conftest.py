"""Benchmarks run only in the gate (``--benchmark-only``; see tests/benchmarks/gate.sh); the plain
test run skips them so that the README's test command stays quick."""

import os
import time

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config, items):
    if config.getoption("benchmark_only", default=False):
        return
    skip = pytest.mark.skip(reason="benchmark: runs in the gate (tests/benchmarks/gate.sh, --benchmark-only)")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def world_of_one():
    """A one-rank gloo process group in this process (what a strategy and the meter expect)."""
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@pytest.fixture
def gauged(benchmark):
    """``benchmark.pedantic`` with the yardstick (yardsticks.py) timed before every round, outside
    pytest-benchmark's timing. Its name and min time go into the record's ``extra_info``, and the
    gate compares min(benchmark) / min(yardstick) with the baseline's (gate_check.py)."""
    from yardsticks import YARDSTICK, yardstick

    def run(target, *, rounds, warmup_rounds, args=(), kwargs=None):
        yardstick_s = []

        def time_yardstick():
            start = time.perf_counter()
            yardstick()
            yardstick_s.append(time.perf_counter() - start)

        result = benchmark.pedantic(
            target, args=args, kwargs=kwargs, setup=time_yardstick, rounds=rounds, warmup_rounds=warmup_rounds
        )
        benchmark.extra_info["yardstick"] = YARDSTICK
        benchmark.extra_info["yardstick_min_s"] = min(yardstick_s[warmup_rounds:])
        return result

    return run
