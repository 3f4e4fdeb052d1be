"""Records are untrusted input: mutated copies of real records (fields deleted, retyped, set to
NaN, inf, huge or negative numbers, or to path-like strings) go through ``load``, ``export``,
``compare`` and the report, and none of them may raise. Every file is either read or named as
left out: nothing is dropped silently.

Mutations are batched into run folders (a report takes a fraction of a second whatever the
number of records in it), so the 500+ mutated records cost a few seconds."""

from __future__ import annotations

import copy
import json
import math
import os
import random
from pathlib import Path

import pytest

from parabench.compare import compare_runs, format_markdown, format_table, missing_data
from parabench.data import export, load
from parabench.report.html import render_report
from parabench.results import SchemaError, load_run

ROOT = Path(__file__).resolve().parent.parent
GPU_RUN = ROOT / "results" / "gpu-spine" / "20261126-020214"
FOLDERS = 20
RECORDS_PER_FOLDER = 26  # 520 mutated records in all
SEED = int(os.environ.get("PARABENCH_FUZZ_SEED", "53"))  # another seed explores other mutations

HOSTILE = [
    None,
    True,
    0,
    -1,
    -1e308,
    1e308,
    math.nan,
    math.inf,
    -math.inf,
    10**400,
    -(10**400),
    2**64,
    "",
    "x",
    "NaN",
    "../../../../tmp/x",
    "/etc/passwd",
    "a\\b",
    [],
    {},
    [None, "a", math.nan],
    {"../x": 1},
]


def _paths(value, prefix=(), depth=0) -> list[tuple]:
    """Every path (keys and list indices) into ``value`` down to depth 4."""
    out = [prefix] if prefix else []
    if depth >= 4:
        return out
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):
            out += _paths(v, (*prefix, i), depth + 1)
    return out


def mutate(rec: dict, rng: random.Random, keep: tuple = ()) -> str:
    """Change one field of ``rec`` (not those in ``keep``) in place; a description of what was done."""
    path = rng.choice([p for p in _paths(rec) if p[0] not in keep])
    parent = rec
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[key]
        return f"deleted {path}"
    value = copy.deepcopy(rng.choice(HOSTILE))
    parent[key] = value
    return f"{path} = {value!r:.40}"


def _write(path: Path, rec: dict) -> None:
    path.write_text(json.dumps(rec))  # NaN and Infinity as Python writes them; 10**400 as digits


def make_folder(folder: Path, bases: list[dict], manifest: dict, rng: random.Random) -> list[str]:
    """A run folder of RECORDS_PER_FOLDER mutated records, some in groups of three launches of one
    case; returns what was mutated."""
    (folder / "cases").mkdir(parents=True)
    m = copy.deepcopy(manifest)
    if rng.random() < 0.1:
        mutate(m, rng)
    _write(folder / "manifest.json", m)
    done, n = [], 0
    while n < RECORDS_PER_FOLDER:
        base = rng.choice(bases)
        launches = 3 if rng.random() < 0.3 else 1
        case_hash = f"{rng.getrandbits(64):016x}"
        for k in range(launches):
            rec = copy.deepcopy(base)
            rec["case_hash"] = case_hash
            rec["case"].update(repeats=launches, repeat=k)
            for _ in range(rng.choice((1, 1, 2, 3))):
                # a record of another schema version refuses the whole run (tests/test_bad_input.py):
                # keep it, so that every other mutation of the folder is read
                done.append(mutate(rec, rng, keep=("schema_version",)))
            _write(folder / "cases" / (f"{case_hash}.r{k}.json" if k else f"{case_hash}.json"), rec)
            n += 1
    return done


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory) -> list[tuple[Path, list[str]]]:
    rng = random.Random(SEED)
    manifest, bases = load_run(GPU_RUN)
    root = tmp_path_factory.mktemp("fuzz")
    return [(root / f"run{i}", make_folder(root / f"run{i}", bases, manifest, rng)) for i in range(FOLDERS)]


def test_enough_mutated_records(fuzzed):
    assert sum(len(list((folder / "cases").glob("*.json"))) for folder, _ in fuzzed) >= 500


def test_mutated_records_never_crash_load_export_compare_or_report(fuzzed, tmp_path):
    baseline = load_run(GPU_RUN)
    for folder, mutations in fuzzed:
        where = f"{folder.name} ({len(mutations)} mutations, seed {SEED}): {mutations[:5]}"
        problems: list[str] = []
        try:
            candidate = load_run(folder, problems)
        except SchemaError as exc:  # a mutated manifest: refused, naming the file
            assert str(folder / "manifest.json") in str(exc), where
            continue
        files = sorted((folder / "cases").glob("*.json"))
        left_out = {p.split(": ", 1)[0] for p in problems if ": left out: " in p}
        assert len(candidate[1]) + len(left_out) == len(files), where  # read or named, never dropped
        assert all(str(f) in left_out or f.name for f in files)
        for per_rank in (False, True):
            frame = load(folder, per_rank=per_rank)
            export(frame, tmp_path / f"{folder.name}-{per_rank}.csv", "csv")
        for base, cand in ((baseline, candidate), (candidate, baseline)):
            result = compare_runs(base, cand, threshold=0.03)
            result["missing"] = missing_data(base, cand)
            format_table(result, everything=True)
            format_markdown(result)
            json.dumps(result, default=str)
        render_report([folder], with_figures=False)
