"""The runner through real torchrun launches: failures are recorded with their cause while the
rest of the suite completes, --resume skips finished cases, bad input fails before launching."""

import json
import shutil
import textwrap
from pathlib import Path

import pytest
from helpers import parabench

from parabench.case import Case
from parabench.results import load_run


def write_suite(tmp_path: Path, body: str, name="t") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(textwrap.dedent(body))
    return path


FAULTS = """
[suite]
name = "faults"
device = "cpu"
steps = 3
warmup = 1
timeout_s = 60

[[matrix]]
model = "tiny"
strategy = "torch.ddp"
world_size = 2
micro_batch = 2
options = [
  {},
  {inject_fault = {kind = "oom", rank = 1, step = 2}},
  {inject_fault = {kind = "crash", rank = 0, step = 1}},
  {inject_fault = {kind = "abort", rank = 1, step = 1}},
  {inject_fault = {kind = "hang", rank = 1, step = 1}},
  {bucket_mb = 1},
]

[[matrix]]
model = "tiny"
strategy = "torch.ddp"
world_size = 2
micro_batch = 2
timeout_s = 15
options = {inject_fault = {kind = "hang", rank = 1, step = 1}}

[[exclude]]
options = {inject_fault = {kind = "hang", rank = 1, step = 1}}
timeout_s = 60
"""


def test_faults_are_recorded_and_the_suite_goes_on(tmp_path):
    suite = write_suite(tmp_path, FAULTS)
    proc = parabench("run", "suite", str(suite), "--out", str(tmp_path / "res"), "--run-id", "r1", "--no-report")
    assert proc.returncode == 1, proc.stderr  # failed cases: exit 1, the rest of the suite still recorded
    _, records = load_run(tmp_path / "res" / "faults" / "r1")
    by_fault = {json.dumps(r["case"]["options"].get("inject_fault", {}).get("kind")): r for r in records}
    assert len(records) == 6
    ok = [r for r in records if r["status"] == "ok"]
    assert len(ok) == 2 and all(r["metrics"]["tokens_per_s"] > 0 for r in ok)

    oom = by_fault['"oom"']
    assert oom["status"] == "oom" and oom["error"]["first_failing_rank"] == 1
    assert "out of memory" in oom["error"]["message"].lower()

    crash = by_fault['"crash"']
    assert crash["status"] == "crashed" and crash["error"]["first_failing_rank"] == 0
    assert crash["error"]["type"] == "RuntimeError" and "injected crash" in crash["error"]["message"]

    abort = by_fault['"abort"']
    assert abort["status"] == "crashed" and abort["error"]["first_failing_rank"] == 1
    assert "SIGABRT" in abort["error"]["message"] and "no Python exception" in abort["error"]["message"]

    hang = by_fault['"hang"']
    assert hang["status"] == "timeout" and "hang" in hang["error"]["message"]
    # the 15 s timeout counts from the launch (torchrun's start-up included, a few seconds); the
    # recorded duration from the case's own start
    assert 5 <= hang["duration_s"] < 50


def test_resume_skips_recorded_cases(leak_run, tmp_path):
    """On a copy of the leak suite's finished run (below): one record gone, as if Ctrl-C had come
    before that case finished; --resume runs that case alone and leaves the others untouched."""
    suite, first_out, _ = leak_run
    out = tmp_path / "res"
    shutil.copytree(first_out, out)
    cases = sorted((out / "leak" / "r" / "cases").glob("*.json"))
    assert len(cases) == 4
    kept = {p: json.loads(p.read_text()) for p in cases[:-1]}
    cases[-1].unlink()
    again = parabench("run", "suite", str(suite), "--out", str(out), "--run-id", "r", "--resume", "--no-report")
    assert again.returncode == 0, again.stderr
    assert "already recorded" in again.stdout and again.stdout.count(" ok ") == 1
    assert "parabench: 1 ok, 3 kept" in again.stdout
    assert {p: json.loads(p.read_text()) for p in cases[:-1]} == kept  # untouched
    assert cases[-1].exists()
    manifest = json.loads((out / "leak" / "r" / "manifest.json").read_text())
    [resumed] = manifest["resumed"]  # the second call is on record beside the first
    assert resumed["argv"][-2:] == ["--resume", "--no-report"] and "commit" in resumed["git"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "suite", "no-such-suite"], "valid suites: "),
        (["run", "case", "--model", "tiny", "--strategy", "torch.nope"], "valid strategies: "),
        (["run", "case", "--model", "gpt-9t", "--strategy", "torch.ddp"], "valid models: "),
        (
            ["run", "case", "--model", "tiny", "--strategy", "ref.tp", "--world-size", "3", "--options", '{"tp": 2}'],
            "not dp x pp x tp",
        ),
    ],
)
def test_bad_names_exit_2_and_list_valid_ones(args, message, tmp_path):
    proc = parabench(*args, "--out", str(tmp_path))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing ran, nothing written


def test_unwritable_output_fails_before_any_case(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = parabench(
        "run", "case", "--model", "tiny", "--strategy", "torch.ddp", "--world-size", "2", "--out", str(blocker / "sub")
    )
    assert proc.returncode == 2 and "not writable" in proc.stderr


def test_world_size_beyond_devices_is_skipped(tmp_path):
    suite = write_suite(
        tmp_path,
        """
        [suite]
        name = "gpu"
        device = "cuda"
        [[matrix]]
        model = "tiny"
        strategy = "torch.ddp"
        world_size = 64
        """,
    )
    proc = parabench("run", "suite", str(suite), "--out", str(tmp_path / "res"), "--run-id", "r", "--no-report")
    assert proc.returncode == 0
    _, records = load_run(tmp_path / "res" / "gpu" / "r")
    assert records[0]["status"] == "skipped"
    assert "GPU" in records[0]["error"]["message"] or "CUDA" in records[0]["error"]["message"]


def test_manifest_names_the_commit_the_device_copy_was_sent_from(monkeypatch):
    """A tree copied to an offline GPU machine may carry a stale .git (the device's copy holds the
    session's first commit): the commit named in PARABENCH_GIT_COMMIT wins over its HEAD."""
    from parabench.results import make_manifest
    from parabench.suite import load_suite

    monkeypatch.setenv("PARABENCH_GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    git = make_manifest(load_suite("smoke"), "r")["git"]
    assert git == {
        "commit": "0123456789abcdef0123456789abcdef01234567",
        "dirty": None,
        "source": "PARABENCH_GIT_COMMIT",
    }
    monkeypatch.delenv("PARABENCH_GIT_COMMIT")
    assert make_manifest(load_suite("smoke"), "r")["git"]["commit"] != "0123456789abcdef0123456789abcdef01234567"


def test_a_hung_collective_is_recorded_as_a_timeout_naming_it(tmp_path):
    """NCCL's watchdog (its timeout is shorter than the case's) or gloo's waiting call names the
    collective that never completed; the record says hang, not crash, whatever killed the ranks."""
    from parabench.results import write_json_atomic
    from parabench.runner import _classify

    case = Case(model="tiny", strategy="ref.ep", world_size=2)
    nccl = (
        "[rank0]:[E1126 06:44:00.1 ProcessGroupNCCL.cpp:685] [PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=1234, OpType=ALLTOALL_BASE, NumelIn=8388608, NumelOut=0, "
        "Timeout(ms)=240000) ran for 240011 milliseconds before timing out.\nFatal Python error: Aborted\n"
    )
    status, error = _classify(case, tmp_path, -6, False, nccl, 250.0)
    assert status == "timeout" and "OpType=ALLTOALL_BASE" in error["stuck_collective"]

    write_json_atomic(
        tmp_path / f"{case.case_hash}.rank1.error.json",
        {
            "rank": 1,
            "type": "RuntimeError",
            "time": 1.0,
            "oom": False,
            "message": "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 120000ms for "
            "recv operation to complete",
            "traceback": "...",
        },
    )
    status, error = _classify(case, tmp_path, 1, False, "", 130.0)
    assert status == "timeout" and error["stuck_collective"].startswith("Timed out waiting 120000ms for recv")
    assert error["ranks_reporting"] == [1]

    (tmp_path / f"{case.case_hash}.rank1.error.json").unlink()
    status, error = _classify(case, tmp_path, -6, False, "Fatal Python error: Aborted\n", 5.0)
    assert status == "crashed" and "stuck_collective" not in error


def test_run_case_with_the_default_device_records_its_result(tmp_path):
    """device "auto" reaches the ranks resolved (cpu here), which changes the case's hash; the
    ranks must still name their result by the runner's hash, or the runner never finds it (every
    `parabench run case` without --device was recorded as crashed with exit status 0)."""
    proc = parabench(
        "run",
        "case",
        "--model",
        "tiny",
        "--strategy",
        "torch.ddp",
        "--world-size",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(tmp_path),
        "--name",
        "auto",
        "--no-report",
    )
    assert proc.returncode == 0, proc.stderr
    (run,) = (tmp_path / "auto").iterdir()
    _, records = load_run(run)
    assert [(r["case"]["device"], r["status"], r["launch"]["device"]) for r in records] == [("auto", "ok", "cpu")]


@pytest.fixture(scope="module")
def leak_run(tmp_path_factory):
    """The leak suite below, run once: (suite file, --out folder, the CLI's result)."""
    tmp_path = tmp_path_factory.mktemp("leak")
    suite = write_suite(
        tmp_path,
        """
        [suite]
        name = "leak"
        device = "cpu"
        steps = 2
        warmup = 1
        [[matrix]]
        model = "tiny"
        strategy = "torch.ddp"
        world_size = 2
        options = [
          {inject_fault = {kind = "leak", rank = 1, step = 0, bytes = 1048576}},
          {inject_fault = {kind = "leak", rank = 1, step = 1, bytes = 314572800}},
          {bucket_mb = 1},
          {bucket_mb = 2},
        ]
        """,
    )
    proc = parabench("run", "suite", str(suite), "--out", str(tmp_path / "res"), "--run-id", "r", "--no-report")
    return suite, tmp_path / "res", proc


def test_a_case_that_leaves_memory_allocated_ends_its_launch(leak_run):
    """A case that keeps device memory alive after it finishes (as deepspeed.pp did on 2x H100:
    11.7 GiB on rank 1, added to the next case's peak) must not share its launch with later cases;
    a small leftover (under the limit) keeps the launch going."""
    _, out, proc = leak_run
    assert proc.returncode == 0, proc.stderr
    _, records = load_run(out / "leak" / "r")
    assert [r["status"] for r in records] == ["ok"] * 4
    by_opts = {json.dumps(Case.from_dict(r["case"]).options_as_written(), sort_keys=True): r for r in records}
    small, big, after, last = (
        by_opts[json.dumps(o, sort_keys=True)]
        for o in (
            {"inject_fault": {"kind": "leak", "rank": 1, "step": 0, "bytes": 1048576}},
            {"inject_fault": {"kind": "leak", "rank": 1, "step": 1, "bytes": 314572800}},
            {"bucket_mb": 1},
            {"bucket_mb": 2},
        )
    )
    assert small["launch"]["log"] == big["launch"]["log"]  # 1 MiB left behind: same launch
    assert after["launch"]["log"] == last["launch"]["log"] != big["launch"]["log"]
    assert [p["allocated_at_start_bytes"] for p in big["per_rank"]] == [None, 1048576]
    assert [p["allocated_at_start_bytes"] for p in after["per_rank"]] == [None, None]  # a fresh process
    left = big["leftover_after_case"]
    assert (left["rank"], left["leftover_bytes"]) == (1, 1048576 + 314572800)
    assert any("left 0.29 GiB allocated on rank 1" in c for c in big["caveats"])
    assert not small.get("caveats") and "left 0.29 GiB" in proc.stdout


def test_manifest_names_the_cpu_the_host_bound_libraries_ran_on():
    """Host-bound peers (DeepSpeed's per-tensor Python, FSDP2 hooks) run at the CPU's speed, so the
    manifest says which CPU, how much memory, and how many cores the run could use."""
    from parabench.results import make_manifest
    from parabench.suite import load_suite

    host = make_manifest(load_suite("smoke"), "r")["host"]
    assert host["cpu_model"]
    assert 1 <= host["cpus_usable"] <= host["cpu_count"]
    assert host["memory_bytes"] > 1 << 30


def test_manifest_names_the_libraries_a_result_depends_on():
    """The peers' library and the fp8 recipe's float8 training are versions of their own: a result
    made with other ones is another result."""
    from importlib.metadata import PackageNotFoundError, version

    from parabench.results import make_manifest
    from parabench.suite import load_suite

    versions = make_manifest(load_suite("smoke"), "r")["versions"]
    for package in ("deepspeed", "torchao"):
        try:
            installed = version(package)
        except PackageNotFoundError:
            installed = None
        assert versions[package] == installed, package
