"""Live progress inside a case: rank 0 says what it is doing, the runner shows it.

The worker's rank 0 keeps one small JSON file per case in its launch's scratch folder,
``<key>.status.json``: ``{"phase", "step", "steps", "detail", "phase_started", "time"}``. It
rewrites it (a temporary file renamed into place, so a reader never sees half of it) when a phase
begins and, throttled, as steps complete. The runner polls it while it waits for the launch and
shows one line: case label, phase, step k/n, elapsed seconds (``LiveLine``).

Phases, in order: ``launch`` (no status file yet: torchrun starting, imports, rendezvous; the
runner's name for it), ``build`` (the strategy builds its trainer: a DeepSpeed JIT build lands
here), ``warm-up``, ``timed``, ``instrumented`` (the communication meter's step), ``meters`` (the
extra untimed steps some options ask for: memory breakdown, profiler, memory snapshot; ``detail``
says which) and ``gather`` (rank 0 collects every rank's measurements).

Why the status file does not distort timing: the worker updates it on the host only, never
touching the device (no synchronise, no tensor read), and during the timed steps only after a
step's clock mark. On a GPU the mark is an event already queued behind the step's kernels, and the
host is normally ahead of the device, so the write happens while the device still runs queued
work. On a CPU the host clock is the timer, so a write falls into the next step's interval: at
most one write per ``MIN_INTERVAL_S`` (a ~0.1 ms rename of a ~150-byte file, no fsync) is under
0.1 % of that half second, and it lands in at most one step in every half second, so the median
step time is untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

PHASES = ("launch", "build", "warm-up", "timed", "instrumented", "meters", "gather")
MIN_INTERVAL_S = 0.5  # between two step-counter writes within one phase


def status_path(folder: str | os.PathLike, key: str) -> Path:
    """Where the case ``key``'s status lives in a launch's scratch folder."""
    return Path(folder) / f"{key}.status.json"


class PhaseReporter:
    """Rank 0's side: ``phase()`` at each phase change (written at once), ``step(k)`` after each
    step (written when ``MIN_INTERVAL_S`` has passed since the last write, or at the phase's last
    step). ``path`` None (every rank but 0, or a caller that wants no file): both do nothing."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path is not None else None
        self.state: dict = {}
        self.last_write = 0.0

    def phase(self, name: str, steps: int | None = None, detail: str | None = None) -> None:
        if self.path is None:
            return
        now = time.time()
        self.state = {"phase": name, "step": 0, "steps": steps, "detail": detail, "phase_started": now}
        self._write(now)

    def step(self, done: int) -> None:
        if self.path is None:
            return
        self.state["step"] = done
        now = time.time()
        if now - self.last_write >= MIN_INTERVAL_S or done == self.state.get("steps"):
            self._write(now)

    def _write(self, now: float) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps({**self.state, "time": now}))
            os.replace(tmp, self.path)
        except OSError:  # progress is a courtesy: a full disk must fail the record, not the step
            return
        self.last_write = now


def read_status(path: str | os.PathLike) -> dict | None:
    """The status a worker last wrote at ``path``, or None when there is none (yet)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe(label: str, status: dict | None, elapsed_s: float) -> str:
    """One line: case label, phase (with its detail), step k/n where the phase counts steps, and
    the seconds since the case (or, before it began, its launch) started."""
    status = status or {"phase": "launch"}
    phase = str(status.get("phase") or "?")
    if status.get("detail"):
        phase += f" ({status['detail']})"
    steps = status.get("steps")
    counter = f"  step {status.get('step', 0)}/{steps}" if steps else ""
    return f"{label}  {phase}{counter}  {elapsed_s:.0f} s"


class LiveLine:
    """The runner's live line. On a terminal (``tty``) it is rewritten in place (``\\r``, cleared
    to the end of the line, cut to the terminal's width) every time its text changes; elsewhere
    (a CI log, a file) a line is printed through ``echo`` only when the case or its phase changes,
    so logs stay readable. ``clear()`` before printing anything else on a terminal."""

    def __init__(self, echo=print, tty: bool = False, stream=None):
        self.echo, self.tty = echo, tty
        self.stream = stream if stream is not None else sys.stdout
        self.shown = ""  # the text on the terminal's current line (tty)
        self.last_key: tuple | None = None  # (label, phase) last printed (not tty)

    def update(self, label: str, status: dict | None, elapsed_s: float, prefix: str = "") -> None:
        text = prefix + describe(label, status, elapsed_s)
        if self.tty:
            width = shutil.get_terminal_size((120, 24)).columns - 1
            text = text if len(text) <= width else text[: max(0, width - 3)] + "..."
            if text != self.shown:
                self.stream.write("\r" + text + "\x1b[K")
                self.stream.flush()
                self.shown = text
            return
        key = (label, (status or {}).get("phase", "launch"), (status or {}).get("detail"))
        if key != self.last_key:
            self.last_key = key
            self.echo(text)

    def clear(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = ""
