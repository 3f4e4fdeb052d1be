"""Result files -> pandas frames and plain rows for the report (reads results only).

Records are read by the keys ``parabench.record`` documents. Which sections a record has depends
on its status (a failed case has no metrics): a missing section gives None, never an exception.
"""

from __future__ import annotations

import json
from pathlib import Path

from parabench import pipeline_sim
from parabench.data import case_row
from parabench.matmul_ceiling import fraction_of_ceiling
from parabench.metrics import stage_compute_s
from parabench.recipes import recipe_name
from parabench.record import byte_high, pipeline_stages, rank0_comm
from parabench.registry import grad_reduce_dtype, recipe_of

MiB = 2**20


def dig(d, *keys, default=None):
    for k in keys:
        if isinstance(d, dict):
            d = d.get(k)
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return default
        if d is None:
            return default
    return d


def _mib(v):
    return v / MiB if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def as_number(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def run_name(manifest: dict) -> str:
    """How the report names a run: ``suite/run_id``."""
    return f"{manifest.get('suite')}/{manifest.get('run_id')}"


def records_of(runs, strategies):
    """``(run index, run name, record)`` of every record whose case's strategy is in ``strategies``."""
    for idx, (manifest, records) in enumerate(runs):
        for r in records:
            if dig(r, "case", "strategy") in strategies:
                yield idx, run_name(manifest), r


def variant(case: dict, usual_seed=None) -> str:
    """What tells cases of one model, device count, recipe and micro-batch apart: the strategy,
    a model layout other than the default (``fused``), gradient accumulation, options (as the case
    label writes them) and a seed other than the run's usual one (a suite repeats cases under other
    seeds)."""
    opts = ",".join(f"{k}={v}" for k, v in sorted((case.get("options") or {}).items()))
    ga = case.get("grad_accum")
    seed = case.get("seed")
    layout = case.get("layout")
    return (
        str(case.get("strategy"))
        + (f" {layout}" if layout and layout != "separate" else "")  # the model layout, as the label writes it
        + (f" ga{ga}" if isinstance(ga, int) and ga > 1 else "")
        + (f" [{opts}]" if opts else "")
        + (f" seed {seed}" if seed is not None and usual_seed is not None and seed != usual_seed else "")
    )


def usual_seed(records) -> object:
    """The seed most cases of a run use (None for a run without cases)."""
    seeds = [dig(r, "case", "seed") for r in records]
    return max(set(seeds), key=seeds.count) if seeds else None


def short_case(r: dict, seed=None) -> str:
    """A case without its model: strategy (with options and an unusual seed), devices, recipe,
    micro-batch, so no two cases of one model and run share it."""
    c = r.get("case") or {}
    return (
        f"{variant(c, seed)} w{c.get('world_size')} {recipe_name(str(c.get('precision')), recipe_of(c))} "
        f"mb{c.get('micro_batch')}"
    )


def _ms(seconds):
    return seconds * 1e3 if as_number(seconds) is not None else None


def _pct(fraction):
    return fraction * 100 if as_number(fraction) is not None else None


def case_rows(runs) -> list[dict]:
    """The report's case table: ``parabench.data.case_row`` (the reading ``parabench.load`` gives),
    in the report's units (ms, %, MiB), with its launch, error and pipeline columns."""
    rows = []
    for idx, (manifest, records) in enumerate(runs):
        seed = usual_seed(records)
        for r in records:
            d = case_row(manifest, r, registry=False)  # the report imports no training code
            peak = as_number(d.get("peak_alloc_bytes")) or as_number(d.get("peak_rss_bytes"))
            err = r.get("error") or {}
            rows.append(
                {
                    "run": d["run"],
                    "run_idx": idx,
                    "label": d["label"] or "",
                    "case_hash": d["case_hash"] or "",
                    "status": d["status"] or "?",
                    "strategy": str(d["strategy"]),
                    # production library ("peer") or from-scratch reference ("reference")
                    "kind": d["kind"],
                    "variant": variant(r.get("case") or {}, seed),
                    "seed": dig(r, "case", "seed"),
                    "model": str(d["model"]),
                    "layout": d["layout"],
                    "params": d["params"],
                    "world_size": d["world_size"],
                    # the precision and its recipe ("bf16-master"): every grouping of the report
                    # by precision then pairs like recipes only
                    "precision": recipe_name(str(d["precision"]), d["recipe"]),
                    "micro_batch": d["micro_batch"],
                    # the dtype its gradients were reduced in (registry.pair_note reads it)
                    "grad_reduce": grad_reduce_dtype(r.get("case") or {}),
                    "grad_accum": d["grad_accum"],
                    "device": d["device"],
                    "short": short_case(r, seed),
                    "tokens_per_s_per_device": as_number(d.get("tokens_per_s_per_device")),
                    "tokens_per_s": as_number(d.get("tokens_per_s")),
                    "tokens_per_step": as_number(d.get("tokens_per_step")),
                    **launch_columns(r),
                    "step_time_ms_median": _ms(d.get("step_time_s_median")),
                    "step_time_ms_p10": _ms(d.get("step_time_s_p10")),
                    "step_time_ms_p90": _ms(d.get("step_time_s_p90")),
                    "step_times_s": d.get("step_times_s"),
                    "mfu_pct": _pct(d.get("mfu")),
                    # against the bf16 matmul rate probed at the run's start, not the datasheet's peak
                    "mfu_ceiling_pct": _pct(fraction_of_ceiling(manifest, r)),
                    "roofline_pct": _pct(d.get("roofline_fraction")),
                    "peak_mem_MiB": _mib(peak),
                    "peak_mem_GiB": peak / 2**30 if peak is not None else None,
                    "tokens_per_j": as_number(d.get("tokens_per_j")),
                    "peak_alloc_MiB": _mib(d.get("peak_alloc_bytes")),
                    "peak_requested_MiB": _mib(d.get("peak_requested_bytes")),
                    "peak_reserved_MiB": _mib(d.get("peak_reserved_bytes")),
                    "device_used_MiB": _mib(d.get("device_used_bytes")),
                    "peak_rss_MiB": _mib(d.get("peak_rss_bytes")),
                    "model_state_MiB": _mib(d.get("model_state_bytes_max")),
                    "theory_state_MiB": _mib(d["theory_state_bytes"]),
                    "paper_state_MiB": _mib(dig(r, "theory", "paper_state_bytes")),
                    "comm_MiB": _mib(d["comm_payload_bytes"]),
                    "theory_comm_MiB": _mib(d["theory_comm_bytes"]),
                    "comm_check": d["comm_ok"],
                    "state_check": d["state_ok"],
                    "final_loss": as_number(d.get("final_loss")),
                    "losses": d.get("losses"),
                    "error": err.get("message"),
                    "error_type": err.get("type"),
                    "first_failing_rank": err.get("first_failing_rank"),
                    "error_detail": err.get("traceback_tail") or err.get("log_tail"),
                    "loss_scale": r.get("loss_scale"),
                    "pipeline": pipeline_rows(r),
                }
            )
    add_scaling_efficiency(rows)
    return rows


def launch_columns(r: dict) -> dict:
    """Launch count, the interval of the median tokens/s per device and the launch-to-launch CV,
    from ``launch_stats`` (``parabench.stats.combine_launches``); None where absent."""
    stats = r.get("launch_stats") or {}
    tps = stats.get("tokens_per_s_per_device") or {}
    low, high, cover = as_number(tps.get("ci_low")), as_number(tps.get("ci_high")), as_number(tps.get("ci_coverage"))
    interval = (
        f"{low:,.0f} – {high:,.0f} ({cover:.0%})"
        if low is not None and high is not None and cover is not None and (stats.get("n") or 0) >= 2
        else None
    )
    cv = as_number(tps.get("cv"))
    return {
        "launches": stats.get("n"),
        "tps_device_ci_low": low,
        "tps_device_ci_high": high,
        "tps_device_interval": interval,
        "launch_cv_pct": cv * 100 if cv is not None else None,
    }


def add_scaling_efficiency(rows: list[dict]) -> None:
    """Tokens/s per device as a fraction of one device's (same run, model, precision)."""
    single = {}
    for r in rows:
        if r["status"] == "ok" and r["world_size"] == 1 and r["tokens_per_s_per_device"]:
            key = (r["run_idx"], r["model"], r["precision"])
            single[key] = max(single.get(key, 0), r["tokens_per_s_per_device"])
    for r in rows:
        base = single.get((r["run_idx"], r["model"], r["precision"]))
        r["vs_1_device_pct"] = (
            r["tokens_per_s_per_device"] / base * 100 if base and r["tokens_per_s_per_device"] else None
        )


def pipeline_rows(r: dict) -> list[dict]:
    """Per pipeline stage, measured vs theoretical bubble (``record.pipeline_stages``), and where the
    stages' clocks timed the device's work (a measured bubble), each one's forward and backward
    (B + W) milliseconds and ``load``, its compute over the mean stage's (``metrics.stage_compute_s``,
    whose largest is the record's ``pipeline_stage_imbalance``)."""
    stages = pipeline_stages(r)
    by_stage = stage_compute_s([p for _, p in stages])
    mean = sum(by_stage.values()) / len(by_stage) if by_stage else None
    out = []
    for rank, p in stages:
        meas, theo = as_number(p.get("bubble_fraction_measured")), as_number(p.get("bubble_fraction_theory"))
        if meas is None and theo is None:
            continue
        by_kind = (p.get("compute_s_by_kind") or {}) if meas is not None else {}
        out.append(
            {
                "rank": rank,
                "stage": p.get("stage", rank),
                "stages": p.get("stages"),
                "schedule": p.get("schedule"),
                "microbatches": p.get("microbatches"),
                "measured": meas,
                "theory": theo,
                "forward_ms": _ms(by_kind.get("F")),
                "backward_ms": _ms(sum(as_number(v) or 0.0 for k, v in by_kind.items() if k in ("B", "W")) or None),
                "load": p["compute_s"] / mean if mean else None,
            }
        )
    return out


def comm_check_rows(runs) -> list[dict]:
    rows = []
    for manifest, records in runs:
        seed = usual_seed(records)
        for r in records:
            checks = dig(r, "checks", "comm")
            by_kind = (rank0_comm(r) or {}).get("by_kind") or {}
            if not checks:
                continue
            for kind, c in sorted(checks.items()):
                k = by_kind.get(kind) or {}
                rows.append(
                    {
                        "run": run_name(manifest),
                        "label": r.get("label", ""),
                        "short": short_case(r, seed),
                        "model": dig(r, "case", "model"),
                        "kind": kind,
                        "expected_MiB": _mib(byte_high(c.get("expected_bytes"))),
                        "measured_MiB": _mib(byte_high(c.get("measured_bytes"))),
                        "expected_range": isinstance(c.get("expected_bytes"), list),
                        # a byte count or a [low, high] range: the report formats both
                        "expected_bytes": c.get("expected_bytes"),
                        "measured_bytes": c.get("measured_bytes"),
                        "ratio": as_number(c.get("ratio")),
                        "ok": c.get("ok"),
                        "calls": k.get("calls"),
                        "dtypes": ", ".join(map(str, k.get("dtypes") or [])),
                        "wire_MiB": _mib(k.get("wire_bytes")),
                        "theory_source": theory_source(r),
                    }
                )
    return rows


def theory_source(r: dict) -> str:
    routed = " + recorded routing" if dig(r, "theory", "comm_exact_from") else ""
    recheck = r.get("theory_recheck")
    if recheck is None:
        return "run" + routed
    return (
        f"recheck {str(recheck.get('at', ''))[:10]} {str(recheck.get('parabench_commit') or '')[:8]}".rstrip() + routed
    )


def collectives_rows(run_dirs: list[Path]) -> tuple[list[dict], list[dict]]:
    """Rows of every collectives-w*.json in the run folders, and their headers."""
    rows, heads = [], []
    for d in run_dirs:
        for p in sorted(Path(d).glob("collectives-w*.json")):
            if p.name.endswith(".config.json"):
                continue
            try:
                data = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if not isinstance(data, dict) or data.get("kind") != "collectives":
                continue
            world = data.get("world_size")
            heads.append(
                {
                    "file": f"{Path(d).name}/{p.name}",
                    "world_size": world,
                    "backend": data.get("backend"),
                    "device": dig(data, "device", "name"),
                    "ok": data.get("ok"),
                    "failures": data.get("failures") or [],
                    "wall_s": data.get("wall_s"),
                }
            )
            for row in data.get("rows") or []:
                if not isinstance(row, dict):
                    continue
                rows.append(
                    {
                        "run": Path(d).name,
                        "world_size": world,
                        "backend": data.get("backend"),
                        "op": str(row.get("op")),
                        "algorithm": str(row.get("algorithm")),
                        "bytes": as_number(row.get("bytes")),
                        "time_us": (as_number(row.get("time_s_median")) or 0) * 1e6 or None,
                        "algbw_GBps": as_number(row.get("algbw_GBps")),
                        "busbw_GBps": as_number(row.get("busbw_GBps")),
                        "correct": row.get("correct"),
                        "skipped": row.get("skipped"),
                    }
                )
    return rows, heads


def loss_scale_points(rows: list[dict]) -> list[dict]:
    pts = []
    for r in rows:
        for step, e in enumerate(r.get("loss_scale") or []):
            if as_number(e.get("scale")):
                pts.append(
                    {
                        "case": r["short"],
                        "model": r["model"],
                        "step": step,
                        "scale": e["scale"],
                        "skipped": bool(e.get("skipped")),
                    }
                )
    return pts


# The ZeRO paper's model-state bytes per rank (Rajbhandari et al. 2020, Sec. 5: mixed precision and
# Adam, K = 12), Ψ parameters over N data-parallel ranks: ``parabench.theory.zero_paper_state_bytes``,
# restated because the report imports no training code.
ZERO_LINES = (
    ("DP: 16Ψ", lambda psi, n: 16 * psi),
    ("ZeRO-1: 4Ψ + 12Ψ/N", lambda psi, n: 4 * psi + 12 * psi / n),
    ("ZeRO-2: 2Ψ + 14Ψ/N", lambda psi, n: 2 * psi + 14 * psi / n),
    ("ZeRO-3: 16Ψ/N", lambda psi, n: 16 * psi / n),
)
# a measured pipeline bubble further than this from (p−1)/(m+p−1) is flagged
BUBBLE_TOLERANCE = 0.05
# options that add untimed, metered steps and leave the timed ones alone: a series' name and
# grouping ignore them, so a strategy's profiled and unprofiled points form one series
METER_OPTIONS = frozenset(
    {
        "step_breakdown",
        "memory_breakdown",
        "trace",
        "memory_snapshot",
        "telemetry",
        "timed_meters",
        "roofline",
        "record_timeline",
    }
)


def zero_line_rows(psi: float, ranks) -> list[dict]:
    """The four ZeRO lines at each data-parallel degree in ``ranks``: ``{line, ranks, bytes}``."""
    return [{"line": name, "ranks": n, "bytes": f(psi, n)} for name, f in ZERO_LINES for n in ranks]


def _case_dp(case: dict) -> int | None:
    opts = case.get("options") or {}
    world = case.get("world_size")
    split = (opts.get("pp") or 1) * (opts.get("tp") or 1)
    return world // split if isinstance(world, int) and isinstance(split, int) and split > 0 else None


def _breakdown_shares(r: dict) -> tuple[float | None, float | None]:
    """(communication, exposed communication) as fractions of the profiled step, mean over ranks
    (``parabench.meters.step_breakdown``); None without a complete breakdown."""
    parts = [pr.get("step_breakdown") for pr in r.get("per_rank") or []]
    parts = [b for b in parts if isinstance(b, dict)]
    if not parts:
        return None, None

    def share(key):
        vals = [(as_number(b.get(key)), as_number(b.get("step_s"))) for b in parts]
        if any(v is None or not s for v, s in vals):
            return None
        return sum(v / s for v, s in vals) / len(vals)

    return share("comm_s"), share("exposed_comm_s")


def scaling_rows(runs) -> list[dict]:
    """One row per case and scaling series it belongs to (``case.scaling``, ``parabench.suite``),
    ok cases only, with the series' efficiency against its smallest world size (N = 1 where the
    series has it; ``base_world_size`` says which):

    * strong (global batch fixed): t(N0)·N0 / (N·t(N)) on the median step time t;
    * weak (micro-batch per rank fixed): tokens/s per device at N over tokens/s per device at N0.

    Both are 1 for perfect scaling (with the tokens per step of each mode the two are the same
    ratio of tokens/s per device, computed here as each mode is defined). Beside them: the
    communication share of the profiled step (``step_breakdown``), rank 0's measured and analytic
    communication bytes per step, and the model-state bytes per rank, measured and the paper's.
    Options that only add metered steps (``METER_OPTIONS``) neither name nor split a series."""
    rows = []
    for idx, (manifest, records) in enumerate(runs):
        seed = usual_seed(records)
        for r in records:
            c = r.get("case") or {}
            modes = c.get("scaling") or []
            if r.get("status") != "ok" or not modes:
                continue
            d = case_row(manifest, r, registry=False)
            dp, mb, ga = _case_dp(c), c.get("micro_batch"), c.get("grad_accum") or 1
            gb = mb * ga * dp if isinstance(mb, int) and dp else None
            comm_share, exposed_share = _breakdown_shares(r)
            timed_as = {**c, "options": {k: v for k, v in (c.get("options") or {}).items() if k not in METER_OPTIONS}}
            for mode in modes:
                size = f"gb{gb}" if mode == "strong" else f"mb{mb}"
                recipe = recipe_name(str(d["precision"]), d["recipe"])
                rows.append(
                    {
                        "run": d["run"],
                        "run_idx": idx,
                        "label": r.get("label", ""),
                        "mode": mode,
                        "series": f"{variant(timed_as, seed)} {size}",
                        "strategy": str(d["strategy"]),
                        "kind": d["kind"],
                        "model": str(d["model"]),
                        "params": d["params"],
                        "precision": recipe,
                        "world_size": d["world_size"],
                        "dp": dp,
                        "micro_batch": mb,
                        "grad_accum": ga,
                        "global_batch": gb,
                        "step_time_ms": _ms(as_number(d.get("step_time_s_median"))),
                        "tokens_per_s_per_device": as_number(d.get("tokens_per_s_per_device")),
                        "comm_share_pct": _pct(comm_share),
                        "exposed_comm_share_pct": _pct(exposed_share),
                        "comm_bytes": as_number(d["comm_payload_bytes"]),
                        "theory_comm_bytes": as_number(d["theory_comm_bytes"]),
                        "state_bytes": as_number(d.get("model_state_bytes_max")),
                        "paper_state_bytes": as_number(dig(r, "theory", "paper_state_bytes")),
                        "peak_mem_bytes": as_number(d.get("peak_alloc_bytes")) or as_number(d.get("peak_rss_bytes")),
                    }
                )
    series: dict[tuple, list[dict]] = {}
    for row in rows:
        series.setdefault((row["run_idx"], row["mode"], row["model"], row["precision"], row["series"]), []).append(row)
    for members in series.values():
        timed = [m for m in members if m["step_time_ms"] and m["tokens_per_s_per_device"]]
        base = min(timed, key=lambda m: m["world_size"], default=None)
        for m in members:
            m["base_world_size"] = base["world_size"] if base else None
            m["efficiency_pct"] = None
            if base is None or m not in timed:
                continue
            if m["mode"] == "strong":
                eff = base["step_time_ms"] * base["world_size"] / (m["world_size"] * m["step_time_ms"])
            else:
                eff = m["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
            m["efficiency_pct"] = eff * 100
    rows.sort(key=lambda m: (m["run_idx"], m["params"] or 0, m["model"], m["mode"], m["series"], m["world_size"]))
    return rows


def _bubble_replay(r: dict, stages: list[dict]) -> dict | None:
    """The case's schedule replayed with its own measured op times and free messages
    (``parabench.pipeline_sim``), one replay per pipeline replica (ranks that differ only in their
    pipeline coordinate): the mean over all stages of the simulated bubble, with measured and with
    equal (per-kind mean) op times. None where any stage lacks a measured, timed schedule."""
    if not stages or any(s["measured"] is None for s in stages):
        return None
    coords_of = {pr.get("rank"): pr.get("coords") or {} for pr in r.get("per_rank") or []}
    replicas: dict[tuple, list[dict]] = {}
    for rank, p in pipeline_stages(r):
        coords = coords_of.get(rank, {})
        replicas.setdefault(tuple(sorted((k, v) for k, v in coords.items() if k != "pp")), []).append(p)
    try:
        replays = [pipeline_sim.replay(members) for members in replicas.values()]
    except (ValueError, TypeError, IndexError):  # a timeline that does not cover its order
        return None
    if not replays or None in replays:
        return None

    def mean_of(key):
        values = [b for rep in replays for b in rep[key]["bubble"]]
        return sum(values) / len(values)

    return {"simulated": mean_of("simulated"), "equal": mean_of("equal")}


def _timeline_step_ratio(r: dict, stages: list[dict]) -> float | None:
    """The step that recorded the timeline over the median timed step of rank 0: how far the ops
    whose times make the measured bubble ran slower than the timed ones. Its length is the whole
    step (``timeline_step_s``, longest rank) where the timeline had its own step (option
    ``record_timeline``), else the pipeline part of the instrumented step (longest stage's ``step_s``)."""
    own = [as_number(p.get("timeline_step_s")) for _, p in pipeline_stages(r)]
    lengths = own if any(t is not None for t in own) else [as_number(p.get("step_s")) for _, p in pipeline_stages(r)]
    timed = [t for t in dig(r, "per_rank", 0, "step_times_s", default=[]) if as_number(t)]
    if not stages or not timed or None in lengths:
        return None
    timed = sorted(timed)
    median = (timed[(len(timed) - 1) // 2] + timed[len(timed) // 2]) / 2
    return max(lengths) / median if median > 0 else None


def bubble_rows(runs) -> list[dict]:
    """One row per pipeline case: the measured bubble (idle share of each stage's step, mean and
    range over stages) against its schedule's theory as the stage recorded it ((p−1)/(m+p−1) for
    GPipe and 1F1B with p stages and m micro-batches); ``agrees`` is
    False where the mean differs by more than ``BUBBLE_TOLERANCE`` and None without a measurement
    (DeepSpeed's pipeline engine, or a GPU case without record_timeline, whose host clock saw launches
    only).

    Beside it, the decomposition ``measured = theory + op ratio + imbalance + residual`` from
    replaying the case's own schedule (``_bubble_replay``): op ratio = equal-stage simulation −
    theory (non-zero where the theory assumes T_F = T_B = T_W, as ZB-H1's default); imbalance =
    simulation with the measured op times − equal-stage simulation; residual = measured −
    simulated, what free messages miss (transfers, launches, host gaps between ops).
    ``agrees_simulated`` holds the same tolerance against the simulation."""
    out = []
    for idx, (manifest, records) in enumerate(runs):
        for r in records:
            if r.get("status") != "ok":
                continue
            stages = pipeline_rows(r)
            if not stages:
                continue
            p, m = stages[0]["stages"], stages[0]["microbatches"]
            # the stage's own schedule theory (interleaved and zero-bubble differ from 1F1B's)
            theory = (
                stages[0]["theory"]
                if stages[0]["theory"] is not None
                else (p - 1) / (m + p - 1)
                if isinstance(p, int) and isinstance(m, int) and m + p > 1
                else None
            )
            measured = [s["measured"] for s in stages if s["measured"] is not None]
            mean = sum(measured) / len(measured) if measured else None
            diff = mean - theory if mean is not None and theory is not None else None
            worst = (
                max((s for s in stages if s["measured"] is not None), key=lambda s: abs(s["measured"] - theory))
                if measured and theory is not None
                else None
            )
            replay = _bubble_replay(r, stages)
            simulated = replay["simulated"] if replay else None
            equal = replay["equal"] if replay else None
            residual = mean - simulated if mean is not None and simulated is not None else None
            out.append(
                {
                    "run": run_name(manifest),
                    "run_idx": idx,
                    "label": r.get("label", ""),
                    "model": dig(r, "case", "model"),
                    "strategy": dig(r, "case", "strategy"),
                    "world_size": dig(r, "case", "world_size"),
                    "schedule": stages[0]["schedule"],
                    "stages": p,
                    "microbatches": m,
                    "measured_stages": len(measured),
                    "measured_pct": _pct(mean),
                    "measured_min_pct": _pct(min(measured)) if measured else None,
                    "measured_max_pct": _pct(max(measured)) if measured else None,
                    "theory_pct": _pct(theory),
                    "difference_pct": _pct(diff),
                    "worst_stage": worst["stage"] if worst else None,
                    "worst_difference_pct": _pct(worst["measured"] - theory) if worst else None,
                    "agrees": None if diff is None else abs(diff) <= BUBBLE_TOLERANCE,
                    "equal_stages_pct": _pct(equal),
                    "simulated_pct": _pct(simulated),
                    "op_ratio_pct": _pct(equal - theory) if equal is not None and theory is not None else None,
                    "imbalance_pct": _pct(simulated - equal) if replay else None,
                    "residual_pct": _pct(residual),
                    "agrees_simulated": None if residual is None else abs(residual) <= BUBBLE_TOLERANCE,
                    "timeline_step_ratio": _timeline_step_ratio(r, stages),
                }
            )
    out.sort(key=lambda b: (b["run_idx"], str(b["model"]), b["stages"] or 0, b["microbatches"] or 0, b["label"]))
    return out
