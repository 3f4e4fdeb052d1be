"""The CPU smoke gate: the smoke suite held to the committed CPU baseline (results/baselines/cpu-smoke)
on everything that is deterministic there (statuses, loss series, every rank's communication and
model-state bytes), and a deliberate change to one strategy's communication caught by name.

When a change is meant to move one of those figures, re-record the baseline with
``.ci/update-smoke-baseline`` and commit it with the change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from parabench.cli import main as cli_main
from parabench.compare import FAILING

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "results" / "baselines" / "cpu-smoke"
FAULT_CASE = "ref.ddp tiny w2 fp32"


def _gate(tmp_path: Path, candidate: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "gate.json"
    rc = cli_main(["compare", str(BASELINE), str(candidate), "--exact-only", "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def _failures(result: dict) -> list[str]:
    lines = [f"missing: {m}" for m in result.get("missing", [])]
    for case in result["cases"]:
        if case["verdict"] in FAILING and not case["metrics"]:
            lines.append(f"{case['label']}: {'; '.join(case['notes'])}")
        lines += [
            f"{case['label']}: {m['metric']} {m['baseline']} -> {m['candidate']} ({m['verdict']}) {m['note']}"
            for m in case["metrics"]
            if m["verdict"] in FAILING
        ]
    return lines


def test_smoke_suite_matches_the_committed_cpu_baseline(smoke_run, tmp_path):
    rc, result = _gate(tmp_path, smoke_run)
    failures = _failures(result)
    assert rc == 0 and not failures, (
        "the smoke suite moved against results/baselines/cpu-smoke; if the change is meant to, "
        "re-record it with .ci/update-smoke-baseline and commit it:\n  " + "\n  ".join(failures)
    )
    compared = [c for c in result["cases"] if c["verdict"] == "same"]
    assert len(compared) == len(result["cases"]) >= 40
    # the exact figures were compared, not skipped: losses and every rank's bytes of the 2-rank cases
    metrics = {m["metric"] for c in result["cases"] for m in c["metrics"]}
    assert {"losses", "comm_payload_bytes", "comm_payload_bytes[rank 1]", "model_state_bytes[rank 1]"} <= metrics


# Loaded by every Python process of the faulty run (PYTHONPATH): once reference_impls.data_parallel is
# imported, its DDP issues every gradient all-reduce twice, the first on a copy, so the gradients and
# the losses stay exactly as they were and only the communication doubles.
SECOND_ALL_REDUCE = """
import importlib.abc
import importlib.machinery
import sys

TARGET = "reference_impls.data_parallel"


class _TwiceAllReduce:
    def __init__(self, dist):
        self._dist = dist

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        self._dist.all_reduce(tensor.clone(), *args, **{**kwargs, "async_op": False})
        return self._dist.all_reduce(tensor, *args, **kwargs)


class _Inject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.dist = _TwiceAllReduce(module.dist)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Inject())
"""


def test_a_second_all_reduce_in_one_strategy_fails_the_gate_naming_the_metric(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SECOND_ALL_REDUCE)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "parabench.cli",
            "run",
            "suite",
            "smoke",
            "--filter",
            FAULT_CASE,
            "--out",
            str(tmp_path),
            "--run-id",
            "fault",
            "--no-report",
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rc, result = _gate(tmp_path, tmp_path / "smoke" / "fault", "--allow-missing")
    assert rc == 1 and result["regression"]
    (case,) = [c for c in result["cases"] if c["verdict"] not in ("only-baseline",)]
    assert case["label"].startswith(FAULT_CASE) and case["verdict"] == "regression"
    by = {m["metric"]: m for m in case["metrics"]}
    flagged = {name for name, m in by.items() if m["verdict"] == "regression"}
    assert flagged == {"comm_payload_bytes", "comm_bytes[all_reduce]", "comm_payload_bytes[rank 1]"}
    assert by["comm_payload_bytes"]["candidate"] == 2 * by["comm_payload_bytes"]["baseline"]
    assert by["losses"]["verdict"] == "same"  # only the traffic changed
    assert any("comm_payload_bytes" in line for line in _failures(result))
