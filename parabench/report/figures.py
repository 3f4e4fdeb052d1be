"""Seaborn figures for the report, each returned as a PNG data URI.

Every function takes plain rows (``frames``) and returns a list of ``{id, title, caption, src}``
(empty when its data is absent), so a report only shows what its results hold. PNGs are drawn
at a modest DPI to keep a report of a few dozen cases around a megabyte. Labels from result
files are drawn as plain text (``text.parse_math`` off): a ``$`` in a strategy name must not
be read as TeX.

Every figure fits one screen of a 1,280 px page: at most ``MAX_WIDTH_IN`` wide (so the page shows
it unscaled, and ``MIN_TEXT_PT`` is at least 11 px), at most ``MAX_HEIGHT_IN`` tall (a chart with more
bars than that is split into parts, each its own figure), its legend on top.
"""

from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from parabench.report.overview import CPU_SPEED_LABEL, on_cpu  # noqa: E402

DPI = 90
BAR_IN = 0.22  # inches per bar in the horizontal bar charts
MIN_TEXT_PT = 9  # 11.25 px at DPI 90
MAX_HEIGHT_IN = 12.5  # 1,125 px at DPI 90: one screen
MAX_WIDTH_IN = 13.0  # 1,170 px: inside a 1,280 px page's content column, so shown unscaled
LEGEND_IN = 0.6  # a legend row above the panels, with its margin
KIND_COLOURS = {"peer": "#4c72b0", "reference": "#dd8452"}
KIND_NAMES = {"peer": "production library (torch.*, deepspeed.*)", "reference": "reference implementation (ref.*)"}


def setup_style():
    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.9)
    plt.rcParams["text.parse_math"] = False
    plt.rcParams["axes.titlesize"] = "medium"
    for key in ("legend.fontsize", "legend.title_fontsize", "xtick.labelsize", "ytick.labelsize"):
        plt.rcParams[key] = MIN_TEXT_PT


def _plain_number(v, _pos=None) -> str:
    """Tick text without TeX (parse_math is off): 1024 -> '1K', 3e9 -> '3G'."""
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(v) >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:g}"


def _log_ticks(axis) -> None:
    """Plain tick labels on a log axis, and enough of them: a range under three decades gets
    1-2-5 ticks (one label per decade left a memory plot with one label per axis)."""
    from matplotlib.ticker import LogLocator, NullFormatter

    lo, hi = sorted(axis.get_view_interval())
    base = getattr(axis.get_transform(), "base", 10)
    if base == 10 and lo > 0 and hi / lo < 1e3:
        axis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5) if hi / lo > 4 else (1, 1.5, 2, 3, 4, 5, 7)))
    axis.set_major_formatter(FuncFormatter(_plain_number))
    axis.set_minor_formatter(NullFormatter())


def _readable(fig) -> None:
    """No text under ``MIN_TEXT_PT``, and no figure beyond one screen: a figure drawn too tall is
    squeezed to ``MAX_HEIGHT_IN`` (the bar charts split into parts before they get there)."""
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        if text.get_fontsize() < MIN_TEXT_PT:
            text.set_fontsize(MIN_TEXT_PT)
    w, h = fig.get_size_inches()
    if w > MAX_WIDTH_IN or h > MAX_HEIGHT_IN:
        fig.set_size_inches(min(w, MAX_WIDTH_IN), min(h, MAX_HEIGHT_IN))


def _png(fig) -> str:
    for ax in fig.axes:  # log axes default to TeX tick labels, which parse_math=False prints raw
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale == "log":
                _log_ticks(axis)
    _readable(fig)
    buf = io.BytesIO()
    # the layout engine keeps labels and legends inside the figure: no second, "tight" drawing pass
    if fig.get_layout_engine() is None:
        fig.set_layout_engine("constrained")
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(_small_png(buf.getvalue())).decode()


def _small_png(png: bytes) -> bytes:
    """The PNG with a 256-colour palette: a third of the bytes for flat-coloured charts, so a
    report of a hundred cases stays near a megabyte."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    img.save(out, format="PNG", optimize=True)
    return out.getvalue() if out.tell() < len(png) else png


def figure_entry(id_, title, caption, fig) -> dict:
    return {"id": id_, "title": title, "caption": caption, "src": _png(fig)}


def figure_entries(id_, title, caption, figs) -> list[dict]:
    """One entry per part of a figure split to fit the screen: ``id``, ``id-2``, …, "(part 2 of 3)"."""
    if len(figs) == 1:
        return [figure_entry(id_, title, caption, figs[0])]
    return [
        figure_entry(id_ if i == 1 else f"{id_}-{i}", f"{title} (part {i} of {len(figs)})", caption, fig)
        for i, fig in enumerate(figs, 1)
    ]


def pages(pieces: list[tuple[str, pd.DataFrame]], per: float = BAR_IN, extra: float = 0.9) -> list[list]:
    """Panels ``(title, rows)`` packed into figures no taller than ``MAX_HEIGHT_IN``: a panel of ``n``
    rows is ``per * n + extra`` inches; a panel with more rows than one figure holds is cut into
    parts ("title (rows 1–40)"). Order is kept."""
    room = MAX_HEIGHT_IN - LEGEND_IN
    most = max(1, int((room - extra) / per))
    cut = []
    for title, rows in pieces:
        if len(rows) <= most:
            cut.append((title, rows))
            continue
        for lo in range(0, len(rows), most):
            part = rows.iloc[lo : lo + most]
            cut.append((f"{title} (rows {lo + 1}–{lo + len(part)} of {len(rows)})", part))
    out, used = [], 0.0
    for title, rows in cut:
        need = per * len(rows) + extra
        if out and used + need <= room:
            out[-1].append((title, rows))
            used += need
        else:
            out.append([(title, rows)])
            used = need
    return out


def _grid(n, w=5.0, h=3.0, ncols=2):
    ncols = min(n, ncols)
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False, layout="constrained")
    axes = axes.ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes


def _column(sizes: list[int], width=8.0, per=BAR_IN, extra=0.9, ncols=1):
    """One column of panels (a row of ``ncols`` per panel), each as tall as its number of bars (so no
    panel's labels reach into another's, and no bar is squeezed); room for a legend on top."""
    fig, axes = plt.subplots(
        len(sizes),
        ncols,
        figsize=(width, sum(per * n + extra for n in sizes) + LEGEND_IN),
        squeeze=False,
        layout="constrained",
        sharey="row" if ncols > 1 else False,
        gridspec_kw={"height_ratios": [per * n + extra for n in sizes]},
    )
    return fig, (axes.ravel() if ncols == 1 else axes)


def _width(labels, plot_in: float = 5.5) -> float:
    """Figure width that leaves the bars ``plot_in`` inches beside labels as long as these (at
    ``MIN_TEXT_PT``), at most ``MAX_WIDTH_IN``."""
    return min(MAX_WIDTH_IN, plot_in + 0.08 * max((len(str(x)) for x in labels), default=10))


def _models(df):
    order = df.groupby("model")["params"].max().sort_values(na_position="last")
    return list(order.index)


def with_names(ok: pd.DataFrame) -> pd.DataFrame:
    """``bar``: one case, unique within its panel (strategy with options and an unusual seed,
    devices, micro-batch, and the run where the report has several); ``series``: the same without
    the device count (a line across device counts); ``panel``: the model, with the recipe where a
    model ran under several."""
    several = ok.run.nunique() > 1
    run = ok.run.str.split("/").str[-1] if several else ""
    mb = " mb" + ok.micro_batch.astype(str)
    suffix = (" · " + run) if several else ""
    recipes = ok.groupby("model").precision.transform("nunique")
    return ok.assign(
        bar=ok.variant + " w" + ok.world_size.astype(str) + mb + suffix,
        series=ok.variant + mb + suffix,
        panel=ok.model.where(recipes <= 1, ok.model + " · " + ok.precision),
    )


def _panels(df) -> list[str]:
    order = df.groupby("panel")[["params"]].max().assign(p=lambda x: x.index)
    return list(order.sort_values(["params", "p"], na_position="last").index)


def _bar_order(sub: pd.DataFrame, value: str, by_name: bool = False) -> pd.DataFrame:
    """Micro-batch groups, fastest first within each (``by_name``: in order of name); the first bar on top."""
    if by_name:
        return sub.sort_values(["micro_batch", "bar"])
    return sub.sort_values(["micro_batch", value], ascending=[True, False])


def _kind_legend(fig) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=KIND_COLOURS[k], label=KIND_NAMES[k]) for k in KIND_COLOURS]
    fig.legend(handles=handles, loc="outside upper center", ncol=2, frameon=False)


def _bars(ok: pd.DataFrame, value: str, xlabel: str, err=None, by_name: bool = False) -> list:
    """Horizontal bars, one per case, one panel per model; thin lines part micro-batches; as many
    figures as it takes to keep each within one screen."""
    ok = ok.dropna(subset=[value])
    pieces = [(p, _bar_order(ok[ok.panel == p], value, by_name)) for p in _panels(ok)]
    return [_bar_page(page, value, xlabel, err, _width(ok.bar)) for page in pages(pieces)]


def _bar_page(page, value, xlabel, err, width):
    fig, axes = _column([len(sub) for _, sub in page], width=width)
    for ax, (panel, sub) in zip(axes, page):
        ys = list(range(len(sub)))[::-1]
        xerr = None
        if err is not None:
            lo, hi = err(sub)
            xerr = [(sub[value] - lo).clip(lower=0).fillna(0), (hi - sub[value]).clip(lower=0).fillna(0)]
        ax.barh(
            ys,
            sub[value],
            color=[KIND_COLOURS.get(k, "grey") for k in sub.kind],
            xerr=xerr,
            error_kw={"elinewidth": 1, "ecolor": "#333"},
            height=0.75,
        )
        ax.set_yticks(ys)
        ax.set_yticklabels(sub.bar)
        mbs = list(sub.micro_batch)
        for i in range(1, len(mbs)):
            if mbs[i] != mbs[i - 1]:
                ax.axhline(ys[i] + 0.5, color="#999", lw=0.8, ls=":")
        ax.set_ylim(-0.6, len(sub) - 0.4)
        ax.xaxis.set_major_formatter(FuncFormatter(_plain_number))
        ax.set_title(panel)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("")
    _kind_legend(fig)
    return fig


def throughput(ok: pd.DataFrame) -> list[dict]:
    """Tokens/s per device, one bar per case, with the spread of the per-step rate."""
    ok = ok.dropna(subset=["tokens_per_s_per_device"])
    if ok.empty:
        return []

    def per_step(sub):  # the slowest and fastest tenth of steps, as tokens/s per device
        rate = sub.tokens_per_step / sub.world_size * 1e3
        return rate / sub.step_time_ms_p90, rate / sub.step_time_ms_p10

    # gloo timings on a shared CPU are no ranking (parabench.report.overview): bars in order of name
    cpu = all(on_cpu(r) for r in ok.to_dict("records"))
    figs = _bars(ok, "tokens_per_s_per_device", "tokens/s per device", err=per_step, by_name=cpu)
    return figure_entries(
        "throughput",
        f"Tokens/s per device, in order of name ({CPU_SPEED_LABEL})"
        if cpu
        else "Tokens/s per device (higher is better)",
        "One bar per case (strategy, devices w, micro-batch mb; other seeds and options named): its "
        "median tokens/s per device, over launches where the case was repeated. Whisker: the 10th to "
        "90th percentile of the per-step rate within one launch. Dotted lines part micro-batches.",
        figs,
    )


def scaling(ok: pd.DataFrame) -> list[dict]:
    """Global tokens/s against the number of devices, for every strategy (and micro-batch) that ran
    at two device counts or more; one device counts (it is the baseline the dashed line starts from)."""
    spans = ok.groupby(["model", "series"]).world_size.transform("nunique") > 1
    multi = ok[spans].dropna(subset=["tokens_per_s"])
    if multi.empty:
        return []
    models = [m for m in _models(ok) if m in set(multi.model)]
    figs = [
        _scaling_page(ok, multi, page)
        for page in _pack([(m, [*multi[multi.model == m].series.unique(), "linear from 1 device"]) for m in models])
    ]
    return figure_entries(
        "scaling",
        "Scaling across device counts",
        "One line per strategy and micro-batch that ran at two device counts or more (1 device included). "
        "Dashed: linear scaling from the best one-device run of the model.",
        figs,
    )


def _scaling_page(ok, multi, page):
    fig, axes = _line_panels(page)
    for ax, (model, _) in zip(axes, page):
        sub = multi[multi.model == model]
        style = "precision" if sub.precision.nunique() > 1 else None
        sns.lineplot(
            data=sub, x="world_size", y="tokens_per_s", hue="series", style=style, marker="o", ax=ax, errorbar=None
        )
        one = ok[(ok.model == model) & (ok.world_size == 1)].tokens_per_s.max()
        if one == one and one:
            ws = sorted(sub.world_size.unique())
            ax.plot(ws, [one * w for w in ws], "k--", lw=0.8, label="linear from 1 device")
        _top_legend(ax, *ax.get_legend_handles_labels(), model)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(sub.world_size.unique()))
        ax.set_xlabel("devices")
        ax.set_ylabel("tokens/s (global)")
    return fig


def memory(ok: pd.DataFrame) -> list[dict]:
    figs = []
    # against model size, with the analytic model-state lines, when there are several sizes
    sized = ok.dropna(subset=["params", "peak_mem_MiB"])
    if sized.model.nunique() > 1:
        sized = sized.assign(
            line=sized.variant + " w" + sized.world_size.astype(str) + " mb" + sized.micro_batch.astype(str)
        )
        n = sized.line.nunique()
        ncol = legend_cols(list(sized.line.unique()), 10.5)
        fig, ax = plt.subplots(figsize=(11, 4.5 + LEGEND_ROW_IN * (n + 2) / ncol), layout="constrained")
        sns.lineplot(
            data=sized,
            x="params",
            y="peak_mem_MiB",
            hue="line",
            marker="o",
            ax=ax,
            errorbar=None,
            palette="tab20" if n > 10 else None,
        )
        palette = {line.get_label(): line.get_color() for line in ax.get_lines()}
        th = sized.assign(analytic=sized.theory_state_MiB.fillna(sized.paper_state_MiB)).dropna(subset=["analytic"])
        for line, sub in th.groupby("line"):
            sub = sub.sort_values("params")
            ax.plot(sub.params, sub.analytic, ls="--", lw=1, color=palette.get(line, "grey"))
        ax.plot([], [], "k--", lw=1, label="analytic model state (dashed)")
        handles, labels = ax.get_legend_handles_labels()
        ax.get_legend().remove()
        fig.legend(handles, labels, loc="outside upper center", ncol=ncol, frameon=False)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (count, log scale)")
        ax.set_ylabel("MiB per rank (log scale)")
        figs.append(
            figure_entry(
                "memory-vs-size",
                "Peak memory per rank against model size",
                "One line per strategy, device count and micro-batch. Solid: measured peak per rank; dashed: "
                "analytic model-state bytes (the strategy's layout, else the ZeRO paper's formula).",
                fig,
            )
        )
    return figs + memory_parts(ok)


MEMORY_PARTS = {
    "peak_mem_MiB": ("peak (measured)", "#4c72b0"),
    "model_state_MiB": ("model state (measured)", "#55a868"),
    "theory_state_MiB": ("model state (analytic)", "#8172b3"),
    "paper_state_MiB": ("ZeRO paper formula", "#937860"),
}


def _value_text(v) -> str:
    return "–" if v != v else (_plain_number(v) if abs(v) >= 1e3 else f"{v:.3g}")


def memory_parts(ok: pd.DataFrame) -> list[dict]:
    """One panel per memory component, side by side, each on its own scale with its values written
    beside the bars: a model state of 0.5 MiB beside a resident set of 400 MiB (CPU) stays visible."""
    parts = [c for c in MEMORY_PARTS if c in ok and ok[c].notna().any()]
    if not parts:
        return []
    ok = ok.dropna(subset=parts, how="all")
    pieces = [(p, _bar_order(ok[ok.panel == p].assign(order_MiB=ok.peak_mem_MiB), "order_MiB")) for p in _panels(ok)]
    width = min(MAX_WIDTH_IN, 0.08 * max(len(str(b)) for b in ok.bar) + 0.6 + 2.4 * len(parts))
    figs = []
    for page in pages(pieces):
        fig, grid = _column([len(sub) for _, sub in page], width=width, ncols=len(parts))
        for i, (row, (panel, sub)) in enumerate(zip(grid, page)):
            ys = list(range(len(sub)))[::-1]
            for ax, part in zip(row, parts):
                name, colour = MEMORY_PARTS[part]
                vals = sub[part].astype(float)
                ax.barh(ys, vals.fillna(0), color=colour, height=0.75)
                for y, v in zip(ys, vals):
                    ax.text(0 if v != v else v, y, " " + _value_text(v), va="center", ha="left")
                top = vals.max()
                ax.set_xlim(0, top * 1.45 if top == top and top > 0 else 1)
                ax.set_ylim(-0.6, len(sub) - 0.4)
                ax.xaxis.set_major_formatter(FuncFormatter(_plain_number))
                ax.set_title(name if i == 0 else "")
                ax.set_xlabel("MiB per rank")
            row[0].set_yticks(ys)
            row[0].set_yticklabels(sub.bar)
            row[0].set_ylabel(panel)
        figs.append(fig)
    return figure_entries(
        "memory",
        "Memory per rank: measured peak, model state, analytic",
        "One row per case, one panel per component, each panel on its own scale (the values are written "
        "beside the bars): the largest rank's peak (the CUDA allocator's on GPUs, the resident set on CPUs, "
        "which includes the framework, so it is far above the model state on tiny models), the parameters, "
        "gradients and optimizer states it held, their analytic layout, and the ZeRO paper's formula.",
        figs,
    )


def efficiency(ok: pd.DataFrame) -> list[dict]:
    col = "mfu_pct" if ok.mfu_pct.notna().any() else "roofline_pct"
    sub = ok.dropna(subset=[col])
    if sub.empty:
        return []
    if col == "mfu_pct":
        return figure_entries(
            "mfu",
            "Model FLOPs utilisation (% of dense peak)",
            "One bar per case. Model FLOPs per token 6N + 12·L·s·d (PaLM app. B) over the device's dense peak.",
            _bars(sub, col, "MFU (% of the device's dense peak)"),
        )
    return figure_entries(
        "mfu",
        "Achieved model FLOP/s as % of a measured matmul rate",
        "No dense peak is known for this device (CPU), so no MFU: the fraction of a matmul rate "
        "measured on the spot instead. One bar per case.",
        _bars(sub, col, "achieved model FLOP/s (% of a measured matmul rate)"),
    )


def communication(comm_rows: list[dict]) -> list[dict]:
    rows = [r for r in comm_rows if (r["expected_MiB"] or 0) > 0 or (r["measured_MiB"] or 0) > 0]
    if not rows:
        return []
    several = len({r["run"] for r in rows}) > 1
    long = []
    for r in rows:
        y = (
            f"{r['short']} · {r['kind']}"
            + (f" · {r['run'].split('/')[-1]}" if several else "")
            + ("  [range]" if r.get("expected_range") else "")
            + ("" if r["ok"] in (True, None) else "  [≠ theory]")
        )
        for src, key in (("measured", "measured_MiB"), ("theory", "expected_MiB")):
            if r[key] is not None:
                long.append({"model": r["model"], "case": y, "source": src, "MiB": r[key]})
    df = pd.DataFrame(long)
    wide = df.pivot_table(index=["model", "case"], columns="source", values="MiB", aggfunc="first").reset_index()
    for src in ("measured", "theory"):
        if src not in wide:
            wide[src] = float("nan")
    pieces = [(m, wide[wide.model == m].sort_values("case")) for m in sorted(wide.model.unique())]
    figs = [_comm_page(page, _width(wide.case)) for page in pages(pieces)]
    return figure_entries(
        "comm",
        "Communication per step: measured vs theory, by kind",
        "Payload bytes seen at the c10d dispatcher on one instrumented step (bar), against the analytic "
        "volume (black tick). [≠ theory] marks kinds off by more than the check's allowance; [range]: theory "
        "allows a range, the tick shows its upper end.",
        figs,
    )


def _comm_page(page, width, xlabel="payload MiB per step, rank 0"):
    """Panels of measured bars, each with its theory as a black tick on the same row."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, axes = _column([len(sub) for _, sub in page], width=width)
    for ax, (model, sub) in zip(axes, page):
        ys = list(range(len(sub)))[::-1]
        ax.barh(ys, sub.measured.fillna(0), color="#4c72b0", height=0.7)
        ax.plot(sub.theory, ys, "|", color="black", ms=13, mew=2.2)
        ax.set_yticks(ys)
        ax.set_yticklabels(sub.case)
        ax.set_ylim(-0.6, len(sub) - 0.4)
        ax.xaxis.set_major_formatter(FuncFormatter(_plain_number))
        ax.set_title(model)
        ax.set_xlabel(xlabel)
    handles = [
        Patch(color="#4c72b0", label="measured"),
        Line2D([], [], color="black", marker="|", ls="", ms=13, mew=2.2, label="theory"),
    ]
    fig.legend(handles=handles, loc="outside upper center", ncol=2, frameon=False)
    return fig


LEGEND_ROW_IN = 0.21
LINE_PANEL_IN = 2.8  # the plot of a line chart's panel, without its legend
LINE_WIDTH_IN = 11.0
CHAR_IN = 0.075  # the width of a character at MIN_TEXT_PT, generously


def legend_cols(labels, width_in: float = LINE_WIDTH_IN) -> int:
    """As many legend columns as labels this long fit across ``width_in``, at most 4."""
    longest = max((len(str(x)) for x in labels), default=10)
    return max(1, min(4, int(width_in / (CHAR_IN * longest + 0.7))))


def _legend_rows_in(labels) -> float:
    return LEGEND_ROW_IN * -(-len(labels) // legend_cols(labels)) + 0.35


def _pack(panels: list[tuple[str, list]]) -> list[list[tuple[str, list]]]:
    """Line-chart panels ``(title, legend labels)`` packed into figures of at most ``MAX_HEIGHT_IN``,
    each panel a plot with its legend on top."""
    out, used = [], 0.0
    for title, labels in panels:
        need = LINE_PANEL_IN + _legend_rows_in(labels)
        if out and used + need <= MAX_HEIGHT_IN:
            out[-1].append((title, labels))
            used += need
        else:
            out.append([(title, labels)])
            used = need
    return out


def _line_panels(page):
    heights = [LINE_PANEL_IN + _legend_rows_in(labels) for _, labels in page]
    fig, axes = plt.subplots(
        len(page),
        1,
        figsize=(LINE_WIDTH_IN, sum(heights)),
        squeeze=False,
        layout="constrained",
        gridspec_kw={"height_ratios": heights},
    )
    return fig, axes.ravel()


def _top_legend(ax, handles, labels, title: str) -> None:
    """The panel's legend above its plot, titled with the panel's name (no separate axes title)."""
    ax.legend(
        handles,
        labels,
        loc="lower left",
        bbox_to_anchor=(0, 1.01),
        ncol=legend_cols(labels),
        frameon=False,
        title=title,
        alignment="left",
    )


def _loss_page(df: pd.DataFrame, page) -> object:
    fig, axes = _line_panels(page)
    for ax, (panel, labels) in zip(axes, page):
        n = len(labels)
        sub = df[df.panel == panel]
        # one line per case; references dashed, so 20 colours serve 40 cases
        sns.lineplot(
            data=sub,
            x="step",
            y="loss",
            hue="case",
            style="kind",
            style_order=["peer", "reference"],
            ax=ax,
            errorbar=None,
            lw=1.1,
            palette="tab20" if n > 10 else None,
        )
        handles, labels = ax.get_legend_handles_labels()
        keep = [(h, lab) for h, lab in zip(handles, labels) if lab in set(sub.case)]
        _top_legend(ax, [h for h, _ in keep], [lab for _, lab in keep], f"{panel} (dashed: reference)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (cross-entropy, nats)")
    return fig


def losses(ok: pd.DataFrame) -> list[dict]:
    pts = []
    for _, r in ok.iterrows():
        for i, v in enumerate(r.losses or []):
            if isinstance(v, (int, float)):
                pts.append({"panel": r.panel, "params": r.params, "step": i, "loss": v, "case": r.bar, "kind": r.kind})
    if not pts:
        return []
    df = pd.DataFrame(pts)
    figs = [_loss_page(df, page) for page in _pack([(p, list(df[df.panel == p].case.unique())) for p in _panels(df)])]
    return figure_entries(
        "losses",
        "Loss curves",
        "Every step's loss (warm-up, timed and instrumented steps), mean over data-parallel replicas, one "
        "line per case. Same model, data and seed: the curves of equivalent strategies lie on top of "
        "each other.",
        figs,
    )


def loss_scale(points: list[dict]) -> list[dict]:
    if not points:
        return []
    df = pd.DataFrame(points)
    df["line"] = df.model + " · " + df.case
    fig, ax = plt.subplots(figsize=(9, 3.6), layout="constrained")
    sns.lineplot(data=df, x="step", y="scale", hue="line", ax=ax, errorbar=None, drawstyle="steps-post")
    sk = df[df.skipped]
    if not sk.empty:
        ax.scatter(sk.step, sk.scale, marker="x", color="red", zorder=5, label="skipped step")
    _top_legend(ax, *ax.get_legend_handles_labels(), "")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale (log2)")
    return [figure_entry("loss-scale", "Dynamic loss scale", "Red crosses: steps skipped on inf/nan gradients.", fig)]


def pipeline(ok: pd.DataFrame) -> list[dict]:
    pts = []
    for _, r in ok.iterrows():
        for p in r.pipeline or []:
            pct = {src: p[src] * 100 if p.get(src) is not None else float("nan") for src in ("measured", "theory")}
            if pct["measured"] == pct["measured"] or pct["theory"] == pct["theory"]:
                pts.append({"model": r.panel, "case": f"{r.bar} · stage {p.get('stage')}", **pct})
    if not pts:
        return []
    df = pd.DataFrame(pts)
    pieces = [(m, df[df.model == m].sort_values("case")) for m in sorted(df.model.unique())]
    figs = [_comm_page(page, _width(df.case), "bubble (% of the step)") for page in pages(pieces)]
    return figure_entries(
        "pipeline",
        "Pipeline bubble per stage: measured vs theory",
        "Measured (bar): the stage's idle (waiting) share of the step; theory (black tick): (p−1)/(m+p−1).",
        figs,
    )


def collectives(rows: list[dict]) -> list[dict]:
    df = pd.DataFrame([r for r in rows if r["busbw_GBps"] and r["bytes"]])
    if df.empty:
        return []
    ops = list(dict.fromkeys(df.op))
    fig, axes = _grid(len(ops), 5, 3.8)
    style = "world_size" if df.world_size.nunique() > 1 else None
    for ax, op in zip(axes, ops):
        sub = df[df.op == op]
        sns.lineplot(
            data=sub,
            x="bytes",
            y="busbw_GBps",
            hue="algorithm",
            style=style,
            marker="o",
            markersize=3,
            ax=ax,
            errorbar=None,
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        sns.move_legend(ax, "lower left", bbox_to_anchor=(0, 1.01), ncol=2, frameon=False, title=op)
    return [
        figure_entry(
            "collectives",
            "Collectives: bus bandwidth against message size",
            "busbw = algbw × 2(n−1)/n for all-reduce, × (n−1)/n for all-gather and reduce-scatter (nccl-tests).",
            fig,
        )
    ]


def all_figures(rows: list[dict], comm_rows: list[dict], coll_rows: list[dict], ls_points: list[dict]) -> list[dict]:
    setup_style()
    figs = []
    df = pd.DataFrame(rows)
    ok = with_names(df[df.status == "ok"]) if not df.empty else df
    if not ok.empty:
        for fn in (throughput, scaling, memory, efficiency):
            figs += fn(ok)
    figs += communication(comm_rows)
    if not ok.empty:
        figs += losses(ok)
    figs += loss_scale(ls_points)
    if not ok.empty:
        figs += pipeline(ok)
    figs += collectives(coll_rows)
    return figs
