import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")


import fcntl  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> Path:
    """The smoke suite run once through the real CLI (torchrun launches); its run folder.

    Once per test command even under pytest-xdist (``-n 2 --dist loadfile``), whose workers are
    separate sessions: the first worker to ask runs it into the folder the workers share (the parent
    of their base temp folders) while holding a lock, and a later one waits and reads the same run,
    or the same failure."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out = shared / "smoke-shared"
    outcome = out / "outcome.json"
    with open(shared / "smoke.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not outcome.exists():
            out.mkdir(exist_ok=True)
            proc = subprocess.run(
                [sys.executable, "-m", "parabench.cli", "run", "suite", "smoke", "--out", str(out), "--run-id", "ci"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=900,
            )
            outcome.write_text(json.dumps({"rc": proc.returncode, "tail": proc.stdout[-3000:] + proc.stderr[-3000:]}))
    result = json.loads(outcome.read_text())
    assert result["rc"] == 0, result["tail"]
    run_dir = out / "smoke" / "ci"
    assert (run_dir / "report.html").exists(), result["tail"][-2000:]
    return run_dir
