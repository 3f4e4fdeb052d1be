"""CI runs what the README says: .ci/run is the README's test command, and the workflows run .ci/run
(CPU) and the gate with the noise model (GPU)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ci_command() -> str:
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[:2] == ["set -euo pipefail", 'cd "$(dirname "$0")/.."'], lines
    (command,) = lines[2:]
    return command


def test_ci_runs_exactly_the_readmes_test_command():
    command = _ci_command()
    assert command.startswith(".ci/install-chromium && ") and "pytest -q -n 2 --dist loadfile" in command
    readme = (ROOT / "README.md").read_text()
    assert f"\n{command}\n" in readme, f"README.md must show .ci/run's command as it is:\n{command}"


def test_the_workflows_run_ci_and_the_gpu_gate():
    cpu = (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    assert "run: .ci/run" in cpu
    gpu = (ROOT / ".github" / "workflows" / "gpu.yml").read_text()
    assert "self-hosted" in gpu and "parabench.cli compare" in gpu and "--noise-model" in gpu
