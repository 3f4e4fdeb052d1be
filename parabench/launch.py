"""Launch ownership: how the launchers (the suite runner, ``parabench.runner``, and the collectives
benchmark, ``parabench.collectives_bench``) hold a run folder and the torchrun launches they start.

- one launcher per run folder: ``.lock`` is flock'ed for the launcher's life, a second one fails
  at once (``RunFolderBusy``, exit 2) naming the holder's pid;
- every process of a launch carries ``PARABENCH_LAUNCH=<invocation id>`` in its environment.
  torchrun starts each rank in a session of its own, so killing torchrun's process group is not
  enough: a launch is ended by asking torchrun to stop (it stops and reaps its ranks), then by
  SIGKILLing every process still carrying the mark (ranks, compilers of a JIT build), checked through
  a pidfd so a reused pid is never hit. This happens after every launch, on timeout, on
  Ctrl-C / SIGTERM / SIGHUP (all turned into ``KeyboardInterrupt``) and when a record cannot be
  written (``OutputError``: the disk is full);
- each invocation works in ``.scratch/<invocation id>/``; ``owner.json`` and ``launch.json`` there
  name the launcher and its live torchrun (pid and start time from ``/proc/<pid>/stat``); a later
  start ends the launch of a dead owner, when pid and start time still match, sweeps its marked
  processes and removes its scratch;
- a stale torch-extension build lock (see ``clear_stale_extension_locks``) is removed before each
  launch, so a DeepSpeed JIT build killed half-way does not hang every later DeepSpeed case.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from parabench.results import write_json_atomic


class OutputError(RuntimeError):
    pass


class RunFolderBusy(OutputError):
    """Another runner holds the run folder's lock."""


class MultiNodeStop(OutputError):
    """The nodes cannot go on together (another suite on one node, a node that did not arrive):
    every node's runner stops with one message, finished records kept."""


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached the runner: handled like Ctrl-C (launch ended, records kept)."""


@dataclass
class LaunchOptions:
    """How torchrun is invoked. Multi-node rendezvous is torchrun's: its flags pass through.

    With ``--node-rank`` the rendezvous is torchrun's ``static`` backend, so that torchrun's node
    rank is the one given (``parabench.multinode`` says why); each launch has a rendezvous id of its
    own (``<rdzv_id>-<launch number>``), and ``rdzv_timeout_s`` bounds how long it waits for every node.
    ``emulate_link``: the nodes are slices of one GPU host, their traffic forced through sockets
    (``parabench.multinode.emulation_env``), with ``gpus_per_node`` GPUs each."""

    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "parabench"
    rdzv_timeout_s: int | None = None
    emulate_link: str | None = None
    gpus_per_node: int | None = None
    extra_args: list[str] = field(default_factory=list)
    batch: bool = True
    # Cases per launch at most: a crash ends the launch, and the rest of it is launched again.
    # Starting torch, gloo and the imports costs ~5 s of a 2-core CPU, far more than a tiny case.
    max_batch: int = 8
    max_batch_cpu: int = 32

    def torchrun_args(self, nproc: int, launch_number: int | None = None) -> list[str]:
        if self.nnodes == 1 and not self.rdzv_endpoint:
            base = ["--standalone", "--nnodes", "1"]
        elif self.node_rank is not None:
            base = [
                "--nnodes",
                str(self.nnodes),
                "--rdzv-backend",
                "static",
                "--rdzv-endpoint",
                self.rdzv_endpoint or "",
                "--rdzv-id",
                self.rdzv_id if launch_number is None else f"{self.rdzv_id}-{launch_number}",
                "--node-rank",
                str(self.node_rank),
            ]
            if self.rdzv_timeout_s:
                base += ["--rdzv-conf", f"timeout={self.rdzv_timeout_s}"]
        else:
            base = [
                "--nnodes",
                str(self.nnodes),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                self.rdzv_endpoint or "",
                "--rdzv-id",
                self.rdzv_id,
            ]
            if self.node_rank is not None:
                base += ["--node-rank", str(self.node_rank)]
        return base + ["--nproc-per-node", str(nproc), "--max-restarts", "0", *self.extra_args]


# -- processes: identity, launch ownership, ending a launch --------------------------------

LAUNCH_MARK = "PARABENCH_LAUNCH"  # environment variable every process of a launch inherits


def process_start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, field 22 of /proc/<pid>/stat), None when
    there is no such process or it is a zombie. Pid and start time together name one process: a
    pid reused later has a later start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # the command name may hold spaces and ')'
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _carries_mark(pid: int, invocation: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = b"\0" + f.read()
    except OSError:  # gone, or another user's process (never ours)
        return False
    return f"\0{LAUNCH_MARK}={invocation}\0".encode() in env


def marked_processes(invocation: str) -> list[int]:
    """Live processes started by the launches of ``invocation`` (zombies have no environment)."""
    own = os.getpid()
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != own and _carries_mark(int(d), invocation)]


def _signal_exact(pid: int, sig: int, is_it) -> bool:
    """Send ``sig`` to ``pid`` only if ``is_it(pid)`` holds for the process behind the pid. A pidfd
    pins the process first, so a pid reused between the check and the signal is never hit."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # no pidfd (old kernel): the check and the signal are adjacent
        if not is_it(pid):
            return False
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False
    try:
        if not is_it(pid):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def end_launch(
    invocation: str, proc: subprocess.Popen | None = None, leader: dict | None = None, grace_s: float = 10.0
) -> None:
    """End every process of a launch. torchrun (``proc``, or ``leader`` = {pid, start_ticks} of one
    this runner did not start) gets SIGTERM first: it stops its ranks and reaps them. Whatever
    still carries the launch's mark after ``grace_s`` (ranks in their own sessions, a compiler of
    a JIT build, ranks whose torchrun is already dead) gets SIGKILL, until none is left."""
    pid = proc.pid if proc is not None else (leader or {}).get("pid")
    ticks = None if proc is not None else (leader or {}).get("start_ticks")

    def is_leader(p: int) -> bool:
        return proc is not None or (ticks is not None and process_start_ticks(p) == ticks)

    def leader_gone() -> bool:
        return proc.poll() is not None if proc is not None else process_start_ticks(pid) != ticks

    if pid is not None and not leader_gone():
        _signal_exact(pid, signal.SIGTERM, is_leader)
        deadline = time.monotonic() + grace_s
        while not leader_gone() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not leader_gone():
            _signal_exact(pid, signal.SIGKILL, is_leader)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = marked_processes(invocation)
        if not left:
            break
        for p in left:
            _signal_exact(p, signal.SIGKILL, lambda q: _carries_mark(q, invocation))
        time.sleep(0.1)
    if proc is not None:
        proc.wait()


# -- the run folder: one runner at a time, scratch per invocation -----------------------------


class RunFolderLock:
    """An exclusive flock on ``<run folder>/.lock``, held for the runner's life. The kernel drops
    it when the runner dies, however it dies (kill -9 included); the descriptor is not inherited
    by launches, so an orphaned launch never keeps a folder locked."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ".lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"output folder {self.run_dir} is not writable: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunFolderBusy(
                f"run folder {self.run_dir} is in use by another parabench runner (pid {holder}); "
                "wait for it to finish, or pick another --run-id"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise OutputError(f"cannot write {self.path}: {exc}") from None
        self.fd = fd

    def release(self) -> None:
        # The file stays: unlinking a lock file lets a newcomer lock a fresh inode while a waiter
        # holds the old one.
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _owner_alive(info: dict) -> bool:
    pid, ticks = info.get("pid"), info.get("start_ticks")
    return isinstance(pid, int) and ticks is not None and process_start_ticks(pid) == ticks


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def clear_dead_invocations(scratch_root: Path, own: str, echo=print) -> list[str]:
    """Remove the scratch of every earlier invocation whose runner is dead, after ending the launch
    it left behind (its torchrun when pid and start time still match, then every process still
    carrying its mark). Called with the run folder locked, so no other runner is using it."""
    cleared = []
    if not scratch_root.is_dir():
        return cleared
    for entry in sorted(scratch_root.iterdir()):
        if entry.name == own:
            continue
        if not entry.is_dir():  # a loose file of an older layout: no owner can read it any more
            entry.unlink(missing_ok=True)
            continue
        owner = _read_json(entry / "owner.json")
        if owner and _owner_alive(owner):
            echo(f"parabench: warning: scratch {entry} belongs to runner pid {owner['pid']}, still alive; left alone")
            continue
        invocation = owner.get("invocation", entry.name)
        leader = _read_json(entry / "launch.json")
        left = marked_processes(invocation)
        if left or (leader and _owner_alive({"pid": leader.get("pid"), "start_ticks": leader.get("start_ticks")})):
            echo(
                f"parabench: ending the launch left behind by runner pid {owner.get('pid', '?')} "
                f"(torchrun pid {leader.get('pid', '?')}, {len(left)} process(es))"
            )
            end_launch(invocation, leader=leader or None)
        shutil.rmtree(entry, ignore_errors=True)
        cleared.append(entry.name)
    return cleared


# -- torch extension build locks (DeepSpeed's JIT-built ops) ----------------------------------

STALE_LOCK_UNSEEN_S = 600.0


def torch_extensions_root(env: dict | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


# File systems other machines may write too: a builder there is invisible in this /proc.
_SHARED_FS = (
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "lustre",
    "gpfs",
    "beegfs",
    "ceph",
    "glusterfs",
    "9p",
    "fuse.sshfs",
    "fuse.glusterfs",
    "fuse.ceph",
    "virtiofs",
    "afs",
)


def _on_shared_filesystem(path: Path) -> bool:
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        return True  # unknown: assume the worst
    return fstype in _SHARED_FS


def _lock_holders(lock: Path) -> tuple[list[int], bool]:
    """Pids with ``lock`` open, and whether every process's descriptors could be read."""
    target = os.path.realpath(lock)
    holders, complete = [], True
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{d}/fd")
        except FileNotFoundError:
            continue
        except OSError:  # another user's process
            complete = False
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{d}/fd/{fd}") == target:
                    holders.append(int(d))
                    break
            except OSError:
                continue
    return holders, complete


def clear_stale_extension_locks(env: dict | None = None, echo=print, now: float | None = None) -> list[Path]:
    """Remove torch-extension build locks whose builder is dead; return the removed paths.

    ``torch.utils.cpp_extension.load`` (DeepSpeed's ``OpBuilder.load``, e.g. the CPU
    ``deepspeed_shm_comm`` op every DeepSpeed case on CPU needs) takes a ``FileBaton``: it creates
    ``<TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/<py>_<accelerator>>/<op>/lock`` with
    O_EXCL, keeps it open while ninja builds, and deletes it when done; every other process waits
    for the file to vanish, with no timeout. A builder killed mid-build leaves the file and every
    later load waits forever. Since the builder holds the file open for the whole build, a lock
    no live process has open is stale: that is the test here (``/proc/<pid>/fd``). Where the test
    cannot see every possible builder (another user's process, or the folder on a file system
    other machines share, such as an NFS home), the lock must also be older than
    ``STALE_LOCK_UNSEEN_S`` (no build takes 10 minutes).

    To keep the build out of the first case's timeout, build the op before the run, either into
    the DeepSpeed install (``DS_BUILD_SHM_COMM=1 pip install deepspeed``; ``DS_BUILD_OPS=1``
    builds every op) or once into the extensions cache as a warm-up:
    ``DS_ACCELERATOR=cpu python -c "from deepspeed.accelerator import get_accelerator;
    get_accelerator().create_op_builder('ShareMemCommBuilder').load()"``; later loads only load it.
    """
    try:
        root = torch_extensions_root(env)
    except ImportError:  # torch without cpp_extension: no JIT builds either
        return []
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    removed = []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        holders, complete = _lock_holders(lock)
        complete = complete and not _on_shared_filesystem(lock)
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:
            continue  # released meanwhile
        if holders or (not complete and age < STALE_LOCK_UNSEEN_S):
            continue
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        removed.append(lock)
        echo(
            f"parabench: removed the stale build lock {lock} (no live process holds it; a JIT build was "
            "killed half-way): the next load of this op builds it again"
        )
    return removed


class LaunchOwner:
    """One launcher's hold on a run folder, shared by the suite runner and the collectives bench:
    the folder's lock, this invocation's id and scratch, SIGTERM/SIGHUP turned into
    ``KeyboardInterrupt``, and its torchrun launches (marked, recorded in ``launch.json`` for a
    later runner, ended completely). Use it as ``with owner.owning(): ...``."""

    def __init__(self, run_dir: Path, echo=print):
        self.run_dir, self.echo = Path(run_dir), echo
        # this invocation's id: names its scratch folder and marks every process it launches
        self.invocation = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{secrets.token_hex(4)}"
        self.scratch_root = self.run_dir / ".scratch"
        self.scratch = self.scratch_root / self.invocation
        self.lock = RunFolderLock(self.run_dir)
        self._stopping = False

    @contextmanager
    def owning(self):
        """Signals caught, the folder claimed; on the way out, however it is left, every process of
        this invocation's launches ended, its scratch removed, the lock released."""
        previous = self._catch_signals()
        try:
            self.claim()
            try:
                yield self
            finally:
                end_launch(self.invocation)  # a launch a signal caught half-started, if any
                shutil.rmtree(self.scratch, ignore_errors=True)
                try:
                    self.scratch_root.rmdir()  # only when no other invocation's scratch is left
                except OSError:
                    pass
        finally:
            self.lock.release()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def claim(self) -> None:
        """Lock the run folder, end what a dead runner left running there, clear its scratch, and
        record this invocation as the owner of its own."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"output folder {self.run_dir} is not writable: {exc}") from None
        self.lock.acquire()
        clear_dead_invocations(self.scratch_root, self.invocation, self.echo)
        try:
            self.scratch.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"output folder {self.run_dir} is not writable: {exc}") from None
        self._save(
            self.scratch / "owner.json",
            {"invocation": self.invocation, "pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid())},
            "the scratch owner",
        )

    # -- signals: SIGTERM and SIGHUP take Ctrl-C's path ----------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if self._stopping:  # a second signal must not cut the clean-up short
            return
        self._stopping = True
        raise Stopped(signal.Signals(signum).name)

    def _catch_signals(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    # -- launches -------------------------------------------------------------------------
    def launch_env(self, device: str) -> dict:
        env = dict(os.environ)
        env[LAUNCH_MARK] = self.invocation
        if device != "cuda":
            # N gloo ranks share the host's cores: one thread each. On GPUs the ranks start as
            # `torchrun` starts a user's script (one thread each when several share the node, torch's
            # default otherwise), so an adapter and its library's script get the same host threads.
            env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def start_torchrun(self, cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
        """Start ``cmd`` (``env`` from ``launch_env``: it carries the mark) in a session of its own,
        its output in ``log_path``, and record it as this invocation's live launch. End it with
        ``end_torchrun``, whatever happens."""
        clear_stale_extension_locks(env, self.echo)
        try:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as exc:
            raise OutputError(f"cannot start the launch (log {log_path}): {exc}") from None
        try:
            self._save(
                self.scratch / "launch.json",
                {
                    "invocation": self.invocation,
                    "pid": proc.pid,
                    "start_ticks": process_start_ticks(proc.pid),
                    "started_at": time.time(),
                },
                "the live launch's pid",
            )
        except BaseException:
            end_launch(self.invocation, proc)
            raise
        return proc

    def end_torchrun(self, proc: subprocess.Popen) -> None:
        end_launch(self.invocation, proc)
        (self.scratch / "launch.json").unlink(missing_ok=True)

    def run_torchrun(self, cmd: list[str], env: dict, log_path: Path, timeout_s: float) -> tuple[int | None, bool]:
        """One launch with one deadline: (torchrun's exit status, whether it timed out). Nothing of
        the launch outlives the call, whether it exits, times out or is interrupted."""
        proc = self.start_torchrun(cmd, env, log_path)
        try:
            deadline = time.monotonic() + timeout_s
            while (rc := proc.poll()) is None:
                if time.monotonic() > deadline:
                    end_launch(self.invocation, proc)
                    return proc.poll(), True
                time.sleep(0.1)
            return rc, False
        finally:
            self.end_torchrun(proc)

    def _save(self, path: Path, data: dict, what: str) -> None:
        """Write atomically; a full disk or any other write error stops the run with a clear error
        (the caller's launch is ended on the way out), never half a file."""
        try:
            write_json_atomic(path, data)
        except OSError as exc:
            raise OutputError(
                f"cannot write {what} to {path}: {exc.strerror or exc}; the run stopped, finished "
                "records are kept (continue with --resume once the cause is fixed)"
            ) from None
