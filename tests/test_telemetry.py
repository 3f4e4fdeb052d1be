"""The NVML telemetry meter's arithmetic on synthetic samples (no GPU needed), and its absence on CPUs."""

import time

import torch

from parabench.meters.telemetry import Sampler, decode_reasons, sampler_for, summarize_samples
from parabench.metrics import telemetry_summary


def _sample(power_w, sm, mask=0):
    return {
        "power_mw": power_w * 1000,
        "sm_clock_mhz": sm,
        "mem_clock_mhz": 2619,
        "reasons_mask": mask,
        "gpu_util_pct": 100,
        "mem_util_pct": 40,
        "temperature_c": 60,
    }


def test_summary_energy_clocks_and_throttle_reasons():
    samples = [_sample(600, 1980), _sample(700, 1755, 0x4), _sample(650, 1980)]
    out = summarize_samples(samples, (1_000_000, 1_002_600), duration_s=4.0)
    assert out["energy_j"] == 2.6
    assert out["energy_from_power_j"] == 650 * 4.0
    assert out["power_w_mean"] == 650 and out["power_w_max"] == 700
    assert out["sm_clock_mhz_min"] == 1755 and out["sm_clock_mhz_median"] == 1980
    assert out["clocks_event_reasons"] == ["sw_power_cap"]
    assert abs(out["power_capped_fraction"] - 1 / 3) < 1e-12
    assert out["throttled_fraction"] == 0  # the power cap is the card's working state, not a throttle
    assert summarize_samples([_sample(600, 1400, 0x40)], None, 1.0)["throttled_fraction"] == 1


def test_idle_and_sync_boost_are_not_throttling():
    assert decode_reasons(0x1 | 0x10) == ["gpu_idle", "sync_boost"]
    rank = summarize_samples([_sample(100, 1980, 0x1 | 0x10)], None, 1.0)
    assert rank["throttled_fraction"] == 0 and rank["energy_j"] is None
    assert telemetry_summary([{"telemetry": rank}], 1000)["throttled"] is False


def test_record_summary_sums_devices_and_takes_lowest_clock():
    r0 = summarize_samples([_sample(600, 1980)], (0, 500_000), 1.0)
    r1 = summarize_samples([_sample(700, 1600, 0x20)], (0, 300_000), 1.0)
    out = telemetry_summary([{"telemetry": r0}, {"telemetry": r1}], timed_tokens=80_000)
    assert out["energy_j"] == 800.0
    assert out["tokens_per_j"] == 100.0
    assert out["power_w_mean"] == 650
    assert out["sm_clock_mhz_min"] == 1600
    assert out["throttled"] is True and out["clocks_event_reasons"] == ["sw_thermal_slowdown"]
    assert telemetry_summary([{"telemetry": r0}, {"telemetry": None}], 1) == {}


def test_sampler_thread_samples_until_stopped():
    energy = iter([10_000, 12_000])
    s = Sampler(lambda: _sample(500, 1900), lambda: next(energy), interval_s=0.01)
    s.start()
    time.sleep(0.1)
    out = s.stop()
    assert out["n_samples"] >= 3
    assert out["energy_j"] == 2.0
    assert not s._thread.is_alive()


def test_no_sampler_on_cpu():
    assert sampler_for(torch.device("cpu")) is None
