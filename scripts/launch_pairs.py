"""What differs between two launches of one configuration when one is slower: its GPU's busy
share, its SM clock, its host probe. Over every committed GPU record (a record copied into two runs,
as results/baselines holds, counts once), every pair of launches of one case on one device kind
whose median steps differ by more than ``--threshold``.

    python scripts/launch_pairs.py [results] [--threshold 0.05]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path


def launches(results: Path) -> dict[tuple[str, str], list[dict]]:
    """Per (device name, case hash), the distinct ok GPU launches' figures."""
    out: dict[tuple[str, str], list[dict]] = {}
    seen = set()
    for path in sorted(results.glob("*/*/cases/*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        m = rec.get("metrics") or {}
        device = (rec.get("device") or {}).get("name") if isinstance(rec.get("device"), dict) else None
        if rec.get("status") != "ok" or not device or "NVIDIA" not in device or not m.get("step_time_s_median"):
            continue
        key = (rec["case_hash"], m["step_time_s_median"], m.get("gpu_util_pct_mean_min"))
        if key in seen:
            continue
        seen.add(key)
        out.setdefault((device, rec["case_hash"]), []).append(
            {
                "step_s": m["step_time_s_median"],
                "busy_pct": m.get("gpu_util_pct_mean_min"),
                "sm_clock_mhz": m.get("sm_clock_mhz_median_min"),
                "host_us": m.get("host_dispatch_us_max"),
                "switches": m.get("host_involuntary_switches_per_step_max"),
            }
        )
    return out


def compare(groups: dict, threshold: float) -> dict:
    """Per figure, over the pairs more than ``threshold`` apart where both launches measured it:
    how many pairs, and in how many the slower launch had the lower (busy, clock) or higher (host
    probe, switches) value."""
    tally = {k: [0, 0] for k in ("busy_pct", "sm_clock_mhz", "host_us", "switches")}
    lower_is_slow = {"busy_pct": True, "sm_clock_mhz": True, "host_us": False, "switches": False}
    pairs, configurations = 0, set()
    for key, runs in groups.items():
        for a, b in itertools.combinations(runs, 2):
            slow, fast = (a, b) if a["step_s"] > b["step_s"] else (b, a)
            if slow["step_s"] / fast["step_s"] - 1 <= threshold:
                continue
            pairs += 1
            configurations.add(key)
            for k, counts in tally.items():
                if slow[k] is None or fast[k] is None:
                    continue
                counts[0] += 1
                counts[1] += slow[k] < fast[k] if lower_is_slow[k] else slow[k] > fast[k]
    return {"pairs": pairs, "configurations": len(configurations), "tally": tally}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", default="results")
    ap.add_argument("--threshold", type=float, default=0.05)
    args = ap.parse_args(argv)
    out = compare(launches(Path(args.results)), args.threshold)
    print(
        f"{out['pairs']} pairs of launches more than {args.threshold:.0%} apart, {out['configurations']} configurations"
    )
    words = {
        "busy_pct": "the less busy GPU",
        "sm_clock_mhz": "the lower SM clock",
        "host_us": "the slower host probe",
        "switches": "more forced context switches",
    }
    for k, (n, agree) in out["tally"].items():
        print(f"  the slower launch had {words[k]}: {agree} of {n} pairs measuring it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
