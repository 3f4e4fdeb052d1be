"""Results as data (``parabench.load``, ``parabench export``) on committed runs, and what reads
records beside it: the report's case table and environment, ``recheck``'s writes, the CLI's numbers."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import parabench
from parabench.cli import DEFAULT_OUT, build_parser
from parabench.cli import main as cli_main
from parabench.compare import _fmt as cli_number
from parabench.compare import compare_metric
from parabench.registry import recipe_of
from parabench.report import frames
from parabench.report.html import _env_summary, _table, human_bytes
from parabench.results import load_json, load_run

ROOT = Path(__file__).resolve().parent.parent
SPINE = ROOT / "results" / "gpu-spine" / "20261126-020214"  # 7 cases, 2x H100
GPU_MP = ROOT / "results" / "gpu-mp" / "20261126-021202"
CPU_PROXY = ROOT / "results" / "h100x4-cpu-proxy" / "cpu-proxy"


def _records(run: Path) -> dict[str, dict]:
    return {p.name: load_json(p) for p in (run / "cases").glob("*.json")}


def test_load_gives_one_row_per_launch_record_with_identity_metrics_and_verdicts():
    frame = parabench.load(SPINE)
    records = {r["case_hash"]: r for r in _records(SPINE).values()}
    assert len(frame) == len(records) == 7
    assert frame["case_hash"].is_unique
    for row in frame.to_dict("records"):
        rec = records[row["case_hash"]]
        assert (row["run"], row["suite"], row["run_id"]) == (
            "gpu-spine/20261126-020214",
            "gpu-spine",
            "20261126-020214",
        )
        assert row["strategy"] == rec["case"]["strategy"] and row["model"] == "gpt-125m"
        assert (row["world_size"], row["precision"], row["micro_batch"]) == (
            rec["case"]["world_size"],
            "bf16",
            rec["case"]["micro_batch"],
        )
        assert json.loads(row["options"]) == rec["case"]["options"]
        assert row["recipe"] == recipe_of(rec["case"]) and row["repeat"] == 0  # the recipe it ran then
        for name, value in rec["metrics"].items():  # every metric under its own name
            assert row[name] == value or (value is None and pd.isna(row[name])), name
        assert row["comm_payload_bytes"] == rec["per_rank"][0]["comm"]["payload_bytes"]
        assert row["comm_ok"] == rec["checks"].get("comm_ok")
        assert row["check_ok"] == rec["checks"].get("ok")
    by = frame.set_index("strategy")
    assert (by.loc["torch.fsdp2", "kind"], by.loc["torch.fsdp2", "family"]) == ("peer", "sharded")
    assert (by.loc["single", "kind"], by.loc["single", "family"]) == ("reference", "data_parallel")


def test_load_reads_recipe_and_repeats_and_every_run_below_a_folder(tmp_path):
    run = tmp_path / "h100x2" / "r"
    shutil.copytree(SPINE, run, ignore=shutil.ignore_patterns("report.html", "logs"))
    first = sorted((run / "cases").glob("*.json"))[0]
    rec = json.loads(first.read_text())
    rec["case"]["recipe"] = "production"
    rec["case"]["repeat"] = 1
    (run / "cases" / f"{rec['case_hash']}.r1.json").write_text(json.dumps(rec))
    shutil.copytree(GPU_MP, tmp_path / "h100x2" / "other")

    frame = parabench.load(tmp_path)  # no manifest here: every run folder below
    assert sorted(frame["run"].unique()) == ["gpu-mp/20261126-021202", "gpu-spine/20261126-020214"]
    assert len(frame) == 7 + 1 + len(_records(GPU_MP))
    launches = frame[frame["case_hash"] == rec["case_hash"]].sort_values("repeat")
    assert launches["repeat"].tolist() == [0, 1]
    # a record made before cases named a recipe reads as the recipe its strategy had then
    assert launches["recipe"].tolist() == [recipe_of(json.loads(first.read_text())["case"]), "production"]
    with pytest.raises(FileNotFoundError, match="no manifest.json below it"):
        parabench.load(tmp_path / "h100x2" / "r" / "cases")


def test_load_per_rank_gives_each_ranks_time_memory_state_and_traffic():
    frame = parabench.load(SPINE, per_rank=True)
    records = {r["case_hash"]: r for r in _records(SPINE).values()}
    assert len(frame) == sum(len(r["per_rank"]) for r in records.values()) == 13
    kinds = [c for c in frame.columns if c.startswith("comm_") and c.endswith("_payload_bytes")]
    kinds.remove("comm_payload_bytes")
    assert kinds, "no per-kind traffic columns"
    for row in frame.to_dict("records"):
        pr = records[row["case_hash"]]["per_rank"][row["rank"]]
        assert row["step_time_s_median"] == statistics.median(pr["step_times_s"])
        assert row["peak_alloc_bytes"] == pr["memory"]["peak_alloc_bytes"]
        assert row["comm_payload_bytes"] == pr["comm"]["payload_bytes"] == sum(row[k] for k in kinds)
        parts = pr["state_bytes"].values()
        if None in parts:  # DeepSpeed's parts it does not expose: unknown, not 0
            assert pd.isna(row["state_bytes"])
        else:
            assert row["state_bytes"] == sum(parts) > 0


def test_importing_parabench_imports_neither_pandas_nor_torch():
    code = (
        "import sys, parabench; assert 'pandas' not in sys.modules and 'torch' not in sys.modules, "
        "sorted(m for m in sys.modules if m in ('pandas', 'torch')); "
        "from parabench.data import load; assert parabench.load is load"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_export_csv_has_the_frames_rows_with_lists_as_json(tmp_path, capsys):
    out = tmp_path / "x" / "spine.csv"
    assert cli_main(["export", str(SPINE), "--csv", str(out)]) == 0
    assert "7 case launch rows" in capsys.readouterr().out
    table = pd.read_csv(out)
    frame = parabench.load(SPINE)
    assert list(table.columns) == list(frame.columns)
    assert table["tokens_per_s_per_device"].tolist() == pytest.approx(frame["tokens_per_s_per_device"].tolist())
    assert [json.loads(s) for s in table["step_times_s"]] == frame["step_times_s"].tolist()

    ranks = tmp_path / "ranks.csv"
    assert cli_main(["export", str(SPINE), "--csv", str(ranks), "--per-rank"]) == 0
    assert len(pd.read_csv(ranks)) == 13


def test_export_parquet_needs_pyarrow_and_says_how_to_get_it(tmp_path, capsys):
    out = tmp_path / "spine.parquet"
    rc = cli_main(["export", str(SPINE), "--parquet", str(out)])
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        assert rc == 2 and not out.exists()
        assert "pip install pyarrow" in capsys.readouterr().err
    else:
        assert rc == 0
        assert pd.read_parquet(out)["case_hash"].tolist() == parabench.load(SPINE)["case_hash"].tolist()


def test_export_of_a_missing_run_or_without_a_format_fails_clearly(tmp_path, capsys):
    assert cli_main(["export", str(tmp_path / "nope"), "--csv", str(tmp_path / "a.csv")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli_main(["export", str(SPINE)])
    assert exc.value.code == 2 and "one of the arguments --csv --parquet is required" in capsys.readouterr().err


def test_report_case_table_reads_records_as_load_does():
    runs = [load_run(GPU_MP)]
    frame = parabench.load(GPU_MP).set_index("case_hash")
    rows = frames.case_rows(runs)
    assert len(rows) == len(frame)
    for r in rows:
        f = frame.loc[r["case_hash"]]
        assert r["tokens_per_s_per_device"] == f["tokens_per_s_per_device"]
        assert r["step_time_ms_median"] == pytest.approx(f["step_time_s_median"] * 1e3)
        assert r["comm_MiB"] * frames.MiB == f["comm_payload_bytes"]
        assert r["comm_check"] == f["comm_ok"]


def test_recheck_writes_only_records_whose_theory_or_checks_change(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(GPU_MP, run)
    stripped = None
    for p in sorted((run / "cases").glob("*.json")):
        rec = json.loads(p.read_text())
        if rec["case"]["strategy"] == "ref.tp_sp" and stripped is None:  # as before SP traffic was modelled
            rec["theory"]["comm_payload_bytes"] = rec["theory"]["comm_payload_bytes_per_rank"] = None
            rec["checks"] = {"available": True, "comm_ok": None, "state_ok": True, "ok": True}
            p.write_text(json.dumps(rec, indent=1))
            stripped = p.name
    then = 1_600_000_000
    for p in (run / "cases").glob("*.json"):
        os.utime(p, (then, then))

    def files():
        return {p.name: (p.read_bytes(), p.stat().st_mtime) for p in (run / "cases").glob("*.json")}

    before = files()
    assert cli_main(["recheck", str(run), "--strategy", "ref.tp*"]) == 0
    out = capsys.readouterr().out
    after = files()
    assert [n for n in before if before[n] != after[n]] == [stripped]
    assert out.count("file untouched") == 3  # ref.tp at two sizes, the other ref.tp_sp
    assert "comm=theory  (was: no comm verdict)" in out

    assert cli_main(["recheck", str(run), "--strategy", "ref.tp*"]) == 0
    assert files() == after  # nothing left to change: not one byte or mtime
    assert capsys.readouterr().out.count("file untouched") == 4


def test_environment_table_shows_the_recorded_cores_and_cards():
    manifests = [load_json(CPU_PROXY / "manifest.json"), load_json(GPU_MP / "manifest.json")]
    assert manifests[0]["devices"] == [{"type": "cpu", "name": "x86_64", "count": 2}]
    rows = {r["key"]: r["values"] for r in _env_summary(manifests)["rows"]}
    assert rows["devices"] == ["x86_64, 2 cores", "NVIDIA H100 80GB HBM3 ×2"]


def test_byte_cells_show_binary_units_with_the_exact_count_in_the_title():
    assert human_bytes(29_332_618_752) == "27.32 GiB"
    assert human_bytes(1023) == "1,023 B" and human_bytes(64 << 20) == "64.00 MiB"
    cols = [("measured_bytes", "measured", "bytes"), ("expected_bytes", "analytic", "bytes")]
    table = _table("t", "Bytes", cols, [{"measured_bytes": 29_332_618_752, "expected_bytes": [1 << 20, 3 << 20]}])
    assert table["title"] == "Bytes"
    measured, expected = table["rows"][0]["cells"]
    assert (measured["text"], measured["title"], measured["sort"]) == (
        "27.32 GiB",
        "29,332,618,752 bytes",
        29_332_618_752,
    )
    assert (expected["text"], expected["title"], expected["sort"]) == (
        "1.00 MiB – 3.00 MiB",
        "1,048,576 – 3,145,728 bytes",
        3 << 20,
    )


@pytest.mark.parametrize(
    "base, cand, verdict",
    [
        (11.085468292236328, 11.085481643676758, "same"),  # two h100x2 runs of the same code
        (11.09, 11.2, "changed"),
        (11.09, float("nan"), "changed"),
        (float("nan"), float("nan"), "same"),
    ],
)
def test_final_loss_is_changed_only_beyond_kernel_nondeterminism(base, cand, verdict):
    d = compare_metric(
        "final_loss",
        -1,
        "info",
        {"metrics": {"final_loss": base}},
        {"metrics": {"final_loss": cand}},
        threshold=0.03,
        mem_threshold=0.05,
        alpha=0.05,
    )
    assert d.verdict == verdict


def test_cli_prints_large_numbers_alike():
    assert [cli_number(x) for x in (10_936.4, 5_322.4, 5322, 999.4, 0.2547)] == [
        "10,936",
        "5,322",
        "5,322",
        "999.4",
        "0.2547",
    ]


def test_local_runs_go_to_an_ignored_folder_and_results_stays_tracked():
    args = build_parser().parse_args(["run", "suite", "smoke"])
    assert Path(args.out) == DEFAULT_OUT == Path("runs")
    ignored = subprocess.run(["git", "check-ignore", "-q", "runs/smoke/1/manifest.json"], cwd=ROOT)
    tracked = subprocess.run(["git", "check-ignore", "-q", "results/smoke/1/manifest.json"], cwd=ROOT)
    assert (ignored.returncode, tracked.returncode) == (0, 1)
