"""The machine's bf16 matmul ceiling: what a short GEMM probe at a run's start measures, and the MFU
of each case against it beside the MFU against the datasheet peak.

The datasheet's dense bf16 peak (989 TFLOP/s on H100 and H200) is a rate no kernel reaches: bf16
matmuls on the H100s and H200s of the committed runs top out at 790-798 TFLOP/s, about 80 % of it. A
case's MFU against the datasheet therefore says how far it is from a number nothing reaches; against
the measured ceiling, how far it is from what this machine's cuBLAS does on its best shape.

The probe runs in a process of its own (``python -m parabench.matmul_ceiling``), so that its CUDA
context and its 1.5 GiB of matrices are gone before the first case launches: the cases' memory
figures (NVML's device-wide count among them) see nothing of it. Its result is cached per machine
(host, GPU model and UUID, torch and CUDA versions) for ``MAX_AGE_S`` in ``cache_dir()``, so a suite
of many runs probes once. On a machine without CUDA, or a suite whose every case runs on the CPU, no
probe runs and the manifest records why.

The report side (``ceiling_of``, ``fraction_of_ceiling``) reads manifests and records only: no torch.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

# Square sizes timed; the ceiling is the best size's median rate. Below 4096 an H100/H200 product is
# too short to fill the GPU; 16384 (8.8 TFLOP, about 11 ms) is where cuBLAS's best tile shapes saturate.
SIZES = (4096, 8192, 16384)
BATCH = 10  # products per timed batch: one event pair around ten kernels amortises the launch gaps
BATCHES = 5
WARMUP_S = 1.0  # products before timing, long enough for the clocks to leave their idle state
MAX_AGE_S = 7 * 24 * 3600  # a driver update or a new clock policy would show within a week's probes
PROBE_TIMEOUT_S = 300
CACHE_ENV = "PARABENCH_CACHE_DIR"
METHOD = (
    f"torch.matmul of square bf16 matrices of random normal values, sizes {', '.join(map(str, SIZES))}, "
    f"after {WARMUP_S:g} s of warm-up; per size {BATCHES} batches of {BATCH} products timed with CUDA events; "
    "the ceiling is the best size's median batch rate"
)


# --- the probe (torch, in its own process) --------------------------------------------------------


def measure(device_index: int = 0) -> dict:
    """Time the products on CUDA device ``device_index`` and return the ceiling's record."""
    import torch

    device = torch.device("cuda", device_index)
    with torch.cuda.device(device):  # the events record on this device's stream, not device 0's
        by_size = _rates_by_size(torch, device)
    props = torch.cuda.get_device_properties(device)
    return {
        "flops_per_s": max(by_size.values()),
        "dtype": "bf16",
        "by_size_flops_per_s": by_size,
        "device_name": props.name,
        "device_index": device_index,
        "method": METHOD,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **_identity(torch, props),
    }


def _rates_by_size(torch, device) -> dict[str, float]:
    """The median batch rate (FLOP/s) of each size in ``SIZES``."""
    by_size = {}
    for n in SIZES:
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        deadline = time.perf_counter() + (WARMUP_S if n == SIZES[0] else 0.2)
        while time.perf_counter() < deadline:
            torch.matmul(a, b, out=out)
            torch.cuda.synchronize(device)
        rates = []
        for _ in range(BATCHES):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(BATCH):
                torch.matmul(a, b, out=out)
            end.record()
            end.synchronize()
            rates.append(BATCH * 2 * n**3 / (start.elapsed_time(end) / 1e3))
        by_size[str(n)] = sorted(rates)[len(rates) // 2]
        del a, b, out
        torch.cuda.empty_cache()
    return by_size


def _identity(torch, props) -> dict:
    return {
        "hostname": socket.gethostname(),
        "device_uuid": str(getattr(props, "uuid", "")),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "parabench"


def _cache_path(identity: dict, device_name: str) -> Path:
    key = json.dumps({**identity, "device_name": device_name, "method": METHOD}, sort_keys=True)
    return cache_dir() / f"matmul-ceiling-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def probe(device_index: int = 0, use_cache: bool = True) -> dict:
    """The ceiling of this machine's CUDA device ``device_index``: the cached record when one of this
    machine is younger than ``MAX_AGE_S``, else a new measurement (cached where the folder is writable)."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    path = _cache_path(_identity(torch, props), props.name)
    if use_cache:
        try:
            cached = json.loads(path.read_text())
            if time.time() - path.stat().st_mtime < MAX_AGE_S and _positive(cached.get("flops_per_s")):
                return {**cached, "cache": str(path), "from_cache": True}
        except (OSError, ValueError):
            pass
    result = measure(device_index)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: the run still records what it measured
        result["cache_error"] = str(exc)
    return {**result, "cache": str(path), "from_cache": False}


# --- at a run's start (no torch in this process) ----------------------------------------------------


def for_run(cases, timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """The manifest's ``matmul_ceiling``: the probe's record, or ``{"skipped": why}``."""
    if cases and all(getattr(c, "device", "auto") == "cpu" for c in cases):
        return {"skipped": "every case runs on the CPU: the ceiling is a GPU's bf16 matmul rate"}
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine: the ceiling is a GPU's bf16 matmul rate"}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "parabench.matmul_ceiling"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"skipped": f"the probe did not finish within {timeout_s:g} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except ValueError:
        result = None
    if not isinstance(result, dict):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return {"skipped": f"the probe failed (exit {proc.returncode}): {tail}"}
    return result


# --- the report's side: manifests and records only ---------------------------------------------------


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def ceiling_of(manifest: dict) -> dict | None:
    """The run's measured ceiling, or None (no probe, a skipped one, a malformed entry)."""
    c = manifest.get("matmul_ceiling") if isinstance(manifest, dict) else None
    return c if isinstance(c, dict) and _positive(c.get("flops_per_s")) else None


def fraction_of_ceiling(manifest: dict, record: dict) -> float | None:
    """The case's model FLOP/s per device over the run's measured bf16 ceiling: its MFU against what
    the machine's matmul reaches. None unless the case trained in bf16 (every bf16 recipe: MFU counts
    them all against the bf16 peak) on the GPU model the probe measured."""
    ceiling = ceiling_of(manifest)
    if ceiling is None or not isinstance(record, dict):
        return None
    case = record.get("case") if isinstance(record.get("case"), dict) else {}
    device = record.get("device") if isinstance(record.get("device"), dict) else {}
    metrics = record.get("metrics") if isinstance(record.get("metrics"), dict) else {}
    if case.get("precision") != ceiling.get("dtype", "bf16") or device.get("name") != ceiling.get("device_name"):
        return None
    achieved = metrics.get("model_flops_per_s_per_device")
    return achieved / ceiling["flops_per_s"] if _positive(achieved) else None


def ceiling_note(manifests) -> str:
    """One sentence per measured ceiling for the cases table's note ("" when no run has one)."""
    parts = []
    for m in manifests:
        c = ceiling_of(m)
        if c is None:
            continue
        peak = c.get("datasheet_flops_per_s")
        share = f", {c['flops_per_s'] / peak:.0%} of the datasheet's {peak / 1e12:,.0f}" if _positive(peak) else ""
        parts.append(
            f"{m.get('run_id', '?')}: {c.get('device_name', '?')} {c['flops_per_s'] / 1e12:,.0f} TFLOP/s measured{share}"
        )
    if not parts:
        return ""
    return (
        "MFU of measured ceiling: the case's model FLOP/s per device over the bf16 matmul rate a GEMM probe "
        "measured on that machine at the run's start (" + "; ".join(parts) + ")."
    )


def main() -> int:
    """Print the ceiling of CUDA device 0 as one JSON line (``--no-cache``: measure again)."""
    result = probe(0, use_cache="--no-cache" not in sys.argv[1:])
    from parabench.hardware import PEAK_FLOPS

    peak = next((v for (name, prec), v in PEAK_FLOPS.items() if name in result["device_name"] and prec == "bf16"), None)
    if peak:
        result["datasheet_flops_per_s"] = peak
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
