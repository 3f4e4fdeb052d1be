"""Runs a suite: launches torchrun for each case (or for a batch of cases), watches it, and
writes one record per case the moment it finishes.

Failure handling, the part a benchmark harness is judged by:
- every case has a wall-clock timeout; a case that exceeds it is killed (its whole process
  session) and recorded as ``timeout``;
- a rank that raises writes an error file; the earliest one names the first failing rank, its
  exception and whether it was an out-of-memory (``oom``), else the case is ``crashed``;
- a rank that dies without a word (abort, segfault, OOM-killer) is ``crashed`` with the exit
  status and the tail of the launcher's log;
- the suite always goes on with the next case; records already written are never touched, so
  Ctrl-C loses nothing finished and ``--resume`` continues where the last run stopped.

Batch launches run several cases of the same world size in one torchrun, saving its start-up
per case. A case with ``repeats`` > 1 runs that many launches of its own, ordered round-robin over
the suite (A B C A B C: drift hits every case alike); launch k of a case writes
``cases/<hash>.r<k>.json`` beside the first launch's ``cases/<hash>.json`` (``suite.launch_key``). The worker marks each case as started; when a batch dies, the started-but-unfinished
case takes the blame and the rest of the batch is relaunched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from parabench.metrics import check_against_theory, model_section, summarize
from parabench.models import model_config
from parabench.results import (SCHEMA_VERSION, case_record_path, load_json, make_manifest, new_run_id,
                               write_json_atomic)
from parabench.strategies import get_strategy
from parabench.suite import Case, Suite
from parabench import theory

STATUSES = ("ok", "oom", "crashed", "timeout", "skipped", "error")


class OutputError(RuntimeError):
    pass


@dataclass
class LaunchOptions:
    """How torchrun is invoked. Multi-node rendezvous is torchrun's: its flags pass through."""

    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "parabench"
    extra_args: list[str] = field(default_factory=list)
    batch: bool = True
    max_batch: int = 8

    def torchrun_args(self, nproc: int) -> list[str]:
        if self.nnodes == 1 and not self.rdzv_endpoint:
            base = ["--standalone", "--nnodes", "1"]
        else:
            base = ["--nnodes", str(self.nnodes), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", self.rdzv_endpoint or "", "--rdzv-id", self.rdzv_id]
            if self.node_rank is not None:
                base += ["--node-rank", str(self.node_rank)]
        return base + ["--nproc-per-node", str(nproc), "--max-restarts", "0", *self.extra_args]


def resolve_device(case: Case) -> str:
    import torch

    if case.device == "auto":
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
    return None


def _base_record(case: Case) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "case",
        "case": case.to_dict(),
        "case_hash": case.case_hash,
        "label": case.label,
    }


def theory_for(case: Case, per_rank: list[dict] | None = None) -> dict | None:
    """The analytic expectation of a case (``parabench.theory``), as the record stores it. Given
    the measured per-rank records, traffic that depends on a data-dependent decision (expert
    routing) is made exact per rank from what the ranks recorded of that decision."""
    cfg = model_config(case.model, case.seq_len)
    dp = case.global_batch // (case.micro_batch * case.grad_accum)
    expect = theory.expected(case, cfg, dp)
    if expect is None:
        return None
    out = dict(expect)
    routed = theory.routed_comm_per_rank(case, cfg, per_rank) if per_rank else None
    if routed:
        out["comm_payload_bytes_range"] = out.get("comm_payload_bytes")
        out["comm_payload_bytes"], out["comm_payload_bytes_per_rank"] = routed[0], routed
        out["comm_exact_from"] = "the routing each rank recorded on the instrumented step (strategy_stats)"
    return out


def checks_for(expect: dict | None, per_rank: list[dict], loss_scale_steps: list | None) -> dict:
    """Measured per-rank figures against the expectation (``metrics.check_against_theory``)."""
    checks = check_against_theory(expect, per_rank)
    steps = loss_scale_steps or []
    if steps and steps[-1].get("skipped_on_ranks") and checks.get("comm_ok") is False:
        # An fp16 overflow on the instrumented step skips the update, and with it the parameter
        # all-gathers of the ZeRO stages: the theory describes an applied step, so no verdict.
        checks["comm_ok"] = None
        checks["comm_note"] = ("instrumented step skipped on ranks "
                               f"{steps[-1]['skipped_on_ranks']} (fp16 overflow): theory not applicable")
        checks["ok"] = checks.get("state_ok", True)
    return checks


def build_record(case: Case, status: str, raw: dict | None = None, error: dict | None = None,
                 started_at: float | None = None, duration_s: float | None = None, launch: dict | None = None) -> dict:
    rec = _base_record(case)
    rec.update(status=status, error=error, started_at=started_at, duration_s=duration_s, launch=launch or {})
    rec["model"] = model_section(case)
    rec["caveats"] = get_strategy(case.strategy).caveats_for(case.precision)
    if raw is not None and raw.get("debug_slowdown"):  # PARABENCH_DEBUG_SLOWDOWN (worker.py): not the code's speed
        rec["debug_slowdown"] = raw["debug_slowdown"]
        rec["caveats"] = [*rec["caveats"], (f"timed steps deliberately slowed by {raw['debug_slowdown']:.1%} "
                                            "(PARABENCH_DEBUG_SLOWDOWN, a regression-gate check)")]
    rec["theory"] = theory_for(case, raw["per_rank"] if raw is not None else None)
    if raw is not None:
        rec["device"] = {"name": raw["device_name"], "type": raw["device_type"]}
        rec["topology"] = raw["topology"]
        rec["metrics"] = summarize(case, raw)
        if rec["metrics"].get("throttled"):
            rec["caveats"].append("the GPU held its clocks down during the timed steps ("
                                  + ", ".join(rec["metrics"]["clocks_event_reasons"])
                                  + "): its tokens/s describe a throttled card, not only the strategy")
        rec["per_rank"] = raw["per_rank"]
        for key in ("pipeline", "loss_scale"):
            if key in raw:
                rec[key] = raw[key]
        rec["checks"] = checks_for(rec["theory"], rec["per_rank"], rec.get("loss_scale"))
    return rec


_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def _root_cause(log_tail: str) -> tuple[int, int] | None:
    """(rank, exit code) of the first failure as torchrun reports it, if it does."""
    m = _ROOT_CAUSE.search(log_tail)
    return (int(m.group(1)), int(m.group(2))) if m else None


# A collective that never completes: NCCL's watchdog names it (the worker's collective timeout is
# shorter than the case's, so the watchdog fires first); gloo raises from the waiting call.
_STUCK_COLLECTIVE = re.compile(r"(Watchdog caught collective operation timeout: WorkNCCL\([^)]*\)"
                               r"|Timed out waiting \d+ms for (?:send|recv) operation to complete)")


def _stuck_collective(*texts: str) -> str | None:
    for text in texts:
        m = _STUCK_COLLECTIVE.search(text or "")
        if m:
            return m.group(1)
    return None


def _classify(case: Case, scratch: Path, rc: int | None, timed_out: bool, log_tail: str, elapsed: float) -> tuple[str, dict]:
    """Status and cause of a case that produced no result.

    A rank that raises writes an error file; its peers then often raise too (connection reset)
    a moment later, so the earliest error file names the first failure. A rank that dies
    without a Python exception (abort, segfault, SIGKILL) writes nothing, while its peers do:
    torchrun's own root-cause report names it, and it takes precedence when it has no file.
    """
    errors = []
    for p in scratch.glob(f"{case.record_key}.rank*.error.json"):
        try:
            errors.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    stuck = _stuck_collective(log_tail, *(e.get("message", "") + e.get("traceback", "") for e in errors))
    if stuck:  # a hang, whatever way the ranks then went down
        return "timeout", {"message": f"a collective hung until its timeout ({stuck}); the ranks had issued "
                                      "different collectives or sizes, or one stopped issuing them",
                           "stuck_collective": stuck, "ranks_reporting": sorted(e["rank"] for e in errors),
                           "log_tail": log_tail[-1500:]}
    root = _root_cause(log_tail)
    silent_death = root is not None and root[1] != 1 and all(e["rank"] != root[0] for e in errors)
    if errors and not silent_death:
        first = min(errors, key=lambda e: e["time"])
        status = "oom" if first.get("oom") else "crashed"
        return status, {"first_failing_rank": first["rank"], "type": first["type"], "message": first["message"],
                        "traceback_tail": first["traceback"][-2000:], "ranks_reporting": sorted(e["rank"] for e in errors),
                        "log_tail": log_tail[-1500:]}
    if timed_out:
        return "timeout", {"message": f"no result after {elapsed:.0f} s (timeout {case.timeout_s:.0f} s): hang or too slow; "
                                      "the process group was killed", "log_tail": log_tail[-1500:]}
    rank, code = root if root else (None, rc)
    sig = -code if code is not None and code < 0 else None
    signame = signal.Signals(sig).name if sig and sig in signal.Signals._value2member_map_ else None
    msg = (f"rank {rank} " if rank is not None else "launcher ") + f"exited with status {code}" + \
        (f" ({signame})" if signame else "") + " and no Python exception (killed, aborted or segfaulted)"
    if signame == "SIGKILL":
        msg += "; SIGKILL is often the kernel's out-of-memory killer"
    if errors:
        later = min(errors, key=lambda e: e["time"])
        msg += f"; then rank {later['rank']} reported {later['type']}: {later['message'][:200]}"
    return "crashed", {"first_failing_rank": rank, "message": msg, "exit_code": code, "log_tail": log_tail[-1500:]}


def _tail(path: Path, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _kill_session(proc: subprocess.Popen) -> None:
    """Stop torchrun and every rank it started (they share its process session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


class Runner:
    def __init__(self, suite: Suite, run_dir: Path, launch: LaunchOptions, resume: bool = False,
                 retry_failed: bool = False, echo=print):
        self.suite, self.run_dir, self.launch = suite, Path(run_dir), launch
        self.resume, self.retry_failed, self.echo = resume, retry_failed, echo
        self.scratch = self.run_dir / ".scratch"
        self.logs = self.run_dir / "logs"
        self.done = 0
        self.counts = {**{s: 0 for s in STATUSES}, "kept": 0}  # kept: recorded by an earlier launch (--resume)

    # -- set-up -------------------------------------------------------------------------
    def prepare(self) -> None:
        try:
            for d in (self.run_dir / "cases", self.scratch, self.logs):
                d.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"output folder {self.run_dir} is not writable: {exc}") from None
        manifest_path = self.run_dir / "manifest.json"
        if not manifest_path.exists():
            write_json_atomic(manifest_path, make_manifest(self.suite, self.run_dir.name, sys.argv))
        elif self.resume:
            # Cases recorded from now on may run another commit or suite file than the manifest's:
            # each resumption is kept beside it (the records' started_at says which cases it ran).
            manifest = load_json(manifest_path)
            now = make_manifest(self.suite, self.run_dir.name, sys.argv)
            manifest.setdefault("resumed", []).append(
                {k: now[k] for k in ("created_at", "git", "suite_file_sha256", "versions", "argv", "n_cases")})
            write_json_atomic(manifest_path, manifest)

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
        self.prepare()
        # one entry per launch, round-robin over the suite: every case's launch 0, then launch 1...
        cases = [replace(c, repeat=k) if k else c for k in range(max((c.repeats for c in self.suite.cases), default=1))
                 for c in self.suite.cases if k < c.repeats]
        self.total = len(cases)
        pending: list[Case] = []
        for case in cases:
            if self.resume and self._recorded(case):
                self.done += 1
                self.counts["kept"] += 1
                self.echo(self._progress(f"kept   {case.label} (already recorded)"))
                continue
            reason = skip_reason(case, self.launch)
            if reason:
                self._write(case, build_record(case, "skipped", error={"message": reason}))
                continue
            pending.append(case)
        try:
            while pending:
                batch = self._next_batch(pending)
                pending = self._run_batch(batch) + pending
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        return self.counts

    def _next_batch(self, pending: list[Case]) -> list[Case]:
        def shareable(c: Case) -> bool:
            # A CUDA profiler may leave CUPTI attached after it stops (kineto without TEARDOWN_CUPTI:
            # pytorch/pytorch#144455, 10-20 % slower kernels), so a profiled GPU case runs alone and
            # cannot slow the timed steps of the cases after it.
            profiled_on_gpu = bool(c.options.get("step_breakdown")) and resolve_device(c) == "cuda"
            fault = (c.options.get("inject_fault") or {}).get("kind")
            faulty = fault not in (None, "leak")  # an injected leak must share a launch to show
            # a repeated case's launches are its samples of launch-to-launch variance: each its own
            return (not faulty and not profiled_on_gpu and not c.own_launch and c.repeats == 1
                    and get_strategy(c.strategy).shares_launch)

        first = pending.pop(0)
        batch = [first]
        if self.launch.batch and shareable(first):
            # take the next cases that can share this launch, in suite order
            for c in list(pending):
                if len(batch) >= self.launch.max_batch:
                    break
                if c.world_size == first.world_size and resolve_device(c) == resolve_device(first) and shareable(c):
                    batch.append(c)
                    pending.remove(c)
        return batch

    def _env(self, device: str) -> dict:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def _run_batch(self, batch: list[Case]) -> list[Case]:
        """Run ``batch`` in one launch; return the cases to run again (not the one to blame)."""
        nproc = batch[0].world_size // self.launch.nnodes
        device = resolve_device(batch[0])
        tag = batch[0].record_key
        cases_file = self.scratch / f"{tag}.cases.json"
        # The ranks get the resolved device ("auto" -> "cpu"/"cuda"), which changes the case's hash:
        # they name their files by the runner's hash, handed over with each case.
        cases_file.write_text(json.dumps([{**c.to_dict(), "device": device, "scratch_key": c.record_key} for c in batch]))
        log_path = self.logs / f"{tag}.log"
        retired_file = self.scratch / f"{tag}.retired.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", *self.launch.torchrun_args(nproc),
               "-m", "parabench.worker", "--cases", str(cases_file), "--scratch", str(self.scratch),
               "--retired", str(retired_file)]
        launch_info = {"batch_size": len(batch), "nproc_per_node": nproc, "nnodes": self.launch.nnodes,
                       "device": device, "log": str(log_path.relative_to(self.run_dir))}
        t_launch = time.time()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env(device),
                                    start_new_session=True)
            finished: set[str] = set()
            current_start = t_launch
            timed_out = False
            try:
                while True:
                    rc = proc.poll()
                    for case in batch:
                        if case.record_key in finished:
                            continue
                        result = self.scratch / f"{case.record_key}.json"
                        if result.exists():
                            raw = json.loads(result.read_text())
                            started = self._started_at(case) or current_start
                            self._write(case, build_record(case, "ok", raw=raw, started_at=started,
                                                           duration_s=time.time() - started, launch=launch_info))
                            finished.add(case.record_key)
                            current_start = time.time()
                    if rc is not None:
                        break
                    running = next((c for c in batch if c.record_key not in finished), None)
                    if running is not None:
                        began = self._started_at(running) or current_start
                        # torchrun start-up counts against the first case of a launch
                        if time.time() - min(began, current_start) > running.timeout_s:
                            timed_out = True
                            _kill_session(proc)
                            rc = proc.poll()
                            break
                    time.sleep(0.1)
            except KeyboardInterrupt:
                _kill_session(proc)
                raise
        unfinished = [c for c in batch if c.record_key not in finished]
        if not unfinished:
            return []
        if rc == 0 and not timed_out and retired_file.exists():
            self._note_leftover(json.loads(retired_file.read_text()), len(unfinished))
            return unfinished
        culprit = next((c for c in unfinished if self._started_at(c) is not None), unfinished[0])
        elapsed = time.time() - (self._started_at(culprit) or t_launch)
        status, error = _classify(culprit, self.scratch, rc, timed_out, _tail(log_path, 20000), elapsed)
        self._write(culprit, build_record(culprit, status, error=error, started_at=self._started_at(culprit) or t_launch,
                                          duration_s=elapsed, launch=launch_info))
        return [c for c in unfinished if c is not culprit]

    def _note_leftover(self, retired: dict, n_relaunched: int) -> None:
        """The case after which the worker ended its launch (memory still allocated) gets a caveat
        saying so; the cases it did not run go to a fresh launch, their peaks undisturbed."""
        gib = retired["leftover_bytes"] / 2**30
        text = (f"left {gib:.2f} GiB allocated on rank {retired['rank']} after it finished (still referenced "
                f"once its trainer was closed); the {n_relaunched} later case(s) of its launch ran in a fresh "
                "launch, so its leftover is in no other case's peak memory")
        path = case_record_path(self.run_dir, retired["after_case"])
        if path.exists():
            record = json.loads(path.read_text())
            record["caveats"] = [*(record.get("caveats") or []), text]
            record["leftover_after_case"] = retired
            write_json_atomic(path, record)
        self.echo(f"parabench: {retired['after_label']} {text}")

    def _started_at(self, case: Case) -> float | None:
        p = self.scratch / f"{case.record_key}.started"
        try:
            return float(p.read_text())
        except (OSError, ValueError):
            return None

    def _write(self, case: Case, record: dict) -> None:
        write_json_atomic(case_record_path(self.run_dir, case.record_key), record)
        self.done += 1
        self.counts[record["status"]] += 1
        launch = f"  [launch {case.repeat + 1}/{case.repeats}]" if case.repeats > 1 else ""
        self.echo(self._progress(_row(record) + launch))

    def _progress(self, text: str) -> str:
        width = 20
        filled = int(width * self.done / max(self.total, 1))
        return f"[{'#' * filled}{'.' * (width - filled)}] {self.done:>3}/{self.total} {text}"


def _fmt_bytes(b) -> str:
    if b is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024


def _row(record: dict) -> str:
    status = record["status"]
    if status != "ok":
        msg = (record.get("error") or {}).get("message", "")
        return f"{status:<7} {record['label']}  -- {msg[:120]}"
    m = record["metrics"]
    mem = m.get("peak_alloc_bytes") or m.get("peak_rss_bytes")
    eff = f"MFU {m['mfu'] * 100:.1f}%" if m.get("mfu") is not None else (
        f"roofline {m['roofline_fraction'] * 100:.1f}%" if m.get("roofline_fraction") is not None else "")
    comm = record.get("checks", {}).get("comm_ok")
    comm_txt = "" if comm is None else ("  comm=theory" if comm else "  comm!=theory")
    return (f"ok      {record['label']:<44} {m['tokens_per_s_per_device']:>10,.0f} tok/s/dev  "
            f"step {m['step_time_s_median'] * 1e3:8.1f} ms  peak {_fmt_bytes(mem):>10}  {eff}  "
            f"loss {m['final_loss']:.3f}{comm_txt}  ({record['duration_s']:.1f} s)")


def default_run_dir(out_root: Path, suite: Suite, run_id: str | None, resume: bool) -> Path:
    base = Path(out_root) / suite.name
    if run_id:
        return base / run_id
    if resume:
        runs = sorted(p for p in base.glob("*") if (p / "manifest.json").exists()) if base.exists() else []
        if runs:
            return runs[-1]
    return base / new_run_id()
