"""Seaborn figures for the report, each returned as a PNG data URI.

Every function takes plain rows (``frames``) and returns a list of ``{id, title, caption, src}``
(empty when its data is absent), so a report only shows what its results hold. PNGs are drawn
at a modest DPI to keep a report of a few dozen cases around a megabyte. Labels from result
files are drawn as plain text (``text.parse_math`` off): a ``$`` in a strategy name must not
be read as TeX.
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

DPI = 90
BAR_IN = 0.22  # inches per bar in the horizontal bar charts
KIND_COLOURS = {"peer": "#4c72b0", "reference": "#dd8452"}
KIND_NAMES = {"peer": "production library (torch.*, deepspeed.*)", "reference": "reference implementation (ref.*)"}


def setup_style():
    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.9)
    plt.rcParams["text.parse_math"] = False
    plt.rcParams["axes.titlesize"] = "medium"
    plt.rcParams["legend.fontsize"] = 7


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


def _png(fig) -> str:
    for ax in fig.axes:  # log axes default to TeX tick labels, which parse_math=False prints raw
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale == "log":
                _log_ticks(axis)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
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


def _grid(n, w=5.0, h=3.0, ncols=2):
    ncols = min(n, ncols)
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False, layout="constrained")
    axes = axes.ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes


def _column(sizes: list[int], width=8.0, per=BAR_IN, extra=0.9):
    """One column of panels, each as tall as its number of bars (so no panel's labels reach into
    another's, and no bar is squeezed)."""
    fig, axes = plt.subplots(
        len(sizes),
        1,
        figsize=(width, sum(per * n + extra for n in sizes)),
        squeeze=False,
        layout="constrained",
        gridspec_kw={"height_ratios": [per * n + extra for n in sizes]},
    )
    return fig, axes.ravel()


def _width(labels, plot_in: float = 5.5) -> float:
    """Figure width that leaves the bars ``plot_in`` inches beside labels as long as these."""
    return plot_in + 0.07 * max((len(str(x)) for x in labels), default=10)


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


def _bar_order(sub: pd.DataFrame, value: str) -> pd.DataFrame:
    """Micro-batch groups, fastest first within each; the first bar on top."""
    return sub.sort_values(["micro_batch", value], ascending=[True, False])


def _kind_legend(fig) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=KIND_COLOURS[k], label=KIND_NAMES[k]) for k in KIND_COLOURS]
    fig.legend(handles=handles, loc="outside lower center", ncol=2, frameon=False)


def _bars(ok: pd.DataFrame, value: str, xlabel: str, err=None):
    """Horizontal bars, one per case, one panel per model; thin lines part micro-batches."""
    ok = ok.dropna(subset=[value])
    panels = _panels(ok)
    sizes = [int((ok.panel == p).sum()) for p in panels]
    fig, axes = _column(sizes, width=_width(ok.bar))
    for ax, panel in zip(axes, panels):
        sub = _bar_order(ok[ok.panel == panel], value)
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
        ax.set_yticklabels(sub.bar, fontsize=8)
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

    fig = _bars(ok, "tokens_per_s_per_device", "tokens/s per device", err=per_step)
    return [
        figure_entry(
            "throughput",
            "Tokens/s per device (higher is better)",
            "One bar per case (strategy, devices w, micro-batch mb; other seeds and options named): its "
            "median tokens/s per device, over launches where the case was repeated. Whisker: the 10th to "
            "90th percentile of the per-step rate within one launch. Dotted lines part micro-batches.",
            fig,
        )
    ]


def scaling(ok: pd.DataFrame) -> list[dict]:
    """Global tokens/s against the number of devices, for every strategy (and micro-batch) that ran
    at two device counts or more; one device counts (it is the baseline the dashed line starts from)."""
    spans = ok.groupby(["model", "series"]).world_size.transform("nunique") > 1
    multi = ok[spans].dropna(subset=["tokens_per_s"])
    if multi.empty:
        return []
    models = [m for m in _models(ok) if m in set(multi.model)]
    fig, axes = _grid(len(models), 7.5, 3.6, ncols=1)
    for ax, model in zip(axes, models):
        sub = multi[multi.model == model]
        style = "precision" if sub.precision.nunique() > 1 else None
        sns.lineplot(
            data=sub,
            x="world_size",
            y="tokens_per_s",
            hue="series",
            style=style,
            marker="o",
            ax=ax,
            errorbar=None,
        )
        one = ok[(ok.model == model) & (ok.world_size == 1)].tokens_per_s.max()
        if one == one and one:
            ws = sorted(sub.world_size.unique())
            ax.plot(ws, [one * w for w in ws], "k--", lw=0.8, label="linear from 1 device")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(sub.world_size.unique()))
        ax.set_xlabel("devices")
        ax.set_ylabel("tokens/s (global)")
        ax.set_title(model)
    return [
        figure_entry(
            "scaling",
            "Scaling across device counts",
            "One line per strategy and micro-batch that ran at two device counts or more (1 device included). "
            "Dashed: linear scaling from the best one-device run of the model.",
            fig,
        )
    ]


def memory(ok: pd.DataFrame) -> list[dict]:
    figs = []
    # against model size, with the analytic model-state lines, when there are several sizes
    sized = ok.dropna(subset=["params", "peak_mem_MiB"])
    if sized.model.nunique() > 1:
        sized = sized.assign(
            line=sized.variant + " w" + sized.world_size.astype(str) + " mb" + sized.micro_batch.astype(str)
        )
        n = sized.line.nunique()
        fig, ax = plt.subplots(figsize=(10, 4.5 + 0.17 * (n + 2) / 3), layout="constrained")
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
        fig.legend(handles, labels, loc="outside lower center", ncol=3, frameon=False)
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
    # breakdown per model
    cols = {
        "peak_mem_MiB": "peak (measured)",
        "model_state_MiB": "model state (measured)",
        "theory_state_MiB": "model state (analytic)",
        "paper_state_MiB": "ZeRO paper formula",
    }
    long = (
        ok.assign(order_MiB=ok.peak_mem_MiB)
        .melt(
            id_vars=["panel", "params", "bar", "micro_batch", "order_MiB"],
            value_vars=list(cols),
            var_name="figure",
            value_name="MiB",
        )
        .dropna(subset=["MiB"])
    )
    if long.empty:
        return figs
    long["figure"] = long.figure.map(cols)
    panels = _panels(long)
    sizes = [long[long.panel == p].bar.nunique() * 2 for p in panels]
    fig, axes = _column(sizes, width=_width(long.bar))
    for ax, panel in zip(axes, panels):
        sub = long[long.panel == panel]
        order = list(dict.fromkeys(_bar_order(sub, "order_MiB").bar))
        sns.barplot(
            data=sub,
            y="bar",
            x="MiB",
            hue="figure",
            hue_order=list(cols.values()),
            order=order,
            ax=ax,
            errorbar=None,
            legend=ax is axes[0],
        )
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(panel)
        ax.set_ylabel("")
        ax.set_xlabel("MiB per rank (largest rank)")
    if axes[0].get_legend():
        handles, labels = axes[0].get_legend_handles_labels()
        axes[0].get_legend().remove()
        fig.legend(handles, labels, loc="outside lower center", ncol=4, frameon=False)
    figs.append(
        figure_entry(
            "memory",
            "Memory per rank: measured peak, model state, analytic",
            "Peak is the CUDA allocator's on GPUs and the resident set on CPUs (which includes the "
            "framework, so it is far above the model state on tiny models). One group of bars per case.",
            fig,
        )
    )
    return figs


def efficiency(ok: pd.DataFrame) -> list[dict]:
    col = "mfu_pct" if ok.mfu_pct.notna().any() else "roofline_pct"
    sub = ok.dropna(subset=[col])
    if sub.empty:
        return []
    if col == "mfu_pct":
        fig = _bars(sub, col, "MFU (% of the device's dense peak)")
        return [
            figure_entry(
                "mfu",
                "Model FLOPs utilisation (% of dense peak)",
                "One bar per case. Model FLOPs per token 6N + 12·L·s·d (PaLM app. B) over the device's dense peak.",
                fig,
            )
        ]
    fig = _bars(sub, col, "achieved model FLOP/s (% of a measured matmul rate)")
    return [
        figure_entry(
            "mfu",
            "Achieved model FLOP/s as % of a measured matmul rate",
            "No dense peak is known for this device (CPU), so no MFU: the fraction of a matmul rate "
            "measured on the spot instead. One bar per case.",
            fig,
        )
    ]


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
    models = sorted(df.model.unique())
    sizes = [df[df.model == m].case.nunique() * 2 for m in models]
    fig, axes = _column(sizes, width=_width(df.case))
    for ax, model in zip(axes, models):
        sub = df[df.model == model]
        sns.barplot(
            data=sub,
            y="case",
            x="MiB",
            hue="source",
            hue_order=["measured", "theory"],
            order=sorted(sub.case.unique()),
            ax=ax,
            errorbar=None,
            legend=ax is axes[0],
        )
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(model)
        ax.set_ylabel("")
        ax.set_xlabel("payload MiB per step, rank 0")
    if axes[0].get_legend():
        handles, labels = axes[0].get_legend_handles_labels()
        axes[0].get_legend().remove()
        fig.legend(handles, labels, loc="outside lower center", ncol=2, frameon=False)
    return [
        figure_entry(
            "comm",
            "Communication per step: measured vs theory, by kind",
            "Payload bytes seen at the c10d dispatcher on one instrumented step, against the analytic "
            "volume. [≠ theory] marks kinds off by more than the check's allowance; [range]: theory allows a "
            "range, the bar shows its upper end.",
            fig,
        )
    ]


def losses(ok: pd.DataFrame) -> list[dict]:
    pts = []
    for _, r in ok.iterrows():
        for i, v in enumerate(r.losses or []):
            if isinstance(v, (int, float)):
                pts.append({"panel": r.panel, "params": r.params, "step": i, "loss": v, "case": r.bar, "kind": r.kind})
    if not pts:
        return []
    df = pd.DataFrame(pts)
    panels = _panels(df)
    fig, axes = _grid(len(panels), 11.0, 3.4, ncols=1)
    for ax, panel in zip(axes, panels):
        sub = df[df.panel == panel]
        n = sub.case.nunique()
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
        ax.legend(
            [h for h, _ in keep],
            [lab for _, lab in keep],
            loc="upper left",
            bbox_to_anchor=(1.01, 1),
            frameon=False,
            ncol=1 if n <= 18 else 2,
            title="dashed: reference",
            title_fontsize=7,
        )
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (cross-entropy, nats)")
    return [
        figure_entry(
            "losses",
            "Loss curves",
            "Every step's loss (warm-up, timed and instrumented steps), mean over data-parallel replicas, one "
            "line per case. Same model, data and seed: the curves of equivalent strategies lie on top of "
            "each other.",
            fig,
        )
    ]


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
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale (log2)")
    return [figure_entry("loss-scale", "Dynamic loss scale", "Red crosses: steps skipped on inf/nan gradients.", fig)]


def pipeline(ok: pd.DataFrame) -> list[dict]:
    pts = []
    for _, r in ok.iterrows():
        for p in r.pipeline or []:
            name = f"{r.model} · {r.bar} · stage {p.get('stage')}"
            for src in ("measured", "theory"):
                if p.get(src) is not None:
                    pts.append({"case": name, "source": src, "bubble %": p[src] * 100})
    if not pts:
        return []
    df = pd.DataFrame(pts)
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.42 * df.case.nunique() + 0.8)), layout="constrained")
    sns.barplot(
        data=df,
        y="case",
        x="bubble %",
        hue="source",
        hue_order=["measured", "theory"],
        order=sorted(df.case.unique()),
        ax=ax,
        errorbar=None,
    )
    ax.set_ylabel("")
    ax.set_xlabel("bubble (% of the step)")
    sns.move_legend(ax, "lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, title=None, frameon=False)
    return [
        figure_entry(
            "pipeline",
            "Pipeline bubble per stage: measured vs theory",
            "Measured: the stage's idle (waiting) share of the step; theory: (p−1)/(m+p−1).",
            fig,
        )
    ]


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
        ax.set_title(op)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        sns.move_legend(ax, "upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
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
