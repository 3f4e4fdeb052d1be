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

DPI = 80
MAX_COLS = 3


def setup_style():
    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.9)
    plt.rcParams["text.parse_math"] = False
    plt.rcParams["axes.titlesize"] = "medium"


def _plain_number(v, _pos=None) -> str:
    """Tick text without TeX (parse_math is off): 1024 -> '1K', 3e9 -> '3G'."""
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(v) >= div:
            return f"{v / div:g}{unit}"
    return f"{v:g}"


def _png(fig) -> str:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for ax in fig.axes:  # log axes default to TeX tick labels, which parse_math=False prints raw
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale == "log":
                axis.set_major_formatter(FuncFormatter(_plain_number))
                axis.set_minor_formatter(NullFormatter())
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def figure_entry(id_, title, caption, fig) -> dict:
    return {"id": id_, "title": title, "caption": caption, "src": _png(fig)}


def _grid(n, w=5.0, h=3.0):
    ncols = min(n, MAX_COLS)
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False)
    axes = axes.ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes


def _models(df):
    order = df.groupby("model")["params"].max().sort_values(na_position="last")
    return list(order.index)


def throughput(ok: pd.DataFrame) -> list[dict]:
    """Tokens/s per device per strategy, with the 10th-90th percentile over timed steps."""
    samples = []
    for _, r in ok.iterrows():
        steps = r.step_times_s or []
        for t in steps:
            if t and r.tokens_per_step and r.world_size:
                samples.append(
                    {
                        "model": r.model,
                        "case": f"{r.strategy} w{r.world_size}",
                        "precision": r.precision,
                        "run": r.run,
                        "tokens/s per device": r.tokens_per_step / t / r.world_size,
                    }
                )
    if not samples:
        return []
    s = pd.DataFrame(samples)
    hue = "run" if s.run.nunique() > 1 else ("precision" if s.precision.nunique() > 1 else None)
    models = _models(ok)
    n_cases = s.groupby("model").case.nunique().max()
    fig, axes = _grid(len(models), 5.5, max(2.2, 0.32 * n_cases * (1 + 0.3 * (hue is not None))))
    for ax, model in zip(axes, models):
        sub = s[s.model == model]
        order = sorted(sub.case.unique())
        sns.barplot(
            data=sub,
            y="case",
            x="tokens/s per device",
            hue=hue,
            order=order,
            ax=ax,
            estimator="median",
            errorbar=("pi", 80),
            err_kws={"linewidth": 1},
            legend=ax is axes[0],
        )
        ax.set_title(f"{model}")
        ax.set_ylabel("")
    return [
        figure_entry(
            "throughput",
            "Tokens/s per device (higher is better)",
            "Bar: median over timed steps; whisker: 10th to 90th percentile of the per-step rate.",
            fig,
        )
    ]


def scaling(ok: pd.DataFrame) -> list[dict]:
    """Global tokens/s against the number of devices, when a strategy ran at several sizes."""
    multi = ok[ok.world_size > 1]
    if multi.empty or not (multi.groupby(["model", "strategy"]).world_size.nunique() > 1).any():
        return []
    models = [m for m in _models(ok) if (multi[multi.model == m].groupby("strategy").world_size.nunique() > 1).any()]
    fig, axes = _grid(len(models), 5.5, 3.6)
    for ax, model in zip(axes, models):
        sub = ok[ok.model == model]
        style = "precision" if sub.precision.nunique() > 1 else None
        sns.lineplot(
            data=sub[sub.world_size > 1],
            x="world_size",
            y="tokens_per_s",
            hue="strategy",
            style=style,
            marker="o",
            ax=ax,
            errorbar=None,
        )
        one = sub[sub.world_size == 1].tokens_per_s.max()
        if one == one and one:
            ws = sorted(sub.world_size.unique())
            ax.plot(ws, [one * w for w in ws], "k--", lw=0.8, label="linear from 1 device")
            ax.legend(fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices")
        ax.set_ylabel("tokens/s (global)")
        ax.set_title(model)
    return [
        figure_entry(
            "scaling", "Scaling across device counts", "Dashed: linear scaling from the best one-device run.", fig
        )
    ]


def memory(ok: pd.DataFrame) -> list[dict]:
    figs = []
    # against model size, with the analytic model-state lines, when there are several sizes
    sized = ok.dropna(subset=["params", "peak_mem_MiB"])
    if sized.model.nunique() > 1:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        sized = sized.assign(case=sized.strategy + " w" + sized.world_size.astype(str))
        sns.lineplot(data=sized, x="params", y="peak_mem_MiB", hue="case", marker="o", ax=ax, errorbar=None)
        palette = {line.get_label(): line.get_color() for line in ax.get_lines()}
        th = sized.assign(analytic=sized.theory_state_MiB.fillna(sized.paper_state_MiB)).dropna(subset=["analytic"])
        for case, sub in th.groupby("case"):
            sub = sub.sort_values("params")
            ax.plot(sub.params, sub.analytic, ls="--", lw=1, color=palette.get(case, "grey"))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel("MiB per rank")
        figs.append(
            figure_entry(
                "memory-vs-size",
                "Peak memory per rank against model size",
                "Solid: measured peak per rank; dashed: analytic model-state bytes (the strategy's layout, "
                "else the ZeRO paper's formula).",
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
        ok.assign(case=ok.strategy + " w" + ok.world_size.astype(str) + " " + ok.precision)
        .melt(id_vars=["model", "case"], value_vars=list(cols), var_name="figure", value_name="MiB")
        .dropna()
    )
    if long.empty:
        return figs
    long["figure"] = long.figure.map(cols)
    models = [m for m in _models(ok) if m in set(long.model)]
    n = long.groupby("model").case.nunique().max()
    fig, axes = _grid(len(models), 6, max(2.5, 0.55 * n))
    for ax, model in zip(axes, models):
        sub = long[long.model == model]
        sns.barplot(
            data=sub,
            y="case",
            x="MiB",
            hue="figure",
            hue_order=list(cols.values()),
            order=sorted(sub.case.unique()),
            ax=ax,
            errorbar=None,
            legend=ax is axes[0],
        )
        ax.set_title(model)
        ax.set_ylabel("")
        ax.set_xlabel("MiB per rank (largest rank)")
    if axes[0].get_legend():
        sns.move_legend(axes[0], "lower center", bbox_to_anchor=(0.5, 1.06), ncol=2, title=None, fontsize=8)
    figs.append(
        figure_entry(
            "memory",
            "Memory per rank: measured peak, model state, analytic",
            "Peak is the CUDA allocator's on GPUs and the resident set on CPUs (which includes the "
            "framework, so it is far above the model state on tiny models).",
            fig,
        )
    )
    return figs


def efficiency(ok: pd.DataFrame) -> list[dict]:
    col = "mfu_pct" if ok.mfu_pct.notna().any() else "roofline_pct"
    sub = ok.dropna(subset=[col])
    if sub.empty:
        return []
    sub = sub.assign(case=sub.strategy + " w" + sub.world_size.astype(str))
    hue = "precision" if sub.precision.nunique() > 1 else None
    models = _models(sub)
    n = sub.groupby("model").case.nunique().max()
    fig, axes = _grid(len(models), 5, max(2.2, 0.32 * n * (1 + 0.3 * (hue is not None))))
    for ax, model in zip(axes, models):
        m = sub[sub.model == model]
        sns.barplot(
            data=m, y="case", x=col, hue=hue, order=sorted(m.case.unique()), ax=ax, errorbar=None, legend=ax is axes[0]
        )
        ax.set_title(model)
        ax.set_ylabel("")
        ax.set_xlabel("%")
    if col == "mfu_pct":
        return [
            figure_entry(
                "mfu",
                "Model FLOPs utilisation (% of dense peak)",
                "Model FLOPs per token 6N + 12·L·s·d (PaLM app. B) over the device's dense peak.",
                fig,
            )
        ]
    return [
        figure_entry(
            "mfu",
            "Achieved model FLOP/s as % of a measured matmul rate",
            "No dense peak is known for this device (CPU), so no MFU: the fraction of a matmul rate "
            "measured on the spot instead.",
            fig,
        )
    ]


def communication(comm_rows: list[dict]) -> list[dict]:
    rows = [r for r in comm_rows if (r["expected_MiB"] or 0) > 0 or (r["measured_MiB"] or 0) > 0]
    if not rows:
        return []
    long = []
    for r in rows:
        y = (
            f"{r['short']} · {r['kind']}"
            + ("  [range]" if r.get("expected_range") else "")
            + ("" if r["ok"] in (True, None) else "  [≠ theory]")
        )
        for src, key in (("measured", "measured_MiB"), ("theory", "expected_MiB")):
            if r[key] is not None:
                long.append({"model": r["model"], "case": y, "source": src, "MiB": r[key]})
    df = pd.DataFrame(long)
    models = sorted(df.model.unique())
    n = df.groupby("model").case.nunique().max()
    fig, axes = _grid(len(models), 7, max(2.5, 0.42 * n))
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
        ax.set_title(model)
        ax.set_ylabel("")
        ax.set_xlabel("payload MiB per step, rank 0")
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
                pts.append(
                    {
                        "model": r.model,
                        "step": i,
                        "loss": v,
                        "strategy": r.strategy,
                        "precision": r.precision,
                        "run": r.run,
                    }
                )
    if not pts:
        return []
    df = pd.DataFrame(pts)
    models = _models(ok)
    models = [m for m in models if m in set(df.model)]
    fig, axes = _grid(len(models), 5.5, 3.4)
    for ax, model in zip(axes, models):
        sub = df[df.model == model]
        style = "precision" if sub.precision.nunique() > 1 else ("run" if sub.run.nunique() > 1 else None)
        sns.lineplot(data=sub, x="step", y="loss", hue="strategy", style=style, ax=ax, errorbar=None, lw=1.1)
        ax.set_title(model)
        ax.legend(fontsize=6, ncol=2)
    return [
        figure_entry(
            "losses",
            "Loss curves",
            "Every step's loss (warm-up, timed and instrumented steps), mean over data-parallel replicas. "
            "Same model, data and seed: the curves of equivalent strategies lie on top of each other.",
            fig,
        )
    ]


def loss_scale(points: list[dict]) -> list[dict]:
    if not points:
        return []
    df = pd.DataFrame(points)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    sns.lineplot(data=df, x="step", y="scale", hue="case", ax=ax, errorbar=None, drawstyle="steps-post")
    sk = df[df.skipped]
    if not sk.empty:
        ax.scatter(sk.step, sk.scale, marker="x", color="red", zorder=5, label="skipped step")
        ax.legend(fontsize=7)
    ax.set_yscale("log", base=2)
    ax.set_ylabel("loss scale")
    return [figure_entry("loss-scale", "Dynamic loss scale", "Red crosses: steps skipped on inf/nan gradients.", fig)]


def pipeline(ok: pd.DataFrame) -> list[dict]:
    pts = []
    for _, r in ok.iterrows():
        for p in r.pipeline or []:
            name = f"{r.strategy} w{r.world_size} {r.precision} · stage {p.get('stage')}"
            for src in ("measured", "theory"):
                if p.get(src) is not None:
                    pts.append({"case": name, "source": src, "bubble %": p[src] * 100})
    if not pts:
        return []
    df = pd.DataFrame(pts)
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.42 * df.case.nunique())))
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
    fig, axes = _grid(len(ops), 5, 3.6)
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
        ax.set_xlabel("message bytes")
        ax.set_ylabel("bus bandwidth GB/s")
        ax.legend(fontsize=7)
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
    ok = df[df.status == "ok"] if not df.empty else df
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
