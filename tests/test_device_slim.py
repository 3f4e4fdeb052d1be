"""scripts/device_slim.sh: results/ aside for a device call and back, nothing lost."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "device_slim.sh"


def _slim(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=root,
        env={"PARABENCH_ROOT": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_aside_keeps_the_named_runs_and_restore_brings_back_everything(tmp_path):
    root = tmp_path / "checkout"
    for f in ("a/r1/cases/x.json", "a/r1/report.html", "b/r2/report.html", "calibration/h100.json"):
        (root / "results" / f).parent.mkdir(parents=True, exist_ok=True)
        (root / "results" / f).write_text(f)
    before = _files(root / "results")

    out = _slim(root, "aside", "results/a/r1")
    assert out.returncode == 0, out.stderr
    assert _files(root / "results") == {"a/r1/cases/x.json", "a/r1/report.html", "calibration/h100.json"}
    assert _slim(root, "aside").returncode == 1  # one aside at a time: nothing is overwritten

    (root / "results" / "a" / "r1" / "fidelity.json").write_text("written during the call")
    (root / "results" / "a" / "r1" / "report.html").write_text("rebuilt during the call")
    out = _slim(root, "restore")
    assert out.returncode == 0, out.stderr
    assert _files(root / "results") == before | {"a/r1/fidelity.json"}
    assert (root / "results" / "a" / "r1" / "report.html").read_text() == "a/r1/report.html"  # committed wins
    assert _slim(root, "restore").returncode == 1


def test_aside_refuses_a_folder_outside_results(tmp_path):
    root = tmp_path / "checkout"
    (root / "results" / "a").mkdir(parents=True)
    (root / "other").mkdir()
    out = _slim(root, "aside", "other")
    assert out.returncode == 1 and "not under results/" in out.stderr
    assert (root / "results" / "a").is_dir()  # nothing moved
