"""Hard stops of the runner, a second runner on the same folder, a full disk, a stale DeepSpeed
build lock and CPU out-of-memory (issue 20), through real torchrun launches on gloo: nothing
recorded wrong, no finished record lost or altered, no process of a launch left behind."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from unittest import mock

import pytest
from helpers import parabench

from parabench.case import Case
from parabench.launch import clear_stale_extension_locks, marked_processes, process_start_ticks
from parabench.results import load_run
from parabench.runner import _classify, out_of_space

ROOT = Path(__file__).resolve().parent.parent

# Case "a" is over in a moment, "b" runs for seconds (the runner is stopped while it runs), "c"
# is short again: all three share one launch.
SUITE = """
[suite]
name = "{name}"
device = "cpu"
warmup = 0
seq_len = 16
micro_batch = 1
timeout_s = 120

[[matrix]]
model = "tiny"
strategy = "torch.ddp"
world_size = 2
steps = 3
options = {{bucket_mb = 1}}

[[matrix]]
model = "tiny"
strategy = "torch.ddp"
world_size = 2
steps = {long_steps}
options = {{bucket_mb = 2}}

[[matrix]]
model = "tiny"
strategy = "torch.ddp"
world_size = 2
steps = 3
options = {{bucket_mb = 3}}
{extra}"""


def write_suite(tmp_path: Path, name: str, long_steps: int = 500, extra: str = "") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(textwrap.dedent(SUITE.format(name=name, long_steps=long_steps, extra=extra)))
    return path


def cli(*args: str, env=None) -> subprocess.CompletedProcess:
    """A runner that is neither killed nor signalled: in this process (helpers.parabench), with
    ``env`` as its environment while it runs."""
    with mock.patch.dict(os.environ, env or {}):
        return parabench(*args)


def start_cli(log: Path, *args: str, env=None) -> subprocess.Popen:
    """A runner in a session of its own, as from a terminal: signals sent to it reach it alone."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "parabench.cli", *args],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"gave up waiting for {what} after {timeout:.0f} s")


def live_processes_mentioning(text: str) -> list[int]:
    """Live (not zombie) processes whose command line names ``text``: a runner, torchrun and ranks
    all name a path of the test's folder."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline and process_start_ticks(int(d)) is not None:
            found.append(int(d))
    return found


@pytest.fixture
def no_leftovers(tmp_path):
    """Whatever the test's outcome, end the processes it started (found by its folder's path)."""
    yield
    for pid in live_processes_mentioning(str(tmp_path)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def records(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / "cases").glob("*.json"))}


def live_launch(run_dir: Path) -> dict | None:
    found = list((run_dir / ".scratch").glob("*/launch.json"))
    return json.loads(found[0].read_text()) if found else None


def test_kill_9_of_the_runner_then_resume_ends_the_orphans_and_records_every_case_anew(tmp_path, no_leftovers):
    """kill -9 leaves torchrun and its ranks running (each in a session of its own). The resumed
    run ends them (pid and start time checked), never reads what they wrote, keeps the finished
    record byte for byte and runs the interrupted case itself. On the way, the first launch
    removes a stale DeepSpeed build lock, and a rank whose allocation the host cannot satisfy
    is recorded as oom."""
    extensions = tmp_path / "torch_extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    cpu_oom = """
[[matrix]]
model = "tiny"
strategy = "torch.ddp"
world_size = 2
steps = 2
options = {inject_fault = {kind = "cpu_oom", rank = 1, step = 0}}
"""
    suite = write_suite(tmp_path, "kill9", extra=cpu_oom)
    out, run_dir = tmp_path / "res", tmp_path / "res" / "kill9" / "r"
    args = ("run", "suite", str(suite), "--out", str(out), "--run-id", "r", "--no-report")

    runner = start_cli(tmp_path / "first.log", *args, env=env)
    wait_for(lambda: records(run_dir), 120, "the first record")
    orphan = live_launch(run_dir)
    runner.send_signal(signal.SIGKILL)  # the runner alone: its launch lives in another session
    runner.wait(timeout=10)
    invocation = orphan["invocation"]
    assert process_start_ticks(orphan["pid"]) == orphan["start_ticks"], "torchrun should outlive kill -9"
    assert marked_processes(invocation), "the ranks should outlive kill -9"
    assert not lock.exists() and "removed the stale build lock" in (tmp_path / "first.log").read_text()
    before = records(run_dir)
    assert len(before) == 1

    resumed_at = time.time()
    again = cli(*args, "--resume", env=env)
    assert again.returncode == 1, again.stdout + again.stderr  # the injected CPU OOM case failed, by design
    assert "ending the launch left behind by runner pid" in again.stdout
    assert process_start_ticks(orphan["pid"]) is None and marked_processes(invocation) == []
    assert not (run_dir / ".scratch").exists()

    after = records(run_dir)
    assert {k: after[k] for k in before} == before  # the finished record, byte for byte
    new = [json.loads(after[k]) for k in after if k not in before]
    by_fault = {bool(r["case"]["options"].get("inject_fault")): r for r in new}
    assert len(new) == 3 and sorted(r["status"] for r in new) == ["ok", "ok", "oom"]
    for r in new:  # run by the resumed invocation, timed by it
        assert r["started_at"] >= resumed_at and r["duration_s"] <= time.time() - resumed_at
    oom = by_fault[True]["error"]
    assert oom["first_failing_rank"] == 1 and "DefaultCPUAllocator: can't allocate memory" in oom["message"]


def test_sigterm_ends_the_launch_and_keeps_records_and_a_second_runner_is_refused(tmp_path, no_leftovers):
    suite = write_suite(tmp_path, "term")
    out, run_dir = tmp_path / "res", tmp_path / "res" / "term" / "r"
    args = ("run", "suite", str(suite), "--out", str(out), "--run-id", "r", "--no-report")
    runner = start_cli(tmp_path / "first.log", *args)
    launch = wait_for(lambda: live_launch(run_dir), 120, "the first launch")

    second = cli(*args)
    assert second.returncode == 2
    assert f"run folder {run_dir} is in use by another parabench runner (pid {runner.pid})" in second.stderr

    finished = wait_for(lambda: records(run_dir), 120, "the first record")
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=60) != 0
    with pytest.raises(ProcessLookupError):
        os.killpg(launch["pid"], 0)  # torchrun's group
    assert live_processes_mentioning(str(run_dir)) == []  # the ranks, in sessions of their own
    assert records(run_dir) == finished  # the interrupted case is not recorded as anything
    assert "interrupted" in (tmp_path / "first.log").read_text()
    assert not (run_dir / ".scratch").exists()


def test_a_full_disk_stops_the_run_with_a_clear_error_and_no_half_record(tmp_path, no_leftovers):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(disk)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {mounted.stderr.decode().strip()}")
    try:
        extra = "".join(
            f"""
[[matrix]]
model = "tiny"
strategy = "torch.ddp"
world_size = 2
steps = 2
options = {{bucket_mb = {mb}}}
"""
            for mb in range(4, 9)
        )
        suite = write_suite(tmp_path, "full", long_steps=2, extra=extra)  # 8 records of ~20 KiB: too many
        proc = cli("run", "suite", str(suite), "--out", str(disk), "--run-id", "r", "--no-report")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "parabench: error: " in proc.stderr and "No space left on device" in proc.stderr
        run_dir = disk / "full" / "r"
        for p in (run_dir / "cases").glob("*.json"):
            json.loads(p.read_text())  # every record whole
        assert not list(disk.rglob("*.tmp"))
        assert live_processes_mentioning(str(disk)) == []
        # A rank that cannot write its result takes its launch down: the runner then asks the disk
        # whether a record still fits before blaming the case.
        with pytest.raises(OSError), open(disk / "filler", "wb") as f:
            while True:
                f.write(bytes(4096))
                f.flush()
        assert "does not fit: No space left on device" in out_of_space(run_dir)
        assert out_of_space(tmp_path) is None
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_stale_build_lock_goes_and_a_held_one_stays(tmp_path):
    """torch's FileBaton keeps its lock file open while it builds: a lock nobody has open belongs
    to a builder that was killed; one that a live process holds is left alone, however old."""
    stale = tmp_path / "deepspeed_shm_comm" / "lock"
    held = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    for lock in (stale, held):
        lock.parent.mkdir(parents=True)
    hold = (
        f"import os, time\nfd = os.open({str(held)!r}, os.O_CREAT | os.O_EXCL)\n"  # as FileBaton does
        "print('held', flush=True)\ntime.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        stale.touch()
        hour_ago = time.time() - 3600
        for lock in (stale, held):
            os.utime(lock, (hour_ago, hour_ago))
        said = []
        removed = clear_stale_extension_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path)}, echo=said.append)
        assert removed == [stale] and not stale.exists() and held.exists()
        assert str(stale) in said[0]
    finally:
        holder.kill()
        holder.wait()
    assert clear_stale_extension_locks({"TORCH_EXTENSIONS_DIR": str(tmp_path)}, echo=said.append) == [held]


def test_cpu_out_of_memory_is_recorded_as_oom(tmp_path):
    """The host's allocation failures (torch's CPU allocator, Python's MemoryError) and a rank
    killed by the kernel's OOM killer are ``oom``; a SIGKILL while the kernel's OOM-kill count
    stood still came from elsewhere and stays ``crashed``."""
    from parabench.results import write_json_atomic
    from parabench.worker import is_oom

    for allocate in (
        lambda: __import__("torch").empty(1 << 62, dtype=__import__("torch").uint8),
        lambda: bytearray(1 << 62),
    ):
        with pytest.raises((RuntimeError, MemoryError)) as raised:
            allocate()
        assert is_oom(raised.value)
    assert not is_oom(RuntimeError("injected crash"))

    case = Case(model="tiny", strategy="torch.ddp", world_size=2)
    error_file = tmp_path / f"{case.case_hash}.rank1.error.json"
    allocator = (
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 4611686018427387904 bytes."
    )
    for kind, message in (("RuntimeError", allocator), ("MemoryError", "")):
        # "oom": False, as an error file written before the worker knew CPU allocation failures
        write_json_atomic(
            error_file, {"rank": 1, "type": kind, "message": message, "traceback": "...", "time": 1.0, "oom": False}
        )
        status, error = _classify(case, tmp_path, 1, False, "", 3.0)
        assert (status, error["first_failing_rank"], error["type"]) == ("oom", 1, kind)
    error_file.unlink()

    killed = (
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-26_12:00:00\n  host      : h\n"
        "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 4242)\n"
    )
    status, error = _classify(case, tmp_path, 1, False, killed, 3.0, oom_kills=1)
    assert status == "oom" and "out-of-memory killer killed 1 process" in error["message"]
    assert error["first_failing_rank"] == 1 and error["exit_code"] == -9
    status, error = _classify(case, tmp_path, 1, False, killed, 3.0, oom_kills=0)
    assert status == "crashed" and "SIGKILL came from elsewhere" in error["message"]
    assert _classify(case, tmp_path, 1, False, killed, 3.0, oom_kills=None)[0] == "oom"
    aborted = killed.replace("exitcode  : -9", "exitcode  : -6")
    assert _classify(case, tmp_path, 1, False, aborted, 3.0, oom_kills=1)[0] == "crashed"


def test_a_launch_that_dies_in_start_up_is_launched_again_once(tmp_path):
    """A rank that aborts before the process group forms (as gloo's transport sometimes does while
    connecting) is no case's fault: its launch is run again once, and the record says so; a second
    start-up death records the case as crashed, naming both."""
    suite = tmp_path / "s.toml"
    suite.write_text(
        textwrap.dedent(
            """
            [suite]
            name = "startup"
            device = "cpu"
            steps = 2
            warmup = 1
            [[matrix]]
            model = "tiny"
            strategy = "torch.ddp"
            world_size = 2
            options = [
              {inject_fault = {kind = "startup_abort", rank = 1, launches = 1}},
              {inject_fault = {kind = "startup_abort", rank = 1, launches = 2}},
            ]
            """
        )
    )
    proc = parabench("run", "suite", str(suite), "--out", str(tmp_path / "res"), "--run-id", "r", "--no-report")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.count("died in start-up") == 2
    _, records = load_run(tmp_path / "res" / "startup" / "r")
    by_launches = {r["case"]["options"]["inject_fault"]["launches"]: r for r in records}
    once, twice = by_launches[1], by_launches[2]
    assert once["status"] == "ok"
    assert "SIGABRT" in once["launch"]["relaunched_after_startup_crash"]
    assert once["launch"]["log"].endswith(".relaunch.log")
    assert twice["status"] == "crashed"
    assert "SIGABRT" in twice["error"]["message"] and "SIGABRT" in twice["error"]["earlier_startup_crash"]
    logs = sorted(p.name for p in (tmp_path / "res" / "startup" / "r" / "logs").iterdir())
    assert len(logs) == 4  # each case's first launch log is kept beside its relaunch's
