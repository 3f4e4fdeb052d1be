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


# === issue 53: hostile values on the newer surfaces ================================================

# --- values that could exhaust the machine: refused in seconds, before anything starts -------------


def test_cpu_world_beyond_the_host_is_refused_before_any_launch(tmp_path, capsys):
    from parabench.runner import cpu_rank_limit

    too_many = cpu_rank_limit() + 1
    ddp = ["run", "case", "--model", "tiny", "--strategy", "ref.ddp", "--device", "cpu"]
    rc, _, err = cli(capsys, *ddp, "--out", tmp_path / "out", "--world-size", too_many)
    assert rc == 2
    assert f"{too_many} ranks on this host's CPU, more than {cpu_rank_limit()}" in err and "--max-cpu-ranks" in err
    assert not any(tmp_path.iterdir())


def test_a_world_of_a_million_ranks_is_refused_at_once(tmp_path, capsys):
    rc, _, err = cli(capsys, *TINY, "--out", tmp_path / "out", "--world-size", "1000000")
    assert rc == 2 and "world_size must be <= 65536, got 1000000" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("repeats", "1000000000", "must be <= 100, got 1000000000"),
        ("steps", "1000000000", "must be <= 100000, got 1000000000"),
        ("world_size", "1000000", "must be <= 65536, got 1000000"),
        ("micro_batch", "[1, 100000000]", "must be <= 65536, got 100000000"),
    ],
)
def test_suite_values_beyond_their_bound_name_file_line_and_field(tmp_path, capsys, field, value, message):
    fields = {"model": '"tiny"', "strategy": '"single"', "world_size": "1", field: value}
    suite = write_suite(
        tmp_path, "[suite]\nname = 'big'\n[[matrix]]\n" + "".join(f"{k} = {v}\n" for k, v in fields.items())
    )
    rc, _, err = cli(capsys, "run", "suite", suite, "--out", tmp_path / "out")
    assert rc == 2
    assert f"{suite}:{line_of(suite, f'{field} =')}: field '{field}' in [matrix]: {message}" in err
    assert not (tmp_path / "out").exists()


def test_a_matrix_that_expands_past_the_bound_is_refused(tmp_path, capsys):
    seeds = list(range(200))
    suite = write_suite(
        tmp_path,
        f"[suite]\nname = 'wide'\n[[matrix]]\nmodel = 'tiny'\nstrategy = 'single'\nworld_size = 1\n"
        f"seed = {seeds}\nlr = {[1e-4 * (i + 1) for i in range(60)]}\n",
    )
    rc, _, err = cli(capsys, "run", "suite", suite, "--out", tmp_path / "out")
    assert rc == 2 and "the matrix expands to 12,000 cases, more than 10,000" in err


def test_plan_gpus_beyond_the_bound_is_refused_at_parse_time(capsys):
    rc, _, err = cli(capsys, "plan", "--model", "gpt-350m", "--gpus", "1000000")
    assert rc == 2 and "argument --gpus: must be from 1 to 4096, got 1000000" in err


def test_plan_search_stops_at_its_time_limit(capsys):
    import time

    began = time.monotonic()
    rc, _, err = cli(capsys, "plan", "--model", "gpt-350m", "--gpus", "4096", "--max-seconds", "1")
    assert rc == 2 and "longer than 1 s (--max-seconds) and was stopped" in err
    assert time.monotonic() - began < 15


# --- records are untrusted input ------------------------------------------------------------------


def _record_files(run: Path) -> list[Path]:
    return sorted((run / "cases").glob("*.json"))


def test_fidelity_never_writes_outside_the_run_folder(tmp_path, capsys, monkeypatch):
    """A record whose case_hash is a path must not lead fidelity's output anywhere: the loader
    leaves it out, naming the file and the field, and nothing is launched or written for it."""
    import parabench.fidelity as fidelity

    run = copy_run(tmp_path / "a" / "b" / "run")
    record = next(p for p in _record_files(run) if json.loads(p.read_text())["case"]["strategy"] == "torch.ddp")
    rec = json.loads(record.read_text())
    rec["case_hash"] = "../../../../tmp/x"
    record.write_text(json.dumps(rec))
    launched = []
    monkeypatch.setattr(
        fidelity,
        "_launch_script",
        lambda owner, run_dir, r, args, done: (
            launched.append(r) or {"status": "failed", "reason": "not launched in this test", "script": "s", "argv": []}
        ),
    )
    monkeypatch.setattr(fidelity, "plan", lambda r: (["script.py", "--device=cpu"], None))
    _, _, err = cli(capsys, "fidelity", run, "--no-report")
    assert f"{record}: left out: field 'case_hash'" in err
    assert launched and all(r["case_hash"] != "../../../../tmp/x" for r in launched)  # the other peers ran
    assert not (tmp_path / "tmp").exists()
    outside = [p for p in tmp_path.rglob("*") if p.is_file() and run not in p.parents]
    assert outside == []


def test_fidelity_refuses_a_linked_fidelity_folder(tmp_path, capsys):
    run = copy_run(tmp_path / "run")
    (tmp_path / "elsewhere").mkdir()
    (run / "fidelity").symlink_to(tmp_path / "elsewhere")
    rc, _, err = cli(capsys, "fidelity", run, "--no-report")
    assert rc == 2 and "is not a folder of the run (a link or a file)" in err
    assert not any((tmp_path / "elsewhere").iterdir())


def test_a_bare_record_is_named_and_left_out_by_report_export_load_and_compare(tmp_path, capsys):
    from parabench.data import load

    run = copy_run(tmp_path / "run")
    bare = run / "cases" / "0123456789abcdef.json"
    bare.write_text('{"schema_version": 1, "kind": "case"}')
    rc, _, err = cli(capsys, "report", run, "-o", tmp_path / "r.html")
    assert rc == 0 and f"{bare}: left out: field 'case_hash'" in err
    rc, _, err = cli(capsys, "export", run, "--csv", tmp_path / "e.csv")
    assert rc == 0 and f"{bare}: left out" in err
    assert len((tmp_path / "e.csv").read_text().splitlines()) == 1 + 7  # the header and the seven good records
    problems: list[str] = []
    assert len(load(run)) == 7
    from parabench.results import load_run

    load_run(run, problems)
    assert problems == [
        f"{bare}: left out: field 'case_hash': expected 8 to 64 lower-case hex digits, found NoneType null"
    ]
    rc, out, err = cli(capsys, "compare", GPU_RUN, run)
    assert rc == 0 and "Traceback" not in err and f"{bare}: left out" in err


@pytest.mark.parametrize(
    "damage, field",
    [
        (lambda r: r.update(case_hash="../../../../tmp/x"), "case_hash"),
        (lambda r: r.update(case_hash="ABCDEF0123456789"), "case_hash"),
        (lambda r: r.update(status="fine"), "status"),
        (lambda r: r.update(label=7), "label"),
        (lambda r: r.update(case="gpt"), "case"),
        (lambda r: r["case"].pop("world_size"), "case.world_size"),
        (lambda r: r["case"].update(world_size="2"), "case.world_size"),
        (lambda r: r["case"].update(repeat=-1), "case.repeat"),
        (lambda r: r.update(duration_s=float("nan")), "duration_s"),
        (lambda r: r["metrics"].update(step_time_s_median="fast"), "metrics.step_time_s_median"),
        (lambda r: r["metrics"].update(tokens_per_s=[1]), "metrics.tokens_per_s"),
        (lambda r: r.update(per_rank=[1, 2]), "per_rank[0]"),
        (lambda r: r.update(metrics=[]), "metrics"),
    ],
)
def test_a_damaged_record_is_left_out_naming_file_and_field(tmp_path, damage, field):
    from parabench.results import load_run

    run = copy_run(tmp_path / "run")
    path = _record_files(run)[0]
    rec = json.loads(path.read_text())
    damage(rec)
    path.write_text(json.dumps(rec))
    problems: list[str] = []
    _, records = load_run(run, problems)
    assert len(records) == 6
    assert len(problems) == 1 and problems[0].startswith(f"{path}: left out: field {field!r}")


def test_a_record_copied_under_another_name_is_not_a_second_launch(tmp_path, capsys):
    from parabench.data import load

    run = copy_run(tmp_path / "run")
    first = _record_files(run)[0]
    copy = run / "cases" / f"{first.stem}.r1.json"
    shutil.copy(first, copy)
    other = run / "cases" / "copy-of-a-record.json"
    shutil.copy(first, other)
    frame = load(run)
    assert len(frame) == 7 and (frame["case_hash"] == first.stem).sum() == 1
    err = capsys.readouterr().err
    assert f"{copy}: left out: field 'case_hash': this launch's file is {first.name}" in err
    assert f"{other}: left out" in err
    rc, _, err = cli(capsys, "compare", GPU_RUN, run, "--json", tmp_path / "c.json")
    assert rc == 0 and f"{copy}: left out" in err


def test_a_record_larger_than_any_result_file_is_refused_unread(tmp_path, capsys):
    run = copy_run(tmp_path / "run")
    big = _record_files(run)[0]
    with open(big, "r+b") as f:
        f.truncate(40 << 20)  # sparse: no disk used
    rc, _, err = cli(capsys, "report", run, "-o", tmp_path / "r.html")
    assert rc == 2 and f"{big}: {40 << 20} bytes, larger than any result file" in err


def _launches(tmp_path: Path, values: list) -> Path:
    """A copy of the GPU run whose torch.ddp case has three launches with these tokens/s."""
    run = copy_run(tmp_path / "run")
    path = next(p for p in _record_files(run) if json.loads(p.read_text())["case"]["strategy"] == "torch.ddp")
    rec = json.loads(path.read_text())
    for k, v in enumerate(values):
        launch = json.loads(json.dumps(rec))
        launch["case"].update(repeats=len(values), repeat=k)
        launch["metrics"]["tokens_per_s"] = v
        launch["metrics"]["step_time_s_median"] = v if isinstance(v, str) else launch["metrics"]["step_time_s_median"]
        text = json.dumps(launch).replace('"HUGE"', "1" + "0" * 400)
        (run / "cases" / (f"{path.stem}.r{k}.json" if k else path.name)).write_text(text)
    return run


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "HUGE"])
def test_non_finite_and_overflowing_launches_do_not_crash_report_or_export(tmp_path, capsys, bad):
    run = _launches(tmp_path, [1000.0, bad, 1100.0])
    rc, _, err = cli(capsys, "report", run, "-o", tmp_path / "r.html")
    assert rc == 0, err
    assert "is not a possible measurement" in err and "metrics.tokens_per_s" in err
    rc, _, err = cli(capsys, "export", run, "--csv", tmp_path / "e.csv")
    assert rc == 0, err


def test_a_huge_integer_reads_as_infinity_not_as_an_int_that_overflows(tmp_path):
    from parabench.results import load_json

    path = tmp_path / "r.json"
    path.write_text('{"schema_version": 1, "a": 1' + "0" * 5000 + ', "b": -1' + "0" * 400 + "}")
    data = load_json(path)
    assert data["a"] == float("inf") and data["b"] == float("-inf")


# --- strategy options: type and range, finite numbers only -----------------------------------------


@pytest.mark.parametrize("value", ["NaN", "-5", "Infinity", "-Infinity", "1e300"])
def test_option_numbers_must_be_finite_and_in_range(tmp_path, capsys, value):
    rc, _, err = cli(
        capsys, "run", "case", "--model", "tiny", "--strategy", "torch.ddp", "--device", "cpu", "--world-size", "2",
        "--out", tmp_path / "out", "--options", f'{{"bucket_mb": {value}}}',
    )  # fmt: skip
    assert rc == 2
    assert "option bucket_mb must be a finite number from 0.001 to 1048576" in err
    assert not any(tmp_path.iterdir())


def test_option_numbers_inside_a_table_must_be_finite(tmp_path, capsys):
    rc, _, err = cli(capsys, *TINY, "--out", tmp_path / "out", "--options", '{"optim": {"lr": NaN}}')
    assert rc == 2 and "option optim.lr must be a finite number, got nan" in err


def test_suite_option_nan_is_refused_with_file_and_line(tmp_path, capsys):
    suite = write_suite(
        tmp_path,
        "[suite]\nname = 'n'\n[[matrix]]\nmodel = 'tiny'\nstrategy = 'torch.ddp'\nworld_size = 2\n"
        "options = {bucket_mb = nan}\n",
    )
    rc, _, err = cli(capsys, "run", "suite", suite, "--out", tmp_path / "out")
    assert rc == 2 and "option bucket_mb must be a finite number" in err and str(suite) in err


# --- plan: every flag and shape field range-checked at parse time ----------------------------------


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--seq", "0", "must be from 1 to 2097152, got 0"),
        ("--seq", "-5", "must be from 1 to 2097152, got -5"),
        ("--global-batch", "0", "must be from 1 to 16777216, got 0"),
        ("--layers", "-1", "must be from 1 to 1024, got -1"),
        ("--heads", "0", "must be from 1 to 4096, got 0"),
        ("--hidden", "1000000000", "must be from 1 to 131072, got 1000000000"),
        ("--hidden", "1e9", "expected a whole number from 1 to 131072, got '1e9'"),
        ("--vocab", "0", "must be from 1 to 4194304, got 0"),
        ("--top", "-3", "must be from 1 to 100000, got -3"),
        ("--dropped", "-1", "must be from 0 to 100000, got -1"),
        ("--max-seconds", "nan", "must be a number of seconds from 1 to 86400"),
    ],
)
def test_plan_flags_out_of_range_name_the_flag_and_range(capsys, flag, value, message):
    rc, _, err = cli(capsys, "plan", "--model", "gpt-350m", "--gpus", "8", f"{flag}={value}")
    assert rc == 2 and f"argument {flag}: {message}" in err


@pytest.mark.parametrize(
    "body, message",
    [
        (
            'n_layers = 2\nd_model = "wide"\nn_heads = 2\n',
            "field 'd_model' must be a whole number from 1 to 131072, got 'wide'",
        ),
        (
            "n_layers = 2\nd_model = 64\nn_heads = 2\nseq_len = -4\n",
            "field 'seq_len' must be a whole number from 1 to 2097152, got -4",
        ),
        ("n_layers = 2\nd_model = 64\nn_heads = 3\n", "n_heads 3 does not divide d_model 64"),
        ("n_layers = 2\nd_model = 64\nn_heads = 2\ncapacity_factor = nan\n", "field 'capacity_factor'"),
        ("model = 3\n", "[model] must be a table"),
    ],
)
def test_plan_shape_file_with_bad_fields_names_file_and_field(tmp_path, capsys, body, message):
    shape = tmp_path / "shape.toml"
    shape.write_text(body)
    rc, _, err = cli(capsys, "plan", "--shape", shape, "--gpus", "8")
    assert rc == 2 and f"{shape}: {message}" in err and "Traceback" not in err


def test_plan_write_suite_refuses_a_folder_a_missing_folder_and_proc(tmp_path, capsys):
    for target, message in [
        (tmp_path, "it is a folder; name a .toml file to write"),
        (tmp_path / "missing" / "s.toml", f"the folder {tmp_path / 'missing'} does not exist"),
        (Path("/proc/parabench-suite.toml"), "cannot write in /proc"),
    ]:
        rc, _, err = cli(capsys, "plan", "--model", "gpt-350m", "--gpus", "8", "--write-suite", target)
        assert rc == 2 and f"--write-suite {target}: {message}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_plan_write_suite_keeps_an_existing_file_without_force_and_writes_a_hidden_name_that_loads(tmp_path, capsys):
    from parabench.suite import load_suite

    keep = tmp_path / "keep.toml"
    keep.write_text("# mine\n")
    rc, _, err = cli(capsys, "plan", "--model", "gpt-350m", "--gpus", "8", "--write-suite", keep)
    assert rc == 2 and "the file exists; give --force to replace it" in err and keep.read_text() == "# mine\n"
    rc, out, err = cli(capsys, "plan", "--model", "gpt-350m", "--gpus", "8", "--write-suite", keep, "--force")
    assert rc == 0, err
    assert load_suite(str(keep)).cases
    hidden = tmp_path / ".hidden.toml"
    rc, out, err = cli(capsys, "plan", "--model", "gpt-350m", "--gpus", "8", "--write-suite", hidden)
    assert rc == 0, err
    assert load_suite(str(hidden)).name == "hidden"
    written = [".hidden.predictions.json", ".hidden.toml", "keep.predictions.json", "keep.toml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == written  # each with its predictions; no temporary file


# --- export: atomic, names the file ----------------------------------------------------------------


def test_export_on_a_full_disk_keeps_the_earlier_file_and_names_the_target(tiny_tmpfs, capsys):
    target = tiny_tmpfs / "e.csv"
    target.write_text("an earlier export\n")
    big_run = ROOT / "results" / "h100x2" / "20261126-180901"  # 73 launches: about 150 kB of CSV
    rc, _, err = cli(capsys, "export", big_run, "--csv", target)
    assert rc == 2 and f"cannot write {target}: No space left on device" in err
    assert target.read_text() == "an earlier export\n"
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["e.csv"]


def test_export_into_a_folder_names_it(tmp_path, capsys):
    rc, _, err = cli(capsys, "export", GPU_RUN, "--csv", tmp_path)
    assert rc == 2 and f"cannot write {tmp_path}: it is a folder" in err


def test_export_parquet_without_pyarrow_says_which_extra_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow then raises ImportError
    rc, _, err = cli(capsys, "export", GPU_RUN, "--parquet", tmp_path / "e.parquet")
    assert rc == 2 and "pip install 'parabench[parquet]'" in err and str(tmp_path / "e.parquet") in err
    assert not any(tmp_path.iterdir())


# --- redaction by value ----------------------------------------------------------------------------

SECRET_VALUES = {
    "MASTER_ADDR": ("tcp://trainer:p@ss/w0rd@10.0.0.1:29500", ["p@ss/w0rd", "ss/w0rd"]),
    "TORCH_STORE_URL": ("Server=db;Database=x;Password=hunter2;", ["hunter2"]),
    "NCCL_CONF": ("Host=h;password=Hunter3", ["Hunter3"]),
    "TORCH_HEADER": ("Authorization: Bearer abc.def.ghi", ["abc.def.ghi"]),
    "MASTER_BEARER_VALUE": ("Bearer tok-4444", ["tok-4444"]),
    "NCCL_URL": ("https://store/x?token=t0k3n&user=u", ["t0k3n"]),
    "TORCH_PEM": ("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBg\n-----END PRIVATE KEY-----", ["MIIEvQIBADANBg"]),
    "TORCH_RANDOM": ("ghp_A1b2C3d4E5f6G7h8I9j0KlMnOpQrStUv", ["A1b2C3d4E5f6G7h8I9j0KlMnOpQrStUv"]),
}
KEPT_VALUES = {
    "NCCL_SOCKET_IFNAME": "eth0",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    "PARABENCH_GIT_COMMIT": "1c18c66aa4f1e2b3c4d5e6f708192a3b4c5d6e7f",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "TORCH_HOME": "/usr/local/lib/python3.11/site-packages/torch/hub",
    "MASTER_ADDR_PLAIN": "tcp://10.0.0.1:29500",
}


def test_credentials_under_allowlisted_names_are_redacted_by_value():
    env = {k: v for k, (v, _) in SECRET_VALUES.items()} | KEPT_VALUES
    recorded = recorded_env(env)
    text = json.dumps(recorded)
    for name, (_, secrets) in SECRET_VALUES.items():
        assert name in recorded and REDACTED in recorded[name]
        assert not any(s in text for s in secrets), name
    assert {k: recorded[k] for k in KEPT_VALUES} == KEPT_VALUES


def test_credentials_in_argv_are_redacted_by_value():
    argv = [
        "--rdzv-endpoint=tcp://u:p@ss/x@host:1",
        "--header",
        "Authorization: Bearer zzz-secret",
        "--header2",
        "Bearer",
        "yyy-secret",
        "--torchrun-arg=--rdzv-conf=store=Host=h;Password=hunter2",
        "--model",
        "gpt-350m",
    ]
    out = redact_argv(argv)
    assert not any(s in " ".join(out) for s in ("p@ss", "ss/x", "zzz-secret", "yyy-secret", "hunter2"))
    assert out[-2:] == ["--model", "gpt-350m"]


def test_a_manifest_with_secret_values_reaches_no_report(tmp_path, capsys):
    run = copy_run(tmp_path / "run")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["env"] = {k: v for k, (v, _) in SECRET_VALUES.items()}
    manifest["argv"] = ["parabench", "run", "--x=tcp://u:p@ss/x@host:1", "Authorization:", "Bearer", "qqq-secret"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    rc, _, err = cli(capsys, "report", run, "-o", tmp_path / "r.html")
    assert rc == 0, err
    html = (tmp_path / "r.html").read_text()
    for _, secrets in SECRET_VALUES.values():
        assert not any(s in html for s in secrets)
    assert "qqq-secret" not in html and "p@ss" not in html


# --- the small points ------------------------------------------------------------------------------


def test_sigterm_and_sighup_exit_128_plus_the_signal():
    from parabench.cli import _interrupted
    from parabench.launch import Stopped

    assert _interrupted(Stopped("SIGTERM")) == 143
    assert _interrupted(Stopped("SIGHUP")) == 129
    assert _interrupted(KeyboardInterrupt()) == 130


def test_two_runners_in_the_same_second_get_folders_of_their_own(tmp_path):
    import threading

    from parabench.runner import reserve_run_dir

    wanted = tmp_path / "suite" / "20261129-010101"
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(reserve_run_dir(wanted))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 8 and wanted in got and all(p.is_dir() for p in got)
    assert sorted(p.name for p in got) == sorted([wanted.name] + [f"{wanted.name}-{k}" for k in range(2, 9)])


def test_a_start_up_kill_is_not_launched_again_and_a_timeout_reports_one_clock(tmp_path, capsys):
    """A rank SIGKILLed in start-up (the out-of-memory killer's way) would be killed again: the
    runner records it at once instead of relaunching. A timed-out case's message gives the time
    the timeout was judged by: at least its timeout, never less."""
    suite = write_suite(
        tmp_path,
        """
        [suite]
        name = "kills"
        device = "cpu"
        steps = 2
        warmup = 0
        [[matrix]]
        model = "tiny"
        strategy = "torch.ddp"
        world_size = 2
        timeout_s = 120
        options = {inject_fault = {kind = "startup_kill", rank = 1, launches = 1}}
        [[matrix]]
        model = "tiny"
        strategy = "torch.ddp"
        world_size = 2
        timeout_s = 20
        options = {inject_fault = {kind = "hang", rank = 1, step = 1}}
        """,
    )
    rc, out, err = cli(
        capsys, "run", "suite", suite, "--out", tmp_path / "res", "--run-id", "r", "--no-report", "--no-batch"
    )
    assert rc == 1, out + err
    assert "died in start-up" not in out
    _, records = load_run(tmp_path / "res" / "kills" / "r")
    by_kind = {r["case"]["options"]["inject_fault"]["kind"]: r for r in records}
    killed = by_kind["startup_kill"]
    assert killed["status"] in ("oom", "crashed") and "SIGKILL" in killed["error"]["message"]
    assert "relaunched_after_startup_crash" not in killed["launch"]
    hang = by_kind["hang"]["error"]["message"]
    waited = float(hang.split("no result after ")[1].split(" s")[0])
    assert hang.startswith("no result after") and "(timeout 20 s)" in hang and 20 <= waited < 23, hang
