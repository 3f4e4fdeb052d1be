"""Messages a person reads at the command line: an unknown name is one line that names the closest
valid names (``parabench.names``) and points to `parabench list` instead of printing every name;
`parabench list` itself imports nothing heavy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from parabench.cli import main
from parabench.names import closest_names, unknown_name_message
from parabench.registry import STRATEGIES, get_strategy
from parabench.suite import SuiteError, load_suite


def cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


ROOT = Path(__file__).resolve().parent.parent
TINY = ["run", "case", "--model", "tiny", "--device", "cpu"]
HEAVY = {"torch", "deepspeed", "torchao", "pandas", "numpy", "pyarrow"}


@pytest.mark.parametrize(
    "argv, start, closest",
    [
        ([*TINY, "--strategy", "ddp"], "unknown strategy 'ddp'; ", "closest: ref.ddp, torch.ddp"),
        (["run", "case", "--model", "tinny", "--strategy", "single"], "unknown model 'tinny'; ", "closest: tiny"),
        (["run", "suite", "smok"], "unknown suite 'smok'; ", "closest: smoke"),
        (["run", "suite", "smoke", "--proxy-model", "tiny-dep"], "unknown model 'tiny-dep'; ", "closest: tiny-deep"),
        ([*TINY, "--strategy", "single", "--precision", "fp33"], "unknown precision 'fp33'; ", "did you mean fp32?"),
        ([*TINY, "--strategy", "single", "--recipe", "mastr"], "unknown recipe 'mastr'; ", "did you mean master?"),
        (
            [*TINY, "--strategy", "torch.ddp", "--world-size", "2", "--options", '{"profile": "tund"}'],
            "option profile must be 'tuned' | 'matched', got 'tund'",
            "did you mean 'tuned'?",
        ),
    ],
)
def test_an_unknown_name_is_one_line_with_the_closest_valid_ones(tmp_path, capsys, argv, start, closest):
    rc, _, err = cli(capsys, *argv, "--out", tmp_path)
    assert rc == 2 and not any(tmp_path.iterdir())
    [line] = err.splitlines()
    assert line.startswith(f"parabench: error: {start}") and closest in line, line
    assert '"' not in line  # a KeyError's repr would quote the whole message
    assert len(line) < 200, line


def test_a_long_list_points_to_the_listing_and_a_short_one_is_given_whole():
    long = unknown_name_message("strategy", "torch.nope", STRATEGIES)
    assert "(valid strategies: `parabench list`)" in long
    assert sum(name in long for name in STRATEGIES) <= 3  # the closest, not the 49
    short = unknown_name_message("precision", "fp33", ("fp32", "bf16", "fp16"))
    assert short == "unknown precision 'fp33'; did you mean fp32? valid precisions: fp32, bf16, fp16"
    assert "none is close" in unknown_name_message("strategy", "xyz", STRATEGIES)


def test_closest_names_prefer_the_same_name_then_the_same_tail():
    assert closest_names("Torch.DDP", STRATEGIES)[0] == "torch.ddp"
    assert set(closest_names("ddp", STRATEGIES)[:2]) == {"ref.ddp", "torch.ddp"}
    assert closest_names("deepspeed.zero3_ofload", STRATEGIES)[0] == "deepspeed.zero3_offload"


def test_the_lookups_raise_the_same_message_a_person_reads():
    with pytest.raises(KeyError) as exc:
        get_strategy("ref.zero4")
    assert str(exc.value).startswith("unknown strategy 'ref.zero4'; closest: ref.zero3")


def test_a_suite_file_names_its_line_and_the_closest_strategy(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[suite]\nname = "b"\n\n[[matrix]]\nmodel = "tiny"\nstrategy = "torch.dpp"\nworld_size = 2\n')
    with pytest.raises(SuiteError) as exc:
        load_suite(str(bad))
    message = str(exc.value)
    assert message.startswith(f"{bad}:6: field 'strategy'") and "closest: torch.ddp" in message
    assert "\n" not in message and "valid strategies: `parabench list`" in message and "ref.zeropp" not in message


def test_list_imports_no_torch_even_for_suites_whose_cases_are_pipelines():
    """Listing loads every suite, gpu-mp and h100x4 (interleaved and zero-bubble pipelines) among
    them; their schedule checks are plain Python (``reference_impls.pipeline_checks``)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "parabench", "list", "--all"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "parabench.suite" in imported  # the probe sees parabench's own imports
    assert not HEAVY & imported, sorted(HEAVY & imported)
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert "cases" in rows["gpu-mp"] and "INVALID" not in rows["gpu-mp"] and "INVALID" not in rows["h100x4"]


def test_recheck_refuses_a_misspelt_strategy_filter_instead_of_rechecking_nothing(tmp_path, capsys):
    rc, out, err = cli(capsys, "recheck", tmp_path, "--strategy", "torch.dpp")
    assert rc == 2 and not out and err.count("\n") == 1
    assert err.startswith("parabench: error: --strategy: unknown strategy 'torch.dpp'; closest: torch.ddp")
    assert "(valid strategies: `parabench list`)" in err
