"""Launch-level statistics: the samples, intervals and the test the gate and the report share.

Why launches: the timed steps of one torchrun launch share its allocator layout, its NCCL
channels, its clocks and its place in the machine's thermal history, so their spread says
nothing about how far the next launch will land (2026-11-26 on 2x H100: deepspeed.zero3 gave
15,282, then 26,707, then 16,670 tok/s/GPU in three launches of the same code). A case with
``repeats = N`` runs N separate launches; each launch's median step time is ONE sample.

Every method here is distribution-free and exact for small samples (no scipy, no normality):

``median_ci``     the order-statistic interval for the median, [x_(k), x_(n+1-k)], whose coverage
                  is 1 - 2 P(Bin(n, 1/2) <= k - 1). The widest one, [min, max], covers the true
                  median with probability 75 % for 3 launches, 87.5 % for 4, 93.8 % for 5 and
                  96.9 % for 6: with fewer than 6 launches no interval reaches 95 %, so the
                  interval reports the coverage it actually has instead of pretending.
``ratio_ci``      the interval for the ratio of two cases' launch medians: the Hodges-Lehmann /
                  Moses interval of the pairwise ratios a_i / b_j, with the order statistics picked
                  from the exact Mann-Whitney U distribution (a shift on the log scale). With 3
                  launches each the widest interval, [min a_i/b_j, max a_i/b_j], covers 90 %.
``mann_whitney_greater``  one-sided Mann-Whitney U; exact without ties, normal approximation
                  with tie and continuity corrections otherwise.

``combine_launches`` turns the records of one run (one file per launch, see
``parabench.suite.launch_key``) into one record per case for the gate and the report.

Records are untrusted input: a value that is not a finite number (NaN, inf, a string, an integer
too large for a float such as 10**400) is never a sample here (``finite``). Statistics over such
values would crash (``statistics.stdev`` on inf) or mean nothing (NaN sorts anywhere); the raw
value stays in the combined record's ``launches`` rows, where the gate fails it by name
(``parabench.compare.impossible_values``).
"""

from __future__ import annotations

import math
import statistics
from functools import lru_cache

# The figures each launch contributes one sample of; all are functions of the launch's median
# step time, so they rank launches alike. The case-level value is the median over its launches.
TIMING_METRICS = (
    "step_time_s_median",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "mfu",
    "hfu",
    "model_flops_per_s_per_device",
    "hardware_flops_per_s_per_device",
    "roofline_fraction",
)
# Memory figures that move between launches of the same code (the allocator's reserved peak moved
# 10-13 % between two H100 launches, 2026-11-26): the case-level value is their median too.
NOISY_MEMORY = ("peak_reserved_bytes", "device_used_bytes", "peak_rss_bytes")
# What a launch ran on rather than what it measured: kept per launch, so that a launch-to-launch
# spread can be set beside it (the slowest rank's host probe, its main thread's context switches and
# its Python garbage collections, ``parabench.meters.host``; the least busy GPU of the timed steps,
# ``parabench.meters.telemetry``).
LAUNCH_CONDITIONS = (
    "host_dispatch_us_max",
    "host_involuntary_switches_per_step_max",
    "host_gc_pause_s_per_step_max",
    "gpu_util_pct_mean_min",
)
# The timed window's wall clock (``parabench.metrics.window_summary``): kept per launch, so the
# fidelity report can set the window's tokens/s of adapter and script beside the median step's.
WINDOW_METRICS = ("timed_window_s_max", "window_tokens_per_s_per_device")
# Summarised with an interval and a coefficient of variation in ``launch_stats``.
SUMMARISED = ("step_time_s_median", "tokens_per_s", "tokens_per_s_per_device")
CI_LEVEL = 0.95
# Kept per launch beside the timings so the gate can check every launch, not only the representative.
LAUNCH_CHECKED = ("final_loss",)
# Every figure a combined record keeps per launch (its ``launches`` rows).
PER_LAUNCH = TIMING_METRICS + NOISY_MEMORY + LAUNCH_CONDITIONS + WINDOW_METRICS + LAUNCH_CHECKED


def finite(v) -> float | None:
    """``v`` as a float when it is a finite number (bool is not a number here), else None."""
    if type(v) is float:
        return v if math.isfinite(v) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an int beyond the float range
        return None
    return f if math.isfinite(f) else None


# --- Mann-Whitney U -----------------------------------------------------------------------------


def _ranks(values: list[float]) -> tuple[list[float], list[int]]:
    """Average ranks (1-based) of ``values`` and the sizes of the groups of ties."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    ties = []
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        ties.append(j - i + 1)
        i = j + 1
    return ranks, ties


@lru_cache(maxsize=256)
def u_distribution(n1: int, n2: int) -> tuple[int, ...]:
    """Number of arrangements giving each value of U (0..n1*n2), for untied samples.

    Recurrence (Mann & Whitney 1947): c(n1, n2, u) = c(n1-1, n2, u-n2) + c(n1, n2-1, u)."""
    prev = [[1] for _ in range(n2 + 1)]  # i = 0: U is always 0
    for i in range(1, n1 + 1):
        cur = [[1]]  # j = 0: U is 0
        for j in range(1, n2 + 1):
            row = [0] * (i * j + 1)
            for u, c in enumerate(prev[j]):  # (i-1, j): shifted by j
                row[u + j] += c
            for u, c in enumerate(cur[j - 1]):  # (i, j-1)
                row[u] += c
            cur.append(row)
        prev = cur
    return tuple(prev[n2])


def smallest_p(n1: int, n2: int) -> float:
    """The smallest one-sided Mann-Whitney p that samples of these sizes can give: 1 / C(n1+n2, n1)
    (every value of one side above every value of the other). A level below it can never be met."""
    if n1 == 0 or n2 == 0:
        return 1.0
    return 1 / math.comb(n1 + n2, n1)


def mann_whitney_greater(x: list[float], y: list[float]) -> float:
    """One-sided p-value for "values of ``x`` tend to be larger than values of ``y``".

    U counts the pairs (xi, yj) with xi > yj (ties count one half). Exact null distribution
    when there are no ties and the samples are small; otherwise the normal approximation with
    tie and continuity corrections."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return 1.0
    ranks, ties = _ranks(list(x) + list(y))
    u = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    if all(t == 1 for t in ties) and n1 * n2 <= 2500:
        dist = u_distribution(n1, n2)
        return sum(dist[round(u) :]) / sum(dist)
    n = n1 + n2
    tie_term = sum(t**3 - t for t in ties) / (n * (n - 1)) if n > 1 else 0.0
    var = n1 * n2 / 12 * ((n + 1) - tie_term)
    if var <= 0:
        return 1.0
    z = (u - n1 * n2 / 2 - 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2))


# --- intervals ----------------------------------------------------------------------------------


def median(xs) -> float:
    return statistics.median(xs)


def cv(xs) -> float | None:
    """Coefficient of variation: sample standard deviation over the mean (None below 2 finite
    samples; values that are not finite numbers are left out)."""
    xs = [f for f in map(finite, xs) if f is not None]
    if len(xs) < 2:
        return None
    mean = statistics.fmean(xs)
    try:
        return statistics.stdev(xs) / mean if mean else None
    except OverflowError:  # finite values whose squares are not (1e200)
        return None


def median_ci(xs, level: float = CI_LEVEL) -> tuple[float, float, float]:
    """(low, high, coverage): the narrowest order-statistic interval for the median whose coverage
    reaches ``level``, or [min, max] with the coverage it has when none does."""
    s = sorted(xs)
    n = len(s)
    if n == 0:
        raise ValueError("no samples")
    if n == 1:
        return s[0], s[0], 0.0

    def coverage(k: int) -> float:  # of [x_(k), x_(n+1-k)], 1-based
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return s[k - 1], s[n - k], coverage(k)


def ratio_ci(a, b, level: float = CI_LEVEL) -> tuple[float, float, float, float]:
    """(median(a) / median(b), low, high, coverage): the distribution-free interval for the ratio
    of two positive samples' medians (Moses' interval for a shift of log values): the pairwise
    ratios a_i / b_j sorted, cut at the order statistic the exact U distribution allows."""
    if not a or not b:
        raise ValueError("no samples")
    est = median(a) / median(b)
    n, m = len(a), len(b)
    ratios = sorted(x / y for x in a for y in b)
    dist = u_distribution(n, m)
    total = sum(dist)
    k, tail = 1, dist[0] / total  # tail: P(U <= k - 1)
    while k + 1 <= (n * m + 1) // 2 and 1 - 2 * (tail + dist[k] / total) >= level:
        tail += dist[k] / total
        k += 1
    coverage = 1 - 2 * tail if n * m > 1 else 0.0
    return est, ratios[k - 1], ratios[n * m - k], max(coverage, 0.0)


def summary(xs) -> dict:
    """Median, its interval (with the coverage it has), CV and the samples themselves (finite
    numbers only; at least one is needed)."""
    xs = [f for f in map(finite, xs) if f is not None]
    low, high, cover = median_ci(xs)
    return {
        "median": median(xs),
        "ci_low": low,
        "ci_high": high,
        "ci_coverage": cover,
        "cv": cv(xs),
        "n": len(xs),
        "samples": list(xs),
    }


# --- records ------------------------------------------------------------------------------------


def launch_index(record: dict) -> int:
    """Which launch of its case a record is (0 for records written before repeats existed)."""
    k = (record.get("case") or {}).get("repeat") if isinstance(record.get("case"), dict) else None
    return k if isinstance(k, int) and not isinstance(k, bool) and k >= 0 else 0


def launch_samples(record: dict, metric: str) -> list[float]:
    """Per-launch values of ``metric`` of a combined record (``combine_launches``), ok launches only."""
    out = []
    for launch in record.get("launches") or []:
        v = finite(launch.get(metric)) if isinstance(launch, dict) else None
        if launch.get("status") == "ok" and v is not None:
            out.append(v)
    return out


def launch_values(record: dict, metric: str) -> list[float]:
    """One value of ``metric`` per launch: the ok launches of a combined record, else the record's own
    figure; NaN and inf give no value (the gate fails them by name)."""
    samples = launch_samples(record, metric)
    if samples:
        return samples
    v = finite((record.get("metrics") or {}).get(metric))
    return [v] if v is not None else []


def boot_ids(record: dict) -> list[str]:
    """The machines a launch's ranks ran on (``parabench.meters.host.boot_id``), sorted; empty for
    records made before it was read. A combined record: every launch's, together."""
    if isinstance(record.get("launches"), list):
        return sorted({b for row in record["launches"] for b in row.get("boot_ids") or []})
    ranks = record.get("per_rank") or []
    return sorted({b for r in ranks if isinstance(r, dict) and (b := (r.get("host_process") or {}).get("boot_id"))})


def combine_launches(records: list[dict]) -> list[dict]:
    """One record per case hash from one run's records (one per launch), in first-seen order.

    The combined record is a copy of its representative launch (the ok launch whose median step
    time is nearest the median over launches: its per-rank data, memory, communication and step
    series describe one real launch), with

    - ``metrics[m]`` for every figure in ``TIMING_METRICS`` and ``NOISY_MEMORY``: the median over ok
      launches (exact byte figures are the representative's: they do not move between launches);
    - ``launches``: per launch, its repeat index, status, start time, duration, timing and noisy
      memory figures (the launch-level samples the gate tests);
    - ``launch_stats``: ``n`` ok launches, ``representative_repeat``, and for the figures in
      ``SUMMARISED`` the median, interval, coverage, CV and samples (``summary``);
    - ``status``: ok when every launch is; else the first failed launch's status and error (a
      case that fails one launch in three is not ok), with its ok launches' figures kept.
    """
    groups: dict[str, list[dict]] = {}
    for r in records:
        if isinstance(r, dict):
            groups.setdefault(r.get("case_hash"), []).append(r)
    return [_combine(sorted(rs, key=launch_index)) for rs in groups.values()]


def _combine(launches: list[dict]) -> dict:
    if len(launches) == 1 and "launch_stats" in launches[0]:  # combined already
        return launches[0]
    ok = [r for r in launches if r.get("status") == "ok" and isinstance(r.get("metrics"), dict)]
    rows = []
    for r in launches:
        m = r.get("metrics") or {}
        rows.append(
            {
                "repeat": launch_index(r),
                "status": r.get("status"),
                "started_at": r.get("started_at"),
                "duration_s": r.get("duration_s"),
                **{k: m.get(k) for k in PER_LAUNCH},
                "boot_ids": boot_ids(r),
            }
        )
    steps = [finite(r["metrics"].get("step_time_s_median")) for r in ok]
    timed = [s for s in steps if s is not None]
    if ok:
        # a launch without a finite step time is never the representative while another has one
        mid = median(timed) if timed else 0.0
        rep = min(
            zip(ok, steps),
            key=lambda rs: (rs[1] is None, abs(rs[1] - mid) if rs[1] is not None else 0.0, launch_index(rs[0])),
        )[0]
    else:
        rep = launches[0]
    # A shallow copy: only top-level keys and metrics entries are replaced below, never mutated in
    # place, so the launch records stay as they were read.
    out = {**rep, "metrics": dict(rep["metrics"]) if isinstance(rep.get("metrics"), dict) else rep.get("metrics")}
    out["launches"] = rows
    stats: dict = {"n": len(ok), "n_launches": len(launches), "representative_repeat": launch_index(rep)}
    if ok:
        for k in TIMING_METRICS + NOISY_MEMORY if len(ok) > 1 else ():  # one launch: its own figures
            vals = [finite(r["metrics"].get(k)) for r in ok]
            if all(v is not None for v in vals):
                out["metrics"][k] = median(vals)
        for k in SUMMARISED:
            vals = [v for v in (finite(r["metrics"].get(k)) for r in ok) if v is not None]
            if vals:
                stats[k] = summary(vals)
    out["launch_stats"] = stats
    failed = [r for r in launches if r.get("status") != "ok"]
    if failed and ok:
        first = failed[0]
        out["status"], out["error"] = first.get("status"), first.get("error")
        out["caveats"] = [
            *(out.get("caveats") or []),
            (
                f"{len(failed)} of {len(launches)} launches did not finish ok (first: launch "
                f"{launch_index(first)}, {first.get('status')}); the figures are the ok launches'"
            ),
        ]
    return out
