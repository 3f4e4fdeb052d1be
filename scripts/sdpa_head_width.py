"""Time torch's scaled_dot_product_attention (causal, bf16, forward and backward) at the head widths
of the model ladder, beside a block-sized GEMM, on one GPU. The planner's calibration fits
attention's own rate from these files (results/sdpa-head-width-*/, parabench.plan.attention) and
prices attention FLOPs with it, not at the matmul rate: run it on a device kind to calibrate there.

    python scripts/sdpa_head_width.py --batch 1 2 4 8 --seq 2048 4096 --tp 1 2 4 --out sdpa.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from parabench.models import model_config

MODELS = ("gpt-125m", "gpt-350m", "gpt-760m", "gpt-1.3b", "gpt-2.7b", "gpt-6.7b", "gpt-13b")


def _time_ms(fn, iters: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(model: str, batch: int, seq: int, tp: int = 1) -> dict:
    """One point: the model's head width, its heads split over ``tp`` ranks (a rank's share under
    tensor parallelism), ``batch`` rows of ``seq`` tokens; the GEMM is a rank's fc (d x 4d / tp)."""
    cfg = model_config(model)
    h, hd = cfg.n_heads // tp, cfg.d_model // cfg.n_heads
    q, k, v = (
        torch.randn(batch, h, seq, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    grad = torch.randn(batch, h, seq, hd, device="cuda", dtype=torch.bfloat16)

    def attention():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    x = torch.randn(batch * seq, cfg.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(cfg.d_model, 4 * cfg.d_model // tp, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(batch * seq, 4 * cfg.d_model // tp, device="cuda", dtype=torch.bfloat16)

    def gemm():
        (x @ w).backward(gy)

    attn_ms, gemm_ms = _time_ms(attention), _time_ms(gemm)
    # causal: half of the 4 b h s^2 hd forward FLOPs of QK^T and PV; backward twice the forward
    attn_flops = 3 * 4 * batch * h * seq * seq * hd / 2
    gemm_flops = 3 * 2 * batch * seq * cfg.d_model * 4 * cfg.d_model / tp
    return {
        "model": model,
        "batch": batch,
        "seq_len": seq,
        "tp": tp,
        "heads": h,
        "head_width": hd,
        "attention_ms": attn_ms,
        "attention_tflops": attn_flops / attn_ms / 1e9,
        "gemm_ms": gemm_ms,
        "gemm_tflops": gemm_flops / gemm_ms / 1e9,
        "attention_over_gemm_rate": (attn_flops / attn_ms) / (gemm_flops / gemm_ms),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[4])
    ap.add_argument("--seq", type=int, nargs="+", default=[2048])
    ap.add_argument("--tp", type=int, nargs="+", default=[1], help="split each model's heads over this many ranks")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [
        measure(m, b, s, t)
        for m in MODELS
        for b in args.batch
        for s in args.seq
        for t in args.tp
        if model_config(m).n_heads % t == 0
    ]
    doc = {
        "schema_version": 2,
        "kind": "sdpa-head-width",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": rows,
    }
    for r in rows:
        print(
            f"{r['model']:9s} b={r['batch']} s={r['seq_len']} tp={r['tp']} h={r['heads']:2d} width={r['head_width']:3d}  attention {r['attention_ms']:7.3f} ms "
            f"{r['attention_tflops']:6.1f} TFLOP/s   gemm {r['gemm_tflops']:6.1f} TFLOP/s   ratio {r['attention_over_gemm_rate']:.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
