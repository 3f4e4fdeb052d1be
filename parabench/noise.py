"""The noise model: each implementation's launch-to-launch spread, measured on the committed runs.

A single launch a side cannot be judged by a launch-level test (``parabench.compare``: one-sided
Mann-Whitney needs 3 launches a side to reach p = 0.05), and single launches are what GPU budgets
allow per commit. What the records can say instead is how far two launches of the SAME code land
apart: every committed run with ``repeats >= 2`` holds such launches. This module pools them.

Spread of a pair of launches: ``max(a, b) / min(a, b) - 1`` of their median step times (the
throughput figures are its reciprocals, so they share it). A case of n launches gives its
n (n - 1) / 2 pairs.

Regime of a case, from its own launches:

- ``bound``: ``gpu`` when every launch kept its least busy GPU at least ``GPU_BOUND_UTIL_PCT`` busy
  over the timed steps (``gpu_util_pct_mean_min``, NVML), ``host`` when one did not, ``unknown``
  when a launch did not measure it. Host-bound cases (per-tensor hooks, one-row micro-batches)
  follow the host's speed: their launches of the same code moved by up to 72 %, GPU-bound ones by
  at most 1.5 % (the committed runs).
- ``size``: the model's parameters, ``<1B``, ``1-5B`` or ``>=5B``.
- ``gpus``: the world size.

Implementation: the strategy, with its DeepSpeed or torch ``profile`` option where set
(``deepspeed.zero2:tuned`` waits on its host where the default does not).

Entries, from the finest to the coarsest level (``LEVELS``): ``impl|bound|size|gpus``,
``impl|bound``, ``bound``. Each holds its numbers of cases, pairs and runs and the median, the
``QUANTILE`` (95th percentile, nearest rank: a spread that was observed) and the largest of the
pairs' spreads.

How ``parabench compare`` uses it, where the launch counts cannot reach the launch-level test
(``judge``), for a timing change beyond the regression threshold (3 %):

- both sides GPU-bound (every launch of the baseline and of the candidate): judged by the finest
  GPU-bound entry of the baseline's implementation and regime with at least ``MIN_CASES`` cases
  (else the pooled ``gpu`` entry): beyond its 95th percentile a regression (or an improvement),
  within it noise.
- otherwise: unjudged, with the implementation's host-bound spread in the note. No threshold
  held on the committed data: leaving each run out, the host-bound launches of a held-out run
  moved beyond every spread the other runs had shown for their implementation (up to 72 % apart),
  so one launch a side cannot tell a host-bound regression from the host. Run 3 launches a side.

Only CUDA records are modelled (a CPU machine's timings move with whatever else runs on it).

The spread is measured within runs (launches interleaved over one suite run on one host). A
baseline and a candidate are usually further apart (another day, another host of the same kind),
so this is a lower bound on the noise between runs; ``cross_validate`` measures what the defaults
give on the committed data, leaving each run out in turn (the numbers are in docs/gate.md).

``parabench noise-model`` rebuilds ``results/baselines/noise-model.json`` from ``results/``; the file
holds no timestamp, so a rebuild from unchanged records is byte-identical (a test checks it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from itertools import combinations
from pathlib import Path

from parabench.stats import combine_launches, finite

SCHEMA_VERSION = 1
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = ROOT / "results"
DEFAULT_MODEL = ROOT / "results" / "baselines" / "noise-model.json"
QUANTILE = 0.95
GPU_BOUND_UTIL_PCT = 95.0
MIN_CASES = 3
# Below this a single-launch change of a GPU-bound case is never called a regression, whatever its
# implementation's spread within runs: between runs (another day or host of the same kind) the same
# case hashes moved by up to 3.98 % (43 GPU-bound pairs of the committed runs; ``between_runs``
# reports the largest, so a rebuild shows when a new run moves beyond it).
GPU_FLOOR = 0.04
LEVELS = ("impl|bound|size|gpus", "impl|bound", "bound")
SIZES = ((1e9, "<1B"), (5e9, "1-5B"), (math.inf, ">=5B"))
SLOWDOWN = 0.10  # the cross-validation's injected slowdown: tokens/s down 10 %
TIMING = {"tokens_per_s": +1, "tokens_per_s_per_device": +1, "step_time_s_median": -1, "mfu": +1}


# --- regime ---------------------------------------------------------------------------------------


def _part(record: dict, key: str) -> dict:
    v = record.get(key)
    return v if isinstance(v, dict) else {}


def implementation(record: dict) -> str:
    case = _part(record, "case")
    options = case.get("options") if isinstance(case.get("options"), dict) else {}
    profile = options.get("profile")
    return f"{case.get('strategy')}" + (f":{profile}" if isinstance(profile, str) and profile else "")


def _ok_launches(record: dict) -> list[dict]:
    rows = record.get("launches")
    if not isinstance(rows, list):  # a record not combined: it is its own one launch
        m = record.get("metrics") if isinstance(record.get("metrics"), dict) else {}
        rows = [{"status": record.get("status"), **m}]
    return [r for r in rows if isinstance(r, dict) and r.get("status") == "ok"]


def regime(record: dict) -> dict:
    """bound, size and gpus of a record (combined by ``combine_launches`` or a single launch)."""
    utils = [finite(r.get("gpu_util_pct_mean_min")) for r in _ok_launches(record)]
    if not utils or any(u is None for u in utils):
        bound = "unknown"
    else:
        bound = "gpu" if min(utils) >= GPU_BOUND_UTIL_PCT else "host"
    params = finite(_part(_part(record, "model"), "params").get("total"))
    size = next(name for edge, name in SIZES if params < edge) if params else "unknown"
    return {"bound": bound, "size": size, "gpus": _part(record, "case").get("world_size")}


def keys(impl: str, reg: dict) -> list[tuple[str, str]]:
    """(level, key) of a record's entries, finest first."""
    b = reg["bound"]
    return [
        (LEVELS[0], f"{impl}|{b}|{reg['size']}|{reg['gpus']}"),
        (LEVELS[1], f"{impl}|{b}"),
        (LEVELS[2], b),
    ]


def pair_spreads(record: dict) -> list[float]:
    """max/min - 1 of the median step times of every pair of the record's ok launches."""
    steps = [finite(r.get("step_time_s_median")) for r in _ok_launches(record)]
    steps = [s for s in steps if s is not None and s > 0]
    return [max(a, b) / min(a, b) - 1 for a, b in combinations(steps, 2)]


def is_modelled(record: dict) -> bool:
    return _part(record, "device").get("type") == "cuda" and record.get("status") == "ok"


# --- the model --------------------------------------------------------------------------------------


def quantile(xs: list[float], q: float = QUANTILE) -> float:
    """Nearest-rank quantile: the smallest observed value with at least a fraction q at or below it."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def read_runs(results: Path = DEFAULT_RESULTS) -> list[tuple[str, list[dict]]]:
    """(run name, combined CUDA records) of every run folder below ``results`` with a CUDA case; the
    name is the manifest's suite/run id (the folder below ``results`` where it has none). Unreadable
    runs are skipped with a message."""
    from parabench.results import SchemaError, load_run

    runs = []
    for manifest in sorted(Path(results).glob("**/manifest.json")):
        run = manifest.parent
        if "baselines" in run.relative_to(results).parts:  # copies of runs kept elsewhere too
            continue
        try:
            manifest, records = load_run(run)
        except (OSError, SchemaError, ValueError, KeyError) as exc:
            print(f"parabench noise-model: skipped {run}: {exc}", file=sys.stderr)
            continue
        combined = [r for r in combine_launches(records) if is_modelled(r)]
        if combined:
            # named by suite and run id, not by folder: moving a run folder leaves the model as it was
            suite, run_id = manifest.get("suite"), manifest.get("run_id")
            name = f"{suite}/{run_id}" if isinstance(suite, str) and isinstance(run_id, str) else None
            runs.append((name or run.relative_to(results).as_posix(), combined))
    names = [name for name, _ in runs]
    return sorted(runs, key=lambda r: r[0]) if len(set(names)) == len(names) else runs


def build(runs: list[tuple[str, list[dict]]]) -> dict:
    """The model's entries from (run name, combined records)."""
    pools: dict[str, dict] = {}
    for name, records in runs:
        for r in records:
            spreads = pair_spreads(r)
            if not spreads:
                continue
            reg = regime(r)
            for level, key in keys(implementation(r), reg):
                e = pools.setdefault(
                    key, {"level": level, "bound": reg["bound"], "cases": 0, "pairs": [], "runs": set()}
                )
                e["cases"] += 1
                e["pairs"] += spreads
                e["runs"].add(name)
    entries = {}
    for key in sorted(pools):
        e = pools[key]
        entries[key] = {
            "level": e["level"],
            "n_cases": e["cases"],
            "n_pairs": len(e["pairs"]),
            "n_runs": len(e["runs"]),
            "median": round(quantile(e["pairs"], 0.5), 6),
            "p95": round(quantile(e["pairs"]), 6),
            "max": round(max(e["pairs"]), 6),
        }
    return entries


def make_model(runs: list[tuple[str, list[dict]]], cross_validation: dict | None = None) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "noise-model",
        "settings": {
            "spread": "max/min - 1 of two launches' median step times, same case, same run",
            "quantile": QUANTILE,
            "gpu_bound_util_pct": GPU_BOUND_UTIL_PCT,
            "min_cases": MIN_CASES,
            "gpu_floor": GPU_FLOOR,
            "levels": list(LEVELS),
            "sizes": [name for _, name in SIZES],
        },
        "runs": sorted(name for name, records in runs if any(pair_spreads(r) for r in records)),
        "entries": build(runs),
        "cross_validation": cross_validation,
    }


def load(path: Path | str | None = None) -> dict | None:
    """The model at ``path`` (default: the committed one), or None where there is none."""
    path = Path(path) if path else DEFAULT_MODEL
    if not path.exists():
        return None
    model = json.loads(path.read_text())
    if not isinstance(model, dict) or model.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: not a noise model of schema version {SCHEMA_VERSION}")
    return model


def both_gpu_bound(base: dict, cand: dict) -> bool:
    return regime(base)["bound"] == "gpu" and regime(cand)["bound"] == "gpu"


def lookup(model: dict, record: dict, bound: str | None = None) -> tuple[str, dict] | None:
    """(key, entry) for ``record`` (its regime, with ``bound`` in place of its own where given): the
    finest entry with enough cases."""
    if not model or not is_modelled(record):
        return None
    reg = regime(record)
    reg = {**reg, "bound": bound or reg["bound"]}
    entries = model.get("entries") or {}
    min_cases = (model.get("settings") or {}).get("min_cases", MIN_CASES)
    for _, key in keys(implementation(record), reg):
        e = entries.get(key)
        if e and e.get("n_cases", 0) >= min_cases:
            return key, e
    return None


def _util(record: dict) -> str:
    utils = [finite(r.get("gpu_util_pct_mean_min")) for r in _ok_launches(record)]
    return "/".join("?" if u is None else f"{u:.0f}" for u in utils) or "?"


def judge(model: dict | None, base: dict, cand: dict, metric: str, direction: int) -> tuple[str, str] | None:
    """(verdict, note) of a timing change between two records that the launch-level test cannot
    judge: ``regression`` or ``improvement`` beyond the GPU-bound implementation's spread, ``noise``
    within it, ``unjudged`` with the spread in the note where a side is not GPU-bound; None where
    the model says nothing (no model, another device, not CUDA)."""
    if not model or not is_modelled(base) or not is_modelled(cand):
        return None
    if _part(base, "device").get("name") != _part(cand, "device").get("name"):
        return None
    bv, cv = finite(_part(base, "metrics").get(metric)), finite(_part(cand, "metrics").get(metric))
    if bv is None or cv is None or bv <= 0 or cv <= 0:
        return None
    spread = max(bv / cv, cv / bv) - 1
    if not both_gpu_bound(base, cand):
        found = lookup(model, base, "host")
        seen = (
            f"; launches of {found[0]} moved by up to {found[1]['max'] * 100:.0f}% "
            f"(95th percentile {found[1]['p95'] * 100:.0f}%, {found[1]['n_pairs']} pairs)"
            if found
            else ""
        )
        measured = regime(base)["bound"] != "unknown" and regime(cand)["bound"] != "unknown"
        why = (
            f"not GPU-bound (least busy GPU {_util(base)}% -> {_util(cand)}% busy, GPU-bound from {GPU_BOUND_UTIL_PCT:g}%)"
            if measured
            else "GPU utilisation not recorded, so not known to be GPU-bound"
        )
        return "unjudged", (
            f"{why}{seen}: one launch a side cannot judge a case that may wait on its host; run 3 launches a side"
        )
    found = lookup(model, base, "gpu")
    if found is None:
        return None
    key, e = found
    floor = (model.get("settings") or {}).get("gpu_floor", GPU_FLOOR)
    limit = max(e["p95"], floor)
    where = f"95th percentile {e['p95'] * 100:.1f}% of {e['n_pairs']} launch pairs of {e['n_cases']} cases, {key}" + (
        f"; the between-runs floor {floor * 100:g}%" if limit == floor else ""
    )
    if spread > limit:
        worse = (cv - bv) * direction < 0
        return ("regression" if worse else "improvement"), (
            f"{spread * 100:.1f}% apart, beyond the launch-to-launch spread of {limit * 100:.1f}% ({where})"
        )
    return "noise", f"{spread * 100:.1f}% apart, within the launch-to-launch spread of {limit * 100:.1f}% ({where})"


# --- cross-validation ----------------------------------------------------------------------------------


def _one_launch(record: dict, row: dict, factor: float = 1.0) -> dict:
    """``record`` as if only the launch ``row`` had run, its timings slowed by ``factor``."""
    metrics = dict(record.get("metrics") or {})
    for name, direction in TIMING.items():
        v = finite(row.get(name))
        metrics[name] = None if v is None else (v * factor if direction > 0 else v / factor)
    return {**record, "metrics": metrics, "launches": [{**row, **{k: metrics[k] for k in TIMING}}]}


def cross_validate(runs: list[tuple[str, list[dict]]], threshold: float) -> dict:
    """Leave one run out: the model built from the other runs judges every ordered pair of launches
    of each case of the left-out run, one launch a side (the gate's regression threshold, then the
    model), on tokens/s. Same-code pairs as they are (a regression is a false alarm); GPU-bound pairs
    with the candidate's tokens/s cut by ``SLOWDOWN`` (a regression is a detection). ``threshold``:
    the gate's (``compare.DEFAULT_THRESHOLD``, which the command passes: compare reads this module)."""
    tally = {b: {"pairs": 0, "false_alarms": 0, "slowed": 0, "detected": 0, "verdicts": {}} for b in ("gpu", "host")}
    alarms: list[str] = []
    missed: list[str] = []
    for held, records in runs:
        model = {"settings": {"min_cases": MIN_CASES}, "entries": build([r for r in runs if r[0] != held])}
        for rec in records:
            bound = "gpu" if regime(rec)["bound"] == "gpu" else "host"
            rows = [r for r in _ok_launches(rec) if finite(r.get("tokens_per_s"))]
            for a, b in ((a, b) for a in rows for b in rows if a is not b):
                base = _one_launch(rec, a)
                t = tally[bound]
                for factor, key in ((1.0, "pairs"), (1 - SLOWDOWN, "slowed")):
                    if key == "slowed" and bound != "gpu":
                        continue
                    cand = _one_launch(rec, b, factor)
                    bv, cv = base["metrics"]["tokens_per_s"], cand["metrics"]["tokens_per_s"]
                    t[key] += 1
                    if abs(cv - bv) / bv <= threshold:
                        verdict = "same"
                    else:
                        got = judge(model, base, cand, "tokens_per_s", +1)
                        verdict = got[0] if got else "unjudged"
                    if key == "pairs":
                        t["verdicts"][verdict] = t["verdicts"].get(verdict, 0) + 1
                    flagged = verdict == "regression"
                    label = f"{held}: {rec.get('label')} launch {a.get('repeat')} -> {b.get('repeat')}"
                    if key == "pairs" and flagged:
                        t["false_alarms"] += 1
                        alarms.append(f"{label} ({(bv / cv - 1) * 100:.1f}% slower)")
                    elif key == "slowed":
                        t["detected"] += flagged
                        if not flagged:
                            missed.append(label)
    out: dict = {"method": "leave one run out; every ordered pair of launches of a case, one launch a side"}
    out["between_runs"] = between_runs(runs, threshold)
    for b, t in tally.items():
        out[b] = {
            **t,
            "false_alarm_rate": round(t["false_alarms"] / t["pairs"], 4) if t["pairs"] else None,
            "detection_rate": round(t["detected"] / t["slowed"], 4) if t["slowed"] else None,
        }
    total = sum(t["pairs"] for t in tally.values())
    out["false_alarm_rate"] = round(sum(t["false_alarms"] for t in tally.values()) / total, 4) if total else None
    out["false_alarms"] = alarms
    out["missed_detections"] = missed
    return out


def between_runs(runs: list[tuple[str, list[dict]]], threshold: float) -> dict:
    """The same case hash on the same device in two runs, both GPU-bound, the model built without
    either run judging each way: how often code whose strategy did not change moved beyond the gate
    between runs (the runs' other code may differ: a false alarm here is an upper bound)."""
    seen: dict[tuple, list[tuple[str, dict]]] = {}
    for name, records in runs:
        for r in records:
            seen.setdefault((r.get("case_hash"), (r.get("device") or {}).get("name")), []).append((name, r))
    pairs = flagged = 0
    alarms = []
    spreads = []
    for group in seen.values():
        for (na, a), (nb, b) in combinations(group, 2):
            if na == nb or not both_gpu_bound(a, b):
                continue
            model = {"entries": build([r for r in runs if r[0] not in (na, nb)])}
            ta, tb = finite(a["metrics"].get("tokens_per_s")), finite(b["metrics"].get("tokens_per_s"))
            if not ta or not tb:
                continue
            spreads.append(max(ta / tb, tb / ta) - 1)
            for base, cand in ((a, b), (b, a)):
                pairs += 1
                bv, cv = finite(base["metrics"]["tokens_per_s"]), finite(cand["metrics"]["tokens_per_s"])
                if abs(cv - bv) / bv <= threshold:
                    continue
                got = judge(model, base, cand, "tokens_per_s", +1)
                if got and got[0] == "regression":
                    flagged += 1
                    alarms.append(f"{na} -> {nb}: {a.get('label')}")
    return {
        "pairs": pairs,
        "false_alarms": flagged,
        "false_alarm_rate": round(flagged / pairs, 4) if pairs else None,
        "largest_spread": round(max(spreads), 6) if spreads else None,
        "alarms": alarms,
    }


# --- command ----------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", default=str(DEFAULT_RESULTS), help="folder holding the run folders (default: results)")
    p.add_argument("--out", default=str(DEFAULT_MODEL), help="where to write the model (default: %(default)s)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when --out differs from a rebuild")


def render(model: dict) -> str:
    return json.dumps(model, indent=1, sort_keys=True) + "\n"


def main(args) -> int:
    runs = read_runs(Path(args.results))
    if not runs:
        print(f"parabench noise-model: no run with repeated launches under {args.results}", file=sys.stderr)
        return 2
    model = make_model(runs, cross_validate(runs, args.gate_threshold))
    text = render(model)
    out = Path(args.out)
    if getattr(args, "check", False):
        same = out.exists() and out.read_text() == text
        print(f"parabench noise-model: {out} is {'up to date' if same else 'STALE: run parabench noise-model'}")
        return 0 if same else 1
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    cv = model["cross_validation"]
    print(
        f"parabench noise-model: {len(model['entries'])} entries from the {len(model['runs'])} runs with repeated "
        f"launches -> {out}\n"
        f"  leave-one-run-out, one launch a side: false alarms {cv['false_alarm_rate']:.1%} of "
        f"{cv['gpu']['pairs'] + cv['host']['pairs']} same-code pairs "
        f"(GPU-bound {cv['gpu']['false_alarms']}/{cv['gpu']['pairs']}, host-bound "
        f"{cv['host']['false_alarms']}/{cv['host']['pairs']}); a {SLOWDOWN:.0%} slowdown of a GPU-bound case caught "
        f"in {cv['gpu']['detected']}/{cv['gpu']['slowed']}"
    )
    return 0
