"""Finding suites: `parabench list` shows the user suites in one screen and the studies with --all,
its columns line up for the longest names, and a study (suites/studies/) loads by name and writes its
runs under studies/."""

import contextlib
import io
import re
from pathlib import Path

import pytest

from parabench import cli
from parabench.runner import default_run_dir
from parabench.suite import STUDIES_DIR, SuiteError, list_suites, load_suite

ROOT = Path(__file__).resolve().parent.parent
STUDY = "plan-check-13b-h200x2"  # a committed study with committed runs


def _list(*flags: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["list", *flags]) == 0
    return out.getvalue().splitlines()


@pytest.fixture(scope="module")
def brief() -> list[str]:
    return _list()


@pytest.fixture(scope="module")
def full() -> list[str]:
    return _list("--all")


def _section(lines: list[str], title: str) -> list[str]:
    """The indented rows below the heading line that starts with ``title``."""
    start = next(i for i, line in enumerate(lines) if line.startswith(title)) + 1
    rows = []
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        rows.append(line)
    return rows


def _first_column(rows: list[str]) -> list[str]:
    return [row.split()[0] for row in rows]


def test_the_default_listing_fits_one_screen_and_holds_every_user_suite_and_no_study(brief):
    assert len(brief) < 50, "\n".join(brief)
    assert _first_column(_section(brief, "suites:")) == list_suites()
    studies = [name.removeprefix("studies/") for name in list_suites(studies=True)]
    assert STUDY in studies
    assert not set(studies) & set(_first_column(_section(brief, "suites:")))
    assert f"{len(studies)} one-off studies" in brief[-1] and "--all" in brief[-1]
    assert all(len(line) <= 120 for line in brief), max(brief, key=len)


def test_all_lists_the_studies_below_the_user_suites(full):
    suites = _first_column(_section(full, "suites:"))
    studies = _first_column(_section(full, "studies"))
    assert suites == list_suites()
    assert studies == [name.removeprefix("studies/") for name in list_suites(studies=True)]
    assert STUDY in studies
    assert "INVALID" not in "\n".join(full)


@pytest.mark.parametrize("title", ["strategies:", "models:", "suites:"])
def test_columns_line_up_for_the_longest_names(full, title):
    """Every row's second column starts at one offset, two spaces past the longest first cell, so a
    long name neither shifts its own row nor runs into the next column."""
    rows = _section(full, title)
    if title == "models:":
        rows = [row for row in rows if "M params" in row]  # the custom-shape line is prose
    if title == "suites:":
        rows += _section(full, "studies")  # suites and studies share their widths
    longest = max(len(row.split()[0]) for row in rows)
    if title == "models:":  # the size is right-aligned: its unit lines up, past the longest name
        ends = {row.index(" M params") for row in rows}
        assert len(ends) == 1 and ends.pop() > 2 + longest + 2, rows
        return
    starts = {re.match(r"  \S+\s+", row).end() for row in rows}
    assert starts == {2 + longest + 2}, sorted(starts)


def test_a_study_loads_by_bare_name_by_folder_and_by_path():
    by_name, by_folder = load_suite(STUDY), load_suite(f"studies/{STUDY}")
    by_path = load_suite(str(STUDIES_DIR / f"{STUDY}.toml"))
    assert by_name.path == by_folder.path == STUDIES_DIR / f"{STUDY}.toml"
    assert by_name.file_hash == by_folder.file_hash == by_path.file_hash
    assert [c.case_hash for c in by_name.cases] == [c.case_hash for c in by_path.cases]
    assert by_name.name == STUDY and by_name.is_study


def test_a_study_writes_its_runs_under_studies_and_a_user_suite_under_its_name(tmp_path):
    study, smoke = load_suite(STUDY), load_suite("smoke")
    assert default_run_dir(tmp_path, study, "r1", False) == tmp_path / "studies" / STUDY / "r1"
    assert default_run_dir(tmp_path, smoke, "r1", False) == tmp_path / "smoke" / "r1"
    assert not smoke.is_study


def test_every_study_is_valid_and_its_committed_runs_sit_under_results_studies():
    for name in list_suites(studies=True):
        suite = load_suite(name)
        assert suite.is_study
        assert not (ROOT / "results" / suite.name).exists(), f"results/{suite.name} belongs in results/studies/"
    assert (ROOT / "results" / "studies" / STUDY).is_dir()


def test_an_unknown_suite_names_the_closest_suites_and_points_to_the_studies():
    with pytest.raises(SuiteError) as err:
        load_suite("smok")
    message = str(err.value)
    assert "closest: smoke" in message and STUDY not in message and "parabench list --all" in message


def test_a_suite_name_resolves_to_suites_before_studies(tmp_path, monkeypatch):
    """A name in both folders is the user suite: studies are only the fallback."""
    monkeypatch.setattr("parabench.suite.SUITES_DIR", tmp_path)
    monkeypatch.setattr("parabench.suite.STUDIES_DIR", tmp_path / "studies")
    (tmp_path / "studies").mkdir()
    body = (
        '[suite]\nname = "twin"\ndescription = "{}"\n[[matrix]]\nmodel = "tiny"\nstrategy = "single"\nworld_size = 1\n'
    )
    (tmp_path / "twin.toml").write_text(body.format("user"))
    (tmp_path / "studies" / "twin.toml").write_text(body.format("study"))
    (tmp_path / "studies" / "only.toml").write_text(body.format("study").replace('"twin"', '"only"'))
    assert load_suite("twin").description == "user"
    assert load_suite("studies/twin").description == "study"
    assert load_suite("only").description == "study"
