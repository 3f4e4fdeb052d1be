"""Report section: scaling series and pipeline bubbles (reads result records only).

A scaling series is the cases of one strategy, model, recipe and batch shape across world sizes,
grouped by the mode their suite gave them (``case.scaling``, ``parabench.suite``):

* strong: the global batch is fixed; efficiency t(N0)·N0 / (N·t(N)) on the median step time;
* weak: the micro-batch per rank is fixed; efficiency = tokens/s per device at N over N0's.

N0 is the series' smallest world size (1 where it ran). Beside throughput and efficiency: the
communication share of the step measured by the step breakdown (cases with ``step_breakdown``),
the analytic communication bytes per step (no bus bandwidth is assumed, so bytes, not seconds),
and the model-state bytes per rank against the ZeRO paper's lines. The pipeline table sets the
measured bubble of each pipeline case beside (p−1)/(m+p−1) and beside its own schedule replayed
with the measured op times (``frames.bubble_rows``, ``parabench.pipeline_sim``).
"""

from __future__ import annotations

from parabench.report import frames

SERIES_COLUMNS = [
    ("mode", "mode", "str"),
    ("series", "series", "str"),
    ("model", "model", "str"),
    ("precision", "recipe", "str"),
    ("world_size", "devices N", "int"),
    ("micro_batch", "mb", "int"),
    ("global_batch", "global batch", "int"),
    ("step_time_ms", "step ms", "f2"),
    ("tokens_per_s_per_device", "tok/s/device", "int"),
    ("efficiency_pct", "efficiency %", "f1"),
    ("base_world_size", "against N", "int"),
    ("comm_share_pct", "comm % of step (profiled)", "f1"),
    ("exposed_comm_share_pct", "exposed comm % of step", "f1"),
    ("comm_bytes", "comm per step, measured", "bytes"),
    ("theory_comm_bytes", "comm per step, analytic", "bytes"),
    ("state_bytes", "state per rank, measured", "bytes"),
    ("paper_state_bytes", "state per rank, ZeRO paper", "bytes"),
    ("peak_mem_bytes", "peak per rank", "bytes"),
]

SERIES_NOTE = (
    "One row per case and series. Strong scaling fixes the global batch (efficiency t(N0)·N0 / (N·t(N)), "
    "t the median step time); weak scaling fixes the micro-batch per rank (efficiency: tokens/s per device "
    "over that at N0). N0 ('against N') is the series' smallest device count, 1 where it ran; 100 % is "
    "ideal. Communication share: the union of communication intervals, and the part no compute overlaps, "
    "as a share of one profiled step (step_breakdown; mean over ranks; empty where the case was not "
    "profiled). Communication bytes: rank 0's payload per step, measured on the instrumented step, and the "
    "analytic volume; no bus bandwidth is assumed, so the expectation is in bytes, not time. State: "
    "parameters, gradients and optimizer states of the largest rank, beside the ZeRO paper's figure for the "
    "strategy (16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N)."
)

BUBBLE_COLUMNS = [
    ("label", "case", "str"),
    ("schedule", "schedule", "str"),
    ("stages", "stages p", "int"),
    ("microbatches", "micro-batches m", "int"),
    ("measured_pct", "bubble % measured (mean of stages)", "f2"),
    ("measured_min_pct", "min stage %", "f2"),
    ("measured_max_pct", "max stage %", "f2"),
    ("theory_pct", "(p−1)/(m+p−1) %", "f2"),
    ("difference_pct", "measured − theory, points", "f2"),
    ("worst_stage", "furthest stage", "int"),
    ("worst_difference_pct", "its difference, points", "f2"),
    ("agrees", f"within {frames.BUBBLE_TOLERANCE:g}", "str"),
]
# the measured bubble taken apart against its schedule replayed: a table of its own, so that each fits the page
BUBBLE_PART_COLUMNS = [
    ("label", "case", "str"),
    ("measured_pct", "bubble % measured", "f2"),
    ("theory_pct", "theory %", "f2"),
    ("equal_stages_pct", "simulated %, equal stages", "f2"),
    ("simulated_pct", "simulated %, measured op times", "f2"),
    ("op_ratio_pct", "op-time ratio, points", "f2"),
    ("imbalance_pct", "stage imbalance, points", "f2"),
    ("residual_pct", "residual (p2p, launches), points", "f2"),
    ("agrees_simulated", f"within {frames.BUBBLE_TOLERANCE:g} of simulated", "str"),
    ("timeline_step_ratio", "timeline step ÷ timed step", "f2"),
]

BUBBLE_NOTE = (
    "Measured: each stage's idle share of its step (waiting on receives and on the sends it issued) "
    "on the timeline step; on GPUs only with record_timeline (CUDA events around every op), otherwise "
    "the host clock sees kernel launches and no figure is given. Theory: (p−1)/(m+p−1) for GPipe and "
    "1F1B. A mean more than "
    f"{frames.BUBBLE_TOLERANCE:g} ({frames.BUBBLE_TOLERANCE * 100:g} points) from theory is flagged; "
    "the furthest stage shows how evenly the idle time is spread. A dash: the strategy records no "
    "measured bubble (a library's schedule)."
)
BUBBLE_PART_NOTE = (
    "The measured bubble of each pipeline case above, taken apart. Simulated: the case's own schedule replayed with free "
    "messages (parabench.pipeline_sim), each op lasting what it measured on the timeline, or, for equal "
    "stages, its kind's mean over all stages. measured = theory + op-time ratio (equal stages − theory; "
    "non-zero where the theory assumes T_F = T_B = T_W) + stage imbalance (measured op times − equal "
    "stages: the embedding on the first stage, head and loss on the last, slow ops) + residual (measured − "
    "simulated: transfers, launches and host gaps between ops). Timeline step ÷ timed step: the step the "
    "bubble is measured on (its own untimed step with record_timeline; older runs: the instrumented step, "
    "communication meter on, a device sync around every op); well above 1 its op times, and so its bubble, "
    "do not describe the timed steps."
)


def table_specs(runs, run_col: list) -> list[dict]:
    """The section's tables as keyword arguments of ``parabench.report.html._table``."""
    specs = []
    series = frames.scaling_rows(runs)
    if series:
        specs.append(
            {
                "id_": "scaling-series",
                "title": "Scaling series: throughput, efficiency, communication share, memory",
                "columns": run_col + SERIES_COLUMNS,
                "rows": series,
                "note": SERIES_NOTE,
                "drop_empty": True,
            }
        )
    bubbles = frames.bubble_rows(runs)
    if bubbles:
        flagged = [b for b in bubbles if b["agrees"] is False]
        specs.append(
            {
                "id_": "pipeline-bubble",
                "title": "Pipeline bubble: measured against (p−1)/(m+p−1)",
                "columns": run_col + BUBBLE_COLUMNS,
                "rows": bubbles,
                "note": BUBBLE_NOTE,
                "row_class": lambda b: "bad-row" if b["agrees"] is False else "",
                "footer": (
                    f"{len(flagged)} of {len(bubbles)} pipeline cases differ from theory by more than "
                    f"{frames.BUBBLE_TOLERANCE:g}: {'; '.join(b['label'] for b in flagged)}"
                    if flagged
                    else ""
                ),
            }
        )
        specs.append(
            {
                "id_": "pipeline-bubble-parts",
                "title": "Pipeline bubble taken apart: op times, stage imbalance, the rest",
                "columns": run_col + BUBBLE_PART_COLUMNS,
                "rows": bubbles,
                "note": BUBBLE_PART_NOTE,
                "row_class": lambda b: "bad-row" if b["agrees_simulated"] is False else "",
                "drop_empty": True,
            }
        )
    return specs


def _unit(values) -> tuple[float, str]:
    top = max((v for v in values if v), default=0)
    return (2**30, "GiB") if top >= 2**30 else (2**20, "MiB")


def figures(runs) -> list[dict]:
    """One figure per model, recipe and mode (throughput, efficiency, communication share and
    analytic bytes against N), and one of model-state memory per rank against the ZeRO lines."""
    rows = frames.scaling_rows(runs)
    if not rows:
        return []
    from parabench.report.figures import figure_entry, plt, setup_style

    setup_style()
    out = []
    several_runs = len({r["run"] for r in rows}) > 1
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["params"] or 0, r["model"], r["precision"], r["mode"]), []).append(r)
    for (_, model, precision, mode), members in sorted(groups.items()):
        if len({m["world_size"] for m in members}) < 2:
            continue
        out.append(_series_figure(model, precision, mode, members, several_runs, plt, figure_entry))
    memory = _memory_figure(rows, several_runs, plt, figure_entry)
    if memory:
        out.append(memory)
    return out


def _series_name(r: dict, several_runs: bool) -> str:
    return r["series"] + (f" · {r['run'].split('/')[-1]}" if several_runs else "")


def _lines(ax, members, key, several_runs, colours, scale=1.0):
    """One line per series (colour per series; references dashed), points ordered by N."""
    by_series: dict[str, list[dict]] = {}
    for m in members:
        by_series.setdefault(_series_name(m, several_runs), []).append(m)
    drawn = False
    for name, pts in by_series.items():
        pts = sorted((p for p in pts if p[key] is not None), key=lambda p: p["world_size"])
        if not pts:
            continue
        ax.plot(
            [p["world_size"] for p in pts],
            [p[key] / scale for p in pts],
            marker="o",
            ms=4,
            lw=1.3,
            ls="--" if pts[0]["kind"] == "reference" else "-",
            color=colours[name],
            label=name,
        )
        drawn = True
    return drawn


def _series_figure(model, precision, mode, members, several_runs, plt, figure_entry) -> dict:
    names = list(dict.fromkeys(_series_name(m, several_runs) for m in members))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    colours = {n: cmap(i % cmap.N) for i, n in enumerate(names)}
    sizes = sorted({m["world_size"] for m in members})
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4), layout="constrained")
    tps, eff, share, comm = axes.ravel()
    _lines(tps, members, "tokens_per_s_per_device", several_runs, colours)
    tps.set_ylabel("tokens/s per device")
    tps.set_title("throughput per device")
    _lines(eff, members, "efficiency_pct", several_runs, colours)
    eff.axhline(100, color="black", lw=0.8, ls=":", label="ideal (100 %)")
    eff.set_ylabel("scaling efficiency (%)")
    eff.set_title("strong: t(N0)·N0 / (N·t(N))" if mode == "strong" else "weak: tokens/s per device relative to N0")
    if _lines(share, members, "comm_share_pct", several_runs, colours):
        share.set_ylabel("communication (% of profiled step)")
    else:
        share.text(
            0.5,
            0.5,
            "no step breakdown recorded\n(option step_breakdown)",
            ha="center",
            va="center",
            transform=share.transAxes,
            fontsize=8,
            color="#555",
        )
        share.set_ylabel("communication (% of step)")
    share.set_title("communication share, measured")
    unit, unit_name = _unit(m["theory_comm_bytes"] for m in members)
    _lines(comm, members, "theory_comm_bytes", several_runs, colours, scale=unit)
    comm.set_ylabel(f"{unit_name} per step per rank (analytic)")
    comm.set_title("communication volume, analytic")
    for ax in axes.ravel():
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xlabel("devices N")
        ax.set_ylim(bottom=0)
    handles, labels = [], []
    for ax in (tps, eff):
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="outside upper center", ncol=2, frameon=False)
    what = "global batch fixed" if mode == "strong" else "micro-batch per rank fixed"
    return figure_entry(
        f"scaling-{mode}-{model}-{precision}",
        f"{mode.capitalize()} scaling ({what}): {model} · {precision}",
        "One line per series (strategy and batch: gb = global batch, mb = micro-batch per rank); dashed: "
        "reference implementations. Efficiency against the series' smallest device count N0 (1 where it "
        "ran). Communication share: union of communication intervals over one profiled step (step_breakdown), "
        "mean over ranks. Analytic volume: rank 0's payload bytes per step from the record's theory.",
        fig,
    )


def _memory_figure(rows, several_runs, plt, figure_entry) -> dict | None:
    """Measured model-state bytes per rank against the data-parallel degree N, one panel per model
    and recipe, over the ZeRO paper's four lines for that model's Ψ."""
    panels: dict[tuple, dict[str, dict[int, dict]]] = {}
    for r in rows:
        if r["state_bytes"] is None or not r["dp"] or not r["params"]:
            continue
        # the model state does not depend on the batch: one point per strategy (variant) and N
        name = r["series"].rsplit(" ", 1)[0] + (f" · {r['run'].split('/')[-1]}" if several_runs else "")
        panels.setdefault((r["params"], r["model"], r["precision"]), {}).setdefault(name, {})[r["dp"]] = r
    panels = {k: v for k, v in panels.items() if len({n for pts in v.values() for n in pts}) >= 2}
    if not panels:
        return None
    import numpy as np

    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.8 * len(panels)), squeeze=False, layout="constrained")
    styles = ("-", "--", "-.", ":")
    for ax, ((psi, model, precision), series) in zip(axes.ravel(), sorted(panels.items())):
        sizes = sorted({n for pts in series.values() for n in pts})
        values = [p["state_bytes"] for pts in series.values() for p in pts.values()] + [16 * psi]
        unit, unit_name = _unit(values)
        grid = np.linspace(min(sizes), max(sizes), 64)
        for (name, f), ls in zip(frames.ZERO_LINES, styles):
            ax.plot(grid, [f(psi, n) / unit for n in grid], color="#444", lw=1.1, ls=ls, label=f"paper {name}")
        cmap = plt.get_cmap("tab10" if len(series) <= 10 else "tab20")
        for i, (name, pts) in enumerate(series.items()):
            ns = sorted(pts)
            ax.plot(
                ns,
                [pts[n]["state_bytes"] / unit for n in ns],
                marker="o",
                ms=5,
                lw=1.4,
                color=cmap(i % cmap.N),
                label=f"{name} (measured)",
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("data-parallel ranks N")
        ax.set_ylabel(f"model state per rank ({unit_name})")
        ax.set_title(f"{model} · {precision} · Ψ = {psi / 1e6:,.2f} M parameters")
        ax.legend(loc="lower left", bbox_to_anchor=(0, 1.08), ncol=2, frameon=False)
    return figure_entry(
        "scaling-memory",
        "Model state per rank against the ZeRO lines",
        "Coloured: parameters, gradients and optimizer states held by the largest rank, measured, one line per "
        "strategy. Grey: the ZeRO paper's model-state bytes per rank for mixed-precision Adam (K = 12): DP 16Ψ, "
        "ZeRO-1 4Ψ+12Ψ/N, ZeRO-2 2Ψ+14Ψ/N, ZeRO-3 16Ψ/N. Implementations lay the bytes out their own way "
        "(fp32 ZeRO-1 keeps 4-byte parameters and gradients whole: 8Ψ + 8Ψ/N; bf16 with fp32 masters may hold "
        "18Ψ), so a measured line can leave the paper's: the table names each case's paper figure.",
        fig,
    )
