"""Power, energy, clocks, throttle reasons and utilisation of a GPU during the timed steps (NVML).

A background thread on every rank samples its own GPU every ``interval_s`` while the timed steps
run. The energy comes from the device's cumulative energy counter (``nvmlDeviceGetTotalEnergy
Consumption``, millijoules since the driver loaded), read at the start and the end, so it is exact
up to the counter's update interval; the mean sampled power times the duration is kept beside it
as a cross-check. The sampler only reads counters that the driver maintains anyway: it launches
nothing on the device, and its thread sleeps between samples (the ctypes calls release the GIL).
Its cost on the step time is measured by the ``meter-overhead`` suite (``telemetry = false``
switches it off).

Throttle ("clocks event") reasons are the NVML bit mask, decoded to names. Thermal slowdown, the
hardware slowdown and the power brake make a case ``throttled``: its record gets a caveat, because
its tokens/s describe a card that could not hold its clocks, not the strategy. The software power
cap is not among them: an H100 SXM at its 700 W limit lowers its SM clock under any dense load
(on 4x H100, 2026-11-26, every case above 80 % utilisation showed it, its SM clock at 1635-1935
MHz of 1980), so it is the card's normal working state; its share of the samples is recorded
(``power_capped_fraction``) and the clocks beside it.

Without NVML (CPUs, a driver that refuses it) :func:`sampler_for` returns None and the record has no
telemetry section.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Callable

# NVML's clocks-event reason bits (nvml.h, nvmlClocksEventReason*), stable since NVML 10.
REASON_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# The reasons that hold the clocks below what the work asks for.
THROTTLING = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")


def decode_reasons(mask: int) -> list[str]:
    return [name for bit, name in REASON_BITS.items() if mask & bit]


def summarize_samples(samples: list[dict], energy_mj: tuple[int, int] | None, duration_s: float) -> dict:
    """The record's per-rank telemetry from raw samples (each: power_mw, sm_clock_mhz,
    mem_clock_mhz, reasons_mask, gpu_util_pct, mem_util_pct, temperature_c) and the energy counter
    at start and end."""

    def col(key):
        return [s[key] for s in samples if s.get(key) is not None]

    def stat(key, fn):
        xs = col(key)
        return fn(xs) if xs else None

    power_w = [p / 1e3 for p in col("power_mw")]
    mask = 0
    for m in col("reasons_mask"):
        mask |= m
    reasons = decode_reasons(mask)

    def share(names):
        masks = col("reasons_mask")
        return sum(1 for m in masks if any(r in names for r in decode_reasons(m))) / len(masks) if masks else None

    energy_j = (energy_mj[1] - energy_mj[0]) / 1e3 if energy_mj else None
    return {
        "n_samples": len(samples),
        "duration_s": duration_s,
        "energy_j": energy_j,
        "energy_from_power_j": statistics.fmean(power_w) * duration_s if power_w else None,
        "power_w_mean": statistics.fmean(power_w) if power_w else None,
        "power_w_max": max(power_w) if power_w else None,
        "sm_clock_mhz_median": stat("sm_clock_mhz", statistics.median),
        "sm_clock_mhz_min": stat("sm_clock_mhz", min),
        "sm_clock_mhz_max": stat("sm_clock_mhz", max),
        "mem_clock_mhz_median": stat("mem_clock_mhz", statistics.median),
        "gpu_util_pct_mean": stat("gpu_util_pct", statistics.fmean),
        "mem_util_pct_mean": stat("mem_util_pct", statistics.fmean),
        "temperature_c_max": stat("temperature_c", max),
        "clocks_event_reasons": reasons,
        "throttled_fraction": share(THROTTLING),
        "power_capped_fraction": share(("sw_power_cap",)),
    }


class Sampler:
    """Samples ``read()`` every ``interval_s`` from ``start()`` to ``stop()`` on a daemon thread."""

    def __init__(self, read: Callable[[], dict], energy: Callable[[], int | None], interval_s: float = 0.05):
        self.read, self.energy, self.interval_s = read, energy, interval_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.read())
            except Exception:  # a counter the driver refuses mid-run: keep the others
                pass
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        self._e0 = self.energy()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="parabench-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        duration = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        e1 = self.energy()
        energy = (self._e0, e1) if self._e0 is not None and e1 is not None else None
        return summarize_samples(self.samples, energy, duration)


def nvml_handle(device):
    """NVML's handle for a torch CUDA device, found by UUID (NVML numbers every GPU of the host,
    torch only the visible ones); by index where torch gives no UUID."""
    import pynvml
    import torch

    pynvml.nvmlInit()
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else "GPU-" + text)
        except pynvml.NVMLError:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)


def sampler_for(device, interval_s: float = 0.05) -> Sampler | None:
    """A telemetry sampler for ``device``'s GPU, or None (CPU, or NVML unavailable)."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        handle = nvml_handle(device)
    except Exception:
        return None

    def optional(fn):
        try:
            return fn()
        except pynvml.NVMLError:
            return None

    get_reasons = (
        getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    )

    def read() -> dict:
        util = optional(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
        return {
            "power_mw": optional(lambda: pynvml.nvmlDeviceGetPowerUsage(handle)),
            "sm_clock_mhz": optional(lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "mem_clock_mhz": optional(lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)),
            "reasons_mask": optional(lambda: int(get_reasons(handle))),
            "gpu_util_pct": util.gpu if util is not None else None,
            "mem_util_pct": util.memory if util is not None else None,
            "temperature_c": optional(lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
        }

    def energy() -> int | None:
        return optional(lambda: int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)))

    return Sampler(read, energy, interval_s)
