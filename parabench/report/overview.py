"""The report's first screen: which strategy, at what cost.

Two questions, kept apart:

1. **Which production library** (``kind == "peer"``: torch.*, deepspeed.*) to use for a model, a
   device count and a precision recipe: the peers ranked by median tokens/s per device, beside
   what that speed costs (MFU, peak memory, tokens per joule). Cases are ranked only against
   cases of the same micro-batch: a larger micro-batch is a different trade (more memory for more
   speed), never a faster strategy.
2. **How close a from-scratch implementation gets** (``kind == "reference"``): each reference's
   tokens/s as a ratio to the fastest peer of the same model, device count, recipe and micro-batch.

No winner is declared where the measurements cannot tell two cases apart. With at least
``MIN_LAUNCHES`` launches on both sides, two cases tie when the intervals of their medians over
launches overlap (``parabench.stats.median_ci``, recorded in ``launch_stats``); with fewer, when
they differ by less than ``TIE_PCT`` (one launch says nothing about where the next lands: the
same deepspeed.zero3 case gave 15,282, 26,707 and 16,670 tok/s/GPU in three launches on 2x H100).
Ties are judged pairwise, so they need not be transitive: a case tied with the fastest shares
its rank, and a rank counts only the cases clearly faster than the one it labels.

Above the ranking, one row per group answers the question: the configuration chosen (the fastest,
and those it ties with), its time and energy per million tokens beside its peak memory.

CPU groups are not ranked by time: gloo timings on a shared CPU move with whatever else the host
runs (two smoke runs on one laptop put different libraries first). Their rows are ordered by what
is deterministic, the model-state bytes per rank and then the communication bytes per step; their
references are not set against a fastest peer; one sentence above the tables says so, and every
column of the first screen that a busy host moves says in its header that it is ``CPU_SPEED_LABEL``.

A run whose manifest shows a busy host (``busy_host``: other processes took at least
``BUSY_OTHER_CPU_PCT`` % of the host's CPU time over the run, or the load average before it began
was at least the host's CPU count) gets a warning at the top naming the figures.
"""

from __future__ import annotations

import math

from parabench.registry import pair_note

MIN_LAUNCHES = 3
TIE_PCT = 3.0
MILLION = 1e6
J_PER_WH = 3600.0


def on_cpu(r: dict) -> bool:
    """Whether the case ran on CPUs (gloo): its device name, else a roofline where GPUs have an MFU."""
    device = str(r.get("device") or "").lower()
    if device:
        return device.startswith("cpu")
    return r.get("mfu_pct") is None and r.get("roofline_pct") is not None


def per_million(r: dict) -> dict:
    """Seconds (all devices of the case together) and watt-hours (where telemetry recorded energy)
    to train on a million tokens."""
    tps, tpj = r.get("tokens_per_s"), r.get("tokens_per_j")
    return {
        "s_per_mtok": MILLION / tps if tps else None,
        "wh_per_mtok": MILLION / tpj / J_PER_WH if tpj else None,
    }


def group_key(r: dict) -> tuple:
    """What a ranking holds fixed: run, model and its layout, device count, precision recipe,
    micro-batch. A fused-qkv model is a different model: a reference on the separate layout is never
    set against a peer on the fused one."""
    layout = r.get("layout") or "separate"
    return (r["run_idx"], r["model"], layout, r["world_size"], r["precision"], r["micro_batch"])


def _tps(r: dict) -> float:
    return r["tokens_per_s_per_device"]


def interval(r: dict) -> tuple[float, float] | None:
    """The interval of the median tokens/s per device over launches, where there are enough of them."""
    low, high = r.get("tps_device_ci_low"), r.get("tps_device_ci_high")
    if (r.get("launches") or 0) >= MIN_LAUNCHES and low is not None and high is not None:
        return low, high
    return None


def tied(a: dict, b: dict) -> bool:
    """Whether these launches cannot tell the two cases' tokens/s per device apart."""
    ia, ib = interval(a), interval(b)
    if ia is not None and ib is not None:
        return ia[0] <= ib[1] and ib[0] <= ia[1]
    hi, lo = max(_tps(a), _tps(b)), min(_tps(a), _tps(b))
    return lo > 0 and (hi / lo - 1) * 100 < TIE_PCT


def basis(rs: list[dict]) -> str:
    """How a group was ranked, in words."""
    if all(interval(r) is not None for r in rs):
        return f"intervals over ≥{MIN_LAUNCHES} launches"
    if all((r.get("launches") or 1) <= 1 for r in rs):
        return f"one launch each: < {TIE_PCT:g} % is a tie"
    return f"< {MIN_LAUNCHES} launches for some: < {TIE_PCT:g} % is a tie"


def rank(rs: list[dict]) -> list[dict]:
    """The rows of one group, fastest first, each with ``rank`` (1 + the cases clearly faster),
    ``rank_text`` ("1", "1 (tie)", "3"), ``vs_fastest_pct`` and ``ranked_on``."""
    rs = sorted(rs, key=lambda r: -_tps(r))
    on = basis(rs)
    ranks = [1 + sum(1 for o in rs if _tps(o) > _tps(r) and not tied(o, r)) for r in rs]
    best = _tps(rs[0])
    out = []
    for r, k in zip(rs, ranks):
        shared = ranks.count(k) > 1
        out.append(
            {
                **r,
                "rank": k,
                "rank_text": f"{k} (tie)" if shared else str(k),
                "vs_fastest_pct": (_tps(r) / best - 1) * 100,
                "ranked_on": on,
            }
        )
    return out


def groups(rows: list[dict], kind: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["status"] == "ok" and r.get("kind") == kind and r["tokens_per_s_per_device"]:
            out.setdefault(group_key(r), []).append(r)
    return out


def _order(rows: list[dict]) -> tuple:
    return (
        rows[0]["run_idx"],
        rows[0]["params"] or 0,
        rows[0]["model"],
        rows[0]["world_size"] or 0,
        rows[0]["precision"],
        rows[0]["micro_batch"] or 0,
        (rows[0].get("layout") or "separate") != "separate",  # the default layout first
        rows[0].get("layout") or "",
    )


def _bytes_key(r: dict) -> tuple:
    big = float("inf")
    return (r.get("model_state_MiB") or big, r.get("comm_MiB") or big)


def _deterministic_order(rs: list[dict]) -> list[dict]:
    """A CPU group, unranked: least model state per rank first, then least communication."""
    out = sorted(rs, key=lambda r: (*_bytes_key(r), r["variant"]))
    return [
        {**r, "rank": None, "rank_text": "not ranked (CPU)", "vs_fastest_pct": None, "ranked_on": "CPU"} for r in out
    ]


def peer_rows(rows: list[dict]) -> list[dict]:
    """Every production-library case, ranked within its group (CPU groups ordered, not ranked);
    groups by run, model size, devices, recipe, micro-batch; ``group_start`` marks a group's first row."""
    out = []
    for rs in sorted(groups(rows, "peer").values(), key=_order):
        ranked = _deterministic_order(rs) if all(on_cpu(r) for r in rs) else rank(rs)
        for i, r in enumerate(ranked):
            out.append({**r, **per_million(r), "group_start": i == 0, "group_size": len(ranked)})
    return out


def choice_rows(peer: list[dict]) -> list[dict]:
    """One row per group of ``peer_rows``: the fastest case and those tied with it, with its time,
    energy and memory per million tokens; on CPU, no choice by time."""
    out = []
    for i, r in enumerate(peer):
        if not r["group_start"]:
            continue
        group = peer[i : i + r["group_size"]]
        if r["rank"] is None:
            by = CPU_CHOICE
            others = [o["variant"] for o in group[1:] if _bytes_key(o) == _bytes_key(r)]
        else:
            by = "median tokens/s per device"
            others = [o["variant"] for o in group[1:] if o["rank"] == 1]
        out.append(
            {**r, "chosen": r["variant"], "chosen_by": by, "ties": ", ".join(others) or "–", "group_start": False}
        )
    return out


def reference_rows(rows: list[dict]) -> list[dict]:
    """Every reference case beside the fastest peer of its group (none where no peer ran it); on CPU,
    where the fastest is the host's pick, beside none, in the order of its bytes."""
    peers = {k: max(rs, key=_tps) for k, rs in groups(rows, "peer").items()}
    out = []
    for key, rs in sorted(groups(rows, "reference").items(), key=lambda kv: _order(kv[1])):
        cpu = all(on_cpu(r) for r in rs)
        best = None if cpu else peers.get(key)
        ordered = (
            sorted(rs, key=lambda r: (*_bytes_key(r), r["variant"])) if cpu else sorted(rs, key=lambda r: -_tps(r))
        )
        for i, r in enumerate(ordered):
            verdict = "not judged (CPU)" if cpu else None
            if best is not None:
                verdict = "tie" if tied(r, best) else ("faster" if _tps(r) > _tps(best) else "slower")
            out.append(
                {
                    **r,
                    "group_start": i == 0,
                    "best_peer": best["variant"] if best else None,
                    "best_peer_tps": _tps(best) if best else None,
                    "ratio": _tps(r) / _tps(best) if best else None,
                    # where the pair is not like for like (group_key holds PAIRED_ON fixed)
                    "pair_note": pair_note(r, best) if best else None,
                    "verdict": verdict,
                    "ranked_on": basis([r, best]) if best else None,
                }
            )
    return out


# column key -> (header, format), as html.CASE_COLUMNS; the html module drops columns no row fills
GROUP_COLUMNS = [
    ("model", "model", "str"),
    ("world_size", "devices", "int"),
    ("precision", "recipe", "str"),
    ("micro_batch", "micro-batch", "int"),
]
PEER_COLUMNS = [
    ("rank_text", "rank", "str"),
    ("variant", "library strategy", "wrap"),
    ("tokens_per_s_per_device", "tok/s/device", "int"),
    ("tps_device_interval", "interval of the median (coverage)", "str"),
    ("vs_fastest_pct", "vs fastest %", "f1"),
    ("mfu_pct", "MFU %", "f1"),
    ("roofline_pct", "roofline % (CPU)", "f2"),
    ("peak_mem_GiB", "peak memory GiB", "f2"),
    ("s_per_mtok", "s per 1M tokens", "f1"),
    ("wh_per_mtok", "Wh per 1M tokens", "f2"),
    ("launches", "launches", "int"),
]
CPU_CHOICE = "least model state, then communication: gloo timings on a shared CPU are not a ranking"
CHOICE_COLUMNS = [
    ("chosen", "chosen library strategy", "wrap"),
    ("chosen_by", "chosen by", "wrap"),
    ("ties", "tied with it", "wrap"),
    ("tokens_per_s_per_device", "tok/s/device", "int"),
    ("s_per_mtok", "s per 1M tokens", "f1"),
    ("wh_per_mtok", "Wh per 1M tokens", "f2"),
    ("peak_mem_GiB", "peak memory GiB", "f2"),
    ("mfu_pct", "MFU %", "f1"),
]
REFERENCE_COLUMNS = [
    ("variant", "reference", "wrap"),
    ("tokens_per_s_per_device", "tok/s/device", "int"),
    ("best_peer", "fastest peer", "wrap"),
    ("best_peer_tps", "its tok/s/device", "int"),
    ("ratio", "ratio ref / peer", "f3"),
    ("pair_note", "not like for like", "wrap"),
    ("verdict", "verdict", "str"),
    ("mfu_pct", "MFU %", "f1"),
    ("peak_mem_GiB", "peak memory GiB", "f2"),
    ("launches", "launches", "int"),
]
PEER_NOTE = (
    "Production libraries (torch.*, deepspeed.*) only, ranked by median tokens/s per device within the "
    "same model and layout, device count, precision recipe and micro-batch (a thick line starts each group; "
    "different micro-batches are never ranked against each other). A tie: with ≥3 launches on both "
    "sides, the intervals of the medians over launches overlap; with fewer launches, the two differ by "
    "less than 3 %, because one launch cannot tell a smaller difference from launch-to-launch noise. "
    "Peak memory: the largest rank's allocator peak on GPUs, resident set on CPUs. Per 1M tokens: seconds "
    "on all the case's devices together, and watt-hours over the devices' energy (NVML), where recorded."
)
CHOICE_NOTE = (
    "The answer for each model, device count, recipe and micro-batch: the fastest production library "
    "(and those the launches cannot tell apart from it, ranked below), what a million tokens costs it in "
    "time (all its devices together) and energy, and its peak memory per device. On CPU: the least model "
    "state per rank, then the least communication, and those with the same bytes."
)
NO_ENERGY = "Energy: not recorded in this run (the power telemetry, NVML, exists on GPUs only)."
CPU_NOTE = (
    "CPU groups are not ranked: gloo timings on a shared CPU are not a ranking (they move with whatever "
    "else the host runs). Their rows are ordered by model-state bytes per rank, then communication bytes, "
    "which do not depend on the host's load; tokens/s is shown, not judged."
)
REFERENCE_NOTE = (
    "A separate question: how close does a from-scratch implementation (reference_impls/) get to the "
    "fastest production library of the same model, device count, recipe and micro-batch? Ratio above "
    "1: the reference is faster. Verdict by the same tie rule as above. Where the two reduce gradients "
    "in different dtypes (tuned FSDP2 reduces in fp32, as torchtitan does; the references in the "
    "compute dtype), the ratio says so."
)
CPU_REFERENCE_NOTE = (
    "On CPU no peer is the fastest (the host's load picks it): references are ordered by model-state "
    "bytes per rank, then communication bytes, and not judged."
)
# Columns whose values a busy host moves: on a CPU run their headers say that they are not a ranking.
SPEED_KEYS = frozenset(
    {
        "tokens_per_s_per_device",
        "tps_device_interval",
        "vs_fastest_pct",
        "mfu_pct",
        "roofline_pct",
        "s_per_mtok",
        "wh_per_mtok",
        "best_peer_tps",
        "ratio",
    }
)
CPU_SPEED_LABEL = "CPU: not a ranking"
CPU_TIMING_NOTE = (
    "Timings on CPU (gloo) are not a ranking: they move with whatever else the host runs (two smoke runs "
    "of the same code on one laptop, one busy and one quiet, put different libraries first), so CPU cases "
    "are ordered by model-state bytes per rank, then communication bytes, and their speed columns say "
    "so."
)

# A run's host was busy when processes outside the run took at least this share of every CPU's time
# over the run (on a 2-core laptop, 10 % is a fifth of a core, already enough to reorder gloo
# timings), or when the 1-minute load average read before the run's first launch was at least the
# host's CPU count (the end's counts the run's own ranks, so it is shown, not judged).
BUSY_OTHER_CPU_PCT = 10.0


def host_loads(manifest: dict) -> list[tuple[str, dict]]:
    """A run's ``host_load`` readings (``parabench.meters.host.run_host_load``), each with the
    invocation it covers: "" for the first, "resumed <when>" for each resumption."""
    loads = [("", manifest.get("host_load"))] + [
        (f"resumed {e.get('created_at') or '?'}", e.get("host_load"))
        for e in manifest.get("resumed") or []
        if isinstance(e, dict)
    ]
    return [(when, load) for when, load in loads if isinstance(load, dict)]


def _number(x) -> float | None:
    """``x`` as a finite float, or None: a manifest is shared, so anything may stand there."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return None
    try:
        x = float(x)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def _load_1min(load: dict, end: str) -> float | None:
    avg = load.get(f"load_average_{end}")
    return _number(avg[0]) if isinstance(avg, list) and avg else None


def busy_host(load: dict) -> str | None:
    """The figures that make ``load`` a busy host, in words, or None for a quiet one (or one with no figures)."""
    pct, other, wall = (_number(load.get(k)) for k in ("other_cpu_pct", "other_cpu_s", "wall_s"))
    cpus = _number(load.get("host_cpus"))
    start, end = _load_1min(load, "start"), _load_1min(load, "end")
    busy_cpu = pct is not None and pct >= BUSY_OTHER_CPU_PCT
    busy_load = start is not None and cpus is not None and start >= cpus
    if not (busy_cpu or busy_load):
        return None
    parts = []
    if pct is not None:
        cores = f" of {cpus:g} CPUs" if cpus else ""
        spent = f" ({other:,.0f} CPU-seconds in {wall:,.0f} s)" if other is not None and wall else ""
        parts.append(f"other processes took {pct:.0f} % of the CPU time{cores}{spent}")
    if start is not None:
        parts.append(f"1-minute load average {start:.1f} at the start" + (f", {end:.1f} at the end" if end else ""))
    return "; ".join(parts)


def host_load_text(manifest: dict) -> str | None:
    """A run's host load in words, for the environment table (None where the manifest has none)."""
    out = []
    for when, load in host_loads(manifest):
        pct, start, end = _number(load.get("other_cpu_pct")), _load_1min(load, "start"), _load_1min(load, "end")
        words = [f"other processes {pct:.1f} % of the CPU time" if pct is not None else "other processes: not read"]
        if start is not None:
            words.append(f"load average {start:.2f} → {end:.2f}" if end is not None else f"load average {start:.2f}")
        out.append((f"{when}: " if when else "") + ", ".join(words) + (" (busy)" if busy_host(load) else ""))
    return "; ".join(out) or None


def timing_notes(rows: list[dict], manifests: list[dict]) -> list[str]:
    """The sentences above the report's first table: that CPU timings are no ranking (when a case ran
    on CPU), and a warning for each run whose host was busy."""
    notes = [CPU_TIMING_NOTE] if any(r["status"] == "ok" and on_cpu(r) for r in rows) else []
    for m in manifests:
        for when, load in host_loads(m):
            figures = busy_host(load)
            if figures:
                notes.append(
                    f"Busy host during {m.get('suite')}/{m.get('run_id')}{f' ({when})' if when else ''}: "
                    f"{figures} (a busy host is "
                    f"≥ {BUSY_OTHER_CPU_PCT:g} % of the CPU time taken by other processes, or a load average "
                    "at the start of at least the CPU count). Its timings describe the host as much as the strategies."
                )
    return notes


def _speed_header(header: str) -> str:
    """ "tok/s/device (CPU: not a ranking)"; a header already marked "(CPU)" keeps one parenthesis."""
    if header.endswith("(CPU)"):
        return header.removesuffix("(CPU)") + f"({CPU_SPEED_LABEL})"
    return f"{header} ({CPU_SPEED_LABEL})"


def _label_speed(columns: list[tuple], cpu: bool) -> list[tuple]:
    return [(k, _speed_header(h) if cpu and k in SPEED_KEYS else h, f) for k, h, f in columns]


def first_screen(rows: list[dict]) -> list[dict]:
    """The first screen's tables as ``html._table`` keyword arguments (without the run column)."""
    specs = []
    peer = peer_rows(rows)
    if peer:
        cpu = any(r["rank"] is None for r in peer)
        energy = any(r["wh_per_mtok"] is not None for r in peer)
        specs.append(
            {
                "id_": "overview-choice",
                "title": "The answer: the configuration to choose, its time, energy and memory",
                "columns": GROUP_COLUMNS + _label_speed(CHOICE_COLUMNS, cpu),
                "rows": choice_rows(peer),
                "note": " ".join([CHOICE_NOTE] + ([] if energy else [NO_ENERGY])),
                "footer": CPU_NOTE if cpu else "",
            }
        )
        one_launch = sum(1 for r in peer if r["group_start"] and r["ranked_on"].startswith("one launch"))
        specs.append(
            {
                "id_": "overview",
                "title": "Which strategy, what cost: production libraries ranked",
                "columns": GROUP_COLUMNS + _label_speed(PEER_COLUMNS, cpu),
                "rows": peer,
                "note": PEER_NOTE + (" " + CPU_NOTE if cpu else ""),
                "footer": (
                    f"{one_launch} of {sum(1 for r in peer if r['group_start'])} groups are ranked from a single "
                    "launch per case: read their order as provisional (run with repeats = 3 for intervals)."
                    if one_launch
                    else ""
                ),
            }
        )
    refs = reference_rows(rows)
    if refs:
        cpu = any(on_cpu(r) for r in refs)
        specs.append(
            {
                "id_": "overview-references",
                "title": "How close is a from-scratch implementation: references against the fastest peer",
                "columns": GROUP_COLUMNS + _label_speed(REFERENCE_COLUMNS, cpu),
                "rows": refs,
                "note": REFERENCE_NOTE + (" " + CPU_REFERENCE_NOTE if cpu else ""),
            }
        )
    return specs
