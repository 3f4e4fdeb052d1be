import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")


import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> Path:
    """The smoke suite run once through the real CLI (torchrun launches); its run folder."""
    out = tmp_path_factory.mktemp("smoke")
    proc = subprocess.run(
        [sys.executable, "-m", "parabench.cli", "run", "suite", "smoke", "--out", str(out), "--run-id", "ci"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = out / "smoke" / "ci"
    assert (run_dir / "report.html").exists(), proc.stdout[-2000:]
    return run_dir
