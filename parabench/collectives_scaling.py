"""Collective time against the number of ranks K, fitted to the seeds' complexity (no torch: the report reads it).

The seed lecture (seed 001_49cb7c694370cc74.txt, "Data Parallelism" to "Ring All-Reduce") sets the
algorithms apart by how they grow with K: reduce-then-broadcast through a parameter server has
"Peak Bandwidth O(K)" at the master; the ring all-reduce "Time O(K), Peak Bandwidth O(1)" (bandwidth-
optimal); recursive halving "Time O(log K), Peak Bandwidth O(1)". parabench's send/recv versions
(``reference_impls/collectives.py``) have those laws, in the Hockney model a message of N bytes costing
``α + Nβ`` (Thakur, Rabenseifner, Gropp 2005):

    t(K, N) = α · S(K) + β · P(K) · N

with S the steps on the critical path and P the bytes on it per byte of message:

=================  ==================  ==========================  =============================
algorithm          S(K)                P(K)                        seed's claim
=================  ==================  ==========================  =============================
ps                 2(K-1)              2(K-1)                      O(K) at the master
ring               2(K-1)              2(K-1)/K                    O(K) steps, bandwidth-optimal
halving_doubling   2·log2 K            2(K-1)/K                    O(log K) steps
tree               2·⌈log2 K⌉          2·⌈log2 K⌉                  O(log K) steps
=================  ==================  ==========================  =============================

(the parameter server's root takes the K-1 messages one after another, so its steps count K-1 each
way; the tree moves the whole vector at every level; halving-doubling at a K that is not a power of
two adds the fold: 2 steps and 2N.)

:func:`fit` takes the all-reduce rows of ``collectives-w<K>.json`` at several K and fits, for every
algorithm, α and β of *each* law (non-negative least squares on relative error, so a 1 KiB and a
64 MiB message weigh alike), then reports the relative RMS error of each and whether the algorithm's own law fits best.
Per message size it also fits ``t = a + b·(K-1)`` and ``t = a + b·log2 K`` and says which is closer:
the complexity in K on its own, with no model of bandwidth. The backend (gloo, NCCL) gets every law
and no claim.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

FIT_FILE = "collectives-scaling.json"


def _pow2_floor(k: int) -> int:
    return 1 << (k.bit_length() - 1)


def _hd_steps(k: int) -> float:
    p2 = _pow2_floor(k)
    return 2 * math.log2(p2) + (2 if p2 != k else 0)


def _hd_bytes(k: int) -> float:
    p2 = _pow2_floor(k)
    return 2 * (p2 - 1) / p2 + (2 if p2 != k else 0)


# law name -> (S(K), P(K), formula text)
LAWS = {
    "ps": (lambda k: 2 * (k - 1), lambda k: 2 * (k - 1), "S = 2(K-1), P = 2(K-1)"),
    "ring": (lambda k: 2 * (k - 1), lambda k: 2 * (k - 1) / k, "S = 2(K-1), P = 2(K-1)/K"),
    "halving_doubling": (_hd_steps, _hd_bytes, "S = 2 log2 K, P = 2(K-1)/K"),
    "tree": (
        lambda k: 2 * math.ceil(math.log2(k)),
        lambda k: 2 * math.ceil(math.log2(k)),
        "S = 2 ceil(log2 K), P = 2 ceil(log2 K)",
    ),
}
SEED_CLAIMS = {
    "ps": "peak bandwidth O(K) at the master (seed 001_49cb7c694370cc74.txt)",
    "ring": "time O(K) steps, peak bandwidth O(1): bandwidth-optimal (seed 001_49cb7c694370cc74.txt)",
    "halving_doubling": "time O(log K), peak bandwidth O(1) (seed 001_49cb7c694370cc74.txt)",
    "tree": "O(log K) steps (reduce then broadcast along a binary tree)",
}


def _nnls2(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """min Σ (a·x + b·y - t)² / t² over a, b >= 0: the unconstrained solution, else the better edge."""

    def sse(a, b):
        return sum(((a * x + b * y - t) / t) ** 2 for x, y, t in rows)

    w = [(x / t, y / t, 1.0) for x, y, t in rows]
    sxx = sum(x * x for x, _, _ in w)
    syy = sum(y * y for _, y, _ in w)
    sxy = sum(x * y for x, y, _ in w)
    sx1 = sum(x for x, _, _ in w)
    sy1 = sum(y for _, y, _ in w)
    det = sxx * syy - sxy * sxy
    candidates = []
    if abs(det) > 1e-300:
        a, b = (sx1 * syy - sy1 * sxy) / det, (sy1 * sxx - sx1 * sxy) / det
        if a >= 0 and b >= 0:
            candidates.append((a, b))
    candidates.append((sx1 / sxx if sxx else 0.0, 0.0))
    candidates.append((0.0, sy1 / syy if syy else 0.0))
    return min(candidates, key=lambda ab: sse(*ab))


def _rel_rms(pred: list[float], obs: list[float]) -> float:
    """Root-mean-square relative error, sqrt(mean(((p - t) / t)²)): 0 is a perfect fit. (An R² over cells
    spanning six decades of size is near 1 for any law: the size explains the time, not K.)"""
    return math.sqrt(sum(((p - t) / t) ** 2 for p, t in zip(pred, obs)) / len(obs))


def _line_r2(xs: list[float], ts: list[float]) -> tuple[float, float, float]:
    """Ordinary least squares t = a + b·x: (a, b, R²)."""
    n = len(xs)
    mx, mt = sum(xs) / n, sum(ts) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx if sxx else 0.0
    a = mt - b * mx
    ss_tot = sum((t - mt) ** 2 for t in ts)
    ss_res = sum((a + b * x - t) ** 2 for x, t in zip(xs, ts))
    return a, b, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0


def fit(results: list[dict], op: str = "all_reduce") -> dict:
    """The fit document from collectives result documents at different world sizes (see the module doc)."""
    cells: dict[str, dict[int, dict[int, float]]] = {}  # algorithm -> bytes -> K -> median seconds
    device = None
    for res in results:
        k = int(res["world_size"])
        device = device or res.get("device")
        for row in res.get("rows", []):
            if row.get("op") == op and row.get("time_s_median") and row.get("correct") is not False:
                cells.setdefault(row["algorithm"], {}).setdefault(int(row["bytes"]), {})[k] = row["time_s_median"]
    world_sizes = sorted({int(r["world_size"]) for r in results})
    out = {
        "kind": "collectives_scaling",
        "op": op,
        "world_sizes": world_sizes,
        "device": device,
        "model": "t(K, N) = alpha * S(K) + beta * P(K) * N (Hockney); fitted on relative error, alpha and beta >= 0",
        "laws": {name: text for name, (_, _, text) in LAWS.items()},
        "algorithms": {},
    }
    for algo, by_size in sorted(cells.items()):
        points = [(k, n, t) for n, by_k in by_size.items() for k, t in by_k.items()]
        if len({k for k, _, _ in points}) < 2:
            continue
        fits = {}
        for law, (steps, per_byte, _) in LAWS.items():
            rows = [(steps(k), per_byte(k) * n, t) for k, n, t in points]
            a, b = _nnls2(rows)
            fits[law] = {
                "alpha_s": a,
                "beta_s_per_byte": b,
                "rel_rms_error": _rel_rms([a * x + b * y for x, y, _ in rows], [t for _, _, t in rows]),
            }
        best = min(fits, key=lambda law: fits[law]["rel_rms_error"])
        sizes = []
        for n in sorted(by_size):
            by_k = by_size[n]
            if len(by_k) < 3:
                continue
            ks = sorted(by_k)
            ts = [by_k[k] for k in ks]
            _, b_lin, r2_lin = _line_r2([k - 1 for k in ks], ts)
            _, b_log, r2_log = _line_r2([math.log2(k) for k in ks], ts)
            sizes.append(
                {
                    "bytes": n,
                    "time_s_by_K": {str(k): by_k[k] for k in ks},
                    "slope_s_per_rank": b_lin,
                    "r2_linear_in_K": r2_lin,
                    "slope_s_per_doubling": b_log,
                    "r2_log_K": r2_log,
                    "closer": "linear in K" if r2_lin >= r2_log else "log K",
                }
            )
        entry = {
            "points": len(points),
            "fits": fits,
            "best_law": best,
            "by_size": sizes,
        }
        if algo in LAWS:
            own = fits[algo]["rel_rms_error"]
            entry.update(
                seed_claim=SEED_CLAIMS[algo],
                own_law=algo,
                own_law_rel_rms_error=own,
                # within 1 % points of the best law: the laws are indistinguishable at that level
                own_law_fits_best=best == algo or own <= fits[best]["rel_rms_error"] + 0.01,
            )
        out["algorithms"][algo] = entry
    return out


def load_results(run_dir: Path) -> list[dict]:
    return [
        json.loads(p.read_text()) for p in sorted(Path(run_dir).glob("collectives-w*.json")) if ".config." not in p.name
    ]


def fit_run(run_dir: Path, op: str = "all_reduce") -> dict | None:
    """The fit of a run folder's ``collectives-w<K>.json`` files (None with fewer than two world sizes)."""
    results = load_results(run_dir)
    if len({r.get("world_size") for r in results}) < 2:
        return None
    return fit(results, op)
