"""What `parabench compare` tells a person: one closing verdict that matches its exit status (never
"no regression" on a comparison it failed), and counts in cases on every line that counts."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from parabench.cli import main

ROOT = Path(__file__).resolve().parent.parent
GPU_RUN = ROOT / "results" / "gpu-spine" / "20261126-020214"
# Two cases of three launches each: a count of records would read 6 where a count of cases reads 2.
REPEATED_RUN = ROOT / "results" / "studies" / "launch-spread-h200x1" / "20261129-014117"


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("report.html", "logs", "scripts"))
    return dst


def _no_case_in_common(run: Path) -> None:
    for i, p in enumerate(sorted((run / "cases").glob("*.json"))):
        rec = json.loads(p.read_text())
        rec["case_hash"] = f"{i:016x}"
        p.unlink()
        (p.parent / f"{i:016x}.json").write_text(json.dumps(rec))


def _a_lost_metric(run: Path) -> None:
    p = min((run / "cases").glob("*.json"))
    rec = json.loads(p.read_text())
    del rec["metrics"]["tokens_per_s"]
    p.write_text(json.dumps(rec))


def _verdicts(out: str, err: str) -> list[str]:
    return [line for line in (out + err).splitlines() if line.startswith("parabench compare: ")]


@pytest.mark.parametrize("damage", [_no_case_in_common, _a_lost_metric])
def test_a_failed_comparison_never_reads_no_regression(tmp_path, capsys, damage):
    cand = copy_run(GPU_RUN, tmp_path / "cand")
    damage(cand)
    md = tmp_path / "c.md"
    rc, out, err = cli(capsys, "compare", GPU_RUN, cand, "--markdown", md)
    assert rc == 1
    assert "no regression" not in out + err + md.read_text()
    [verdict] = _verdicts(out, err)
    assert verdict.startswith("parabench compare: MISSING DATA: ") and verdict in err
    assert "Result: **MISSING DATA: " in md.read_text()


def test_no_case_in_common_is_said_once_in_the_summary_and_in_the_verdict(tmp_path, capsys):
    cand = copy_run(GPU_RUN, tmp_path / "cand")
    _no_case_in_common(cand)
    rc, out, err = cli(capsys, "compare", GPU_RUN, cand)
    assert rc == 1
    summary = out.splitlines()[0]
    assert "no case in common, nothing compared (7 baseline cases, 7 candidate cases)" in summary
    assert "only-baseline" not in summary  # the counts' own words would say the same thing twice
    assert _verdicts(out, err) == [
        "parabench compare: MISSING DATA: no case in common, nothing was compared "
        "(another suite, or changed case hashes?); --allow-missing accepts that"
    ]
    # the same labels under other hashes: the note says which it is
    assert "7 of 7 baseline cases are not in the candidate (no case in common: 7 of them under a label" in out

    rc, out, err = cli(capsys, "compare", GPU_RUN, cand, "--allow-missing")
    assert rc == 0
    assert _verdicts(out, err) == [
        "parabench compare: nothing compared: no case in common (allowed by --allow-missing)"
    ]


def test_counts_are_cases_in_the_summary_and_in_the_notes_whatever_the_launches(tmp_path, capsys):
    cand = copy_run(REPEATED_RUN, tmp_path / "cand")
    gone = sorted((cand / "cases").glob("*.json"))
    stem = gone[0].name.split(".")[0]
    for p in gone:
        if p.name.startswith(stem):
            p.unlink()
    rc, out, err = cli(capsys, "compare", REPEATED_RUN, cand)
    assert rc == 1
    summary = out.splitlines()[0]
    only = int(re.search(r"(\d+) only-baseline", summary).group(1))
    absent, total = map(int, re.search(r"(\d+) of (\d+) baseline cases are not in the candidate", out).groups())
    assert (only, absent, total) == (1, 1, 2)
    assert "(1 problem, listed above)" in err
