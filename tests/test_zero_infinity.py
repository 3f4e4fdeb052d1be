"""ZeRO-Infinity (``deepspeed.zero3_nvme``): its config as DeepSpeed documents and parses it, the
disk probe, the runner's skip when DeepSpeed's async I/O op is unavailable, and, where libaio is
on this machine, one world-1 training run whose losses equal deepspeed.zero3's (CPU, gloo)."""

from __future__ import annotations

import ctypes.util
import dataclasses
import os

import pytest

from parabench.case import Case
from parabench.launch import LaunchOptions
from parabench.models import GPTConfig
from parabench.peers import deepspeed_aio, deepspeed_nvme
from parabench.peers.deepspeed_nvme import disk_probe, nvme_config
from parabench.record import build_record
from parabench.runner import skip_reason

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def test_config_sections_are_the_documented_keys_and_deepspeed_parses_them(tmp_path):
    cfg = nvme_config(str(tmp_path), pin_memory=False, buffer_size=2**27, aio={"queue_depth": 16})
    param, opt, aio = cfg["offload_param"], cfg["offload_optimizer"], cfg["aio"]
    assert set(param) == {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"}
    assert set(opt) == {"device", "nvme_path", "pin_memory", "buffer_count"}
    assert set(aio) == {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events"}
    assert param["device"] == opt["device"] == "nvme" and param["nvme_path"] == str(tmp_path)
    assert aio["queue_depth"] == 16 and param["buffer_size"] == 2**27  # given keys win
    # Swapped parameters return their buffer after each use; not needed when parameters stay in memory.
    assert cfg["zero"] == {"stage3_max_reuse_distance": 0}
    assert nvme_config(str(tmp_path), False, 2**27, offload_param={"device": "cpu"})["zero"] == {}

    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    assert DeepSpeedZeroOffloadParamConfig(**param).device == "nvme"
    assert DeepSpeedZeroOffloadOptimizerConfig(**opt).buffer_count == 4
    assert get_aio_config({"aio": aio})["queue_depth"] == 16  # the pinned 0.19.8's key names


def test_swap_buffer_holds_the_largest_parameter_partition():
    import torch

    model = torch.nn.Embedding(300_000_000 // 512, 512, device="meta")  # 3e8 elements: above DeepSpeed's 1e8
    assert (
        deepspeed_nvme.swap_buffer_elements(model, world=1) == 287 * 2**20
    )  # 299,999,744 elements, rounded up to 1 Mi
    assert deepspeed_nvme.swap_buffer_elements(model, world=4) == 72 * 2**20  # a quarter of it


def test_swap_buffer_pool_counts_two_blocks_of_swappable_weights_and_stays_small():
    import torch

    from parabench.models import GPT, model_config

    def meta_model(cfg):
        with torch.device("meta"):
            return GPT(cfg)

    # gpt-13b, bf16, one rank: the block's six weight matrices are swappable, its biases and norms
    # (5120 elements) are not; 2 x 6 + 5 buffers of the 50304 x 5120 embedding (rounded to 246 Mi).
    model = meta_model(model_config("gpt-13b"))
    count = deepspeed_nvme.swap_buffer_count(model, world=1, itemsize=2)
    assert count == 17
    pinned = count * deepspeed_nvme.swap_buffer_elements(model, world=1) * 2
    assert pinned < 9e9  # 8.8 GB pinned per rank (the earlier 35 buffers: 18 GB)
    # d_model 512 fp32 on two ranks: the 512 x 512 attention weights' halves (512 KiB) stay in memory.
    small = meta_model(dataclasses.replace(ALIGNED, n_layers=2))
    assert deepspeed_nvme.swap_buffer_count(small, world=1, itemsize=4) == 2 * 6 + 5
    assert deepspeed_nvme.swap_buffer_count(small, world=2, itemsize=4) == 2 * 2 + 5


def test_disk_probe_measures_both_directions_and_cleans_up(tmp_path):
    r = disk_probe(str(tmp_path), 4 << 20, chunk=1 << 20)
    assert r["disk_probe_bytes"] == 4 << 20
    assert r["disk_write_bytes_per_s"] > 0 and r["disk_read_bytes_per_s"] > 0
    assert r["disk_probe_method"] in ("O_DIRECT", "buffered+fsync+fadvise")
    assert list(tmp_path.iterdir()) == []


def _case(strategy: str, world_size: int = 1) -> Case:
    return Case(model="tiny", strategy=strategy, world_size=world_size, micro_batch=2, lr=1e-3, device="cpu")


def test_runner_skips_with_the_builders_verdict_when_the_op_is_unavailable(monkeypatch):
    verdict = {
        "builder": "deepspeed.ops.op_builder.cpu.async_io.AsyncIOBuilder",
        "is_compatible": False,
        "loaded": False,
        "message": "async_io requires the dev libaio .so object and headers but these were not found.",
    }
    monkeypatch.setattr(deepspeed_aio, "aio_verdict", lambda device_type: verdict)
    case = _case("deepspeed.zero3_nvme")
    reason = skip_reason(case, LaunchOptions())
    assert reason is not None
    assert "AsyncIOBuilder.is_compatible() = False" in reason and "libaio .so object and headers" in reason
    record = build_record(case, "skipped", error={"message": reason})
    assert record["status"] == "skipped" and record["error"]["message"] == reason
    assert skip_reason(_case("deepspeed.zero3"), LaunchOptions()) is None  # other peers unaffected

    monkeypatch.setattr(deepspeed_aio, "aio_verdict", lambda device_type: {**verdict, "is_compatible": True})
    assert "loaded = False" in skip_reason(case, LaunchOptions())  # compatible but the build failed
    monkeypatch.setattr(deepspeed_aio, "aio_verdict", lambda d: {**verdict, "is_compatible": True, "loaded": True})
    assert skip_reason(case, LaunchOptions()) is None


LIBAIO = ctypes.util.find_library("aio")


@pytest.mark.skipif(
    LIBAIO is None,
    reason="libaio is not on this machine (DeepSpeed's async I/O op cannot build): "
    "install libaio-dev, or export CPATH/LIBRARY_PATH/LD_LIBRARY_PATH to scripts/libaio_bundle.sh's output",
)
def test_nvme_offload_trains_like_zero3_on_one_rank():
    from dataclasses import replace

    from harness import run_cases

    cases = {s: _case(s) for s in ("deepspeed.zero3", "deepspeed.zero3_nvme")}
    cases["deepspeed.zero3_nvme"] = replace(cases["deepspeed.zero3_nvme"], options={"disk_probe_mb": 4})
    res = run_cases(1, cases, 3, on_end=_record_stats, want_params=False)
    plain, nvme = res["deepspeed.zero3"]["per_rank"][0], res["deepspeed.zero3_nvme"]["per_rank"][0]
    assert nvme["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    s = nvme["strategy_stats"]
    assert s["nvme_sections"]["offload_param"]["device"] == "nvme"
    assert s["disk_read_bytes_per_s"] > 0 and s["disk_write_bytes_per_s"] > 0
    # The tiny model's tensors are all under DeepSpeed's swap minimum (max(1 MiB, aio block_size),
    # swap_tensor/utils.py MIN_AIO_BYTES), so they stay in memory: the run checks the NVMe engine's
    # wiring and bookkeeping, not the disk path (GPU suite zero-infinity-gpu.toml does that).
    assert s["nvme_resident_bytes"] == 0
    assert s["nvme_steps_measured"] == 1 and s["nvme_read_bytes_per_step"] == s["nvme_read_bytes"]
    assert not os.path.exists(nvme["nvme_root"])  # deleted with the case


def _record_stats(trainer, case, record):
    record["strategy_stats"] = trainer.strategy_stats()
    record["nvme_root"] = getattr(trainer, "nvme_root", None)


# Large enough that tensors pass DeepSpeed's 1 MiB swap minimum (a 512x512 fp32 weight is 1 MiB), small
# enough for the CPU. d_model 512 keeps every gradient offset in the flat partition a multiple of the
# aio alignment (256 fp32 elements); 520 does not (its 520-element biases shift the later weights).
ALIGNED = GPTConfig(n_layers=1, d_model=512, n_heads=8, vocab_size=256, seq_len=8)
MISALIGNED = dataclasses.replace(ALIGNED, d_model=520)
# stage-3 prefetch off: DeepSpeed 0.19.8's NVMe prefetch swaps the head in twice on so shallow a
# model ("already assigned swap buffer id"; the module docstring of peers.deepspeed_nvme).
NVME = {"disk_probe_mb": 0, "zero": {"stage3_prefetch_bucket_size": 0}}
# Deep enough that its 36 swapped weights outnumber the swap buffers (17 now, 35 before): stage 3's
# default reuse distance (1e9 elements) kept all 36 swapped in from the second step on and ran out
# ("Not enough buffers 0 for swapping 1", as gpt-1.3b on GPUs). Prefetch on, as on GPUs (tuned).
DEEP = dataclasses.replace(ALIGNED, n_layers=6)


def _op_cached() -> str | None:
    from torch.utils.cpp_extension import _get_build_directory

    if LIBAIO is None:
        return "libaio is not on this machine: export CPATH/LIBRARY_PATH/LD_LIBRARY_PATH to scripts/libaio_bundle.sh's output"
    so = os.path.join(_get_build_directory("async_io", verbose=False), "async_io.so")
    if not os.path.exists(so):
        return (
            f"DeepSpeed's async_io op is not in torch's extension cache ({so}); the test keeps to its "
            "time budget only with a warm cache: build it once with DS_ACCELERATOR=cpu python -c "
            "'from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()' (about 4.5 min on 2 cores)"
        )
    return None


def _train_world1(runs: dict, steps: int) -> dict:
    """On the gloo rank: each run (strategy, model, options) built and trained ``steps`` steps;
    losses, final parameters and, for NVMe, its swap files' bytes by kind; or the refusal's message."""
    import torch

    from parabench.models import global_batch
    from parabench.peers.deepspeed_nvme import MisalignedGradientSwap
    from parabench.registry import get_strategy
    from parabench.topology import Topology
    from parabench.trainer import OptimConfig, TrainSpec

    out = {}
    for key, (strategy, cfg, options) in runs.items():
        spec = TrainSpec(
            model=cfg,
            seed=0,
            device=torch.device("cpu"),
            precision="fp32",
            topology=Topology(world_size=1, rank=0),
            micro_batch=2,
            optim=OptimConfig(lr=1e-3),
            options=options,
        )
        try:
            trainer = get_strategy(strategy).build(spec)
        except MisalignedGradientSwap as exc:
            out[key] = {"refused": str(exc)}
            continue
        try:
            losses = [float(trainer.train_step(*global_batch(s, 2, cfg, 0))) for s in range(steps)]
        except AssertionError as exc:  # DeepSpeed's own checks (swap buffers): reported per run
            trainer.close()
            out[key] = {"failed": f"AssertionError: {exc}"}
            continue
        rec = {"losses": losses, "params": trainer.full_parameters(), "swap_bytes": {}, "param_files": 0}
        for folder, _, files in os.walk(getattr(trainer, "nvme_root", None) or os.devnull):
            for f in files:
                kind = "param" if f.endswith("_param.tensor.swp") else "gradient" if "_gradient_" in f else "optimizer"
                rec["swap_bytes"][kind] = rec["swap_bytes"].get(kind, 0) + os.path.getsize(os.path.join(folder, f))
                rec["param_files"] += kind == "param"
        if hasattr(trainer, "nvme_sections"):
            rec["buffer_count"] = trainer.nvme_sections["offload_param"]["buffer_count"]
            rec["reuse_distance"] = trainer.engine.zero_max_reuse_distance()
        trainer.close()
        out[key] = rec
    return out


@pytest.fixture(scope="module")
def trained():
    """One gloo rank for the module's training runs (2 steps each: the second is stage 3's first
    traced one, where it starts keeping and prefetching parameters)."""
    if _op_cached() is not None:
        pytest.skip(str(_op_cached()))
    from parabench.distributed import run_on_gloo

    runs = {
        "zero3": ("deepspeed.zero3", ALIGNED, {}),
        "nvme": ("deepspeed.zero3_nvme", ALIGNED, NVME),
        "misaligned": ("deepspeed.zero3_nvme", MISALIGNED, NVME),
        "deep_zero3": ("deepspeed.zero3", DEEP, {}),
        "deep_nvme": ("deepspeed.zero3_nvme", DEEP, {"disk_probe_mb": 0}),
    }
    return run_on_gloo(_train_world1, 1, runs, 2)[0]


def test_deep_model_trains_with_more_swapped_parameters_than_swap_buffers(trained):
    import torch

    plain, nvme = trained["deep_zero3"], trained["deep_nvme"]
    assert "failed" not in nvme, nvme["failed"]  # was: AssertionError: Not enough buffers 0 for swapping 1
    assert nvme["reuse_distance"] == 0  # what the engine runs with, from nvme_config's zero keys
    # 6 blocks x 6 weights of 1 MiB and more on disk, each needing a buffer when used: far more than the pool.
    assert nvme["param_files"] == 36 and nvme["buffer_count"] == 17
    assert plain["losses"][1] != plain["losses"][0]
    assert nvme["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    for name, p in plain["params"].items():
        assert torch.allclose(nvme["params"][name], p, rtol=1e-6, atol=1e-7), name


def test_nvme_swapped_training_equals_zero3_and_misaligned_swaps_are_refused(trained):
    import deepspeed
    import torch

    res = trained
    plain, nvme = res["zero3"], res["nvme"]
    # Tensors went through the op: the weights of 1 MiB and more (4 x 1 MiB attention, 2 x 4 MiB MLP)
    # and the optimizer's fp32 master, moments and gradients of the one flat sub-group.
    assert nvme["swap_bytes"]["param"] >= 12 << 20
    assert nvme["swap_bytes"]["optimizer"] >= 3 * 12 << 20 and nvme["swap_bytes"]["gradient"] >= 12 << 20
    # fp32 on both sides, same kernels: measured bit-identical; allowed 1e-6 relative (fp32 rounding).
    # Step 2's loss sees the first update, the final parameters the second (Adam moments read back).
    assert plain["losses"][1] != plain["losses"][0]
    assert nvme["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    for name, p in plain["params"].items():
        assert torch.allclose(nvme["params"][name], p, rtol=1e-6, atol=1e-7), name
    msg = res["misaligned"]["refused"]
    # All six block weights sit behind a 520-element bias or LayerNorm (the 256-token embeddings stay in memory).
    assert f"DeepSpeed {deepspeed.__version__}" in msg and "6 swapped gradient piece(s)" in msg
    assert "blocks.0.attn.q.weight at offset" in msg


def test_nvme_bytes_of_the_h100_run_pass_their_check_and_a_doubled_write_fails():
    """The committed GPU record's disk traffic against expect_deepspeed_zero3_nvme, recomputed."""
    import copy
    import glob
    import json

    from parabench.recheck import recheck_record

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (path,) = glob.glob(f"{root}/results/zero-infinity-gpu/20261127-012755-gpu0/cases/*.json")
    rec = json.load(open(path))
    checked = recheck_record(rec) or rec
    assert checked["checks"]["nvme_io_ok"] is True
    assert set(checked["checks"]["nvme_io"]) == {"read", "write"}
    bad = copy.deepcopy(rec)
    stats = bad["per_rank"][0]["strategy_stats"]
    stats["nvme_write_bytes_per_step"] *= 2
    assert recheck_record(bad)["checks"]["nvme_io_ok"] is False
