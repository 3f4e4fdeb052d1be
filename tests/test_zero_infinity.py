"""ZeRO-Infinity (``deepspeed.zero3_nvme``): its config as DeepSpeed documents and parses it, the
disk probe, the runner's skip when DeepSpeed's async I/O op is unavailable, and, where libaio is
on this machine, one world-1 training run whose losses equal deepspeed.zero3's (CPU, gloo)."""

from __future__ import annotations

import ctypes.util
import os

import pytest

from parabench.case import Case
from parabench.peers import deepspeed_nvme
from parabench.peers.deepspeed_nvme import disk_probe, nvme_config
from parabench.record import build_record
from parabench.runner import LaunchOptions, skip_reason

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def test_config_sections_are_the_documented_keys_and_deepspeed_parses_them(tmp_path):
    cfg = nvme_config(str(tmp_path), pin_memory=False, buffer_size=2**27, aio={"queue_depth": 16})
    param, opt, aio = cfg["offload_param"], cfg["offload_optimizer"], cfg["aio"]
    assert set(param) == {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"}
    assert set(opt) == {"device", "nvme_path", "pin_memory", "buffer_count"}
    assert set(aio) == {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events"}
    assert param["device"] == opt["device"] == "nvme" and param["nvme_path"] == str(tmp_path)
    assert aio["queue_depth"] == 16 and param["buffer_size"] == 2**27  # given keys win

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
    monkeypatch.setattr(deepspeed_nvme, "aio_verdict", lambda device_type: verdict)
    case = _case("deepspeed.zero3_nvme")
    reason = skip_reason(case, LaunchOptions())
    assert reason is not None
    assert "AsyncIOBuilder.is_compatible() = False" in reason and "libaio .so object and headers" in reason
    record = build_record(case, "skipped", error={"message": reason})
    assert record["status"] == "skipped" and record["error"]["message"] == reason
    assert skip_reason(_case("deepspeed.zero3"), LaunchOptions()) is None  # other peers unaffected

    monkeypatch.setattr(deepspeed_nvme, "aio_verdict", lambda device_type: {**verdict, "is_compatible": True})
    assert "loaded = False" in skip_reason(case, LaunchOptions())  # compatible but the build failed
    monkeypatch.setattr(deepspeed_nvme, "aio_verdict", lambda d: {**verdict, "is_compatible": True, "loaded": True})
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
