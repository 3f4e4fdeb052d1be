"""One self-contained HTML file from one or more run folders.

Figures are seaborn PNGs embedded as data URIs and tables are plain HTML with a few lines of
inline script for sorting, so the file opens offline. Every string from a result file goes
through Jinja's autoescaping: results are untrusted text.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import jinja2

from parabench.results import load_run

TEMPLATE_DIR = Path(__file__).parent / "templates"


def _figure_png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _frame(runs):
    import pandas as pd

    rows = []
    for manifest, records in runs:
        for r in records:
            m = r.get("metrics") or {}
            c = r["case"]
            rows.append({
                "run": manifest["run_id"], "suite": manifest["suite"], "label": r["label"], "status": r["status"],
                "strategy": c["strategy"], "model": c["model"], "world_size": c["world_size"],
                "precision": c["precision"], "micro_batch": c["micro_batch"], "grad_accum": c["grad_accum"],
                "tokens_per_s_per_device": m.get("tokens_per_s_per_device"),
                "tokens_per_s": m.get("tokens_per_s"),
                "step_time_ms_median": (m["step_time_s_median"] * 1e3) if m.get("step_time_s_median") else None,
                "step_time_ms_p10": (m["step_time_s_p10"] * 1e3) if m.get("step_time_s_p10") else None,
                "step_time_ms_p90": (m["step_time_s_p90"] * 1e3) if m.get("step_time_s_p90") else None,
                "mfu_pct": m["mfu"] * 100 if m.get("mfu") is not None else None,
                "roofline_pct": m["roofline_fraction"] * 100 if m.get("roofline_fraction") is not None else None,
                "peak_mem_MiB": ((m.get("peak_alloc_bytes") or m.get("peak_rss_bytes") or 0) / 2**20) or None,
                "model_state_MiB": (m["model_state_bytes_max"] / 2**20) if m.get("model_state_bytes_max") else None,
                "theory_state_MiB": _theory_state_mib(r),
                "comm_MiB": _comm_mib(r),
                "theory_comm_MiB": _theory_comm_mib(r),
                "final_loss": m.get("final_loss"),
                "error": (r.get("error") or {}).get("message"),
                "losses": m.get("losses"),
            })
    return pd.DataFrame(rows)


def _theory_state_mib(r):
    t = r.get("theory") or {}
    s = t.get("state_bytes")
    if isinstance(s, dict) and all(v is not None for v in s.values()):
        return sum(s.values()) / 2**20
    p = t.get("paper_state_bytes")
    return p / 2**20 if p else None


def _comm_mib(r):
    pr = r.get("per_rank") or []
    if pr and pr[0].get("comm"):
        return pr[0]["comm"]["payload_bytes"] / 2**20
    return None


def _theory_comm_mib(r):
    c = (r.get("theory") or {}).get("comm_payload_bytes")
    return sum(c.values()) / 2**20 if c is not None else None


def _figures(df) -> list[dict]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    ok = df[df.status == "ok"]
    figs = []
    if ok.empty:
        return figs
    order = sorted(ok.strategy.unique())
    hue = "precision" if ok.precision.nunique() > 1 else None

    def bar(y, title, xlabel):
        height = max(2.5, 0.35 * len(order) * max(1, ok.model.nunique()))
        fig, ax = plt.subplots(figsize=(9, height))
        sns.barplot(data=ok, y="strategy", x=y, hue=hue, order=order, ax=ax, errorbar=None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("")
        ax.set_title(title)
        return fig

    for model in sorted(ok.model.unique()):
        sub = ok[ok.model == model]
        n = len(sorted(sub.strategy.unique()))
        fig, axes = plt.subplots(1, 2, figsize=(12, max(2.5, 0.38 * n)), sharey=True)
        sns.barplot(data=sub, y="strategy", x="tokens_per_s_per_device", hue=hue, ax=axes[0], errorbar=None,
                    order=sorted(sub.strategy.unique()))
        axes[0].set_title(f"{model}: tokens/s per device (higher is better)")
        axes[0].set_xlabel("tokens/s per device")
        axes[0].set_ylabel("")
        sns.barplot(data=sub, y="strategy", x="peak_mem_MiB", hue=hue, ax=axes[1], errorbar=None,
                    order=sorted(sub.strategy.unique()))
        axes[1].set_title("peak memory per rank (MiB, lower is better)")
        axes[1].set_xlabel("MiB")
        if hue:
            axes[1].get_legend().remove() if axes[1].get_legend() else None
        figs.append({"id": f"throughput-memory-{model}", "title": f"Throughput and memory: {model}",
                     "src": _figure_png(fig)})

    eff = ok.dropna(subset=["mfu_pct"]) if ok.mfu_pct.notna().any() else ok.dropna(subset=["roofline_pct"])
    if not eff.empty:
        col = "mfu_pct" if ok.mfu_pct.notna().any() else "roofline_pct"
        fig = bar(col, "MFU (% of dense peak)" if col == "mfu_pct" else
                  "achieved model FLOP/s as % of a measured matmul rate (no peak known for this device)", "%")
        figs.append({"id": "mfu", "title": "Model FLOPs utilisation", "src": _figure_png(fig)})

    state = ok.dropna(subset=["model_state_MiB"])
    if not state.empty:
        fig, ax = plt.subplots(figsize=(9, max(2.5, 0.35 * len(order))))
        melt = state.melt(id_vars=["strategy"], value_vars=["model_state_MiB", "theory_state_MiB"],
                          var_name="kind", value_name="MiB").dropna()
        sns.barplot(data=melt, y="strategy", x="MiB", hue="kind", ax=ax, errorbar=None, order=order)
        ax.set_title("model-state bytes per rank: measured vs analytic")
        ax.set_ylabel("")
        figs.append({"id": "state-vs-theory", "title": "Model state vs theory", "src": _figure_png(fig)})

    comm = ok.dropna(subset=["comm_MiB"])
    if not comm.empty:
        fig, ax = plt.subplots(figsize=(9, max(2.5, 0.35 * len(order))))
        melt = comm.melt(id_vars=["strategy"], value_vars=["comm_MiB", "theory_comm_MiB"],
                         var_name="kind", value_name="MiB").dropna()
        sns.barplot(data=melt, y="strategy", x="MiB", hue="kind", ax=ax, errorbar=None, order=order)
        ax.set_title("communication payload per step per rank: measured vs analytic")
        ax.set_ylabel("")
        figs.append({"id": "comm-vs-theory", "title": "Communication vs theory", "src": _figure_png(fig)})

    curves = ok.dropna(subset=["losses"])
    if not curves.empty:
        for model in sorted(curves.model.unique()):
            fig, ax = plt.subplots(figsize=(9, 4))
            for _, row in curves[curves.model == model].iterrows():
                ys = [v for v in row.losses if v is not None]
                ax.plot(range(len(ys)), ys, label=f"{row.strategy} {row.precision} w{row.world_size}", lw=1.2)
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.set_title(f"loss curves: {model}")
            ax.legend(fontsize=7, ncol=2)
            figs.append({"id": f"loss-{model}", "title": f"Loss curves: {model}", "src": _figure_png(fig)})
    return figs


def render_report(run_dirs: list[Path]) -> str:
    runs = [load_run(d) for d in run_dirs]
    df = _frame(runs)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), autoescape=True)
    columns = ["label", "status", "tokens_per_s_per_device", "tokens_per_s", "step_time_ms_median", "step_time_ms_p10",
               "step_time_ms_p90", "mfu_pct", "roofline_pct", "peak_mem_MiB", "model_state_MiB", "theory_state_MiB",
               "comm_MiB", "theory_comm_MiB", "final_loss"]
    tables = []
    if not df.empty:
        ok = df[df.status == "ok"]
        for (model, world), sub in ok.groupby(["model", "world_size"]):
            tables.append({"title": f"{model}, {world} rank(s)", "columns": columns,
                           "rows": sub[columns].to_dict("records")})
    failed = df[df.status != "ok"][["run", "label", "status", "error"]].to_dict("records") if not df.empty else []
    return env.get_template("report.html.j2").render(
        manifests=[m for m, _ in runs], tables=tables, failed=failed, figures=_figures(df) if not df.empty else [],
        n_cases=len(df), n_ok=int((df.status == "ok").sum()) if not df.empty else 0,
    )


def write_report(run_dirs: list[Path], output: Path) -> Path:
    output = Path(output)
    html = render_report([Path(d) for d in run_dirs])
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix(output.suffix + ".tmp")
    tmp.write_text(html)
    tmp.replace(output)
    return output.resolve()
