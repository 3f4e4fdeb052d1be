"""`parabench recheck` sets recorded measurements beside the current theory without touching them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from parabench.cli import main
from parabench.results import load_run

GPU_MP = Path(__file__).resolve().parent.parent / "results" / "gpu-mp" / "20261126-021202"


def _as_before_the_theory(run: Path) -> dict:
    """Strip the ref.tp_sp records back to what a run made before 16-bit SP traffic was modelled."""
    measured = {}
    for p in (run / "cases").glob("*.json"):
        rec = json.loads(p.read_text())
        rec.pop("theory_recheck", None)
        if rec["case"]["strategy"] == "ref.tp_sp":
            rec["theory"]["comm_payload_bytes"] = rec["theory"]["comm_payload_bytes_per_rank"] = None
            rec["checks"] = {"available": True, "comm_ok": None, "state_ok": True, "ok": True}
            measured[p.name] = rec["per_rank"]
        p.write_text(json.dumps(rec))
    return measured


def test_recheck_judges_old_measurements_by_new_theory_and_keeps_them(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(GPU_MP, run)
    measured = _as_before_the_theory(run)
    assert len(measured) == 2  # gpt-350m and gpt-1.3b, 2 GPUs, bf16

    assert main(["recheck", str(run), "--strategy", "torch.*"]) == 0  # a filter that excludes them
    assert all(json.loads((run / "cases" / n).read_text())["checks"]["comm_ok"] is None for n in measured)

    assert main(["recheck", str(run), "--strategy", "ref.tp*"]) == 0
    out = capsys.readouterr().out
    assert out.count("comm=theory  (was: no comm verdict)") == 2  # tp_sp at both sizes
    _, records = load_run(run)
    for rec in records:
        if rec["case"]["strategy"] != "ref.tp_sp":
            continue
        assert rec["per_rank"] == measured[f"{rec['case_hash']}.json"]
        assert rec["checks"]["comm_ok"] is True
        for kind in ("all_gather", "reduce_scatter"):
            row = rec["checks"]["comm"][kind]
            assert row["measured_bytes"] == row["expected_bytes"], (kind, row)
        assert rec["theory_recheck"]["original_checks"]["comm_ok"] is None
        assert rec["theory_recheck"]["at"]


def test_recheck_of_a_missing_run_fails_clearly(tmp_path, capsys):
    assert main(["recheck", str(tmp_path / "nope")]) == 2
    assert "not a parabench run folder" in capsys.readouterr().err


def test_recheck_leaves_records_of_another_strategy_version_alone(tmp_path, capsys):
    """ref.zero3 changed its memory layout (version 3) after the 2-GPU run: its v2 records keep
    their theory, since the new theory describes code that did not run."""
    run = tmp_path / "run"
    shutil.copytree(Path(__file__).resolve().parent.parent / "results" / "h100x2" / "20261126-025621", run)
    before = {p.name: p.read_text() for p in (run / "cases").glob("*.json")}
    assert main(["recheck", str(run), "--strategy", "ref.zero3"]) == 0
    out = capsys.readouterr().out
    assert "skipped: ref.zero3 gpt-1.3b" in out and "not rechecked" in out
    assert {p.name: p.read_text() for p in (run / "cases").glob("*.json")} == before
