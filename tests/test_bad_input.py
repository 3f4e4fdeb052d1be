"""Every bad input gets a clear error naming the flag or file:line (exit 2, nothing written), names
that become paths stay inside --out, the gate fails on missing data, a failed case exits 1, and no
secret reaches the manifest or the report. Through ``parabench.cli.main`` in-process, except the
one real launch (a case with an injected crash)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from parabench.cli import _resume_command, build_parser, main
from parabench.results import REDACTED, load_run, recorded_env, redact_argv

ROOT = Path(__file__).resolve().parent.parent
GPU_RUN = ROOT / "results" / "gpu-spine" / "20261126-020214"
TINY = ["run", "case", "--model", "tiny", "--strategy", "single", "--device", "cpu"]


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``parabench ARGV``; argparse's own errors exit by SystemExit."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def write_suite(tmp_path: Path, body: str, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_run(dst: Path) -> Path:
    shutil.copytree(GPU_RUN, dst, ignore=shutil.ignore_patterns("report.html", "logs"))
    return dst


# --- names that become paths ----------------------------------------------------------------------

TRAVERSAL = ["../../escaped", "/tmp/parabench-escaped", "a/b", "..", ".hidden", "a\\b"]


@pytest.mark.parametrize("name", TRAVERSAL)
def test_suite_name_that_is_not_one_folder_is_refused_with_file_and_line(tmp_path, capsys, name):
    suite = write_suite(
        tmp_path,
        f"""
        [suite]
        description = "traversal"
        name = {json.dumps(name)}
        [[matrix]]
        model = "tiny"
        strategy = "single"
        world_size = 1
        """,
    )
    out = tmp_path / "deep" / "out"
    rc, _, err = cli(capsys, "run", "suite", suite, "--out", out)
    assert rc == 2
    assert f"{suite}:{line_of(suite, 'name =')}: field 'name'" in err and "suite name" in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["s.toml"]  # nothing written anywhere
    assert not Path("/tmp/parabench-escaped").exists()


@pytest.mark.parametrize("name", TRAVERSAL)
@pytest.mark.parametrize("flag", ["--run-id", "--name"])
def test_run_id_and_case_name_must_be_one_folder(tmp_path, capsys, flag, name):
    out = tmp_path / "out"
    rc, _, err = cli(capsys, *TINY, "--out", out, f"{flag}={name}")
    assert rc == 2
    assert f"argument {flag}: {flag} {name!r}" in err
    assert not any(tmp_path.iterdir())


def test_run_id_is_checked_for_suites_too(tmp_path, capsys):
    suite = write_suite(
        tmp_path,
        """
        [suite]
        name = "ok"
        [[matrix]]
        model = "tiny"
        strategy = "single"
        world_size = 1
        """,
    )
    rc, _, err = cli(capsys, "run", "suite", suite, "--out", tmp_path / "out", "--run-id", "../../x")
    assert rc == 2 and "argument --run-id" in err and not (tmp_path / "out").exists()


# --- run case flags: ranges at parse time ---------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--micro-batch", "0", "out of range: must be >= 1, got 0"),
        ("--grad-accum", "0", "out of range: must be >= 1, got 0"),
        ("--steps", "0", "out of range: must be >= 1, got 0"),
        ("--steps", "-1", "out of range: must be >= 1, got -1"),
        ("--warmup", "-1", "out of range: must be >= 0, got -1"),
        ("--nnodes", "0", "out of range: must be >= 1, got 0"),
        ("--world-size", "0", "out of range: must be >= 1, got 0"),
        ("--world-size", "-2", "out of range: must be >= 1, got -2"),
        ("--seq-len", "0", "out of range: must be >= 1, got 0"),
        ("--seq-len", "-64", "out of range: must be >= 1, got -64"),
        ("--timeout-s", "0", "out of range: must be a finite number > 0"),
        ("--timeout-s", "-3", "out of range: must be a finite number > 0"),
        ("--timeout-s", "nan", "out of range: must be a finite number > 0"),
        ("--steps", "two", "expected an integer, got 'two'"),
        ("--options", "[1]", "must be a JSON object"),
        ("--options", '"tp"', "must be a JSON object"),
        ("--options", "{tp: 2", "not valid JSON"),
    ],
)
def test_run_case_values_out_of_range_name_the_flag(tmp_path, capsys, flag, value, message):
    rc, _, err = cli(capsys, *TINY, "--out", tmp_path / "out", f"{flag}={value}")
    assert rc == 2
    assert f"argument {flag}: {message}" in err
    assert "Traceback" not in err and not any(tmp_path.iterdir())


# --- suite files: the same ranges with file:line and field ----------------------------------------


@pytest.mark.parametrize(
    "table, field, value, message",
    [
        ("suite", "micro_batch", "0", "must be >= 1"),
        ("suite", "grad_accum", "0", "must be >= 1"),
        ("suite", "steps", "0", "must be >= 1"),
        ("suite", "steps", "-1", "must be >= 1"),
        ("suite", "warmup", "-1", "must be >= 0"),
        ("suite", "seq_len", "0", "must be >= 1"),
        ("suite", "timeout_s", "0", "must be > 0 seconds"),
        ("suite", "timeout_s", "-1.5", "must be > 0 seconds"),
        ("suite", "timeout_s", "nan", "must be a finite number"),
        ("suite", "options", "[1]", "expected dict, got list"),
        ("matrix", "world_size", "0", "must be >= 1"),
        ("matrix", "steps", "[4, 0]", "must be >= 1"),
        ("matrix", "options", "[1]", "expected dict, got int"),
    ],
)
def test_suite_values_out_of_range_name_file_line_and_field(tmp_path, capsys, table, field, value, message):
    head = f"{field} = {value}\n" if table == "suite" else ""
    row = f"{field} = {value}\n" if table == "matrix" else ""
    world = "" if field == "world_size" and table == "matrix" else "world_size = 1\n"
    suite = tmp_path / "s.toml"
    suite.write_text(f'[suite]\nname = "ranges"\n{head}\n[[matrix]]\nmodel = "tiny"\nstrategy = "single"\n{world}{row}')
    rc, _, err = cli(capsys, "run", "suite", suite, "--out", tmp_path / "out")
    assert rc == 2
    assert f"{suite}:{line_of(suite, f'{field} =')}: field '{field}' in [{table}]: {message}" in err
    assert not (tmp_path / "out").exists()


def test_suite_path_that_is_a_folder(tmp_path, capsys):
    folder = tmp_path / "suite.toml"
    folder.mkdir()
    rc, _, err = cli(capsys, "run", "suite", folder, "--out", tmp_path / "out")
    assert rc == 2 and f"suite path {folder} is a folder" in err


def test_suite_file_that_is_not_utf8_names_the_line(tmp_path, capsys):
    suite = tmp_path / "latin1.toml"
    suite.write_bytes('[suite]\nname = "x"\ndescription = "caf\u00e9"\n'.encode("latin-1"))
    rc, _, err = cli(capsys, "run", "suite", suite, "--out", tmp_path / "out")
    assert rc == 2 and f"{suite}:3: not UTF-8 text (byte 0xe9" in err


# --- result files that cannot be read ------------------------------------------------------------


def test_manifest_that_is_not_a_json_object(tmp_path, capsys):
    run = copy_run(tmp_path / "run")
    (run / "manifest.json").write_text("[1, 2]")
    rc, _, err = cli(capsys, "report", run, "-o", tmp_path / "r.html")
    assert rc == 2 and f"{run / 'manifest.json'}: expected a JSON object, found list" in err
    assert not (tmp_path / "r.html").exists()


@pytest.fixture
def truncated_run(tmp_path) -> tuple[Path, Path]:
    """A copy of a real run whose second record was cut off mid-write (as by a full disk)."""
    run = copy_run(tmp_path / "out" / "resumed" / "r")
    record = sorted((run / "cases").glob("*.json"))[1]
    record.write_bytes(record.read_bytes()[:200])
    return run, record


def test_truncated_record_in_report_names_the_file(tmp_path, capsys, truncated_run):
    run, record = truncated_run
    rc, _, err = cli(capsys, "report", run, "-o", tmp_path / "r.html")
    assert rc == 2 and f"{record}: not valid JSON (truncated or edited?)" in err
    assert not list(tmp_path.glob("*.html")) and not list(tmp_path.glob(".*.tmp"))


def test_truncated_record_in_recheck_names_the_file_and_changes_nothing(capsys, truncated_run):
    run, record = truncated_run
    before = snapshot(run)
    rc, _, err = cli(capsys, "recheck", run)
    assert rc == 2 and f"{record}: not valid JSON" in err
    assert snapshot(run) == before


def test_truncated_record_stops_resume_before_anything_runs(tmp_path, capsys, truncated_run):
    run, record = truncated_run
    suite = write_suite(
        tmp_path,
        """
        [suite]
        name = "resumed"
        [[matrix]]
        model = "tiny"
        strategy = "single"
        world_size = 1
        device = "cpu"
        """,
    )
    before = snapshot(run)
    rc, _, err = cli(capsys, "run", "suite", suite, "--out", tmp_path / "out", "--run-id", "r", "--resume")
    assert rc == 2
    assert f"cannot resume {run}: {record}: not valid JSON" in err and "nothing was run" in err
    assert snapshot(run) == before  # no record lost or altered, the manifest not even marked resumed


def test_report_into_an_existing_folder(tmp_path, capsys):
    target = tmp_path / "reports"
    target.mkdir()
    rc, _, err = cli(capsys, "report", GPU_RUN, "-o", target)
    assert rc == 2 and f"cannot write the report to {target}: it is a folder" in err
    assert not any(target.iterdir()) and sorted(p.name for p in tmp_path.iterdir()) == ["reports"]


def test_writing_to_a_pipe_or_device_writes_through_it_and_leaves_it_there(tmp_path):
    """``--out /dev/null`` must not rename a file over the device (as root it would replace it)."""
    import os
    import threading

    from parabench.results import write_json_atomic

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    got = []
    reader = threading.Thread(target=lambda: got.append(pipe.read_text()), daemon=True)
    reader.start()
    write_json_atomic(pipe, {"a": 1})
    reader.join(timeout=10)
    assert got == ['{\n "a": 1\n}'] and pipe.is_fifo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "full"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_on_report_write(tiny_tmpfs, capsys):
    keep = tiny_tmpfs / "kept.txt"
    keep.write_text("an earlier file\n")
    rc, _, err = cli(capsys, "report", GPU_RUN, "-o", tiny_tmpfs / "report.html")  # about 200 kB into 64 kB
    assert rc == 2
    assert f"cannot write the report to {tiny_tmpfs / 'report.html'}: No space left on device" in err
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["kept.txt"]  # no partial report, no .tmp
    assert keep.read_text() == "an earlier file\n"


# --- the regression gate on missing data ----------------------------------------------------------


def _no_cases(run: Path) -> None:
    for p in (run / "cases").glob("*.json"):
        p.unlink()


def _disjoint(run: Path) -> None:
    for i, p in enumerate(sorted((run / "cases").glob("*.json"))):
        rec = json.loads(p.read_text())
        rec["case_hash"] = f"{i:016x}"
        p.unlink()
        (p.parent / f"{i:016x}.json").write_text(json.dumps(rec))


def _ok_without_metrics(run: Path) -> None:
    p = min((run / "cases").glob("*.json"))
    rec = json.loads(p.read_text())
    assert rec["status"] == "ok"
    rec["metrics"] = None
    p.write_text(json.dumps(rec))


def _lost_metric(run: Path) -> None:
    p = min((run / "cases").glob("*.json"))
    rec = json.loads(p.read_text())
    del rec["metrics"]["tokens_per_s"]
    p.write_text(json.dumps(rec))


@pytest.mark.parametrize(
    "damage, message",
    [
        (_no_cases, "the candidate has no cases"),
        (_disjoint, "7 of 7 baseline cases are not in the candidate (no case in common"),
        (_ok_without_metrics, "status ok but the candidate record has no metrics"),
        (_lost_metric, "the candidate lacks tokens_per_s (measured in the baseline)"),
    ],
)
def test_compare_fails_on_missing_data_unless_allowed(tmp_path, capsys, damage, message):
    cand = copy_run(tmp_path / "cand")
    damage(cand)
    rc, out, err = cli(capsys, "compare", GPU_RUN, cand)
    assert rc == 1, out
    assert message in out and "MISSING DATA" in err
    rc, out, _ = cli(capsys, "compare", GPU_RUN, cand, "--allow-missing", "--json", tmp_path / "c.json")
    assert rc == 0, out
    assert any(line.startswith("note: missing data (allowed): ") and message in line for line in out.splitlines())
    assert any(message in m for m in json.loads((tmp_path / "c.json").read_text())["missing"])


# --- exit status, file modes and secrets: one real launch -----------------------------------------

SECRETS = {
    "NCCL_IB_PASSWD": "s3cr3t-nccl",
    "DS_PASS": "s3cr3t-ds",
    "TORCH_AUTH": "s3cr3t-torch",
    "GLOO_BEARER": "s3cr3t-gloo",
    "PYTORCH_PAT": "s3cr3t-pat",
    "CUDA_PRIVATE": "s3cr3t-cuda",
    "SLURM_JOB_ACCOUNT": "s3cr3t-account",
    "HF_TOKEN": "s3cr3t-hf",
    "AWS_SECRET_ACCESS_KEY": "s3cr3t-aws",
    "MY_API_KEY": "s3cr3t-api",
    "GITHUB_TOKEN": "s3cr3t-gh",
}


def test_failed_case_exits_1_and_no_secret_reaches_manifest_or_report(tmp_path, capsys, monkeypatch):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    # The runner records its own process's command line.
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "parabench",
            "run",
            "case",
            "--password=s3cr3t-argv1",
            "--token",
            "s3cr3t-argv2",
            "WANDB_API_KEY=s3cr3t-argv3",
            "--rdzv-endpoint=tcp://u:s3cr3t-argv4@host:1",
        ],
    )
    old_mask = os.umask(0o022)
    try:
        rc, out, err = cli(
            capsys,
            "run",
            "case",
            "--model",
            "tiny",
            "--strategy",
            "single",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--timeout-s",
            "120",
            "--out",
            tmp_path,
            "--name",
            "fault",
            "--run-id",
            "r",
            "--options",
            '{"inject_fault": {"kind": "crash", "rank": 0, "step": 0}}',
        )
    finally:
        os.umask(old_mask)
    assert rc == 1, out + err  # a failed case exits 1 without --strict
    run = tmp_path / "fault" / "r"
    _, [record] = load_run(run)
    assert record["status"] == "crashed" and "injected crash" in record["error"]["message"]

    files = [run / "manifest.json", run / "report.html", *sorted((run / "cases").glob("*.json"))]
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o644"}  # shared alike, not 0600 / 0644
    text = "".join(p.read_text() for p in files)
    leaked = [v for v in [*SECRETS.values(), *(f"s3cr3t-argv{i}" for i in range(1, 5))] if v in text]
    assert not leaked
    manifest = json.loads((run / "manifest.json").read_text())
    for name in ("NCCL_IB_PASSWD", "DS_PASS", "TORCH_AUTH", "GLOO_BEARER", "PYTORCH_PAT", "CUDA_PRIVATE"):
        assert manifest["env"][name] == REDACTED  # set, and shown as such, value withheld
    assert "HF_TOKEN" not in manifest["env"] and "SLURM_JOB_ACCOUNT" not in manifest["env"]
    assert manifest["argv"][3:] == [
        f"--password={REDACTED}",
        "--token",
        REDACTED,
        f"WANDB_API_KEY={REDACTED}",
        f"--rdzv-endpoint=tcp://{REDACTED}@host:1",
    ]


def test_allowlist_keeps_what_matters_and_redacts_by_name_component():
    env = {
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "CUDA_PATH": "/usr/local/cuda",
        "MASTER_ADDR": "10.0.0.1",
        "WORLD_SIZE": "2",
        "NCCL_DEBUG": "INFO",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "NCCL_IB_PASSWD": "x",
        "DS_SESSION_ID": "x",
        "TORCH_APITOKEN": "x",
        "OMP_KEY": "x",
        "HOME": "/root",
        "PATH": "/bin",
        "SSH_AUTH_SOCK": "/tmp/s",
        "MASTER_URL": "https://me:pw@h/",
    }
    assert recorded_env(env) == {
        "CUDA_PATH": "/usr/local/cuda",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "DS_SESSION_ID": REDACTED,
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_URL": f"https://{REDACTED}@h/",
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_PASSWD": REDACTED,
        "OMP_KEY": REDACTED,
        "OMP_NUM_THREADS": "1",
        "TORCH_APITOKEN": REDACTED,
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "WORLD_SIZE": "2",
    }
    assert redact_argv(
        ["--api-key", "k", "--out", "res", "--secret", "--run-id", "r", "--torchrun-arg=--rdzv-conf=timeout=5,token=t"]
    ) == [
        "--api-key",
        REDACTED,
        "--out",
        "res",
        "--secret",
        "--run-id",
        "r",
        f"--torchrun-arg=--rdzv-conf=timeout=5,token={REDACTED}",
    ]


def test_interrupt_hint_keeps_suite_out_and_run_id():
    argv = ["run", "suite", "my suite.toml", "--out", "/data/res", "--filter", "ddp", "--run-id", "old"]
    args = build_parser().parse_args(argv)
    args.argv = argv
    assert _resume_command(args, Path("/data/res/s/old")) == (
        "parabench run suite 'my suite.toml' --out /data/res --filter ddp --run-id old --resume"
    )
    argv = ["run", "suite", "smoke", "--resume", "--out=elsewhere"]  # the run folder was picked by --resume
    args = build_parser().parse_args(argv)
    args.argv = argv
    assert _resume_command(args, Path("elsewhere/smoke/20261127-101010")) == (
        "parabench run suite smoke --out=elsewhere --run-id 20261127-101010 --resume"
    )


def test_a_custom_shape_trains_end_to_end_and_a_malformed_one_names_the_line(tmp_path, capsys):
    """A suite may name a shape off the ladder (custom-L<layers>-d<width>-h<heads>[-v<vocab>]): the
    workers rebuild it from the name, and the record carries its shape and parameter count."""
    from parabench.models import model_config, parameter_count

    good = write_suite(
        tmp_path,
        """
        [suite]
        name = "custom-shape"
        device = "cpu"
        seq_len = 32
        steps = 2
        warmup = 0

        [[matrix]]
        model = "custom-L1-d32-h2-v128"
        strategy = "ref.zero2"
        world_size = 2
        micro_batch = 2
        """,
    )
    rc, out, err = cli(capsys, "run", "suite", good, "--out", tmp_path / "res")
    assert rc == 0, err
    run = next((tmp_path / "res" / "custom-shape").iterdir())
    record = json.loads(next((run / "cases").glob("*.json")).read_text())
    assert record["case"]["model"] == "custom-L1-d32-h2-v128"
    want = parameter_count(model_config("custom-L1-d32-h2-v128", seq_len=32))["total"]
    assert record["model"]["params"]["total"] == want and record["model"]["config"]["n_layers"] == 1
    bad = write_suite(
        tmp_path, '[suite]\nname = "b"\n\n[[matrix]]\nmodel = "custom-L1-d30-h4"\nstrategy = "single"\n', "b.toml"
    )
    rc, _, err = cli(capsys, "run", "suite", bad, "--out", tmp_path / "res")
    assert rc == 2 and f"b.toml:{line_of(bad, 'custom-L1-d30-h4')}" in err and "custom-L<layers>" in err


def test_no_skips_names_every_case_that_would_be_skipped_and_runs_nothing(tmp_path, capsys):
    # On CPU an fp8 case is always skipped (float8 matmuls need an sm_89+ GPU), so it stands for the
    # GPU machine that lacks torchao: the flag must stop the suite before its first launch.
    suite = write_suite(
        tmp_path,
        """
        [suite]
        name = "needs-a-gpu"
        device = "cpu"
        steps = 1
        warmup = 0

        [[matrix]]
        model = "tiny"
        strategy = "single"
        world_size = 1
        precision = "bf16"
        recipe = ["amp", "fp8"]
        """,
    )
    rc, out, err = cli(capsys, "run", "suite", str(suite), "--out", str(tmp_path / "res"), "--no-skips")
    assert rc == 2, out + err
    assert "1 of 2 cases would be skipped" in err and "fp8" in err and "nothing was run" in err
    assert not (tmp_path / "res").exists()
