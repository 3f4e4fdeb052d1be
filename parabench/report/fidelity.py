"""Report section: each library peer beside its minimal documentation script (``parabench fidelity``).

Reads ``<run>/fidelity/<case_hash>.json`` beside the run's case records (a pure function of the
result folders, like the rest of the report). Per peer case: tokens/s per device of the adapter and
of the script, their ratio (target: adapter >= 0.95x), peak memory of each (allocator peak on GPUs,
resident set on CPUs) and its ratio (target: adapter <= 1.05x), and the loss each reached at the
last timed step (same weights and data: they should agree to the precision's rounding).
"""

from __future__ import annotations

import json
from pathlib import Path

from parabench.stats import boot_ids, combine_launches, launch_values, median, ratio_ci

TPS_TARGET = 0.95  # adapter tokens/s over script tokens/s, at least
MEM_TARGET = 1.05  # adapter peak memory over script peak memory, at most
# A host-bound case's tokens/s follows its host's single-core speed, which differs between machines of
# one kind (the probe's floor 6.8 against 10.6 µs per dispatch) and, on one machine, from core to
# core and second to second (6.8-17.7 µs, two modes about 1.35x apart; results/studies/
# host-speed-h200x1). So the two sides of a ratio are judged on speed only when they ran on the same
# machine: both record its kernel boot id (``parabench.meters.host.boot_id``), and launches
# alternating on one machine see the same distribution of moments. Records from before the boot id
# fall back to the probe: medians over launches this much apart (slower over faster) count as apart.
HOST_SPEED_TOLERANCE = 1.15

COLUMNS = [
    ("label", "case", "str"),
    ("recipe", "recipe", "str"),
    ("status", "status", "str"),
    ("adapter_tps", "adapter tok/s/device", "int"),
    ("script_tps", "script tok/s/device", "int"),
    ("tps_ratio", "tok/s adapter / script", "f3"),
    ("tps_interval_text", "ratio interval (launches)", "str"),
    ("launches", "launches adapter / script", "str"),
    ("tps_ok", "≥ 0.95", "str"),
    ("window_ratio", "window tok/s adapter / script", "f3"),
    ("adapter_mem_MiB", "adapter peak MiB", "f1"),
    ("script_mem_MiB", "script peak MiB", "f1"),
    ("mem_ratio", "peak adapter / script", "f3"),
    ("mem_ok", "≤ 1.05", "str"),
    ("host_speed_text", "dispatch µs adapter / script", "str"),
    ("verdict", "verdict", "str"),
    ("adapter_loss", "adapter loss", "g4"),
    ("script_loss", "script loss", "g4"),
    ("script_optimizer", "script optimizer", "str"),
    ("choices_text", "where the script follows its library and the case does not", "wrap"),
    ("reason", "note", "wrap"),
]
NOTE = (
    "Each peer adapter beside a minimal training script written only from its library's documentation "
    "(parabench/fidelity/scripts, run by `parabench fidelity RUN`), same model, shapes, micro-batch, "
    "steps, seed, precision and recipe. Targets: the adapter at least 0.95x the script's tokens/s per "
    "device (median step, the slowest rank's) and at most 1.05x its peak memory (allocator peak on GPUs, "
    "resident set on CPUs, largest rank, timed steps). Both sides time alike: a device event after each "
    "step, no sync between steps, the median step of the slowest rank; beside it, the window ratio sets the "
    "timed steps' wall clock (one sync before the first, one after the last) of the two sides, which keeps the "
    "slow steps a median leaves out (host stalls, garbage collections, periodic syncs). Losses are at the last timed step. The scripts follow their "
    "library's reference recipe (torchtitan, DeepSpeed's docs); where that differs from the case's (pipeline "
    "split, context parallelism's parameter sharding), the last column names both. With several launches a "
    "side (`--repeats` for the adapter, `parabench fidelity --launches N` for the script) each figure is "
    "the median over launches, and the interval is the range the launch-to-launch spread allows for the "
    "ratio (distribution-free, its coverage in brackets). Cases of the 'matched' profile are shown but "
    "not judged: they align with the references, not with the library's best."
)


def script_launches(entry: dict) -> list[dict]:
    """The script's ok launches (their result dicts); an entry from before ``launches``: its one."""
    launches = [x.get("result") or {} for x in entry.get("launches") or []]
    return launches or ([entry["result"]] if entry.get("result") else [])


def ratios(record: dict, entry: dict) -> dict:
    """Adapter over script for tokens/s per device and peak memory, with the verdict against the
    targets (None where a figure is missing; not judged for the ``matched`` profile).

    ``record``: the case's record, or its launches combined (``parabench.stats.combine_launches``,
    as the report reads a run). With several launches a side the figures are medians over launches,
    and the tokens/s ratio carries the distribution-free interval of ``parabench.stats.ratio_ci``
    (pairwise launch ratios): the verdict is still on the median ratio, and the interval says how
    far launch-to-launch spread could move it."""
    m = record.get("metrics") or {}
    a_tps_all = launch_values(record, "tokens_per_s_per_device")
    results = script_launches(entry)
    s_tps_all = [s["tokens_per_s_per_device"] for s in results if s.get("tokens_per_s_per_device")]
    s_mem_all = [s["peak_memory_bytes"] for s in results if s.get("peak_memory_bytes")]
    a_tps, s_tps = (median(a_tps_all) if a_tps_all else None), (median(s_tps_all) if s_tps_all else None)
    a_mem = m.get("peak_alloc_bytes") or m.get("peak_rss_bytes")  # combined: the median where it moves
    s_mem = median(s_mem_all) if s_mem_all else None
    tps_ratio = a_tps / s_tps if a_tps and s_tps else None
    a_win_all = launch_values(record, "window_tokens_per_s_per_device")
    s_win_all = [s["window_tokens_per_s_per_device"] for s in results if s.get("window_tokens_per_s_per_device")]
    a_win, s_win = (median(a_win_all) if a_win_all else None), (median(s_win_all) if s_win_all else None)
    mem_ratio = a_mem / s_mem if a_mem and s_mem else None
    interval = None
    if len(a_tps_all) >= 2 and len(s_tps_all) >= 2:
        _, low, high, coverage = ratio_ci(a_tps_all, s_tps_all)
        interval = {"low": low, "high": high, "coverage": coverage}
    tps_ok = tps_ratio >= TPS_TARGET if tps_ratio is not None else None
    mem_ok = mem_ratio <= MEM_TARGET if mem_ratio is not None else None
    a_us, s_us = host_dispatch_us(record), median(s_us_all) if (s_us_all := script_dispatch_us(results)) else None
    a_boot, s_boot = boot_ids(record), script_boot_ids(results)
    if a_boot and s_boot:
        hosts_apart = a_boot != s_boot
    else:
        hosts_apart = bool(a_us and s_us and max(a_us, s_us) / min(a_us, s_us) > HOST_SPEED_TOLERANCE)
    if ((record.get("case") or {}).get("options") or {}).get("profile") == "matched":
        verdict = "not judged (matched profile)"
    elif hosts_apart:
        verdict = "fail (memory)" if mem_ok is False else "speed not judged (hosts apart)"
    elif tps_ok is None or mem_ok is None:
        verdict = None
    else:
        verdict = "pass" if tps_ok and mem_ok else "fail"
    return {
        "adapter_tps": a_tps,
        "script_tps": s_tps,
        "tps_ratio": tps_ratio,
        "tps_interval": interval,
        "launches": f"{len(a_tps_all)} / {len(s_tps_all)}",
        "tps_ok": tps_ok,
        "adapter_window_tps": a_win,
        "script_window_tps": s_win,
        "window_ratio": a_win / s_win if a_win and s_win else None,
        "adapter_mem": a_mem,
        "script_mem": s_mem,
        "mem_ratio": mem_ratio,
        "mem_ok": mem_ok,
        "adapter_dispatch_us": a_us,
        "script_dispatch_us": s_us,
        "host_speed_text": f"{a_us:.1f} / {s_us:.1f}" if a_us and s_us else "",
        "same_machine": (a_boot == s_boot) if a_boot and s_boot else None,
        "verdict": verdict,
    }


def host_dispatch_us(record: dict) -> float | None:
    """The adapter's host probe before its timed steps (slowest rank), median over its launches."""
    values = launch_values(record, "host_dispatch_us_max")
    return median(values) if values else None


def script_boot_ids(results: list[dict]) -> list[str]:
    """The machines the script's launches ran on (their ranks' kernel boot ids), sorted."""
    return sorted({b for r in results for h in r.get("host_per_rank") or [] if (b := h.get("boot_id"))})


def script_dispatch_us(results: list[dict]) -> list[float]:
    """Each script launch's host probe before its timed steps, the slowest rank's."""
    out = []
    for result in results:
        ranks = [(h.get("dispatch_us") or {}).get("before") for h in result.get("host_per_rank") or []]
        ranks = [v for v in ranks if isinstance(v, (int, float)) and v > 0]
        if ranks:
            out.append(max(ranks))
    return out


def interval_text(interval: dict | None) -> str:
    if not interval:
        return "–"
    return f"{interval['low']:.3f}–{interval['high']:.3f} ({interval['coverage']:.0%})"


def choices_text(result: dict) -> str:
    """The script's departures from the case (``result["choices"]``: {name: {script, case, source}})
    as one line each."""
    lines = []
    for name, c in sorted((result.get("choices") or {}).items()):
        if isinstance(c, dict):
            lines.append(f"{name}: script {c.get('script')}; case {c.get('case')} ({c.get('source')})")
    return "\n".join(lines)


def _adapter_loss_at_last_timed_step(record: dict):
    losses = (record.get("metrics") or {}).get("losses") or []
    case = record.get("case") or {}
    i = case.get("warmup", 0) + case.get("steps", 0) - 1
    return losses[i] if 0 <= i < len(losses) else None


def _mib(v):
    return v / 2**20 if v else None


def fidelity_rows(run_dirs: list[Path], runs) -> list[dict]:
    rows = []
    for run_dir, (manifest, records) in zip(run_dirs, runs):
        folder = Path(run_dir) / "fidelity"
        if not folder.is_dir():
            continue
        by_hash = {r.get("case_hash"): r for r in combine_launches(records)}
        for path in sorted(folder.glob("*.json")):
            try:
                entry = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                rows.append({"label": path.name, "status": "unreadable", "reason": str(exc)})
                continue
            if not isinstance(entry, dict):
                continue
            record = by_hash.get(entry.get("case_hash"), {})
            r = ratios(record, entry)
            result = entry.get("result") or {}
            rows.append(
                {
                    "run": f"{manifest.get('suite')}/{manifest.get('run_id')}",
                    "label": entry.get("label") or record.get("label"),
                    "recipe": entry.get("recipe") or "–",
                    "status": entry.get("status"),
                    **r,
                    "tps_interval_text": interval_text(r["tps_interval"]),
                    "adapter_mem_MiB": _mib(r["adapter_mem"]),
                    "script_mem_MiB": _mib(r["script_mem"]),
                    "adapter_loss": _adapter_loss_at_last_timed_step(record) if record else None,
                    "script_loss": result.get("final_loss"),
                    "script_optimizer": (result.get("config") or {}).get("optimizer"),
                    "choices_text": choices_text(result),
                    "reason": entry.get("reason") or ("no case record with this hash" if not record else ""),
                }
            )
    return rows


def table_specs(run_dirs: list[Path], runs, run_col: list) -> list[dict]:
    """The section's table as keyword arguments of ``parabench.report.html._table`` (none without
    fidelity results)."""
    rows = fidelity_rows(run_dirs, runs)
    if not rows:
        return []
    return [
        {
            "id_": "peer-fidelity",
            "title": "Peer fidelity: each adapter against its library's documented minimal script",
            "columns": run_col + COLUMNS,
            "rows": rows,
            "note": NOTE,
            "row_class": lambda r: (
                "bad-row"
                if str(r.get("verdict") or "").startswith("fail") or r.get("status") not in ("ok", "skipped")
                else ""
            ),
        }
    ]
