"""The benchmark gate's verdict: each benchmark's min time, measured against a yardstick timed in
the same seconds, compared with the baseline's.

    change = (min / yardstick_min) now  /  (min / yardstick_min) in the baseline  - 1

Why a ratio: the 2-core CI machines run a core at one of two speeds and switch within seconds, so
a raw min moves by more than any useful threshold between two runs of the same code (the
smoke-suite parse took 3.3 and 6.5 ms back to back; a CI run failed the old raw-min gate on it).
The yardstick (yardsticks.py) is timed before every round, so it sees the same speed. Contention
only adds time, so mins are the stable statistic on both sides of the ratio.

Threshold: 40 % when the baseline was timed on this kind of machine, 200 % on another (a CPU model
with faster cores but slower loopback moves figures unevenly, and a yardstick of one kind of work
does not follow all of that); PARABENCH_BENCH_THRESHOLD=N overrides both. A benchmark with no
yardstick in the baseline is compared on its raw min. A benchmark missing from this run fails the
gate: a dropped benchmark must be dropped from the baseline too (gate.sh --update).

Given several runs, each benchmark is judged on its best one. gate.sh times the failed benchmarks
once more after a pause: a neighbour on the machine can slow one benchmark and not the yardstick
(a CI run timed report building at 31.6 ms with the yardstick at its usual speed; alone, on the
same checkout, it took 21.3 and 21.5 ms), and a regression in the code fails both runs.

Usage: gate_check.py [--failed] BASELINE.json RUN.json [RUN.json ...]
       exit 1 when any benchmark fails; --failed prints the failed benchmarks' names and nothing else
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

SAME_MACHINE_PCT = 40.0
OTHER_MACHINE_PCT = 200.0


@dataclass(frozen=True)
class Timing:
    min_s: float
    yardstick: str | None
    yardstick_min_s: float | None


@dataclass(frozen=True)
class Verdict:
    name: str
    baseline_min_s: float | None
    now_min_s: float | None
    change: float | None  # fraction; None when the benchmark is new or missing
    normalised: bool
    failed: bool
    why: str


def fingerprint(info: dict) -> tuple:
    # The brand string alone does not name the machine: two CI machines both reported "Intel(R)
    # Xeon(R) Processor" with 2 cores, one model 167 at 2.6 GHz, the other model 207 at 2.1 GHz, and
    # the same code (a730206) parsed the smoke suite in 1.7 and 3.8 ms there.
    cpu = info.get("cpu", {})
    return (
        cpu.get("brand_raw"),
        cpu.get("family"),
        cpu.get("model"),
        cpu.get("hz_advertised_friendly"),
        cpu.get("count"),
        info.get("machine"),
        info.get("python_version"),
    )


def timings(record: dict) -> dict[str, Timing]:
    out = {}
    for bench in record["benchmarks"]:
        extra = bench.get("extra_info", {})
        out[bench["name"]] = Timing(bench["stats"]["min"], extra.get("yardstick"), extra.get("yardstick_min_s"))
    return out


def threshold_pct(baseline: dict, current: dict) -> tuple[float, str]:
    if "PARABENCH_BENCH_THRESHOLD" in os.environ:
        return float(os.environ["PARABENCH_BENCH_THRESHOLD"]), "PARABENCH_BENCH_THRESHOLD"
    here, there = fingerprint(current["machine_info"]), fingerprint(baseline["machine_info"])
    if here == there:
        return SAME_MACHINE_PCT, f"baseline timed on this kind of machine {here}"
    return OTHER_MACHINE_PCT, f"baseline timed on {there}, this machine is {here}: gross regressions only"


def judge(baseline: dict[str, Timing], current: dict[str, Timing], limit_pct: float) -> list[Verdict]:
    verdicts = []
    for name in sorted(baseline.keys() | current.keys()):
        base, now = baseline.get(name), current.get(name)
        if now is None:
            why = "in the baseline but not run (drop it from the baseline with gate.sh --update)"
            verdicts.append(Verdict(name, base.min_s, None, None, False, True, why))
            continue
        if base is None:
            verdicts.append(Verdict(name, None, now.min_s, None, False, False, "new: not in the baseline"))
            continue
        normalised = bool(base.yardstick and base.yardstick == now.yardstick)
        normalised = normalised and bool(base.yardstick_min_s and now.yardstick_min_s)
        if normalised:
            change = (now.min_s / now.yardstick_min_s) / (base.min_s / base.yardstick_min_s) - 1
            why = f"{base.yardstick} yardstick {now.yardstick_min_s / base.yardstick_min_s:.2f}x the baseline's"
        else:
            change = now.min_s / base.min_s - 1
            why = "raw min (no matching yardstick in the baseline)"
        failed = change * 100 > limit_pct
        verdicts.append(Verdict(name, base.min_s, now.min_s, change, normalised, failed, why))
    return verdicts


def best_timings(records: list[dict]) -> dict[str, Timing]:
    """Each benchmark's best run of several: the lowest min over yardstick min (raw min without a
    yardstick). Contention on the machine only adds time, so the best run is the one it touched least."""

    def cost(t: Timing) -> float:
        return t.min_s / t.yardstick_min_s if t.yardstick_min_s else t.min_s

    best: dict[str, Timing] = {}
    for record in records:
        for name, timing in timings(record).items():
            if name not in best or cost(timing) < cost(best[name]):
                best[name] = timing
    return best


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def main(baseline_path: str, run_paths: list[str], list_failed: bool = False) -> int:
    with open(baseline_path) as f:
        baseline = json.load(f)
    runs = []
    for path in run_paths:
        with open(path) as f:
            runs.append(json.load(f))
    limit, reason = threshold_pct(baseline, runs[0])
    verdicts = judge(timings(baseline), best_timings(runs), limit)
    failed = [v.name for v in verdicts if v.failed]
    if list_failed:
        print(" ".join(v.name for v in verdicts if v.failed and v.now_min_s is not None))
        return 1 if failed else 0
    runs_note = f", the better of {len(runs)} runs" if len(runs) > 1 else ""
    print(f"benchmark gate: threshold {limit:g} % on min / yardstick min{runs_note} ({reason})")
    width = max(len(v.name) for v in verdicts)
    print(f"{'benchmark':<{width}}  {'base ms':>9}  {'now ms':>9}  {'change':>8}  verdict")
    for v in verdicts:
        change = "-" if v.change is None else f"{v.change * 100:+.1f}%"
        verdict = "FAIL" if v.failed else "ok"
        print(f"{v.name:<{width}}  {_ms(v.baseline_min_s):>9}  {_ms(v.now_min_s):>9}  {change:>8}  {verdict}  {v.why}")
    if failed:
        print(f"benchmark gate: FAILED ({', '.join(failed)})")
        return 1
    print("benchmark gate: passed")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    list_failed = "--failed" in args
    args = [a for a in args if a != "--failed"]
    if len(args) < 2:
        sys.exit(__doc__.rsplit("Usage: ", 1)[1])
    sys.exit(main(args[0], args[1:], list_failed))
