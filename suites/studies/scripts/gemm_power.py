"""Sustained bf16 GEMM rate against shape on one GPU, with the clocks and power it ran at.

A training step's matmuls are the block's (tokens x d) @ (d x n) products, n = d (attention
projection), 3d (fused qkv) or 4d (fc). Each shape here runs back to back for ``--seconds`` after a
warm-up, long enough for the card to settle at its power cap, and records the TFLOP/s it sustained
beside the NVML telemetry of that window (``parabench.meters.telemetry``: median SM clock, mean
power, the share of samples at the software power cap). An H100 or H200 SXM holds its 700 W limit by
lowering its SM clock, so the sustained rate of a large GEMM is the power cap's, not the clock's.

    python suites/studies/scripts/gemm_power.py --d 1024 2048 4096 8192 --tokens 4096 16384 65536 --out gemm.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from parabench.meters.telemetry import sampler_for


def sustain(a: torch.Tensor, b: torch.Tensor, seconds: float, device) -> dict:
    """Runs a @ b back to back for ``seconds`` (after as long again of warm-up), in batches timed
    with CUDA events; the rate is the batches' median, the telemetry the timed window's."""
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=device)
    batch = 1
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.02:  # batch size: about 20 ms of work between events
        torch.matmul(a, b, out=out)
        torch.cuda.synchronize()
        batch += 1
    warm_end = time.perf_counter() + seconds
    while time.perf_counter() < warm_end:
        for _ in range(batch):
            torch.matmul(a, b, out=out)
        torch.cuda.synchronize()
    sampler = sampler_for(device, interval_s=0.02)
    if sampler:
        sampler.start()
    rates = []
    end = time.perf_counter() + seconds
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while time.perf_counter() < end:
        start_ev.record()
        for _ in range(batch):
            torch.matmul(a, b, out=out)
        end_ev.record()
        end_ev.synchronize()
        rates.append(flops * batch / (start_ev.elapsed_time(end_ev) / 1e3))
    telemetry = sampler.stop() if sampler else {}
    rates.sort()
    return {
        "tflops": rates[len(rates) // 2] / 1e12,
        "tflops_min": rates[0] / 1e12,
        "tflops_max": rates[-1] / 1e12,
        "batches": len(rates),
        "telemetry": telemetry,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, nargs="+", default=[1024, 2048, 2560, 4096, 5120, 8192])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--n-mult", type=int, nargs="+", default=[1, 4], help="n = d x this (1: projection, 4: fc)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument(
        "--cooldown",
        type=float,
        default=0.0,
        help="seconds idle before each shape, so a short one starts below the cap",
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    points = []
    for d in a.d:
        for m in a.tokens:
            for k in a.n_mult:
                x = torch.randn(m, d, device=device, dtype=torch.bfloat16)
                w = torch.randn(d, k * d, device=device, dtype=torch.bfloat16)
                torch.cuda.synchronize()
                time.sleep(a.cooldown)
                p = {"m": m, "k": d, "n": k * d, **sustain(x, w, a.seconds, device)}
                t = p["telemetry"]
                print(
                    f"m {m:6d} k {d:5d} n {k * d:6d}: {p['tflops']:6.1f} TFLOP/s "
                    f"(min {p['tflops_min']:.1f}), SM {t.get('sm_clock_mhz_median')} MHz, "
                    f"{t.get('power_w_mean') and round(t['power_w_mean'])} W",
                    flush=True,
                )
                points.append(p)
                del x, w
    meta = {
        "kind": "gemm-power",
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "seconds": a.seconds,
        "cooldown_s": a.cooldown,
        "points": points,
    }
    with open(a.out, "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"written {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
