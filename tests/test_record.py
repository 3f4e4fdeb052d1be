"""The case record: one documented shape (parabench.record), refused when of another schema."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import get_type_hints

import pytest

from parabench.case import Case
from parabench.cli import main
from parabench.record import RECORD_KEYS, CaseRecord, build_record, pipeline_stages
from parabench.results import SCHEMA_VERSION, SchemaError, load_run

ROOT = Path(__file__).resolve().parent.parent
PP_RUN = ROOT / "results" / "studies" / "pp-profile-gpu" / "20261126-085905"


def test_documented_keys_cover_every_committed_record():
    """Every top-level key of every committed record is one RECORD_KEYS documents, so a reader
    that knows those keys knows the results; and the TypedDict names the same keys."""
    assert set(get_type_hints(CaseRecord)) == set(RECORD_KEYS)
    seen: set[str] = set()
    results = ROOT / "results"
    for path in [*results.glob("*/*/cases/*.json"), *results.glob("studies/*/*/cases/*.json")]:
        seen |= set(json.loads(path.read_text()))
    assert seen, "no committed records found"
    assert seen <= set(RECORD_KEYS), sorted(seen - set(RECORD_KEYS))


def test_built_record_uses_documented_keys_in_order():
    rec = build_record(Case(model="tiny", strategy="ref.ddp", world_size=2), "skipped", error={"message": "no"})
    assert list(rec) == [k for k in RECORD_KEYS if k in rec]
    assert rec["schema_version"] == SCHEMA_VERSION and rec["kind"] == "case" and rec["theory"] is not None


def test_data_parallel_degree_is_the_grid_s_and_sets_the_global_batch():
    """dp comes from the rank grid once (Topology.check); the global batch and the theory both use it."""
    case = Case(
        model="tiny", strategy="ref.pp_1f1b", world_size=8, micro_batch=2, grad_accum=3, options={"pp": 2, "tp": 2}
    )
    assert case.dp == 2 and case.global_batch == 2 * 3 * 2


def test_record_of_another_schema_version_is_refused_naming_the_file(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(PP_RUN, run)
    victim = min((run / "cases").glob("*.json"))
    data = json.loads(victim.read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    victim.write_text(json.dumps(data))
    with pytest.raises(SchemaError) as err:
        load_run(run)
    assert str(err.value).startswith(str(victim))
    assert f"schema version {SCHEMA_VERSION + 1}" in str(err.value)
    assert f"reads version {SCHEMA_VERSION} only" in str(err.value)
    assert main(["recheck", str(run)]) == 2
    assert str(victim) in capsys.readouterr().err
    assert json.loads(victim.read_text())["schema_version"] == SCHEMA_VERSION + 1  # left as it was


def test_pipeline_stages_drop_a_gpu_bubble_seen_by_the_host_clock_only():
    _, records = load_run(PP_RUN)
    unsynced = [
        r
        for r in records
        if r["device"]["type"] == "cuda"
        and any((pr.get("pipeline") or {}).get("timeline_synchronized") is False for pr in r["per_rank"])
    ]
    assert unsynced, "the committed pp-profile run has unsynchronised GPU timelines"
    for _, stage in pipeline_stages(unsynced[0]):
        assert stage["bubble_fraction_measured"] is None
        assert stage["bubble_fraction_theory"] is not None
