"""Peak memory per rank, reset between phases so the timed steps are measured on their own.

On CUDA: the caching allocator's peak allocated and reserved bytes, and NVML's device-wide used
bytes (which adds the CUDA context and NCCL's buffers). Allocated bytes count whole allocator
blocks: sizes round up to 512 B, and a cached block reused for a smaller tensor counts whole when
the rest is too small to split off (up to 1 MiB for large blocks), so two programs holding the
same tensors can differ there by megabytes, depending only on the order they allocate in. The
peak of the bytes the tensors asked for (``peak_requested_bytes``) has no such slack: it is the
figure that compares what two strategies keep alive. On CPU: the process's peak resident set
(``ru_maxrss``), whose high-water mark Linux resets when ``5`` is written to
``/proc/self/clear_refs``.
"""

from __future__ import annotations

import resource

import torch


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # not Linux, or not permitted: the peak then covers the whole process life


def _nvml_used_bytes(device: torch.device) -> int | None:
    try:
        import pynvml

        from parabench.meters.telemetry import nvml_handle

        return int(pynvml.nvmlDeviceGetMemoryInfo(nvml_handle(device)).used)
    except Exception:  # NVML missing or not permitted: the allocator figures still stand
        return None


def read_peak(device: torch.device) -> dict:
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)  # what max_memory_allocated/_reserved read, in one call
        return {
            "peak_alloc_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
            "peak_requested_bytes": int(stats.get("requested_bytes.all.peak", 0)) or None,
            "peak_reserved_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
            "device_used_bytes": _nvml_used_bytes(device),
        }
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
