"""One self-contained HTML file from one or more run folders.

A pure function of result folders (``manifest.json``, ``cases/*.json``, ``collectives-w*.json``):
it never imports training code. Figures are seaborn PNGs embedded as data URIs, tables are plain
HTML with a few lines of inline script for sorting and filtering, so the file opens offline (no
CDN). Every string from a result file goes through Jinja's autoescaping: results are untrusted text.

Sections: overview (the configuration chosen per model, device count, recipe and micro-batch with
its time, energy and memory per million tokens, the production libraries ranked, then the references
against the fastest of them: ``overview``), figures, all cases,
memory, communication vs theory, pipeline, ring-attention balance (``cp_balance``), expert routing
of the MoE strategies (``moe_routing``), run-to-run
spread of repeated cases (``spread``), peer fidelity (``fidelity``), links to traces and memory
snapshots (``traces``), collectives,
cross-run comparison (same case hash, ``parabench.compare``'s verdicts), failed and skipped
cases, environment. A section with no data is left out, and every table and figure fits a 1,280 px
page (long columns wrap; figures split into parts of one screen: ``figures``).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import jinja2

from parabench.compare import DEFAULT_THRESHOLD, METRICS, compare_runs
from parabench.matmul_ceiling import ceiling_note
from parabench.report import (
    collective_scaling,
    compression_to_loss,
    cp_balance,
    frames,
    moe_routing,
    nvme,
    overview,
    recipe_effect,
    spread,
)
from parabench.report import fidelity as fidelity_section
from parabench.report import predicted as predicted_section
from parabench.report import scaling as scaling_section
from parabench.report import step_breakdown as step_breakdown_section
from parabench.report import traces as traces_section
from parabench.results import host_shared, load_run
from parabench.stats import combine_launches

TEMPLATE_DIR = Path(__file__).parent / "templates"

# columns naming a case: they wrap (so that no table outgrows a 1,280 px page)
LABEL_KEYS = {"label", "variant", "best_peer", "short", "case", "run"}
# a text column whose longest value has more characters than this wraps too
WRAP_CHARS = 28
# a table of more columns than this gets a smaller font, and headers that may break inside a word
DENSE_COLUMNS = 13
# column key -> (header, format): format "int", "f1", "f2", "f3", "g4", "pct", "str", "wrap" (text that wraps),
# "bytes" (a byte count, or a [low, high] range, in binary units; the exact count in the cell's title)
CASE_COLUMNS = [
    ("label", "case", "str"),
    ("status", "status", "str"),
    ("tokens_per_s_per_device", "tok/s/device", "int"),
    ("tokens_per_s", "tok/s", "int"),
    ("launches", "launches", "int"),
    ("tps_device_interval", "tok/s/device interval (coverage)", "str"),
    ("launch_cv_pct", "launch CV %", "f2"),
    ("vs_1_device_pct", "% of 1 device", "f1"),
    ("step_time_ms_median", "step ms", "f2"),
    ("step_time_ms_p10", "p10 ms", "f2"),
    ("step_time_ms_p90", "p90 ms", "f2"),
    ("mfu_pct", "MFU %", "f2"),
    ("mfu_ceiling_pct", "MFU of measured ceiling %", "f2"),
    ("roofline_pct", "roofline %", "f2"),
    ("peak_mem_MiB", "peak MiB", "f1"),
    ("model_state_MiB", "state MiB", "f2"),
    ("theory_state_MiB", "analytic state MiB", "f2"),
    ("comm_MiB", "comm MiB", "f2"),
    ("theory_comm_MiB", "analytic comm MiB", "f2"),
    ("final_loss", "final loss", "g4"),
]
MEMORY_COLUMNS = [
    ("label", "case", "str"),
    ("peak_alloc_MiB", "alloc peak MiB", "f1"),
    ("peak_requested_MiB", "requested peak MiB (no block slack)", "f2"),
    ("peak_reserved_MiB", "reserved peak MiB", "f1"),
    ("device_used_MiB", "NVML used MiB", "f1"),
    ("peak_rss_MiB", "RSS peak MiB", "f1"),
    ("model_state_MiB", "state MiB", "f2"),
    ("theory_state_MiB", "analytic MiB", "f2"),
    ("paper_state_MiB", "ZeRO paper MiB", "f2"),
    ("state_check", "state = analytic", "str"),
]
COMM_COLUMNS = [
    ("label", "case", "str"),
    ("kind", "kind", "str"),
    ("measured_bytes", "measured", "bytes"),
    ("expected_bytes", "analytic (range: low – high)", "bytes"),
    ("ratio", "ratio", "g4"),
    ("ok", "within allowance", "str"),
    ("calls", "calls", "int"),
    ("dtypes", "dtypes", "str"),
    ("wire_MiB", "wire MiB (est.)", "f2"),
    ("theory_source", "analytic from", "str"),
]
PIPE_COLUMNS = [
    ("label", "case", "str"),
    ("stage", "stage", "int"),
    ("schedule", "schedule", "str"),
    ("microbatches", "micro-batches", "int"),
    ("measured_pct", "bubble % measured", "f2"),
    ("theory_pct", "bubble % theory", "f2"),
    ("forward_ms", "forward ms", "f2"),
    ("backward_ms", "backward ms", "f2"),
    ("load", "compute / mean stage", "f3"),
]
COLL_COLUMNS = [
    ("run", "run", "str"),
    ("world_size", "ranks", "int"),
    ("op", "op", "str"),
    ("algorithm", "algorithm", "str"),
    ("peak_busbw", "peak busbw GB/s", "g4"),
    ("at_bytes", "at size", "bytes"),
    ("largest_busbw", "busbw at largest GB/s", "g4"),
    ("largest_bytes", "largest size", "bytes"),
    ("correct", "all correct", "str"),
]


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def human_bytes(v) -> str:
    """A byte count in binary units with two decimals (29,332,618,752 -> "27.32 GiB")."""
    if abs(v) < 1024:
        return f"{v:,.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        v /= 1024
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:,.2f} {unit}"
    raise AssertionError("unreachable")


def _exact_bytes(v) -> str:
    """The exact count behind a "bytes" cell, for its title."""
    if isinstance(v, list):
        return " – ".join(f"{x:,}" if _is_number(x) else "?" for x in v) + " bytes"
    return f"{v:,} bytes" if _is_number(v) else ""


def _fmt(v, kind: str) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    if kind == "bytes" and isinstance(v, list):
        return " – ".join(human_bytes(x) if _is_number(x) else "?" for x in v)
    if kind == "bytes" and _is_number(v):
        return human_bytes(v)
    if kind == "str" or not isinstance(v, (int, float)) or isinstance(v, bool):
        return str(v)
    if kind == "int":
        return f"{v:,.0f}"
    if kind == "f1":
        return f"{v:,.1f}"
    if kind == "f2":
        return f"{v:,.2f}"
    if kind == "f3":
        return f"{v:,.3f}"
    return f"{v:.4g}"


def _change_text(baseline, candidate, kind: str) -> str:
    """ "baseline → candidate", with as many digits as it takes to show two different values
    differently (a final loss of 11.0861 → 11.0874 is not "11.09 → 11.09")."""
    a, b = _fmt(baseline, kind), _fmt(candidate, kind)
    if a == b and baseline != candidate and kind == "g4" and _is_number(baseline) and _is_number(candidate):
        for digits in range(5, 13):
            a, b = f"{baseline:.{digits}g}", f"{candidate:.{digits}g}"
            if a != b:
                break
    return f"{a} → {b}"


def _table(
    id_: str, title: str, columns, rows, note: str = "", row_class=None, footer: str = "", drop_empty: bool = False
) -> dict:
    """A table as plain cells: (text, sort key or None, css class); ``footer``: a warning under it;
    ``drop_empty``: leave out the columns no row fills (MFU on CPU, roofline and energy on GPU)."""
    if drop_empty:
        columns = [c for c in columns if any(r.get(c[0]) is not None for r in rows)]
    # a text column with long values wraps, so that the table fits a 1,280 px page
    wrapping = {
        key
        for key, _, kind in columns
        if kind == "str" and key not in LABEL_KEYS and any(len(_fmt(r.get(key), kind)) > WRAP_CHARS for r in rows)
    }
    body = []
    for r in rows:
        cells = []
        for key, _, kind in columns:
            v = r.get(key)
            num = v if _is_number(v) else None
            if kind == "bytes" and isinstance(v, list):  # a range sorts by its high end
                num = max((x for x in v if _is_number(x)), default=None)
            cls = ""
            if key == "status":
                cls = "ok" if v == "ok" else "bad"
            elif v is False:
                cls = "bad"
            elif kind == "wrap" or key in wrapping:
                cls = "wrapcell"
            elif key in LABEL_KEYS:
                cls = "labelcell"
            exact = _exact_bytes(v) if kind == "bytes" else ""
            cells.append({"text": _fmt(v, kind), "sort": num, "cls": cls, "title": exact, "href": r.get(f"{key}_href")})
        body.append({"cells": cells, "cls": row_class(r) if row_class else ""})
    return {
        "id": id_,
        "title": title,
        "note": note,
        "headers": [h for _, h, _ in columns],
        "rows": body,
        "footer": footer,
        "dense": len(columns) > DENSE_COLUMNS,
    }


def _collectives_summary(coll_rows: list[dict]) -> list[dict]:
    groups: dict = {}
    for r in coll_rows:
        groups.setdefault((r["run"], r["world_size"], r["op"], r["algorithm"]), []).append(r)
    out = []
    for (run, world, op, algo), rs in groups.items():
        timed = [r for r in rs if r["busbw_GBps"]]
        peak = max(timed, key=lambda r: r["busbw_GBps"]) if timed else None
        largest = max(timed, key=lambda r: r["bytes"] or 0) if timed else None
        out.append(
            {
                "run": run,
                "world_size": world,
                "op": op,
                "algorithm": algo,
                "peak_busbw": peak and peak["busbw_GBps"],
                "at_bytes": peak and peak["bytes"],
                "largest_busbw": largest and largest["busbw_GBps"],
                "largest_bytes": largest and largest["bytes"],
                "correct": all(r["correct"] is not False for r in rs),
            }
        )
    return out


# bytes metrics of the comparison table are shown in binary units (compare.METRICS' unit "B")
CMP_METRICS = [
    ("tokens_per_s_per_device", "tok/s/device"),
    ("step_time_s_median", "step s"),
    ("mfu", "MFU"),
    ("peak_alloc_bytes", "alloc peak"),
    ("peak_rss_bytes", "RSS peak"),
    ("model_state_bytes_max", "state"),
    ("comm_payload_bytes", "comm"),
    ("final_loss", "final loss"),
]


BYTE_METRICS = {name for name, _, _, unit in METRICS if unit == "B"}


def _comparisons(runs, threshold: float) -> list[dict]:
    """Run 0 as baseline against every later run: one row per case hash, the main metrics as
    "baseline → candidate (change)" cells coloured by ``parabench.compare``'s verdict."""
    out = []
    for cand in runs[1:]:
        res = compare_runs(runs[0], cand, threshold=threshold)
        present = {m["metric"] for c in res["cases"] for m in c["metrics"]}
        cols = [(k, h) for k, h in CMP_METRICS if k in present]
        rows = []
        for c in res["cases"]:
            by = {m["metric"]: m for m in c["metrics"]}
            cells = []
            for key, _ in cols:
                m = by.get(key)
                if m is None:
                    cells.append({"text": "–", "cls": "", "sort": None, "title": ""})
                    continue
                if key in BYTE_METRICS:
                    kind = "bytes"
                else:
                    kind = "g4" if isinstance(m["baseline"], float) or isinstance(m["candidate"], float) else "int"
                text = _change_text(m["baseline"], m["candidate"], kind)
                title = (
                    f"{_exact_bytes(m['baseline']) or '–'} → {_exact_bytes(m['candidate']) or '–'}"
                    if kind == "bytes"
                    else ""
                )
                if m["rel_change"] is not None and abs(m["rel_change"]) >= 5e-5:  # not "(+0.00%)"
                    text += f" ({m['rel_change'] * 100:+.2f}%)"
                if m["p_value"] is not None:
                    text += f" p={m['p_value']:.2g}"
                cells.append({"text": text, "cls": m["verdict"], "sort": m["rel_change"], "title": title})
            others = [
                f"{m['metric']}: {m['verdict']}" + (f" ({m['rel_change'] * 100:+.2f}%)" if m["rel_change"] else "")
                for m in c["metrics"]
                if m["verdict"] not in ("same", "n/a") and m["metric"] not in dict(cols)
            ]
            # one sentence per reason, naming the figures it concerns ("tok/s/device, MFU: not enough
            # repeats to judge"), never the same sentence once per figure
            by_note: dict[str, list[str]] = {}
            for m in c["metrics"]:
                if m["note"]:
                    by_note.setdefault(m["note"], []).append(dict(CMP_METRICS).get(m["metric"], m["metric"]))
            status = (
                c["baseline_status"]
                if c["baseline_status"] == c["candidate_status"]
                else f"{c['baseline_status'] or '–'} → {c['candidate_status'] or '–'}"
            )
            rows.append(
                {
                    "label": c["label"],
                    "status": status,
                    "verdict": c["verdict"],
                    "cells": cells,
                    "note": "; ".join(
                        list(dict.fromkeys(c["notes"]))
                        + [f"{', '.join(names)}: {note}" for note, names in by_note.items()]
                        + others
                    ),
                }
            )
        out.append(
            {
                "baseline": res["baseline"],
                "candidate": res["candidate"],
                "counts": res["counts"],
                "notes": res["notes"],
                "headers": [h for _, h in cols],
                "rows": rows,
                "regression": res["regression"],
                "settings": res["settings"],
            }
        )
    return out


def devices_text(m: dict) -> str:
    """A manifest's devices in words: a GPU is one entry per card, the CPU one entry with its core
    count in "count" ("NVIDIA H100 80GB HBM3 ×2", "x86_64, 2 cores")."""
    counts: dict[tuple[str, str], int] = {}
    for d in m.get("devices") or []:
        if isinstance(d, dict):
            key = (str(d.get("type")), str(d.get("name")))
            n = d.get("count")
            counts[key] = counts.get(key, 0) + (n if isinstance(n, int) and not isinstance(n, bool) else 1)
    parts = [f"{name}, {n} cores" if kind == "cpu" else f"{name} ×{n}" for (kind, name), n in sorted(counts.items())]
    return "; ".join(parts) if parts else "–"


def _cpus_text(m: dict) -> str | None:
    """The host's CPU and how many of its cores the run could use ("Intel Xeon, 16 of 64 cores usable")."""
    model, total, usable = (frames.dig(m, "host", k) for k in ("cpu_model", "cpu_count", "cpus_usable"))
    if total is None and model is None:
        return None
    cores = f"{usable} of {total} cores usable" if usable is not None and usable != total else f"{total} cores"
    return f"{model}, {cores}" if model else cores


def host_shared_notes(manifests: list[dict]) -> list[dict]:
    """Runs whose host ran other work meanwhile (``PARABENCH_HOST_SHARED``, set by the one who ran
    them): shown at the top, because a host-bound case measures the host as much as the GPU."""
    out = []
    for m in manifests:
        text = host_shared(m)
        if text:
            out.append({"run": f"{m.get('suite')}/{m.get('run_id')}", "text": text, "cpus": _cpus_text(m)})
    return out


def superseded_notes(run_dirs: list[Path]) -> list[str]:
    """What ``results/superseded.toml`` says of these runs: shown first, so that nobody quotes a
    superseded run's figures (``parabench headline`` refuses them)."""
    from parabench.superseded import load_superseded, superseded_entries

    entries = load_superseded()
    return [e.text() for d in run_dirs for e in superseded_entries(d, entries)]


def _env_summary(manifests: list[dict]) -> dict:
    keys = [
        ("suite", lambda m: m.get("suite")),
        ("run id", lambda m: m.get("run_id")),
        ("created", lambda m: m.get("created_at")),
        (
            "git",
            lambda m: (
                f"{(frames.dig(m, 'git', 'commit') or '?')[:12]}"
                + (" (dirty)" if frames.dig(m, "git", "dirty") else "")
            ),
        ),
        ("devices", devices_text),
        ("host", lambda m: frames.dig(m, "host", "hostname")),
        ("CPUs", _cpus_text),
        ("platform", lambda m: frames.dig(m, "host", "platform")),
        ("python", lambda m: frames.dig(m, "versions", "python")),
        ("torch", lambda m: frames.dig(m, "versions", "torch")),
        ("CUDA", lambda m: frames.dig(m, "versions", "cuda")),
        ("NCCL", lambda m: frames.dig(m, "versions", "nccl")),
        ("DeepSpeed", lambda m: frames.dig(m, "versions", "deepspeed")),
        ("parabench", lambda m: frames.dig(m, "versions", "parabench")),
        ("cases", lambda m: m.get("n_cases")),
    ]
    if any(overview.host_loads(m) for m in manifests):  # recorded by runs since it was measured
        keys.append(("host load over the run", overview.host_load_text))
    env_keys = sorted({k for m in manifests for k in (m.get("env") or {})})
    rows = [{"key": k, "values": [str(f(m)) if f(m) is not None else "–" for m in manifests]} for k, f in keys]
    rows += [{"key": k, "values": [str((m.get("env") or {}).get(k, "–")) for m in manifests]} for k in env_keys]
    for r in rows:
        r["differs"] = len(manifests) > 1 and len(set(r["values"])) > 1
    return {"rows": rows}


# Other processes keeping at least this many CPUs busy during a case's timed steps earn it a caveat.
SHARED_HOST_CPUS = 0.5


def _shared_host_notes(record: dict) -> list[str]:
    m = record.get("metrics") or {}
    foreign = m.get("host_foreign_cpu_share_max")
    if not isinstance(foreign, (int, float)) or foreign < SHARED_HOST_CPUS:
        return []
    load = m.get("host_load_average_max")
    return [
        f"other processes kept {foreign:.1f} CPUs busy during the timed steps"
        + (f" (load average {load:.1f})" if isinstance(load, (int, float)) else "")
        + ": its timings describe a shared host, not only the strategy"
    ]


def _emulation_note(manifest: dict) -> str | None:
    """Nodes emulated on one host (``parabench run suite --emulate-link``): the run says so."""
    emulation = manifest.get("emulation")
    if not isinstance(emulation, dict):
        return None
    link = emulation.get("inter_node_link") or "another transport"
    return str(emulation.get("note") or f"several nodes emulated on one host, the link between them forced to {link}")


def render_report(
    run_dirs: list[Path],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    with_figures: bool = True,
    link_from: Path | None = None,
) -> str:
    """``link_from``: the folder the report will be written to; links to files of the runs
    (traces) are relative to it (None: relative to where the run folders were named from)."""
    run_dirs = [Path(d) for d in run_dirs]
    # one record per case: timings are medians over its launches, with launches and launch_stats
    runs = [(manifest, combine_launches(records)) for manifest, records in map(load_run, run_dirs)]
    manifests = [m for m, _ in runs]
    several = len(runs) > 1
    rows = frames.case_rows(runs)
    comm_rows = frames.comm_check_rows(runs)
    coll_rows, coll_heads = frames.collectives_rows(run_dirs)
    ok = [r for r in rows if r["status"] == "ok"]
    bad = [r for r in rows if r["status"] != "ok"]

    run_col = [("run", "run", "str")] if several else []
    tables = []
    for spec in overview.first_screen(rows):  # which strategy, what cost; then the references
        spec["columns"] = run_col + spec["columns"]
        tables.append(_table(**spec, row_class=lambda r: "group-start" if r["group_start"] else "", drop_empty=True))
    caveats = [
        {"run": f"{m.get('suite')}/{m.get('run_id')}", "label": r.get("label", ""), "caveat": text}
        for m, records in runs
        for r in records
        for text in (r.get("caveats") or []) + _shared_host_notes(r)
    ] + [
        {"run": f"{m.get('suite')}/{m.get('run_id')}", "label": "every case", "caveat": note}
        for m in manifests
        if (note := _emulation_note(m))
    ]
    if caveats:
        tables.append(
            _table(
                "caveats",
                "Caveats: known behaviour behind some numbers",
                run_col + [("label", "case", "str"), ("caveat", "what to know", "wrap")],
                caveats,
                "Written into the records by the strategy that measured them: read these cases' "
                "figures with it in mind.",
            )
        )
    if rows:
        tables.append(
            _table(
                "cases",
                "All cases",
                run_col + CASE_COLUMNS,
                sorted(
                    rows, key=lambda r: (r["run_idx"], r["params"] or 0, r["model"], r["world_size"] or 0, r["label"])
                ),
                "Step time is the slowest rank's, median over timed steps; with several launches (repeats) "
                "tokens/s and step time are the medians over launches, the interval the order-statistic "
                "interval of that median with the probability it covers the true one ([min, max] of 3 "
                "launches: 75 %), CV the launch-to-launch standard deviation over the mean; "
                "memory the largest rank's peak; "
                "communication one rank's payload over one instrumented step. "
                "% of 1 device: tokens/s per device relative to the single-device run of the same model. "
                + ceiling_note(manifests),
                row_class=lambda r: "" if r["status"] == "ok" else "bad-row",
                drop_empty=True,
            )
        )
    if ok:
        tables.append(
            _table(
                "memory-table",
                "Memory per rank",
                run_col + MEMORY_COLUMNS,
                ok,
                "Allocator peaks and NVML on GPUs, resident set on CPUs. The alloc peak counts whole "
                "allocator blocks (rounded, and cached blocks reused unsplit count whole), the requested "
                "peak only the bytes tensors asked for, so it compares strategies without the allocator's "
                "slack (recorded since 2026-11-26). State = parameters, gradients "
                "and optimizer states actually held, beside their analytic layout and the ZeRO paper's "
                "16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N.",
            )
        )
    if comm_rows:
        tables.append(
            _table(
                "comm-table",
                "Communication vs theory, by kind",
                run_col + COMM_COLUMNS,
                comm_rows,
                "Rank 0's payload per kind on the instrumented step against the analytic volume. 'analytic from': "
                "'run' when the expectation was computed when the case ran; 'recheck <date> <commit>' "
                "when `parabench recheck` later set the same measurement beside a newer theory; '+ recorded "
                "routing': expert-parallel traffic made exact by the routing each rank recorded.",
                row_class=lambda r: "" if r["ok"] else "bad-row",
            )
        )
    pipe = [
        {
            "label": r["label"],
            "run": r["run"],
            **p,
            "measured_pct": p["measured"] * 100 if p["measured"] is not None else None,
            "theory_pct": p["theory"] * 100 if p["theory"] is not None else None,
        }
        for r in ok
        for p in (r["pipeline"] or [])
    ]
    if pipe:
        tables.append(
            _table(
                "pipeline-table",
                "Pipeline bubbles",
                run_col + PIPE_COLUMNS,
                pipe,
                "Per stage: the share of its step spent waiting for a neighbour, measured and in theory; "
                "its forward and backward (B + W) time and its compute over the mean stage's, where its clock "
                "timed the device's work (on a GPU, option record_timeline). A pipeline runs at the pace of "
                'its slowest stage; option stage_layers = "balanced" evens the stages\' FLOPs.',
            )
        )
    for spec in scaling_section.table_specs(runs, run_col):  # scaling series; bubbles against (p-1)/(m+p-1)
        tables.append(_table(**spec))
    for spec in cp_balance.table_specs(runs, run_col):  # ring attention: contiguous vs zig-zag balance
        tables.append(_table(**spec))
    for spec in moe_routing.table_specs(runs, run_col):  # MoE: expert load, all-to-all, drops, collapse
        tables.append(_table(**spec))
    for spec in nvme.table_specs(runs, run_col):  # ZeRO-Infinity: disk bytes vs theory, rates vs the disk
        tables.append(_table(**spec))
    for spec in step_breakdown_section.table_specs(runs, run_col):  # compute vs exposed communication
        tables.append(_table(**spec))
    for spec in traces_section.table_specs(runs, run_dirs, run_col, link_from):  # links to trace files
        tables.append(_table(**spec))
    for spec in recipe_effect.table_specs(runs, run_col):  # one strategy in both recipes, kept apart
        tables.append(_table(**spec))
    for spec in spread.table_specs(runs, run_col):  # repeated cases and ref/peer ratios, with intervals
        tables.append(_table(**spec))
    for spec in fidelity_section.table_specs(run_dirs, runs, run_col):  # adapters vs their library's script
        tables.append(_table(**spec))
    for spec in predicted_section.table_specs(runs, run_col):  # the planner's prediction beside each case
        tables.append(_table(**spec))
    for spec in collective_scaling.table_specs(run_dirs, run_col):  # time against K, fitted to each law
        tables.append(_table(**spec))
    for spec in compression_to_loss.table_specs(runs, run_col):  # compressors to DDP's loss: bytes and time
        tables.append(_table(**spec))
    if coll_rows:
        tables.append(
            _table("collectives-table", "Collectives: bus bandwidth", COLL_COLUMNS, _collectives_summary(coll_rows))
        )

    figures = []
    if with_figures:
        from parabench.report.figures import all_figures  # matplotlib only when drawing

        figures = all_figures(rows, comm_rows, coll_rows, frames.loss_scale_points(rows))
        figures += step_breakdown_section.figures(runs)  # compute, exposed communication, the rest
        figures += scaling_section.figures(runs)  # efficiency, communication share, ZeRO lines against N
        figures += collective_scaling.figures(run_dirs)  # all-reduce time against K with each law's line
        figures += compression_to_loss.figures(runs)  # loss against bytes sent and against wall time

    failed = [
        {
            "run": r["run"],
            "label": r["label"],
            "status": r["status"],
            "error": r["error"],
            "type": r["error_type"],
            "rank": r["first_failing_rank"],
            "detail": r["error_detail"],
        }
        for r in bad
    ]
    return (
        _template_env()
        .get_template("report.html.j2")
        .render(
            manifests=manifests,
            device_texts=[devices_text(m) for m in manifests],
            host_shared=host_shared_notes(manifests),
            superseded=superseded_notes(run_dirs),
            timing_notes=overview.timing_notes(rows, manifests),
            env_summary=_env_summary(manifests),
            tables=tables,
            failed=failed,
            figures=figures,
            comparisons=_comparisons(runs, threshold) if several else [],
            coll_heads=coll_heads,
            n_cases=len(rows),
            n_ok=len(ok),
            n_status={s: sum(1 for r in rows if r["status"] == s) for s in sorted({r["status"] for r in rows})},
        )
    )


@cache
def _template_env() -> jinja2.Environment:
    """One Jinja environment a process: it keeps the compiled template (recompiling it when the file
    changes), where a fresh environment compiled it again for every report, two thirds of a report's
    rendering time."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), autoescape=True)
