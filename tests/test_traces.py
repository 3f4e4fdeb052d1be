"""The ``trace`` and ``memory_snapshot`` options (parabench/meters/traces.py).

* the worker on 2 gloo ranks: ``trace`` writes a gzipped Chrome trace per rank that loads as JSON
  with ``traceEvents`` (operators and gloo's collectives in it), its path and size in each rank's
  entry; ``memory_snapshot`` on a CPU runs no step and records why; with ``step_breakdown`` too,
  one profiled step serves both (same breakdown keys, the trace beside it);
* through the runner (real torchrun): the files move into the run folder's ``traces/``, the record
  names them, the scratch is gone, and the report links them (from the run folder and from
  elsewhere).
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import torch

from parabench.case import Case
from parabench.distributed import run_on_gloo


def _case(strategy="ref.ddp", world_size=2, **options):
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=world_size,
        micro_batch=4,
        steps=2,
        warmup=1,
        device="cpu",
        options=options,
    )


def _run_cases(case_dicts, folder):
    from parabench.meters.traces import TraceFiles
    from parabench.worker import run_case

    return [
        run_case(Case.from_dict(cd), torch.device("cpu"), trace_files=TraceFiles(Path(folder), f"case{i}"))
        for i, cd in enumerate(case_dicts)
    ]


def _events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_worker_writes_a_trace_per_rank_and_no_snapshot_on_cpu(tmp_path):
    cases = [
        _case(trace=True, memory_snapshot=True),
        _case(trace=True, step_breakdown=True),
        _case(memory_snapshot=True),
    ]
    traced, with_breakdown, snapshot_only = run_on_gloo(_run_cases, 2, [c.to_dict() for c in cases], str(tmp_path))[0]

    for r in traced["per_rank"]:
        entry = r["trace"]
        assert entry["path"] == f"traces/case0.rank{r['rank']}.json.gz"
        assert entry["bytes"] == (tmp_path / entry["path"]).stat().st_size > 0
        names = {e.get("name") for e in _events(tmp_path / entry["path"])}
        assert "aten::mm" in names and "gloo:all_reduce" in names, sorted(n for n in names if n)[:40]
        assert r["memory_snapshot"]["path"] is None
        assert "CUDA caching allocator" in r["memory_snapshot"]["reason"] and "cpu" in r["memory_snapshot"]["reason"]
        assert "step_breakdown" not in r  # the profiled step ran for the trace only
        assert len(r["step_times_s"]) == 2 and len(r["losses"]) == 1 + 2 + 1  # nothing extra recorded

    for r in with_breakdown["per_rank"]:  # one profiled step: its breakdown and its trace
        assert r["trace"]["path"] == f"traces/case1.rank{r['rank']}.json.gz"
        assert r["step_breakdown"]["comm_s"] > 0 and "trace" not in r["step_breakdown"]

    for r in snapshot_only["per_rank"]:
        assert "trace" not in r and r["memory_snapshot"]["path"] is None
    # no snapshot file, no temporary file: only the four traces
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        f"case{i}.rank{r}.json.gz" for i in (0, 1) for r in (0, 1)
    ]


def test_the_runner_keeps_traces_in_the_run_folder_and_the_report_links_them(tmp_path):
    from parabench.launch import LaunchOptions
    from parabench.report import write_report
    from parabench.runner import Runner
    from parabench.suite import load_suite

    suite_file = tmp_path / "traces.toml"
    suite_file.write_text(
        '[suite]\nname = "traces"\ndescription = "a traced case"\ndevice = "cpu"\nsteps = 2\nwarmup = 1\n'
        "timeout_s = 180\n\n[[matrix]]\n"
        'model = "tiny"\nstrategy = "single"\nworld_size = 1\nmicro_batch = 4\n'
        "options = {trace = true, memory_snapshot = true}\n"
    )
    suite = load_suite(str(suite_file))
    run_dir = tmp_path / "out" / "traces" / "run"
    lines: list[str] = []
    counts = Runner(suite, run_dir, LaunchOptions(), echo=lines.append, live=False).run()
    assert counts["ok"] == 1, "\n".join(lines)

    (record_path,) = (run_dir / "cases").glob("*.json")
    record = json.loads(record_path.read_text())
    (rank0,) = record["per_rank"]
    assert rank0["trace"]["path"] == f"traces/{record['case_hash']}.rank0.json.gz"
    assert any(e.get("name") == "aten::mm" for e in _events(run_dir / rank0["trace"]["path"]))
    assert rank0["memory_snapshot"]["path"] is None and "cpu" in rank0["memory_snapshot"]["reason"]
    assert not (run_dir / ".scratch").exists()

    own = write_report([run_dir], run_dir / "report.html", with_figures=False).read_text()
    assert f'<a href="traces/{record["case_hash"]}.rank0.json.gz">' in own
    assert "not available: a memory snapshot records the CUDA caching allocator" in own
    elsewhere = write_report([run_dir], tmp_path / "reports" / "r.html", with_figures=False).read_text()
    (href,) = re.findall(r'<a href="([^"]+\.json\.gz)">', elsewhere)
    assert (tmp_path / "reports" / href).resolve() == (run_dir / rank0["trace"]["path"]).resolve()
