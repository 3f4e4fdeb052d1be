"""Every figure parabench reports, derived once from the raw per-rank measurements.

Names carry their units. Conventions:
- ``step_time_s``: per step, the slowest rank's duration (a step ends when every rank ends it);
  the summary is the median over timed steps, with p10/p90 and min/max as spread.
- ``tokens_per_s``: global (all data-parallel replicas) = global batch x seq_len / median step time;
  ``tokens_per_s_per_device`` divides by the world size.
- ``timed_window_s_max``: the timed steps' wall clock, from one device sync before the first to one
  after the last, the slowest rank's; ``window_tokens_per_s`` and ``window_tokens_per_s_per_device``
  are the timed tokens over it. The step times (device events, no sync between steps) add up to
  about the window, but their median leaves out slow steps (a host stall, a garbage collection, a
  periodic sync) that the window keeps. None in records made before it was measured.
- ``mfu``: model FLOPs (``parabench.models.FLOPS_CONVENTION``) per second per device over the
  device's dense peak; None where the peak is unknown (CPUs), where ``roofline_fraction``
  (over a matmul rate measured on the spot) is given instead.
- ``hfu``: as ``mfu`` but over hardware FLOPs, which count the recomputation of activation
  checkpointing (``parabench.models.HFU_CONVENTION``); equal to ``mfu`` without it.
- ``first_step_s_max``: the first warm-up step (slowest rank), timed apart from the timed steps;
  ``compile_s`` (cases with option ``compile``): that step minus ``step_time_s_median``.
- ``host_dispatch_us_max``: the slowest host of the launch, the largest of the ranks' probes
  (``parabench.meters.host``: µs to issue one tiny op, before the warm-up and after the timed
  steps); None in records made before it was measured.
- ``host_involuntary_switches_per_step_max`` and ``host_thread_cpu_share_max``: over the timed steps,
  the ranks' main threads' context switches forced by other threads or processes, per step, and their
  CPU seconds over the wall seconds (``parabench.meters.host.cpu_use``), the largest rank's; None
  in records made before they were measured, and on platforms without per-thread accounting.
- ``host_foreign_cpu_share_max`` and ``host_load_average_max``: the CPUs other processes kept busy
  during the timed steps and the load average after them (:func:`foreign_load`), so a slow or
  scattered launch on a shared host can be told from a slow strategy.
- ``host_steal_cpu_share_max``: the CPUs' worth of time the hypervisor took from the (virtual)
  host during the timed steps (/proc/stat's steal), the largest rank's reading: a host-bound
  launch slowed by busy neighbours on the physical machine shows here and nowhere else; 0 on bare
  metal, None where it was not read.
- ``host_gc_pause_s_per_step_max`` and ``host_gc_full_collections_max``: over the timed steps, the
  seconds per step a rank's process spent in Python's garbage collector and its full (generation 2)
  collections (``parabench.meters.host.GcPauses``), the largest rank's; None in records made before
  they were measured.
- ``pipeline_stage_imbalance``: the slowest pipeline stage's compute seconds over the stages' mean
  (each stage's slowest rank), on the step its pipeline stats describe (``reference_impls.pipeline``
  ``StageClock``: the timeline step of option ``record_timeline`` on a GPU, the last step on a CPU);
  1.0 is balanced, and a pipeline runs at its slowest stage's pace. None without a pipeline, and on
  a GPU where the stats timed kernel launches only.
- Memory: the maximum over ranks of each rank's peak during the timed steps.
- ``loss_scale`` (fp16 only, else None): see :func:`loss_scale_summary`; the fp16-vs-fp32 loss
  deviation of two records of the same case is :func:`loss_deviation` (for the report).
"""

from __future__ import annotations

import statistics

from parabench.shapes import (
    FLOPS_CONVENTION,
    HFU_CONVENTION,
    MOE_FLOPS_CONVENTION,
    hardware_flops_per_token,
    model_flops_per_token,
    parameter_count,
)


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def step_times_over_ranks(per_rank: list[dict]) -> list[float]:
    return [max(ts) for ts in zip(*(r["step_times_s"] for r in per_rank))]


def losses_over_ranks(per_rank: list[dict]) -> list[float | None]:
    """Per step, the mean loss of the ranks that see it (every dp replica's last stage)."""
    out = []
    for vals in zip(*(r["losses"] for r in per_rank)):
        seen = [v for v in vals if v is not None]
        out.append(sum(seen) / len(seen) if seen else None)
    return out


def summarize(case, raw: dict) -> dict:
    """The record's ``metrics`` section from the worker's gathered measurements."""
    cfg = case.model_config()
    per_rank = raw["per_rank"]
    steps = step_times_over_ranks(per_rank)
    median = statistics.median(steps)
    tokens_per_step = case.global_batch * cfg.seq_len
    world = case.world_size
    flops_per_token = model_flops_per_token(cfg)
    achieved = tokens_per_step / median * flops_per_token / world
    peak = raw.get("peak_flops_per_device")
    roof = raw.get("matmul_roofline_flops")

    def mem(key):
        vals = [r["memory"].get(key) for r in per_rank]
        vals = [v for v in vals if v is not None]
        return max(vals) if vals else None

    state_total = [sum(v for v in r["state_bytes"].values() if v is not None) for r in per_rank]
    losses = losses_over_ranks(per_rank)
    hw_flops_per_token = hardware_flops_per_token(cfg, bool(case.options.get("activation_checkpointing")))
    hw_achieved = tokens_per_step / median * hw_flops_per_token / world
    return {
        "step_time_s_median": median,
        "step_time_s_p10": _quantile(steps, 0.1),
        "step_time_s_p90": _quantile(steps, 0.9),
        "step_time_s_min": min(steps),
        "step_time_s_max": max(steps),
        "step_times_s": steps,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / median,
        "tokens_per_s_per_device": tokens_per_step / median / world,
        **window_summary(per_rank, tokens_per_step * len(steps), world),
        "model_flops_per_token": flops_per_token,
        "model_flops_per_s_per_device": achieved,
        "peak_flops_per_device": peak,
        "mfu": achieved / peak if peak else None,
        "hardware_flops_per_token": hw_flops_per_token,
        "hardware_flops_per_s_per_device": hw_achieved,
        "hfu": hw_achieved / peak if peak else None,
        "hfu_convention": HFU_CONVENTION,
        "matmul_roofline_flops": roof,
        "roofline_fraction": achieved / roof if roof else None,
        "peak_alloc_bytes": mem("peak_alloc_bytes"),
        "peak_requested_bytes": mem("peak_requested_bytes"),
        "peak_reserved_bytes": mem("peak_reserved_bytes"),
        "device_used_bytes": mem("device_used_bytes"),
        "peak_rss_bytes": mem("peak_rss_bytes"),
        "model_state_bytes_max": max(state_total),
        "losses": losses,
        "final_loss": next((l for l in reversed(losses) if l is not None), None),
        "setup_s_max": max(r["setup_s"] for r in per_rank),
        **first_step_summary(case, per_rank, median),
        "host_dispatch_us_max": host_dispatch_max(per_rank),
        "host_involuntary_switches_per_step_max": largest_rank(
            per_rank, "host_cpu", lambda c: c["involuntary_switches_per_step"]
        ),
        "host_thread_cpu_share_max": largest_rank(per_rank, "host_cpu", lambda c: c["thread_cpu_share"]),
        **foreign_load(per_rank),
        "host_steal_cpu_share_max": host_steal_max(per_rank),
        "host_gc_pause_s_per_step_max": largest_rank(per_rank, "host_gc", lambda g: g["pause_s_per_step"]),
        "host_gc_full_collections_max": largest_rank(per_rank, "host_gc", lambda g: g["collections_by_generation"][2]),
        "loss_scale": loss_scale_summary(raw.get("loss_scale")),
        "pipeline_stage_imbalance": pipeline_stage_imbalance(per_rank),
        **telemetry_summary(per_rank, tokens_per_step * len(steps)),
    }


def stage_compute_s(stats: list[dict | None]) -> dict[int, float] | None:
    """Each pipeline stage's compute seconds (its slowest rank's) from the ranks' pipeline stats;
    None unless every rank's stats timed the device's work (``bubble_fraction_measured`` is None
    where they timed launches only) and carry ``compute_s`` (records made before it lack it), and
    there are two stages or more."""
    if not stats or any(
        not p
        or p.get("bubble_fraction_measured") is None
        or not isinstance(p.get("compute_s"), (int, float))
        or not isinstance(p.get("stage"), int)
        for p in stats
    ):
        return None
    by_stage: dict[int, float] = {}
    for p in stats:
        by_stage[p["stage"]] = max(by_stage.get(p["stage"], 0.0), p["compute_s"])
    return by_stage if len(by_stage) > 1 else None


def pipeline_stage_imbalance(per_rank: list[dict]) -> float | None:
    """Largest over mean of the stages' compute seconds (module docstring, ``stage_compute_s``)."""
    by_stage = stage_compute_s([r.get("pipeline") for r in per_rank])
    if not by_stage:
        return None
    mean = sum(by_stage.values()) / len(by_stage)
    return max(by_stage.values()) / mean if mean > 0 else None


def window_summary(per_rank: list[dict], timed_tokens: int, world: int) -> dict:
    """``timed_window_s_max`` (the slowest rank's) and the window's tokens/s, global and per device;
    None unless every rank measured its window."""
    windows = [r.get("timed_window_s") for r in per_rank]
    if not windows or any(not isinstance(w, (int, float)) or w <= 0 for w in windows):
        return {"timed_window_s_max": None, "window_tokens_per_s": None, "window_tokens_per_s_per_device": None}
    window = max(windows)
    return {
        "timed_window_s_max": window,
        "window_tokens_per_s": timed_tokens / window,
        "window_tokens_per_s_per_device": timed_tokens / window / world,
    }


def first_step_summary(case, per_rank: list[dict], median_step_s: float) -> dict:
    """``first_step_s_max``: the first warm-up step, slowest rank (None without warm-up, or in
    records made before it was measured). ``compile_s`` (option ``compile`` only, else None): that
    step minus the median timed step, the time torch.compile's compilation added to the run."""
    firsts = [r.get("first_step_s") for r in per_rank]
    first = max(firsts) if firsts and all(f is not None for f in firsts) else None
    compiled = bool(case.options.get("compile")) and first is not None
    return {"first_step_s_max": first, "compile_s": first - median_step_s if compiled else None}


def foreign_load(per_rank: list[dict]) -> dict:
    """``host_foreign_cpu_share_max``: the CPUs that processes other than this launch's ranks kept
    busy during the timed steps, the largest over ranks: a rank's ``other_cpu_share`` (the host's
    busy CPU time not its own, ``parabench.meters.host``) less the other ranks' own CPU use, which on
    one host is part of it. ``host_load_average_max``: the largest 1-minute load average read at the
    end of the timed steps. None for records made before the host's busy time was read. Ranks on
    other nodes are subtracted too, so on several nodes the figure errs low, never high."""
    cpu = [r.get("host_cpu") or {} for r in per_rank]
    if not cpu or any(c.get("other_cpu_share") is None for c in cpu):
        return {"host_foreign_cpu_share_max": None, "host_load_average_max": None}
    total_own = sum(c["process_cpu_share"] for c in cpu)
    foreign = max(max(0.0, c["other_cpu_share"] - (total_own - c["process_cpu_share"])) for c in cpu)
    loads = [c["load_average"][1][0] for c in cpu if (c.get("load_average") or [None, None])[1]]
    return {"host_foreign_cpu_share_max": foreign, "host_load_average_max": max(loads) if loads else None}


def host_steal_max(per_rank: list[dict]) -> float | None:
    """The largest rank's ``steal_cpu_share`` (``parabench.meters.host``); None unless every rank read it."""
    return largest_rank(per_rank, "host_cpu", lambda c: c.get("steal_cpu_share"))


def host_dispatch_max(per_rank: list[dict]) -> float | None:
    probes = [p["dispatch_us"] for r in per_rank for p in (r.get("host_probe") or {}).values()]
    return max(probes) if probes else None


def largest_rank(per_rank: list[dict], section: str, read) -> float | None:
    """The largest rank's ``read(rank[section])`` (a host meter's reading over the timed steps:
    ``host_cpu``, ``host_gc``); None unless every rank has the section and a reading in it (records
    made before a reading existed)."""
    vals = [read(r[section]) for r in per_rank if r.get(section)]
    return max(vals) if vals and len(vals) == len(per_rank) and None not in vals else None


def lowest_or_highest(rows: list[dict], key: str, pick) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return pick(vals) if vals else None


def telemetry_summary(per_rank: list[dict], timed_tokens: int) -> dict:
    """Energy, power and clocks over the timed steps (``meters.telemetry``), over all ranks:
    ``energy_j`` sums the devices, ``tokens_per_j`` is the timed tokens over it, ``power_w_mean`` is
    per device, clocks are the lowest rank's, ``throttled`` is True when any rank saw a clocks
    event that holds the clocks down. Empty where no rank had telemetry (CPUs)."""
    tel = [r.get("telemetry") for r in per_rank]
    if not tel or any(t is None for t in tel):
        return {}
    energy = [t["energy_j"] for t in tel]
    energy_j = sum(energy) if all(e is not None for e in energy) else None

    def lowest(key):
        return lowest_or_highest(tel, key, min)

    power = [t["power_w_mean"] for t in tel if t.get("power_w_mean") is not None]
    from parabench.meters.telemetry import THROTTLING

    reasons = sorted({r for t in tel for r in t.get("clocks_event_reasons") or []})
    return {
        "energy_j": energy_j,
        "tokens_per_j": timed_tokens / energy_j if energy_j else None,
        "power_w_mean": sum(power) / len(power) if power else None,
        "sm_clock_mhz_median_min": lowest("sm_clock_mhz_median"),
        "sm_clock_mhz_min": lowest("sm_clock_mhz_min"),
        "gpu_util_pct_mean_min": lowest("gpu_util_pct_mean"),
        "clocks_event_reasons": reasons,
        "throttled": any(r in THROTTLING for r in reasons),
        "power_capped_fraction_max": lowest_or_highest(tel, "power_capped_fraction", max),
    }


def loss_scale_summary(steps: list[dict] | None) -> dict | None:
    """Per-case summary of the per-step loss-scale entries (``{scale, scale_used, overflow, skipped}``
    per step, as the worker records them for fp16 cases); None for other cases.

    ``steps_to_recover``: for each overflow episode (a run of consecutive skipped steps), how many
    steps passed before an update was applied again (the episode's length). ``steps_to_regain_scale``:
    for each episode, steps from its first skip until the scale is back at the scale used just
    before it, None if the run ended first (growth takes ``growth_interval`` clean steps per doubling).
    """
    if not steps or not any(isinstance(e, dict) and e.get("scale") is not None for e in steps):
        return None
    entries = [e for e in steps if isinstance(e, dict) and e.get("scale") is not None]
    scales = [e["scale"] for e in entries]
    skipped = [bool(e.get("skipped")) for e in entries]
    episodes, regain, i = [], [], 0
    while i < len(entries):
        if not skipped[i]:
            i += 1
            continue
        j = i
        while j < len(entries) and skipped[j]:
            j += 1
        episodes.append(j - i if j < len(entries) else None)  # None: never recovered within the run
        before = entries[i].get("scale_used", scales[i])
        back = next((k for k in range(i, len(entries)) if scales[k] >= before and not skipped[k]), None)
        regain.append(None if back is None else back - i + 1)
        i = j
    return {
        "steps": len(entries),
        "skipped_steps": sum(skipped),
        "overflow_steps": sum(bool(e.get("overflow")) for e in entries),
        "scale_min": min(scales),
        "scale_max": max(scales),
        "scale_initial": entries[0].get("scale_used", scales[0]),
        "scale_final": scales[-1],
        "steps_to_recover": episodes,
        "steps_to_regain_scale": regain,
    }


def loss_deviation(record: dict, reference: dict) -> dict | None:
    """Loss deviation of ``record`` (e.g. an fp16 run) from ``reference`` (the fp32 run of the same
    case), step by step over the steps both have: ``per_step_rel`` |a - b| / |b|, ``max_rel``,
    ``final_rel``, ``mean_rel``. None when either has no losses. For the report, with two records."""
    a = ((record or {}).get("metrics") or {}).get("losses") or []
    b = ((reference or {}).get("metrics") or {}).get("losses") or []
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None and y != 0]
    if not pairs:
        return None
    rel = [abs(x - y) / abs(y) for x, y in pairs]
    return {
        "per_step_rel": rel,
        "max_rel": max(rel),
        "final_rel": rel[-1],
        "mean_rel": sum(rel) / len(rel),
        "precision": ((record or {}).get("case") or {}).get("precision"),
        "reference_precision": ((reference or {}).get("case") or {}).get("precision"),
    }


def model_section(case) -> dict:
    cfg = case.model_config()
    return {
        "name": case.model,
        "config": cfg.to_dict(),
        "params": parameter_count(cfg),
        "tied_head": False,
        "flops_per_token": model_flops_per_token(cfg),
        "flops_convention": MOE_FLOPS_CONVENTION if getattr(cfg, "n_experts", 0) else FLOPS_CONVENTION,
    }


def check_against_theory(theory: dict | None, per_rank: list[dict], allowance: float = 0.01) -> dict:
    """Measured vs expected: communication payload per kind (rank 0's instrumented step),
    model-state bytes per rank, and where the theory gives them NVMe bytes read and written per
    step. ``ok`` is False when any ratio is off by more than ``allowance``."""
    if not theory:
        return {"available": False}
    out: dict = {"available": True, "allowance": allowance}
    # Pipeline stages and expert-parallel ranks move different volumes: where the theory gives
    # one expectation per rank, every rank is checked against its own; else rank 0 stands for all.
    per_rank_exp = theory.get("comm_payload_bytes_per_rank")
    if (
        per_rank_exp is not None
        and all(e is not None for e in per_rank_exp)
        and all(r.get("comm") is not None for r in per_rank)
    ):
        ranks = [_comm_rows(per_rank_exp[r["rank"]], r["comm"], allowance) for r in per_rank]
        out["comm"] = ranks[0]
        out["comm_per_rank"] = ranks
        out["comm_ok"] = all(row["ok"] for rows in ranks for row in rows.values())
    elif theory.get("comm_payload_bytes") is not None and per_rank[0].get("comm") is not None:
        out["comm"] = _comm_rows(theory["comm_payload_bytes"], per_rank[0]["comm"], allowance)
        out["comm_ok"] = all(r["ok"] for r in out["comm"].values())
    state_exp = theory.get("state_bytes")
    if state_exp is not None:
        rows = []
        for r in per_rank:
            exp = state_exp if not isinstance(state_exp, list) else state_exp[r["rank"]]
            row = {}
            for k, e in exp.items():
                m = r["state_bytes"].get(k)
                row[k] = {"expected_bytes": e, "measured_bytes": m, "ok": m is None or e is None or m == e}
            rows.append(row)
        out["state"] = rows
        out["state_ok"] = all(v["ok"] for row in rows for v in row.values())
    nvme_exp = theory.get("nvme_io_bytes_per_step")
    nvme_meas = (per_rank[0].get("strategy_stats") or {}) if per_rank else {}
    if nvme_exp and nvme_meas.get("nvme_read_bytes_per_step") is not None:
        # ZeRO-Infinity's disk traffic, rank 0's measured bytes per timed step (peers.deepspeed_nvme)
        out["nvme_io"] = _comm_rows(
            nvme_exp,
            {"by_kind": {k: {"payload_bytes": nvme_meas[f"nvme_{k}_bytes_per_step"]} for k in nvme_exp}},
            allowance,
        )
        out["nvme_io_ok"] = all(r["ok"] for r in out["nvme_io"].values())
    act_exp = theory.get("activation_checkpoint_bytes")
    act_meas = nvme_meas.get("activation_checkpoint_bytes")
    if act_exp and act_meas is not None:
        # ZeRO-R's activation checkpoints held at the peak, by place (device or host), rank 0: exact
        out["activation_checkpoints"] = {"expected_bytes": act_exp, "measured_bytes": act_meas}
        out["activation_checkpoints_ok"] = act_meas == act_exp
    out["ok"] = (
        out.get("comm_ok", True)
        and out.get("state_ok", True)
        and out.get("nvme_io_ok", True)
        and out.get("activation_checkpoints_ok", True)
    )
    return out


def _comm_rows(comm_exp: dict, comm_meas: dict, allowance: float) -> dict:
    """Per kind: expected (a number, or a documented [low, high] range) and measured payload."""
    rows = {}
    for k in sorted(set(comm_exp) | set(comm_meas["by_kind"])):
        exp = comm_exp.get(k, 0)
        meas = comm_meas["by_kind"].get(k, {}).get("payload_bytes", 0)
        if isinstance(exp, (list, tuple)):
            lo, hi = exp
            rows[k] = {
                "expected_bytes": [lo, hi],
                "measured_bytes": meas,
                "ratio": meas / hi if hi else None,
                "ok": lo * (1 - allowance) <= meas <= hi * (1 + allowance),
            }
            continue
        ratio = meas / exp if exp else (None if meas == 0 else float("inf"))
        rows[k] = {
            "expected_bytes": exp,
            "measured_bytes": meas,
            "ratio": ratio,
            "ok": (meas == 0) if not exp else abs(ratio - 1) <= allowance,
        }
    return rows
