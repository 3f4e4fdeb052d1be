"""Peak FLOP rates by device, and a measured matmul roofline where no peak is known.

MFU needs an honest denominator. Known devices use the vendor's dense (not sparse) figure;
an unknown device, every CPU included, gets no MFU at all, and its achieved FLOP/s is reported
as a fraction of a matrix-multiply rate measured on the spot instead.
"""

from __future__ import annotations

import time

import torch

# Dense peak FLOP/s by (device-name substring, dtype). 1979 TF for H100 is the sparsity figure: not used.
PEAK_FLOPS = {
    ("H100 PCIe", "bf16"): 756e12,
    ("H100", "bf16"): 989.4e12,
    ("H200", "bf16"): 989.4e12,
    ("A100", "bf16"): 312e12,
    ("H100 PCIe", "fp16"): 756e12,
    ("H100", "fp16"): 989.4e12,
    ("H200", "fp16"): 989.4e12,
    ("A100", "fp16"): 312e12,
    # fp32 training on tensor cores runs at the TF32 rate when allowed; we count plain fp32.
    ("H100 PCIe", "fp32"): 51e12,
    ("H100", "fp32"): 67e12,
    ("H200", "fp32"): 67e12,
    ("A100", "fp32"): 19.5e12,
}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The dense peak for this device and precision, or None when parabench does not know it."""
    if device.type != "cuda":
        return None
    name = device_name(device)
    for (key, prec), value in PEAK_FLOPS.items():  # ordered: the more specific names first
        if key in name and prec == precision:
            return value
    return None


_MEASURED_MATMUL: dict[tuple, float] = {}


def measured_matmul_flops(device: torch.device, precision: str, n: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of a square matmul in the run's precision, timed here and now (untimed phase only).

    Measured once per process, device and precision: the cases of one launch share the figure. Where
    one matmul takes over a quarter of a second (bf16 on a CPU without bf16 instructions runs about 50x
    below fp32), one timed repeat is already long against the clock, and five would add seconds to
    every case."""
    key = (str(device), precision, n, repeats)
    if key not in _MEASURED_MATMUL:
        _MEASURED_MATMUL[key] = _time_matmul(device, precision, n, repeats)
    return _MEASURED_MATMUL[key]


def _time_matmul(device: torch.device, precision: str, n: int | None, repeats: int) -> float:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # CPUs have no fast fp16 matmul; fp32 is the honest ceiling there
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    t0 = time.perf_counter()
    a @ b
    sync(device)
    if time.perf_counter() - t0 > 0.25:
        repeats = 1
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
