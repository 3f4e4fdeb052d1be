"""Report sections: run-to-run spread of repeated cases, and reference/peer ratios with intervals.

A case counts as repeated when it has several launches (``repeats``: records combined by
``parabench.stats.combine_launches``, one sample per launch), when several finished records share
everything but the seed (a suite repeats cases with ``seed = [1, 2]``) or when the very same case
hash appears in several runs of the report. Different seeds draw different (equally learnable)
data and initial weights, which does not change the work of a step, so all of these are samples of
the noise a reader should hold every other comparison in the report against: the table gives their
median with its distribution-free interval (``parabench.stats.median_ci``) and their coefficient of
variation.

The ratio table sets each reference implementation beside the peers that do the same thing (the
production peers its registry row names) on the same case shape, with the interval of the ratio of
their launch medians (``parabench.stats.ratio_ci``), for pairs with at least two launches on each side.
"""

from __future__ import annotations

import json
import statistics

from parabench.registry import can_pair, pair_facts, pair_note
from parabench.report.frames import dig, run_name
from parabench.stats import finite, launch_values, median_ci, ratio_ci

COLUMNS = [
    ("label", "case", "str"),
    ("n", "samples", "int"),
    ("seeds", "seeds", "str"),
    ("runs", "runs", "str"),
    ("tokens_per_s_median", "tok/s median", "int"),
    ("tokens_per_s_ci_low", "interval low", "int"),
    ("tokens_per_s_ci_high", "interval high", "int"),
    ("ci_coverage_pct", "coverage %", "f1"),
    ("tokens_per_s_min", "tok/s min", "int"),
    ("tokens_per_s_max", "tok/s max", "int"),
    ("spread_pct", "spread % (max-min)/mean", "f2"),
    ("cv_pct", "CV %", "f2"),
    ("peak_alloc_spread_pct", "peak memory spread %", "f2"),
    ("host_dispatch_us_range", "host µs/op, min – max", "str"),
    ("gpu_busy_pct_range", "GPU busy %, min – max", "str"),
    ("host_switches_range", "forced switches/step, min – max", "str"),
    ("host_gc_ms_range", "Python GC ms/step, min – max", "str"),
]
NOTE = (
    "Cases measured more than once in these runs: separate launches of the same case (repeats), other "
    "seeds (same work, other data and initial weights) or the same case hash in several runs; one "
    "sample per launch. The interval is the order-statistic interval of the median with the probability "
    "it covers the true median (fewer than 6 samples cannot reach 95 %). Spread is (max - min) / mean of "
    "the tokens/s; CV the sample standard deviation over the mean. A difference between two strategies "
    "smaller than these spreads is not a difference. Host µs/op: per launch, the slowest rank's time to "
    "issue one tiny op (probed before the warm-up and after the timed steps); where the spread follows "
    "it, the host moved, not the strategy (host-bound cases: small micro-batches, per-tensor hooks). GPU "
    "busy %: per launch, the least busy GPU's share of the timed steps with a kernel running (NVML); a "
    "slow launch whose GPU idled more waited on its host or a synchronisation, not on a slower GPU. "
    "Forced switches: per launch, the most the ranks' main threads were preempted per timed step by other "
    "threads or processes (CPU contention)."
)
_NOT_SHAPE = ("strategy", "seed", "repeats", "repeat", "timeout_s", "own_launch", "comm_meter")


def _key(case: dict) -> str:
    return json.dumps(
        {k: v for k, v in case.items() if k not in ("seed", "repeat", "repeats")}, sort_keys=True, default=str
    )


def spread_rows(runs) -> list[dict]:
    groups: dict[str, list[tuple[str, dict]]] = {}
    for manifest, records in runs:
        run = run_name(manifest)
        for r in records:
            if r.get("status") == "ok":
                groups.setdefault(_key(r["case"]), []).append((run, r))
    rows = []
    for members in groups.values():
        tps = [t for _, r in members for t in launch_values(r, "tokens_per_s") if t]
        if len(tps) < 2:
            continue
        mean = statistics.fmean(tps)
        low, high, cover = median_ci(tps)
        peaks = [p for p in (finite(dig(r, "metrics", "peak_alloc_bytes")) for _, r in members) if p]
        hosts = [h for _, r in members for h in launch_values(r, "host_dispatch_us_max")]
        busy = [u for _, r in members for u in launch_values(r, "gpu_util_pct_mean_min")]
        switches = [x for _, r in members for x in launch_values(r, "host_involuntary_switches_per_step_max")]
        gc_ms = [x * 1e3 for _, r in members for x in launch_values(r, "host_gc_pause_s_per_step_max")]
        rows.append(
            {
                "label": members[0][1].get("label", ""),
                "n": len(tps),
                "seeds": ", ".join(sorted({str(dig(r, "case", "seed")) for _, r in members})),
                "runs": ", ".join(sorted({name for name, _ in members})),
                "tokens_per_s_median": statistics.median(tps),
                "tokens_per_s_ci_low": low,
                "tokens_per_s_ci_high": high,
                "ci_coverage_pct": cover * 100,
                "tokens_per_s_min": min(tps),
                "tokens_per_s_mean": mean,
                "tokens_per_s_max": max(tps),
                "spread_pct": (max(tps) - min(tps)) / mean * 100,
                "cv_pct": statistics.stdev(tps) / mean * 100,
                "peak_alloc_spread_pct": (max(peaks) - min(peaks)) / statistics.fmean(peaks) * 100
                if len(peaks) >= 2
                else None,
                "host_dispatch_us_range": f"{min(hosts):.1f} – {max(hosts):.1f}" if hosts else None,
                "gpu_busy_pct_range": f"{min(busy):.0f} – {max(busy):.0f}" if busy else None,
                "host_switches_range": f"{min(switches):.1f} – {max(switches):.1f}" if switches else None,
                "host_gc_ms_range": f"{min(gc_ms):.1f} – {max(gc_ms):.1f}" if gc_ms else None,
            }
        )
    return sorted(rows, key=lambda r: r["label"])


RATIO_COLUMNS = [
    ("shape", "case shape", "str"),
    ("reference", "reference", "str"),
    ("peer", "peer", "str"),
    ("n_reference", "launches ref", "int"),
    ("n_peer", "launches peer", "int"),
    ("ratio", "tok/s ratio ref/peer", "f3"),
    ("ratio_low", "interval low", "f3"),
    ("ratio_high", "interval high", "f3"),
    ("coverage_pct", "coverage %", "f1"),
    ("pair_note", "not like for like", "wrap"),
]
RATIO_NOTE = (
    "Reference implementation over peer, tokens/s (ratio of their medians over launches), same case "
    "shape and run, for pairs with at least two launches each. The interval is Moses' distribution-free "
    "interval of the pairwise launch ratios, with the probability it covers the true ratio (3 launches "
    "each: 90 %). An interval that holds 1 means the two are not told apart by these launches. Where the "
    "two reduce gradients in different dtypes, the last column says so."
)


def is_peer(reference: str, peer: str) -> bool:
    """Whether ``peer`` is one of the production peers the reference's registry row names."""
    from parabench.registry import STRATEGIES

    row = STRATEGIES.get(reference)
    return row is not None and peer in row.peers


def _shape(case: dict) -> str:
    """What a reference and its peer share: the case but the strategy, the launch and a peer's
    profile (a reference has none; the peer column names it)."""
    shape = {k: v for k, v in case.items() if k not in _NOT_SHAPE}
    shape["options"] = {k: v for k, v in (case.get("options") or {}).items() if k != "profile"}
    return json.dumps(shape, sort_keys=True, default=str)


def ratio_rows(runs) -> list[dict]:
    rows = []
    for manifest, records in runs:
        by_shape: dict[str, list[dict]] = {}
        for r in records:
            if r.get("status") == "ok" and len(launch_values(r, "tokens_per_s")) >= 2:
                by_shape.setdefault(_shape(r["case"]), []).append(r)
        for members in by_shape.values():
            for ref in members:
                for peer in members:
                    if not is_peer(ref["case"]["strategy"], peer["case"]["strategy"]):
                        continue
                    facts = pair_facts(ref["case"]), pair_facts(peer["case"])
                    if not can_pair(*facts):
                        continue
                    a, b = launch_values(ref, "tokens_per_s"), launch_values(peer, "tokens_per_s")
                    est, low, high, cover = ratio_ci(a, b)
                    c = ref["case"]
                    profile = (peer["case"].get("options") or {}).get("profile")
                    rows.append(
                        {
                            "run": run_name(manifest),
                            "shape": f"{c.get('model')}{' ' + c['layout'] if c.get('layout') else ''} "
                            f"w{c.get('world_size')} {c.get('precision')} "
                            f"mb{c.get('micro_batch')}",
                            "reference": c["strategy"],
                            "peer": peer["case"]["strategy"] + (f" [{profile}]" if profile else ""),
                            "pair_note": pair_note(*facts),
                            "n_reference": len(a),
                            "n_peer": len(b),
                            "ratio": est,
                            "ratio_low": low,
                            "ratio_high": high,
                            "coverage_pct": cover * 100,
                        }
                    )
    return sorted(rows, key=lambda r: (r["run"], r["shape"], r["reference"], r["peer"]))


def table_specs(runs, run_col=()) -> list[dict]:
    specs = []
    rows = spread_rows(runs)
    if rows:
        specs.append(
            {
                "id_": "spread-table",
                "title": "Run-to-run spread of repeated cases",
                "columns": COLUMNS,
                "rows": rows,
                "note": NOTE,
            }
        )
    ratios = ratio_rows(runs)
    if ratios:
        specs.append(
            {
                "id_": "ratio-table",
                "title": "Reference vs peer: tokens/s ratio with its interval",
                "columns": list(run_col) + RATIO_COLUMNS,
                "rows": ratios,
                "note": RATIO_NOTE,
            }
        )
    return specs
