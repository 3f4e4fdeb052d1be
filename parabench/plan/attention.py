"""Attention's own rate: torch's scaled_dot_product_attention (causal, forward and backward), timed
by ``scripts/sdpa_head_width.py`` on the device kind, fitted as

    t(b x h, s, hd) = t0 + F / R(hd, s),   F = 6 b h s^2 hd   (causal: half of QK^T and PV, x3),
    R(hd, s) = R_inf(hd) s / (s + s0)

per call of b sequences x h heads of width hd. t0 is the call's fixed cost in isolation (launches,
a partial wave); R(hd, s) rises with the sequence towards R_inf(hd), since the causal diagonal tiles
and each row tile's ramp weigh less at long sequences (H100: 162-296 TFLOP/s at 4 x 2048 tokens,
263-386 at 4096, beside 450-700 for the block's GEMMs; results/sdpa-head-width-h100x1).

The step model prices attention FLOPs with ``flops_s`` (no t0: in a training step the call is one
kernel among a block's, launched ahead of the device, and the per-layer fixed costs are the fitted
``host_s``) in place of the matmul rate. A head width not measured takes the nearest measured one's
rate.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from parabench.plan.least_squares import nnls

KIND = "sdpa-head-width"
# The least-squares search over s0 (tokens): 0 to 8192 in steps of 64.
SEQ_HALF_GRID = range(0, 8193, 64)


def attention_flops(rows: float, heads: float, seq: int, head_width: int) -> float:
    """Causal forward+backward FLOPs of one call (the 2 QK^T and PV matmuls, half the tiles, x3)."""
    return 6 * rows * heads * seq * seq * head_width


def _points(doc: dict) -> list[tuple[float, int, int, float]]:
    """(b x h, s, hd, seconds) of a timing file; schema 1 kept batch and sequence at the top."""
    out = []
    for r in doc.get("rows") or []:
        batch, seq = r.get("batch", doc.get("batch")), r.get("seq_len", doc.get("seq_len"))
        if batch and seq and r.get("attention_ms"):
            out.append((batch * r["heads"], int(seq), int(r["head_width"]), r["attention_ms"] / 1e3))
    return out


def fit(points: list[tuple[float, int, int, float]]) -> dict:
    """t0, s0 and R_inf per head width minimising the squared relative error (NNLS per s0)."""
    widths = sorted({hd for _, _, hd, _ in points})
    y = np.array([t for *_, t in points])
    best = None
    for s0 in SEQ_HALF_GRID:
        x = np.zeros((len(points), 1 + len(widths)))
        for i, (bh, s, hd, _) in enumerate(points):
            x[i, 0] = 1.0
            x[i, 1 + widths.index(hd)] = attention_flops(bh, 1, s, hd) * (s + s0) / s
        coef = nnls(x / y[:, None], np.ones(len(y)))
        err = x @ coef / y - 1
        score = float(np.sum(err**2))
        if best is None or score < best[0]:
            best = (score, s0, coef, err)
    _, s0, coef, err = best
    return {
        "t0_s": float(coef[0]),
        "seq_half": s0,
        "rate_inf_flops": {str(hd): (float(1 / c) if c > 0 else None) for hd, c in zip(widths, coef[1:])},
        "points": len(points),
        "fit_median_pct": float(np.median(np.abs(err)) * 100),
        "fit_p90_pct": float(np.percentile(np.abs(err), 90) * 100),
    }


def fit_kind(results_dir, kind: str, kind_of) -> dict | None:
    """The fit over every sdpa-head-width file under ``results_dir`` whose device is ``kind``
    (``kind_of``: device name -> kind); None where none is."""
    points, sources = [], []
    for path in sorted(Path(results_dir).glob("sdpa-head-width*/*.json")):
        doc = json.loads(path.read_text())
        if doc.get("kind") != KIND or kind_of(doc.get("device")) != kind:
            continue
        pts = _points(doc)
        if pts:
            points += pts
            sources.append(str(path))
    if not points:
        return None
    return {**fit(points), "source": ", ".join(sources)}


def rate(table: dict, head_width: int, seq: int) -> float:
    """R(hd, s) in FLOP/s: the nearest measured head width's R_inf, at sequence ``seq``."""
    rates = {int(k): v for k, v in table["rate_inf_flops"].items() if v}
    hd = min(rates, key=lambda k: (abs(k - head_width), -k))
    return rates[hd] * seq / (seq + table["seq_half"])


def flops_s(table: dict, rows: float, heads: float, seq: int, head_width: int) -> float:
    """Seconds of one call's FLOPs at R(hd, s), without the isolated call's fixed cost t0."""
    return attention_flops(rows, heads, seq, head_width) / rate(table, head_width, seq)
