"""Report section: collective time against the number of ranks K, fitted to each algorithm's law.

Reads only ``collectives-scaling.json`` in each run folder (written by ``parabench run`` for a collectives
suite at several world sizes, or ``python -m parabench.collectives_bench --fit RUN_DIR``; the fit is
``parabench.collectives_scaling``). One table row per (run, algorithm): the law that fits best, the
algorithm's own law and its error, α and β of its own law; one figure: time against K at the smallest,
a middle and the largest message, the points measured and the own law's line.
"""

from __future__ import annotations

import json
from pathlib import Path

from parabench.collectives_scaling import FIT_FILE

COLUMNS = [
    ("algorithm", "algorithm", "str"),
    ("device", "device", "str"),
    ("world_sizes", "K", "str"),
    ("claim", "seed's claim", "wrap"),
    ("own_err_pct", "own law: rel. RMS error %", "f1"),
    ("best_law", "best-fitting law", "str"),
    ("best_err_pct", "best law: rel. RMS error %", "f1"),
    ("own_fits", "own law fits best", "str"),
    ("alpha_us", "α µs (own law)", "f1"),
    ("beta_gbps", "1/β GB/s (own law)", "f2"),
    ("small", "smallest message: closer to", "str"),
    ("large", "largest message: closer to", "str"),
]
NOTE = (
    "t(K, N) = α·S(K) + β·P(K)·N with S the steps and P the bytes per byte of message on the critical path: "
    "ps S = 2(K−1), P = 2(K−1); ring S = 2(K−1), P = 2(K−1)/K; halving-doubling S = 2 log2 K, P = 2(K−1)/K; "
    "tree S = P = 2⌈log2 K⌉. Every law is fitted to every algorithm (non-negative least squares on relative "
    "error over all message sizes and K); 'own law fits best' allows 1 % point. Per message size, the time "
    "against K alone is fitted as a + b·(K−1) and as a + b·log2 K. The claims are seed "
    "001_49cb7c694370cc74.txt's."
)


def load_fits(run_dirs) -> list[tuple[str, dict]]:
    out = []
    for d in run_dirs:
        p = Path(d) / FIT_FILE
        if p.is_file():
            try:
                out.append((Path(d).name, json.loads(p.read_text())))
            except (OSError, ValueError):
                continue
    return out


def scaling_rows(run_dirs) -> list[dict]:
    rows = []
    for run, doc in load_fits(run_dirs):
        device = (doc.get("device") or {}).get("type", "?")
        for algo, e in (doc.get("algorithms") or {}).items():
            fits = e.get("fits") or {}
            own = fits.get(e.get("own_law")) or {}
            best = fits.get(e.get("best_law")) or {}
            sizes = e.get("by_size") or []
            beta = own.get("beta_s_per_byte")
            rows.append(
                {
                    "run": run,
                    "algorithm": algo,
                    "device": device,
                    "world_sizes": ", ".join(str(k) for k in doc.get("world_sizes") or []),
                    "claim": e.get("seed_claim", "–"),
                    "own_err_pct": 100 * own["rel_rms_error"] if "rel_rms_error" in own else None,
                    "best_law": e.get("best_law"),
                    "best_err_pct": 100 * best["rel_rms_error"] if "rel_rms_error" in best else None,
                    "own_fits": {True: "yes", False: "no"}.get(e.get("own_law_fits_best"), "–"),
                    "alpha_us": own["alpha_s"] * 1e6 if "alpha_s" in own else None,
                    "beta_gbps": 1e-9 / beta if beta else None,
                    "small": sizes[0]["closer"] if sizes else None,
                    "large": sizes[-1]["closer"] if sizes else None,
                }
            )
    return rows


def table_specs(run_dirs, run_col: list) -> list[dict]:
    rows = scaling_rows(run_dirs)
    if not rows:
        return []
    return [
        {
            "id_": "collective-scaling",
            "title": "Collectives: time against the number of ranks, fitted to each algorithm's law",
            "columns": run_col + COLUMNS,
            "rows": rows,
            "note": NOTE,
        }
    ]


def figures(run_dirs) -> list[dict]:
    fits = load_fits(run_dirs)
    if not fits:
        return []
    import matplotlib.pyplot as plt

    from parabench.collectives_scaling import LAWS
    from parabench.report.figures import _grid, figure_entry

    entries = []
    for run, doc in fits:
        algos = doc.get("algorithms") or {}
        sizes = sorted({s["bytes"] for e in algos.values() for s in e.get("by_size") or []})
        if not sizes:
            continue
        picked = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})
        fig, axes = _grid(len(picked), 4.2, 3.4, ncols=3)
        for ax, n in zip(axes, picked):
            for algo, e in sorted(algos.items()):
                pts = next((s for s in e.get("by_size") or [] if s["bytes"] == n), None)
                if pts is None:
                    continue
                ks = sorted(int(k) for k in pts["time_s_by_K"])
                line = ax.plot(ks, [pts["time_s_by_K"][str(k)] * 1e3 for k in ks], "o", label=algo)[0]
                law = e.get("own_law") or e.get("best_law")
                f = (e.get("fits") or {}).get(law)
                if f and law in LAWS:
                    steps, per_byte, _ = LAWS[law]
                    # at the measured K only: between powers of two the laws jump (halving-doubling's fold)
                    model = [(f["alpha_s"] * steps(k) + f["beta_s_per_byte"] * per_byte(k) * n) * 1e3 for k in ks]
                    ax.plot(ks, model, "-", color=line.get_color(), alpha=0.6)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("ranks K")
            ax.set_ylabel("time per all-reduce (ms)")
            ax.set_title(f"{n:,} bytes")
        axes[0].legend(fontsize="small", frameon=False)
        entries.append(
            figure_entry(
                f"collective-scaling-{run}",
                f"All-reduce time against K ({(doc.get('device') or {}).get('type', '?')}, run {run})",
                "Points: median time per call, the slowest rank's; lines: each algorithm's own law "
                "(the backend's best-fitting one) with α and β fitted over every size and K.",
                fig,
            )
        )
        plt.close(fig)
    return entries
