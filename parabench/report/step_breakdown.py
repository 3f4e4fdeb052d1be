"""Report section: step-time breakdown, compute against communication and what of it is exposed.

Reads only result records (``per_rank[i]["step_breakdown"]``, written by
``parabench.meters.step_breakdown`` on one extra profiled step of cases with
``options.step_breakdown = true``) and never imports training code.

Per case, the numbers are the mean over ranks, and the fractions are of the *profiled* step
(the profiler lengthens a step, most on CPUs, so its wall time is shown beside the timed median
rather than mixed with it). A profiled step splits exactly into compute, exposed communication
and the rest (idle, and device copies that nothing else overlaps): the figure stacks those three,
and overlapped communication sits inside compute.
"""

from __future__ import annotations

from parabench.report.frames import as_number, dig, run_name

SOURCE_TEXT = {"cuda_kernels": "CUDA kernels", "cpu_ops": "CPU operator events (threads)"}
TOP_NAMES = 3
NAME_CHARS = 48

COLUMNS = [
    ("label", "case", "str"),
    ("source", "source", "str"),
    ("ranks", "ranks", "int"),
    ("timed_step_ms", "timed step ms (median)", "f2"),
    ("step_ms", "profiled step ms", "f2"),
    ("compute_ms", "compute ms", "f2"),
    ("compute_pct", "compute % of step", "f1"),
    ("comm_ms", "comm ms", "f2"),
    ("exposed_ms", "exposed comm ms", "f2"),
    ("exposed_pct", "exposed % of step", "f1"),
    ("exposed_ms_max", "exposed ms, worst rank", "f2"),
    ("overlap_pct", "overlap % of comm", "f1"),
    ("idle_ms", "idle ms", "f2"),
    ("memcpy_ms", "memcpy ms", "f2"),
    ("top_comm", "top communication (rank 0)", "str"),
    ("top_compute", "top compute kernels (rank 0)", "str"),
]

NOTE = (
    "One extra untimed step per case under torch.profiler, after the timed steps; mean over ranks. "
    "Compute and communication are the lengths of the unions of their intervals; exposed communication "
    "is communication time with no compute interval running; overlap = 1 − exposed / comm. "
    "On GPUs the intervals are device kernels (NCCL kernels are communication, memcpy/memset their own "
    "category, every other kernel compute; an NCCL kernel's time includes waiting for a late peer). "
    "On CPUs they are operator events of every thread: gloo runs collectives on its own threads, so "
    "'overlapped' means an operator ran on another thread meanwhile, on cores both share, and exposed "
    "time includes Python between operators. Fractions are of the profiled step, which the profiler "
    "lengthens; the timed median is the step time to quote."
)


def _mean(values: list) -> float | None:
    nums = [v for v in values if as_number(v) is not None]
    return sum(nums) / len(nums) if nums and len(nums) == len(values) else None


def _ms(v):
    return v * 1e3 if v is not None else None


def _short(name: str) -> str:
    name = name.split("(")[0]  # kernel argument lists
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"


def breakdown_rows(runs) -> list[dict]:
    rows = []
    for idx, (manifest, records) in enumerate(runs):
        run = run_name(manifest)
        for r in records:
            per_rank = [pr["step_breakdown"] for pr in r.get("per_rank") or [] if pr.get("step_breakdown") is not None]
            if not per_rank:
                continue

            def mean(key):
                return _mean([b.get(key) for b in per_rank])

            step, compute, exposed = mean("step_s"), mean("compute_s"), mean("exposed_comm_s")
            comm, idle = mean("comm_s"), mean("idle_s")
            overlaps = [b.get("overlap_fraction") for b in per_rank]
            overlap = _mean(overlaps) if any(o is not None for o in overlaps) else None
            exposed_all = [as_number(b.get("exposed_comm_s")) for b in per_rank]
            sources = sorted({str(b.get("source")) for b in per_rank})
            top = dig(per_rank, 0, "top_comm") or []
            c = r.get("case") or {}
            rows.append(
                {
                    "_sort": (
                        idx,
                        str(c.get("model")),
                        c.get("world_size") or 0,
                        str(c.get("precision")),
                        str(c.get("strategy")),
                        r.get("label", ""),
                    ),
                    "run": run,
                    "label": r.get("label", ""),
                    "model": str(c.get("model")),
                    "short": f"{c.get('strategy')} w{c.get('world_size')} {c.get('precision')}",
                    "source": ", ".join(SOURCE_TEXT.get(s, s) for s in sources),
                    "ranks": len(per_rank),
                    "timed_step_ms": _ms(as_number(dig(r, "metrics", "step_time_s_median"))),
                    "step_ms": _ms(step),
                    "compute_ms": _ms(compute),
                    "comm_ms": _ms(comm),
                    "exposed_ms": _ms(exposed),
                    "exposed_ms_max": _ms(max(exposed_all)) if None not in exposed_all else None,
                    "idle_ms": _ms(idle),
                    "memcpy_ms": _ms(mean("memcpy_s")),
                    "compute_pct": compute / step * 100 if compute is not None and step else None,
                    "exposed_pct": exposed / step * 100 if exposed is not None and step else None,
                    "overlap_pct": overlap * 100 if overlap is not None else None,
                    "top_comm": _top_text(top),
                    "top_compute": _top_text(dig(per_rank, 0, "top_compute") or []),
                    "warning": "; ".join(sorted({str(b["warning"]) for b in per_rank if b.get("warning")})),
                }
            )
    rows.sort(key=lambda row: row["_sort"])
    return rows


def _top_text(top: list) -> str:
    return (
        "; ".join(
            f"{_short(str(t.get('name')))} ×{t.get('calls')} {(as_number(t.get('total_s')) or 0) * 1e3:.2f} ms"
            for t in top[:TOP_NAMES]
            if isinstance(t, dict)
        )
        or "–"
    )


def table_specs(runs, run_col: list) -> list[dict]:
    """The section's table as keyword arguments of ``parabench.report.html._table`` (none without
    profiled steps)."""
    rows = breakdown_rows(runs)
    if not rows:
        return []
    note = NOTE
    warned = sorted({f"{r['label']}: {r['warning']}" for r in rows if r["warning"]})
    if warned:
        note += " Warnings: " + " | ".join(warned) + "."
    return [
        {
            "id_": "step-breakdown",
            "title": "Step-time breakdown: compute, communication, exposed communication",
            "columns": run_col + COLUMNS,
            "rows": rows,
            "note": note,
        }
    ]


def figures(runs) -> list[dict]:
    """One stacked bar per case: compute, exposed communication and the rest, as % of the profiled step."""
    rows = [
        r
        for r in breakdown_rows(runs)
        if None not in (r["step_ms"], r["compute_ms"], r["exposed_ms"]) and r["step_ms"] > 0
    ]
    if not rows:
        return []
    from parabench.report.figures import figure_entry, plt, setup_style

    setup_style()
    several_runs = len({r["run"] for r in rows}) > 1
    labels = [f"{r['model']} · {r['short']}" + (f" · {r['run']}" if several_runs else "") for r in rows]
    compute = [r["compute_ms"] / r["step_ms"] * 100 for r in rows]
    exposed = [r["exposed_ms"] / r["step_ms"] * 100 for r in rows]
    rest = [max(0.0, 100 - a - b) for a, b in zip(compute, exposed)]
    fig, ax = plt.subplots(figsize=(8, max(2.0, 0.38 * len(rows) + 0.8)))
    ys = list(range(len(rows)))[::-1]  # first row on top
    ax.barh(ys, compute, color="#4c72b0", label="compute (overlapped comm inside)")
    ax.barh(ys, exposed, left=compute, color="#c44e52", label="exposed communication")
    ax.barh(ys, rest, left=[a + b for a, b in zip(compute, exposed)], color="#cccccc", label="idle / other")
    for y, r in zip(ys, rows):
        if r["overlap_pct"] is not None:
            ax.text(1, y, f"overlap {r['overlap_pct']:.0f}%", va="center", ha="left", color="white")
    ax.set_yticks(ys)
    ax.set_yticklabels(labels)
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of the profiled step (mean over ranks)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    return [
        figure_entry(
            "step-breakdown",
            "Step-time breakdown: compute, exposed communication, the rest",
            "One profiled step per case (torch.profiler, untimed). Blue: union of compute intervals; red: "
            "communication with no compute running; grey: neither (idle, launch gaps, Python, copies). "
            "Overlap: the share of communication hidden under compute. Source per case in the table.",
            fig,
        )
    ]
