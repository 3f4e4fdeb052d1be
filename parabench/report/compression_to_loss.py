"""Report section: gradient compression and local SGD to a target loss, against bytes sent and wall time.

The compressors trade bytes for loss: fp16 halves the all-reduce, 1-bit and top-k send a few per cent of it
with error feedback, PowerSGD a low-rank factorisation, local SGD averages only every H steps. Which one is
*cheapest* is a question of what it costs to reach a given loss, not of bytes per step. The target here is
plain DDP's: its loss at its last timed step (step 300 in ``suites/studies/compression-to-loss-*.toml``),
smoothed over the last ``WINDOW`` steps, plus 1 %.

Reads only records, of the strategies whose rows name this section: per step, the loss the record keeps
(``metrics.losses``, warm-up steps included, the metered extra step not), smoothed by a trailing mean of
``WINDOW`` steps; bytes per step from the record's theory (``comm_payload_bytes_avg_per_step`` where the
traffic varies by step, as local SGD's, else ``comm_payload_bytes``: rank 0's payload, which the record's
communication check compares with the meter); seconds per step, the median timed step. Cumulative bytes
and seconds to the first step whose smoothed loss is at or under the target. Only runs of at least
``MIN_STEPS`` steps take part: a short run says nothing about a target loss.
"""

from __future__ import annotations

from parabench.registry import STRATEGIES, reporting
from parabench.report.frames import as_number, dig, records_of

SECTION = "compression_to_loss"
WINDOW = 20
TARGET_MARGIN = 0.01
MIN_STEPS = 100
COLUMNS = [
    ("label", "case", "str"),
    ("family", "family", "str"),
    ("kind", "kind", "str"),
    ("mb_per_step", "MB per step", "f3"),
    ("ms_per_step", "ms per step", "f1"),
    ("final_loss", f"loss, last {WINDOW} steps", "f3"),
    ("vs_target_pct", "vs target %", "f2"),
    ("reached_step", "step reaching target", "str"),
    ("mb_to_target", "MB to target", "f2"),
    ("s_to_target", "s to target", "f2"),
]


def _smoothed(losses: list[float]) -> list[float]:
    out, total = [], 0.0
    for i, x in enumerate(losses):
        total += x
        if i >= WINDOW:
            total -= losses[i - WINDOW]
        out.append(total / min(i + 1, WINDOW))
    return out


def _bytes_per_step(r: dict) -> float | None:
    theory = r.get("theory") or {}
    per_step = theory.get("comm_payload_bytes_avg_per_step") or theory.get("comm_payload_bytes")
    if not isinstance(per_step, dict):
        return None
    return float(sum(as_number(v) or 0 for v in per_step.values()))


def _series(r: dict) -> dict | None:
    case = r.get("case") or {}
    steps = (case.get("warmup") or 0) + (case.get("steps") or 0)
    losses = [as_number(x) for x in (dig(r, "metrics", "losses") or [])][:steps]
    if r.get("status") != "ok" or (case.get("steps") or 0) < MIN_STEPS or not losses or None in losses:
        return None
    row = STRATEGIES.get(case.get("strategy"))
    opts = ", ".join(f"{k}={v}" for k, v in sorted((case.get("options") or {}).items()) if k != "profile")
    return {
        "label": r.get("label") or case.get("strategy"),
        "short": str(case.get("strategy")) + (f" [{opts}]" if opts else ""),
        "family": row.family if row else "?",
        "kind": row.kind if row else "?",
        "group": (case.get("model"), case.get("world_size"), case.get("precision")),
        "smoothed": _smoothed(losses),
        "bytes_per_step": _bytes_per_step(r),
        "s_per_step": as_number(dig(r, "metrics", "step_time_s_median")),
    }


def analyse(runs) -> list[dict]:
    """Per run and (model, world size, precision): the target, each case's series and its cost to the target."""
    groups: dict[tuple, dict] = {}
    for _, run, r in records_of(runs, reporting(SECTION)):
        s = _series(r)
        if s is not None:
            groups.setdefault((run, *s["group"]), {"run": run, "series": []})["series"].append(s)
    out = []
    for g in groups.values():
        plain = [s for s in g["series"] if s["family"] == "data_parallel"]
        if not plain or len(g["series"]) < 2:
            continue
        target = min(s["smoothed"][-1] for s in plain) * (1 + TARGET_MARGIN)
        for s in g["series"]:
            hit = next((i for i, x in enumerate(s["smoothed"]) if x <= target), None)
            s["target"] = target
            s["reached_step"] = None if hit is None else hit + 1
            bps, sps = s["bytes_per_step"], s["s_per_step"]
            s["bytes_to_target"] = None if hit is None or bps is None else (hit + 1) * bps
            s["s_to_target"] = None if hit is None or sps is None else (hit + 1) * sps
        reached = [s for s in g["series"] if s["reached_step"] is not None]
        g["target"] = target
        g["cheapest_bytes"] = min(reached, key=lambda s: s["bytes_to_target"] or 0.0, default=None)
        g["cheapest_time"] = min(reached, key=lambda s: s["s_to_target"] or float("inf"), default=None)
        out.append(g)
    return out


def table_specs(runs, run_col: list) -> list[dict]:
    specs = []
    for g in analyse(runs):
        rows = []
        for s in sorted(g["series"], key=lambda s: (s["bytes_to_target"] is None, s["bytes_to_target"] or 0)):
            bps, sps = s["bytes_per_step"], s["s_per_step"]
            rows.append(
                {
                    "run": g["run"],
                    "label": s["label"],
                    "family": s["family"],
                    "kind": s["kind"],
                    "mb_per_step": bps / 1e6 if bps is not None else None,
                    "ms_per_step": sps * 1e3 if sps is not None else None,
                    "final_loss": s["smoothed"][-1],
                    "vs_target_pct": 100 * (s["smoothed"][-1] / g["target"] - 1),
                    "reached_step": str(s["reached_step"]) if s["reached_step"] else "not reached",
                    "mb_to_target": s["bytes_to_target"] / 1e6 if s["bytes_to_target"] is not None else None,
                    "s_to_target": s["s_to_target"],
                }
            )
        cb, ct = g["cheapest_bytes"], g["cheapest_time"]
        verdict = (
            f"Cheapest in bytes to the target: {cb['label']} ({cb['bytes_to_target'] / 1e6:.2f} MB at step "
            f"{cb['reached_step']}); fastest: {ct['label']} ({ct['s_to_target']:.2f} s)."
            if cb and ct
            else "No case reached the target."
        )
        specs.append(
            {
                "id_": f"compression-to-loss-{len(specs) + 1}",
                "title": f"Compression to DDP's loss: {g['series'][0]['group'][0]}, {g['series'][0]['group'][1]} ranks",
                "columns": run_col + COLUMNS,
                "rows": rows,
                "note": f"Target: the best plain data-parallel case's loss at its last step (trailing mean of {WINDOW} "
                f"steps) + {TARGET_MARGIN:.0%} = {g['target']:.4f}. Bytes: rank 0's payload per step from the "
                "record's theory (local SGD: its mean over H steps). " + verdict,
            }
        )
    return specs


def figures(runs) -> list[dict]:
    groups = analyse(runs)
    if not groups:
        return []
    import matplotlib.pyplot as plt

    from parabench.report.figures import _grid, figure_entry

    entries = []
    for i, g in enumerate(groups, 1):
        fig, axes = _grid(2, 5.6, 4.2)
        by_bytes, by_time = axes[0], axes[1]
        for s in sorted(g["series"], key=lambda s: s["label"]):
            steps = range(1, len(s["smoothed"]) + 1)
            style = "-" if s["kind"] == "reference" else "--"
            if s["bytes_per_step"]:
                by_bytes.plot([k * s["bytes_per_step"] / 1e6 for k in steps], s["smoothed"], style, label=s["short"])
            if s["s_per_step"]:
                by_time.plot([k * s["s_per_step"] for k in steps], s["smoothed"], style, label=s["label"])
        for ax, xlabel in ((by_bytes, "MB sent per rank (cumulative)"), (by_time, "seconds (cumulative)")):
            ax.axhline(g["target"], color="black", linewidth=0.8, linestyle=":")
            ax.set_xscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"loss (trailing mean of {WINDOW} steps)")
            lowest = min(min(s["smoothed"]) for s in g["series"])
            ax.set_ylim(lowest - 0.02 * g["target"], g["target"] * 1.2)  # the approach to the target
        handles, labels = by_bytes.get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize="x-small", frameon=False)
        cb, ct = g["cheapest_bytes"], g["cheapest_time"]
        entries.append(
            figure_entry(
                f"compression-to-loss-{i}",
                f"Loss against bytes sent and wall time ({g['series'][0]['group'][0]}, run {g['run']})",
                f"Dotted: DDP's last-step loss + {TARGET_MARGIN:.0%}. Solid: references, dashed: torch's DDP hooks "
                "and DDP. "
                + (
                    f"Cheapest to the target in bytes: {cb['label']}; in time: {ct['label']}."
                    if cb and ct
                    else "No case reached the target."
                ),
                fig,
            )
        )
        plt.close(fig)
    return entries
