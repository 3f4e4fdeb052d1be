"""Live progress inside a case (parabench/progress.py) and the runner's finished-case rows.

* the status file: rank 0's phases and step counter, throttled, atomically replaced; nothing
  written where there is no path (other ranks);
* the live line: one printed line per phase where the output is not a terminal, rewritten in
  place (``\\r``) on one;
* rows stay in columns whatever the label length; failure rows keep the whole label;
* a real case through the runner (torchrun): the echoed lines name the launch and the timed phase
  with its step count, then the finished row.
"""

from __future__ import annotations

import io
import json
import re

from parabench.case import Case
from parabench.progress import MIN_INTERVAL_S, LiveLine, PhaseReporter, describe, read_status, status_path


def test_the_status_file_follows_phases_and_steps_throttled(tmp_path):
    path = status_path(tmp_path, "abc")
    assert path.name == "abc.status.json" and read_status(path) is None
    reporter = PhaseReporter(path)
    reporter.phase("timed", 50)
    assert read_status(path) | {"time": 0, "phase_started": 0} == {
        "phase": "timed",
        "step": 0,
        "steps": 50,
        "detail": None,
        "phase_started": 0,
        "time": 0,
    }
    reporter.step(1)  # just after a write: not written again yet
    assert read_status(path)["step"] == 0
    reporter.last_write -= MIN_INTERVAL_S  # half a second later
    reporter.step(2)
    assert read_status(path)["step"] == 2
    reporter.step(50)  # the phase's last step is always written
    assert read_status(path)["step"] == 50
    reporter.phase("meters", detail="profiler")
    assert read_status(path)["detail"] == "profiler" and read_status(path)["steps"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abc.status.json"]  # no temporary file left

    silent = PhaseReporter(None)  # ranks other than 0
    silent.phase("timed", 5)
    silent.step(5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abc.status.json"]


def test_describe_names_phase_steps_and_seconds():
    assert describe("ref.ddp tiny w2", None, 3.4) == "ref.ddp tiny w2  launch  3 s"
    status = {"phase": "timed", "step": 7, "steps": 20}
    assert describe("ref.ddp tiny w2", status, 12.6) == "ref.ddp tiny w2  timed  step 7/20  13 s"
    status = {"phase": "meters", "step": 0, "steps": None, "detail": "profiler"}
    assert describe("x", status, 1) == "x  meters (profiler)  1 s"


def test_the_live_line_prints_phase_changes_only_off_a_terminal():
    lines: list[str] = []
    live = LiveLine(lines.append, tty=False)
    live.update("a", None, 1.0)
    live.update("a", None, 2.0)  # same phase: nothing
    live.update("a", {"phase": "timed", "step": 1, "steps": 9}, 3.0)
    live.update("a", {"phase": "timed", "step": 5, "steps": 9}, 4.0)  # a step, same phase: nothing
    live.update("b", None, 0.0)  # the next case
    assert lines == ["a  launch  1 s", "a  timed  step 1/9  3 s", "b  launch  0 s"]


def test_the_live_line_rewrites_itself_on_a_terminal():
    stream, lines = io.StringIO(), []
    live = LiveLine(lines.append, tty=True, stream=stream)
    live.update("a", {"phase": "timed", "step": 1, "steps": 9}, 1.0)
    live.update("a", {"phase": "timed", "step": 1, "steps": 9}, 1.2)  # same text: not rewritten
    live.update("a", {"phase": "timed", "step": 2, "steps": 9}, 1.4)
    live.clear()
    assert stream.getvalue() == ("\ra  timed  step 1/9  1 s\x1b[K" + "\ra  timed  step 2/9  1 s\x1b[K" + "\r\x1b[K")
    assert lines == []  # nothing went to the log


def _ok_record(label: str, duration_s: float = 1.5) -> dict:
    return {
        "status": "ok",
        "label": label,
        "duration_s": duration_s,
        "metrics": {
            "tokens_per_s_per_device": 12345.6,
            "step_time_s_median": 0.0123,
            "peak_rss_bytes": 300 << 20,
            "roofline_fraction": 0.05,
            "final_loss": 5.4321,
        },
        "checks": {"comm_ok": True},
    }


def test_rows_stay_in_columns_whatever_the_label_length():
    from parabench.runner import LABEL_WIDTH_MAX, _row

    short = "single tiny w1 fp32 mb8"
    long = "torch.fsdp2 gpt-125m w2 bf16 mb4 ga2 [mixed_precision=bf16-params,reshard=false,step_breakdown=True]"
    assert len(long) > LABEL_WIDTH_MAX
    width = LABEL_WIDTH_MAX
    rows = [_row(_ok_record(short), width), _row(_ok_record(long, 123.4), width)]
    for word in ("tok/s/dev", "step", "peak", "loss", "comm=theory"):
        assert len({r.index(word) for r in rows}) == 1, (word, rows)
    assert "..." in rows[1] and long not in rows[1]  # cut to the column

    # a width fitted to the suite's labels: every row's figures start at the same column
    mid = "ref.zero3 tiny w2 bf16 mb4 ga2 [step_breakdown=True,trace=True]"
    fitted = max(len(short), len(mid))
    rows = [_row(_ok_record(label), fitted) for label in (short, mid)]
    assert rows[0].index("tok/s/dev") == rows[1].index("tok/s/dev") == len("ok      ") + fitted + 12
    assert mid in rows[1]

    failed = {"status": "crashed", "label": long, "error": {"message": "rank 1 raised RuntimeError"}}
    assert long in _row(failed, width)  # a failure keeps its whole label


def test_the_runner_sizes_the_label_column_from_the_suite(tmp_path):
    from parabench.launch import LaunchOptions
    from parabench.runner import LABEL_WIDTH_MAX, Runner
    from parabench.suite import Suite

    def suite_of(*options):
        cases = [Case(model="tiny", strategy="ref.ddp", world_size=2, device="cpu", options=o) for o in options]
        return Suite("s", tmp_path / "s.toml", "", cases)

    small = suite_of({})
    runner = Runner(small, tmp_path / "a", LaunchOptions(), echo=print, live=False)
    assert runner.label_width == len(small.cases[0].label)
    huge = suite_of({}, {"optim": {"lr": 0.1, "beta1": 0.8, "beta2": 0.9, "eps": 1e-6, "weight_decay": 0.0}})
    assert len(huge.cases[1].label) > LABEL_WIDTH_MAX
    assert Runner(huge, tmp_path / "b", LaunchOptions(), echo=print, live=False).label_width == LABEL_WIDTH_MAX


def test_a_case_through_the_runner_shows_its_phases_and_steps(tmp_path):
    """Enough timed steps (tiny model, one rank) that the timed phase outlasts a few of the
    runner's 0.1 s polls even on a fast machine."""
    from parabench.launch import LaunchOptions
    from parabench.runner import Runner
    from parabench.suite import load_suite

    suite_file = tmp_path / "progress.toml"
    suite_file.write_text(
        '[suite]\nname = "progress"\ndescription = "one case"\ndevice = "cpu"\nsteps = 150\nwarmup = 1\n'
        'timeout_s = 300\n\n[[matrix]]\nmodel = "tiny"\nstrategy = "single"\nworld_size = 1\nmicro_batch = 8\n'
    )
    suite = load_suite(str(suite_file))
    lines: list[str] = []
    counts = Runner(suite, tmp_path / "run", LaunchOptions(), echo=lines.append, live=False).run()
    assert counts["ok"] == 1, "\n".join(lines)
    label = suite.cases[0].label
    live = [m for line in lines if (m := re.match(rf"\[[#.]+\] 0/1 {re.escape(label)}  (\S+)(.*)$", line))]
    phases = [m.group(1) for m in live]
    assert phases[0] == "launch" and "timed" in phases, lines
    assert phases == sorted(phases, key=["launch", "build", "warm-up", "timed", "instrumented", "gather"].index)
    assert all(re.search(r"  \d+ s$", m.group(2)) for m in live), lines
    (timed,) = [m.group(2) for m in live if m.group(1) == "timed"]
    assert re.match(r"  step \d+/150  \d+ s$", timed), timed
    assert re.match(rf"\[#+\] 1/1 ok      {re.escape(label)} +[\d,]+ tok/s/dev", lines[-1]), lines[-1]
    record = json.loads(next((tmp_path / "run" / "cases").glob("*.json")).read_text())
    assert record["status"] == "ok" and len(record["metrics"]["step_times_s"]) == 150
