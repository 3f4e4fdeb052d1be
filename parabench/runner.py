"""Runs a suite: launches torchrun for each case (or for a batch of cases), watches it, and
writes one record per case the moment it finishes.

Failure handling, the part a benchmark harness is judged by:
- every case has a wall-clock timeout; a case that exceeds it is killed (its whole process
  session) and recorded as ``timeout``;
- a rank that raises writes an error file; the earliest one names the first failing rank, its
  exception and whether it was an out-of-memory (``oom``), else the case is ``crashed``;
- a rank that dies without a word (abort, segfault) is ``crashed`` with the exit status and the
  tail of the launcher's log; one killed by SIGKILL while the kernel's OOM-kill counter moved is
  ``oom``, as is a rank that raised ``MemoryError`` or the CPU allocator's "can't allocate memory";
- the suite always goes on with the next case; records already written are never touched, so
  Ctrl-C loses nothing finished and ``--resume`` continues where the last run stopped.

The runner owns its launches through ``parabench.launch.LaunchOwner`` (the run folder's lock, the
invocation's scratch, marked processes ended completely after every launch and on any signal). Each
launch works in ``.scratch/<invocation id>/launch-<n>/``: results, error files and ``.started``
stamps are read only from the current launch's folder, so nothing written by an earlier launch or by
the orphans of a runner killed with ``kill -9`` is ever taken, and a case that did not start in this
invocation is never recorded as a timeout.

Batch launches run several cases of the same world size in one torchrun, saving its start-up
per case. A case with ``repeats`` > 1 runs that many launches of its own, ordered round-robin over
the suite (A B C A B C: drift hits every case alike); launch k of a case writes
``cases/<hash>.r<k>.json`` beside the first launch's ``cases/<hash>.json`` (``suite.launch_key``).
The worker marks each case as started; when a batch dies, the started-but-unfinished
case takes the blame and the rest of the batch is relaunched.

While a launch runs, the runner shows the running case's phase and step counter, which rank 0
keeps in ``<key>.status.json`` in the launch's folder (``parabench.progress``): rewritten in place
on a terminal, one line per phase elsewhere. Trace files the worker wrote there (``trace``,
``memory_snapshot``) move into the run folder's ``traces/`` before the case's record is written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from parabench import multinode
from parabench.case import Case
from parabench.launch import LaunchOptions, LaunchOwner, MultiNodeStop, OutputError, end_launch
from parabench.meters import host
from parabench.progress import LiveLine, read_status, status_path
from parabench.record import build_record
from parabench.registry import get_strategy
from parabench.results import case_record_path, load_json, make_manifest, new_run_id
from parabench.suite import Suite

STATUSES = ("ok", "oom", "crashed", "timeout", "skipped", "error")


def resolve_device(case: Case) -> str:
    if case.device == "auto":
        import torch  # only here: a refusal of a CPU case must not wait for torch to load

        return "cuda" if torch.cuda.is_available() else "cpu"
    return case.device


def skip_reason(case: Case, launch: LaunchOptions) -> str | None:
    import torch

    device = resolve_device(case)
    if device == "cuda":
        have = torch.cuda.device_count()
        if have == 0:
            return "the case asks for CUDA but no CUDA device is present"
        per_node = case.world_size // launch.nnodes
        if per_node > have:
            return f"needs {per_node} GPUs per node, this machine has {have}"
    if case.recipe == "fp8":  # float8 matmuls: sm_89+ and torchao (parabench.fp8)
        from parabench.fp8 import skip_reason as fp8_skip_reason

        reason = fp8_skip_reason(device)
        if reason:
            return reason
    from parabench.registry import get_strategy

    unsupported = get_strategy(case.strategy).unsupported
    return unsupported(case, device) if unsupported else None


_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def _root_cause(log_tail: str) -> tuple[int, int] | None:
    """(rank, exit code) of the first failure as torchrun reports it, if it does."""
    m = _ROOT_CAUSE.search(log_tail)
    return (int(m.group(1)), int(m.group(2))) if m else None


# A collective that never completes: NCCL's watchdog names it (the worker's collective timeout is
# shorter than the case's, so the watchdog fires first); gloo raises from the waiting call.
_STUCK_COLLECTIVE = re.compile(
    r"(Watchdog caught collective operation timeout: WorkNCCL\([^)]*\)"
    r"|Timed out waiting \d+ms for (?:send|recv) operation to complete)"
)


def _stuck_collective(*texts: str) -> str | None:
    for text in texts:
        m = _STUCK_COLLECTIVE.search(text or "")
        if m:
            return m.group(1)
    return None


# What a CPU allocation failure looks like: Python's MemoryError, or c10's DefaultCPUAllocator
# ("[enforce fail at alloc_cpu.cpp:...] DefaultCPUAllocator: can't allocate memory: you tried to
# allocate N bytes. Error code 12 (Cannot allocate memory)"), raised as a plain RuntimeError.
_CPU_OOM = re.compile(r"DefaultCPUAllocator: can't allocate memory|Cannot allocate memory|out of memory", re.IGNORECASE)
SPACE_PROBE_BYTES = 64 << 10  # more than a case record takes


def out_of_space(run_dir: Path) -> str | None:
    """After a failed launch: why the run folder's disk cannot take another record, or None. A
    rank that fails writing its result to a full disk takes the launch down with it (and its
    error file and log may be lost too); recording that as the case's crash would be wrong, so
    the runner asks the disk directly: a probe file of a record's size must fit."""
    probe = run_dir / ".space-probe"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(SPACE_PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"a {SPACE_PROBE_BYTES >> 10} KiB file does not fit: {exc.strerror}"
        return None
    finally:
        probe.unlink(missing_ok=True)
    return None


def is_oom_error(error: dict) -> bool:
    """Whether a rank's error file describes an out-of-memory, on any device."""
    return (
        bool(error.get("oom"))
        or error.get("type") == "MemoryError"
        or bool(_CPU_OOM.search(error.get("message") or ""))
    )


def _classify(
    case: Case,
    scratch: Path,
    rc: int | None,
    timed_out: bool,
    log_tail: str,
    elapsed: float,
    oom_kills: int | None = None,
) -> tuple[str, dict]:
    """Status and cause of a case that produced no result.

    A rank that raises writes an error file; its peers then often raise too (connection reset)
    a moment later, so the earliest error file names the first failure. A rank that dies
    without a Python exception (abort, segfault, SIGKILL) writes nothing, while its peers do:
    torchrun's own root-cause report names it, and it takes precedence when it has no file.

    ``oom_kills``: how many processes the kernel's OOM killer ended during the launch (None:
    unknown). A silent SIGKILL is ``oom`` unless that count is known to be 0 (then someone else
    sent it).
    """
    errors = []
    for p in scratch.glob(f"{case.record_key}.rank*.error.json"):
        try:
            errors.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    stuck = _stuck_collective(log_tail, *(e.get("message", "") + e.get("traceback", "") for e in errors))
    if stuck:  # a hang, whatever way the ranks then went down
        return "timeout", {
            "message": f"a collective hung until its timeout ({stuck}); the ranks had issued "
            "different collectives or sizes, or one stopped issuing them",
            "stuck_collective": stuck,
            "ranks_reporting": sorted(e["rank"] for e in errors),
            "log_tail": log_tail[-1500:],
        }
    root = _root_cause(log_tail)
    silent_death = root is not None and root[1] != 1 and all(e["rank"] != root[0] for e in errors)
    if errors and not silent_death:
        first = min(errors, key=lambda e: e["time"])
        status = "oom" if is_oom_error(first) else "crashed"
        return status, {
            "first_failing_rank": first["rank"],
            "type": first["type"],
            "message": first["message"],
            "traceback_tail": first["traceback"][-2000:],
            "ranks_reporting": sorted(e["rank"] for e in errors),
            "log_tail": log_tail[-1500:],
        }
    if timed_out:
        return "timeout", {
            "message": f"no result after {elapsed:.0f} s (timeout {case.timeout_s:.0f} s): hang or too slow; "
            "the process group was killed",
            "log_tail": log_tail[-1500:],
        }
    rank, code = root if root else (None, rc)
    sig = -code if code is not None and code < 0 else None
    signame = signal.Signals(sig).name if sig and sig in signal.Signals._value2member_map_ else None
    msg = (
        (f"rank {rank} " if rank is not None else "launcher ")
        + f"exited with status {code}"
        + (f" ({signame})" if signame else "")
        + " and no Python exception (killed, aborted or segfaulted)"
    )
    status = "crashed"
    if signame == "SIGKILL":
        if oom_kills is None:
            status = "oom"
            msg += "; SIGKILL without a word is the kernel's out-of-memory killer's signature (its kill count is unreadable here)"
        elif oom_kills > 0:
            status = "oom"
            msg += f"; the kernel's out-of-memory killer killed {oom_kills} process(es) during the launch"
        else:
            msg += "; the kernel's out-of-memory kill count did not move: the SIGKILL came from elsewhere"
    if errors:
        later = min(errors, key=lambda e: e["time"])
        msg += f"; then rank {later['rank']} reported {later['type']}: {later['message'][:200]}"
    return status, {
        "first_failing_rank": rank,
        "message": msg,
        "exit_code": code,
        "log_tail": log_tail[-1500:],
        "kernel_oom_kills": oom_kills,
    }


def _tail(path: Path, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def kernel_oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed: the cgroup's count when cgroup v2
    has one (local to this container), else the machine's (/proc/vmstat), None when neither."""
    try:
        cgroup = Path("/proc/self/cgroup").read_text().splitlines()
        rel = next(line.split("::", 1)[1] for line in cgroup if line.startswith("0::"))
        for line in (Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.events").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


@dataclass
class _Launch:
    proc: subprocess.Popen
    folder: Path  # this launch's scratch: its cases, results, error files and start stamps
    log_path: Path
    retired_file: Path
    started: float
    info: dict  # the record's "launch" section
    oom_kills_at_start: int | None
    # seconds the running case had taken when the watcher ended the launch for its timeout: the
    # clock the timeout was judged by, and so the one its message reports
    timed_out_after_s: float | None = None


def _delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


class Runner(LaunchOwner):
    def __init__(
        self,
        suite: Suite,
        run_dir: Path,
        launch: LaunchOptions,
        resume: bool = False,
        retry_failed: bool = False,
        echo=print,
        live: bool | None = None,
    ):
        """``live``: rewrite the progress line in place (a terminal); False: one line per phase
        through ``echo``; None: in place when ``echo`` is ``print`` and stdout is a terminal."""
        tty = live if live is not None else (echo is print and sys.stdout.isatty())
        self.live = LiveLine(echo, tty=tty)

        def say(text: str) -> None:  # anything printed goes on a line of its own, not over the live one
            self.live.clear()
            echo(text)

        self.node_rank = launch.node_rank or 0
        if launch.nnodes > 1 and launch.node_rank is None:
            raise OutputError(f"--nnodes {launch.nnodes} needs --node-rank (this node's rank, 0 writes the records)")
        if launch.emulate_link and not launch.gpus_per_node:
            raise OutputError("--emulate-link needs --gpus-per-node (each emulated node's slice of this host's GPUs)")
        if self.node_rank > 0:  # the records are node 0's: this node keeps its logs and scratch apart
            run_dir = Path(run_dir) / "nodes" / str(self.node_rank)
        super().__init__(run_dir, say)
        # Options "node" become this launch layout's sizes before any case is hashed, fingerprinted
        # or recorded (a SuiteError naming the layout where one cannot run on it)
        self.suite = replace(suite, cases=multinode.resolve_node_options(suite.cases, launch.nnodes))
        self.launch = launch
        # The label column fits the suite's longest label, up to LABEL_WIDTH_MAX (longer ones are
        # cut with an ellipsis on ok rows; failure rows keep them whole).
        self.label_width = min(max((len(c.label) for c in self.suite.cases), default=0), LABEL_WIDTH_MAX)
        self.resume, self.retry_failed = resume, retry_failed
        self.logs = self.run_dir / "logs"
        self.n_launches = 0
        # Case -> why the launch it led died in start-up, before any case began: such a launch is
        # run again once, as that death is no case's doing (seen as one gloo rank's SIGABRT, cause unknown).
        self.startup_crashes: dict[str, str] = {}
        self.done = 0
        self.counts = {**{s: 0 for s in STATUSES}, "kept": 0}  # kept: recorded by an earlier launch (--resume)

    # -- set-up -------------------------------------------------------------------------
    def prepare(self) -> None:
        if self.node_rank > 0:
            try:
                for d in (self.scratch, self.logs):
                    d.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise OutputError(f"output folder {self.run_dir} is not writable: {exc}") from None
            return
        try:
            for d in (self.run_dir / "cases", self.scratch, self.logs):
                d.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"output folder {self.run_dir} is not writable: {exc}") from None
        manifest_path = self.run_dir / "manifest.json"
        self.resumed_manifest = manifest_path.exists() and self.resume
        if not manifest_path.exists():
            self._save(manifest_path, self._manifest(), "the manifest")
        elif self.resume:
            # Cases recorded from now on may run another commit or suite file than the manifest's:
            # each resumption is kept beside it (the records' started_at says which cases it ran).
            manifest = load_json(manifest_path)
            now = make_manifest(self.suite, self.run_dir.name, sys.argv)
            manifest.setdefault("resumed", []).append(
                {k: now[k] for k in ("created_at", "git", "suite_file_sha256", "versions", "argv", "n_cases")}
            )
            self._save(manifest_path, manifest, "the manifest")

    def _manifest(self) -> dict:
        from parabench import matmul_ceiling

        manifest = make_manifest(self.suite, self.run_dir.name, sys.argv)
        # the machine's bf16 matmul rate, before the first case: the report's MFU against what it reaches
        manifest["matmul_ceiling"] = matmul_ceiling.for_run(self.suite.cases)
        if self.launch.nnodes > 1:
            manifest["nodes"] = {
                "nnodes": self.launch.nnodes,
                "rdzv_endpoint": self.launch.rdzv_endpoint,
                "rdzv_backend": "static",
                "suite_fingerprint": multinode.suite_fingerprint(self.suite.cases),
                "records_from": "node 0; the other nodes keep their logs in their own nodes/<rank>/ folder",
            }
        if self.launch.emulate_link:
            manifest["emulation"] = multinode.emulation_manifest(
                self.launch.nnodes, self.launch.gpus_per_node or 1, self.launch.emulate_link
            )
        return manifest

    def _node_env(self) -> dict:
        """What every rank of this node's launches needs to know of the other nodes."""
        if self.launch.nnodes == 1:
            return {}
        env = {
            multinode.SUITE_ENV: multinode.suite_fingerprint(self.suite.cases),
            multinode.SUITE_CASES_ENV: str(len(self.suite.cases)),
        }
        if self.launch.emulate_link:
            env.update(
                multinode.emulation_env(self.node_rank, self.launch.gpus_per_node or 1, self.launch.emulate_link)
            )
        return env

    def _recorded(self, case: Case) -> bool:
        path = case_record_path(self.run_dir, case.record_key)
        if not path.exists():
            return False
        if self.retry_failed:
            try:
                return load_json(path).get("status") in ("ok", "skipped")
            except Exception:
                return False
        return True

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> dict:
        with self.owning():
            start = host.run_clock()
            counts = self._run_cases()
            self._note_host_load(start)
            return counts

    def _note_host_load(self, start: dict) -> None:
        """What else the host ran meanwhile, in the manifest (a resumption's in its own entry): on a
        shared CPU the timings move with it, and the report warns when it was high."""
        if self.node_rank > 0:
            return
        path = self.run_dir / "manifest.json"
        manifest = load_json(path)
        load = host.run_host_load(start, host.run_clock())
        if self.resumed_manifest:
            manifest["resumed"][-1]["host_load"] = load
        else:
            manifest["host_load"] = load
        self._save(path, manifest, "the manifest")

    def _run_cases(self) -> dict:
        self.prepare()
        # one entry per launch, round-robin over the suite: every case's launch 0, then launch 1...
        cases = [
            replace(c, repeat=k) if k else c
            for k in range(max((c.repeats for c in self.suite.cases), default=1))
            for c in self.suite.cases
            if k < c.repeats
        ]
        kept = {c.record_key for c in cases if self.resume and self._recorded(c)} if self.node_rank == 0 else set()
        if self.launch.nnodes > 1:
            try:
                # the other nodes keep what node 0 has recorded: a resumption is node 0's to decide
                kept = multinode.handshake(
                    self.launch.rdzv_endpoint or "",
                    self.launch.nnodes,
                    self.node_rank,
                    self.launch.rdzv_id,
                    multinode.suite_fingerprint(self.suite.cases),
                    len(self.suite.cases),
                    self.launch.rdzv_timeout_s or multinode.RDZV_TIMEOUT_S,
                    sorted(kept),
                )
            except multinode.HandshakeFailed as exc:
                raise MultiNodeStop(f"{exc}; nothing was run") from None
        self.total = len(cases)
        pending: list[Case] = []
        for case in cases:
            if case.record_key in kept:
                self.done += 1
                self.counts["kept"] += 1
                self.echo(self._progress(f"{'kept':<7} {case.label} (already recorded)"))
                continue
            note = multinode.placement_note(case, self.launch.nnodes)
            if note and case.repeat == 0:
                self.echo(f"parabench: warning: {note}")
            reason = skip_reason(case, self.launch)
            if reason:
                self._write(case, build_record(case, "skipped", error={"message": reason}))
                continue
            pending.append(case)
        while pending:
            batch = self._next_batch(pending)
            pending = self._run_batch(batch) + pending
        return self.counts

    def _next_batch(self, pending: list[Case]) -> list[Case]:
        def batchable(c: Case) -> bool:
            # Whatever its strategy, a case runs alone when it is faulty, profiled on a GPU, asked
            # to, or repeated. A CUDA profiler may leave CUPTI attached after it stops (kineto without TEARDOWN_CUPTI:
            # pytorch/pytorch#144455, 10-20 % slower kernels), so a profiled GPU case runs alone and
            # cannot slow the timed steps of the cases after it.
            profiled = c.options.get("step_breakdown") or c.options.get("trace")
            profiled_on_gpu = bool(profiled) and resolve_device(c) == "cuda"
            fault = (c.options.get("inject_fault") or {}).get("kind")
            faulty = fault not in (None, "leak")  # an injected leak must share a launch to show
            # a repeated case's launches are its samples of launch-to-launch variance: each its own
            return not faulty and not profiled_on_gpu and not c.own_launch and c.repeats == 1

        def shareable(c: Case) -> bool:
            return batchable(c) and get_strategy(c.strategy).shares_launch

        def closes(c: Case) -> bool:
            # A strategy that leaves state behind (shares_launch False) only spoils the cases after
            # it: on CPU, where a launch's start-up costs far more than a tiny case, it may end a
            # batch. On GPUs each keeps a launch of its own, as its measurements were taken.
            return (
                batchable(c)
                and resolve_device(c) == "cpu"
                and c.options.get("inject_fault") is None
                and not get_strategy(c.strategy).shares_launch
            )

        first = pending[0]
        if not (self.launch.batch and (shareable(first) or closes(first))):
            return [pending.pop(0)]
        # the cases that can share this launch, in suite order, and one that can only end it
        limit = self.launch.max_batch_cpu if resolve_device(first) == "cpu" else self.launch.max_batch
        same = [c for c in pending if c.world_size == first.world_size and resolve_device(c) == resolve_device(first)]
        closer = next((c for c in same if closes(c)), None)
        batch = [c for c in same if shareable(c)][: limit - 1 if closer is not None else limit]
        batch += [closer] if closer is not None else []
        for c in batch:
            pending.remove(c)
        return batch

    def _run_batch(self, batch: list[Case]) -> list[Case]:
        """Run ``batch`` in one launch; return the cases to run again (not the one to blame)."""
        launch = self._start_launch(batch)
        try:
            finished, rc, timed_out = self._watch(launch, batch)
        finally:  # whatever happened (a signal, a full disk), nothing of the launch outlives it
            self.live.clear()
            self.end_torchrun(launch.proc)
        return self._settle(launch, batch, finished, rc, timed_out)

    def _start_launch(self, batch: list[Case]) -> _Launch:
        nproc = batch[0].world_size // self.launch.nnodes
        device = resolve_device(batch[0])
        tag = batch[0].record_key
        env = {**self.launch_env(device), **self._node_env()}
        self.n_launches += 1
        # A folder per launch: a result, error or start stamp is only ever read from the launch
        # that wrote it.
        folder = self.scratch / f"launch-{self.n_launches}"
        cases_file = folder / "cases.json"
        try:
            folder.mkdir(parents=True)
            # The ranks get the resolved device ("auto" -> "cpu"/"cuda"), which changes the case's hash:
            # they name their files by the runner's hash, handed over with each case.
            cases_file.write_text(
                json.dumps([{**c.to_dict(), "device": device, "scratch_key": c.record_key} for c in batch])
            )
        except OSError as exc:
            raise OutputError(
                f"cannot write the launch's cases to {cases_file}: {exc}; the run stopped, "
                "finished records are kept (continue with --resume)"
            ) from None
        relaunch_of = self.startup_crashes.get(tag)
        log_path = self.logs / (f"{tag}.relaunch.log" if relaunch_of else f"{tag}.log")
        retired_file = folder / "retired.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *self.launch.torchrun_args(nproc, self.n_launches),
            "-m",
            "parabench.worker",
            "--cases",
            str(cases_file),
            "--scratch",
            str(folder),
            "--retired",
            str(retired_file),
        ]
        info = {
            "batch_size": len(batch),
            "nproc_per_node": nproc,
            "nnodes": self.launch.nnodes,
            **({"node_rank": self.node_rank} if self.launch.nnodes > 1 else {}),
            "device": device,
            "log": str(log_path.relative_to(self.run_dir)),
            **({"relaunched_after_startup_crash": relaunch_of} if relaunch_of else {}),
        }
        oom_kills = kernel_oom_kills()
        started = time.time()
        proc = self.start_torchrun(cmd, env, log_path)
        return _Launch(proc, folder, log_path, retired_file, started, info, oom_kills)

    def _watch(self, launch: _Launch, batch: list[Case]) -> tuple[set[str], int | None, bool]:
        """Record each case's result as it appears; end the launch on a timeout. Returns the
        finished case hashes, torchrun's exit status and whether the launch timed out."""
        finished: set[str] = set()
        current_start = launch.started
        while True:
            rc = launch.proc.poll()
            for case in batch:
                if case.record_key in finished:
                    continue
                result = launch.folder / f"{case.record_key}.json"
                if self.node_rank > 0 and (launch.folder / f"{case.record_key}.done").exists():
                    self._followed(case)
                    finished.add(case.record_key)
                    current_start = time.time()
                elif result.exists():
                    raw = self._keep_traces(json.loads(result.read_text()), launch)
                    started = self._started_at(case, launch) or current_start
                    record = build_record(
                        case, "ok", raw=raw, started_at=started, duration_s=time.time() - started, launch=launch.info
                    )
                    multinode.link_check(record, case)
                    self._write(case, record)
                    finished.add(case.record_key)
                    current_start = time.time()
            if rc is not None:
                return finished, rc, False
            running = next((c for c in batch if c.record_key not in finished), None)
            if running is not None:
                began = self._started_at(running, launch) or current_start
                status = read_status(status_path(launch.folder, running.record_key))
                self.live.update(running.label, status, time.time() - min(began, current_start), self._progress(""))
                # torchrun start-up counts against the first case of a launch
                if time.time() - min(began, current_start) > running.timeout_s:
                    launch.timed_out_after_s = time.time() - min(began, current_start)
                    end_launch(self.invocation, launch.proc)
                    return finished, launch.proc.poll(), True
            time.sleep(0.1)

    def _settle(
        self, launch: _Launch, batch: list[Case], finished: set[str], rc: int | None, timed_out: bool
    ) -> list[Case]:
        """Blame the case a failed launch died in; return the cases to launch again."""
        unfinished = [c for c in batch if c.record_key not in finished]
        if not unfinished:
            return []
        if rc == 0 and not timed_out and launch.retired_file.exists():
            self._note_leftover(json.loads(launch.retired_file.read_text()), len(unfinished))
            return unfinished
        culprit = next((c for c in unfinished if self._started_at(c, launch) is not None), None)
        started = (culprit and self._started_at(culprit, launch)) or launch.started
        elapsed = (
            launch.timed_out_after_s if timed_out and launch.timed_out_after_s is not None else time.time() - started
        )
        log_tail = _tail(launch.log_path, 20000)
        if self.launch.nnodes > 1:
            self._stop_if_nodes_apart(launch, batch, culprit, log_tail, started, elapsed, timed_out)
        oom_kills = _delta(launch.oom_kills_at_start, kernel_oom_kills())
        full = out_of_space(self.run_dir)
        if full:
            raise OutputError(
                f"no space left on the disk of {self.run_dir} (a launch failed and {full}); the run "
                "stopped, finished records are kept (continue with --resume once there is room)"
            )
        if (
            culprit is None
            and not finished
            and rc
            and not timed_out
            and batch[0].record_key not in self.startup_crashes
        ):
            startup_status, error = _classify(batch[0], launch.folder, rc, timed_out, log_tail, elapsed, oom_kills)
            # A launch the out-of-memory killer ended (or any SIGKILL) would meet it again: no second try.
            if startup_status != "oom" and error.get("exit_code") != -signal.SIGKILL:
                why = f"{error['message']}, {elapsed:.0f} s after the launch began and before its first case"
                self.startup_crashes[batch[0].record_key] = why
                self.echo(f"parabench: a launch died in start-up ({why}); launching it again once")
                return batch
        culprit = culprit or unfinished[0]
        status, error = _classify(culprit, launch.folder, rc, timed_out, log_tail, elapsed, oom_kills)
        lost = multinode.lost_node_message(
            [log_tail, error.get("message", ""), error.get("traceback_tail", "")],
            self.launch.nnodes,
            self.node_rank,
            launch.info["nproc_per_node"],
        )
        if lost and status in ("crashed", "timeout"):
            error["lost_node"] = lost
            error["message"] = f"{lost}; here: {error['message']}"
        if culprit.record_key in self.startup_crashes:
            error["earlier_startup_crash"] = self.startup_crashes[culprit.record_key]
        self._write(
            culprit,
            build_record(culprit, status, error=error, started_at=started, duration_s=elapsed, launch=launch.info),
        )
        return [c for c in unfinished if c is not culprit]

    def _stop_if_nodes_apart(
        self,
        launch: _Launch,
        batch: list[Case],
        culprit,
        log_tail: str,
        started: float,
        elapsed: float,
        timed_out: bool,
    ) -> None:
        """Stop the suite (``MultiNodeStop``, on every node alike) when the nodes ran different
        suites or cases, or when the launch's rendezvous did not form; in the latter case the case
        that could not start is recorded as ``timeout`` with the missing node named."""
        for p in sorted(launch.folder.glob("*.rank*.error.json")):
            try:
                error = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if error.get("type") == multinode.NodesDisagree.__name__:
                raise MultiNodeStop(f"{error['message']}; nothing of this launch was recorded, the suite stopped")
        if culprit is not None:
            return
        why = multinode.rendezvous_failure(log_tail, self.launch.nnodes, self.node_rank, self.launch.rdzv_endpoint)
        if why is None and timed_out:
            why = f"the rendezvous of the {self.launch.nnodes} nodes did not form within the case's {elapsed:.0f} s"
        if why is None:
            return
        case = batch[0]
        self._write(
            case,
            build_record(
                case,
                "timeout",
                error={"message": why, "rendezvous": self.launch.rdzv_endpoint, "log_tail": log_tail[-1500:]},
                started_at=started,
                duration_s=elapsed,
                launch=launch.info,
            ),
        )
        raise MultiNodeStop(
            f"{why}; the suite stopped, as no later launch can form without it (finished records are kept: start "
            "every node again with --resume on node 0)"
        )

    def _followed(self, case: Case) -> None:
        """A case this node took part in and node 0 recorded: a line in this node's output only."""
        self.done += 1
        self.counts["ok"] += 1
        self.echo(self._progress(f"{'ok':<7} {_fit(case.label, self.label_width)}  (recorded by node 0)"))

    def _note_leftover(self, retired: dict, n_relaunched: int) -> None:
        """The case after which the worker ended its launch (memory still allocated) gets a caveat
        saying so; the cases it did not run go to a fresh launch, their peaks undisturbed."""
        gib = retired["leftover_bytes"] / 2**30
        text = (
            f"left {gib:.2f} GiB allocated on rank {retired['rank']} after it finished (still referenced "
            f"once its trainer was closed); the {n_relaunched} later case(s) of its launch ran in a fresh "
            "launch, so its leftover is in no other case's peak memory"
        )
        path = case_record_path(self.run_dir, retired["after_case"])
        if path.exists():
            record = json.loads(path.read_text())
            record["caveats"] = [*(record.get("caveats") or []), text]
            record["leftover_after_case"] = retired
            self._save(path, record, f"the record of {retired['after_label']}")
        self.echo(f"parabench: {retired['after_label']} {text}")

    def _keep_traces(self, raw: dict, launch: _Launch) -> dict:
        """Move the trace files a finished case wrote in ``launch``'s folder into the run folder's
        ``traces/`` (same relative path), before its record names them. A file that is not there
        (written on another node's scratch) is recorded as missing, with the reason."""
        for entry in (e for r in raw.get("per_rank") or [] for e in (r.get("trace"), r.get("memory_snapshot"))):
            if not entry or not entry.get("path"):
                continue
            source, target = launch.folder / entry["path"], self.run_dir / entry["path"]
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(source, target)
            except FileNotFoundError:
                entry["reason"] = f"the rank wrote {entry['path']} outside this node's launch folder"
                entry["path"] = None
            except OSError as exc:
                raise OutputError(
                    f"cannot move {source} into {target.parent}: {exc.strerror or exc}; the run stopped, "
                    "finished records are kept (continue with --resume once the cause is fixed)"
                ) from None
        return raw

    def _started_at(self, case: Case, launch: _Launch) -> float | None:
        """When ``launch`` started ``case`` (rank 0's stamp in the launch's own folder)."""
        p = launch.folder / f"{case.record_key}.started"
        try:
            return float(p.read_text())
        except (OSError, ValueError):
            return None

    def _write(self, case: Case, record: dict) -> None:
        if self.node_rank == 0:  # the other nodes only say it in their logs
            self._save(case_record_path(self.run_dir, case.record_key), record, f"the record of {case.label}")
        self.done += 1
        self.counts[record["status"]] += 1
        if off_theory(record):
            self.counts[OFF_THEORY] = self.counts.get(OFF_THEORY, 0) + 1
        launch = f"  [launch {case.repeat + 1}/{case.repeats}]" if case.repeats > 1 else ""
        self.echo(self._progress(_row(record, self.label_width) + launch))

    def _progress(self, text: str) -> str:
        width = 20
        filled = int(width * self.done / max(self.total, 1))
        digits = len(str(self.total))
        return f"[{'#' * filled}{'.' * (width - filled)}] {self.done:>{digits}}/{self.total} {text}"


def _fmt_bytes(b) -> str:
    if b is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024


# Checks against the theory beside communication, as the console row names them when they fail.
OTHER_CHECKS = (("state", "state_ok"), ("nvme", "nvme_io_ok"), ("activation checkpoints", "activation_checkpoints_ok"))
# The count of finished cases whose measurements disagree with their theory (``--strict`` fails on it).
OFF_THEORY = "off theory"


def off_theory(record: dict) -> bool:
    """A finished case whose communication, state or NVMe check failed."""
    return record.get("status") == "ok" and record.get("checks", {}).get("ok") is False


LABEL_WIDTH_MAX = 72  # ok rows cut longer labels with an ellipsis, so their figures stay in line


def _fit(label: str, width: int) -> str:
    """``label`` padded to ``width``, or cut to it with an ellipsis."""
    return f"{label:<{width}}" if len(label) <= width else label[: width - 3] + "..."


def _row(record: dict, label_width: int = 44) -> str:
    """One finished case: status, label (in a column ``label_width`` wide) and its figures, each in
    a fixed-width column. A failure keeps its whole label: it is what the reader looks up."""
    status = record["status"]
    if status != "ok":
        msg = (record.get("error") or {}).get("message", "")
        return f"{status:<7} {record['label']:<{label_width}}  -- {msg[:120]}"
    m = record["metrics"]
    mem = m.get("peak_alloc_bytes") or m.get("peak_rss_bytes")
    eff = (
        f"MFU {m['mfu'] * 100:.1f}%"
        if m.get("mfu") is not None
        else (f"roofline {m['roofline_fraction'] * 100:.1f}%" if m.get("roofline_fraction") is not None else "")
    )
    checks = record.get("checks", {})
    comm = checks.get("comm_ok")
    comm_txt = "" if comm is None else ("comm=theory" if comm else "comm!=theory")
    # a state or NVMe check that fails names itself beside the communication verdict
    comm_txt += "".join(f" {name}!=theory" for name, key in OTHER_CHECKS if checks.get(key) is False)
    return (
        f"ok      {_fit(record['label'], label_width)} {m['tokens_per_s_per_device']:>10,.0f} tok/s/dev  "
        f"step {m['step_time_s_median'] * 1e3:8.1f} ms  peak {_fmt_bytes(mem):>10}  {eff:<15}  "
        f"loss {m['final_loss']:8.3f}  {comm_txt:<12}  ({record['duration_s']:.1f} s)"
    )


# The most ranks a case may start on one host's CPU, per usable core (``--max-cpu-ranks`` overrides):
# each rank is a Python process with torch loaded, and a world far beyond the cores only thrashes.
CPU_RANKS_PER_CORE = 4


def cpu_rank_limit() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return CPU_RANKS_PER_CORE * max(cores, 1)


def too_many_cpu_ranks(case: Case, launch: LaunchOptions, limit: int | None = None) -> str | None:
    """Why a CPU case would start more ranks on this host than it can hold, or None."""
    if resolve_device(case) != "cpu":
        return None
    limit = cpu_rank_limit() if limit is None else limit
    per_host = -(-case.world_size // launch.nnodes)
    if per_host <= limit:
        return None
    return (
        f"{case.label}: {per_host} ranks on this host's CPU, more than {limit} ({CPU_RANKS_PER_CORE} per usable "
        f"core); --max-cpu-ranks N allows more"
    )


def reserve_run_dir(run_dir: Path) -> Path:
    """The folder ``run_dir`` made for this runner alone, or the next free name ``<id>-2``, ``-3``...:
    a runner started in the same second as another (the same automatic id) gets a folder of its own
    instead of being refused at the other's lock. ``mkdir`` is the atomic claim."""
    for k in range(1, 1000):
        candidate = run_dir.with_name(run_dir.name if k == 1 else f"{run_dir.name}-{k}")
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:
            continue
        except OSError as exc:
            raise OutputError(f"output folder {candidate} is not writable: {exc.strerror or exc}") from None
        return candidate
    raise OutputError(f"no free run folder name beside {run_dir}; give --run-id")


def default_run_dir(out_root: Path, suite: Suite, run_id: str | None, resume: bool) -> Path:
    base = Path(out_root) / suite.results_folder
    if run_id:
        return base / run_id
    if resume:
        runs = sorted(p for p in base.glob("*") if (p / "manifest.json").exists()) if base.exists() else []
        if runs:
            return runs[-1]
    return base / new_run_id()
