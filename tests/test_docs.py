"""The README is a guide a newcomer can follow, and the documents under docs/ hold together.

The README must stay short, show its two set-up commands on the first screen, run the tests exactly as CI does,
and cite nothing a reader cannot open: no issue numbers, no links to files that are not there.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
DOCS = sorted((ROOT / "docs").glob("*.md"))
GUIDES = [README, *DOCS]

README_MAX_BYTES = 15_000
SETUP_COMMANDS_WITHIN_LINES = 40
PROSE_LINE_MAX_CHARS = 120

# An issue tracker's numbers and phrases that point at a thread the reader cannot see. The verb ("to issue a
# call") and the noun for issuing ("the issue of one op") stay allowed.
ISSUE_REFERENCES = (
    re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE),
    re.compile(r"(?<![\w&/`])#\d{1,5}\b"),
    re.compile(r"\b\w+'s issue\b", re.IGNORECASE),
    re.compile(r"\b(this|that|the|an|its) issue\b(?!\s+(of|one|a|an|its|each|every|it|them|the)\b)", re.IGNORECASE),
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks and tables."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.lstrip().startswith("|"):
            continue
        out.append((number, line))
    return out


def code_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, body) of each fenced code block."""
    blocks, start, body = [], None, []
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if start is None:
                start, body = number + 1, []
            else:
                blocks.append((start, "\n".join(body)))
                start = None
        elif start is not None:
            body.append(line)
    return blocks


def ci_test_command() -> str:
    """The one command line of .ci/run that installs parabench and runs pytest."""
    lines = [
        line.strip()
        for line in CI_RUN.read_text(encoding="utf-8").splitlines()
        if "pytest" in line and not line.lstrip().startswith("#")
    ]
    assert len(lines) == 1, f".ci/run should run pytest from exactly one command line, found {lines}"
    return lines[0]


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes; at most {README_MAX_BYTES:,}"


def test_setup_commands_are_on_the_first_screen():
    first_screen = "\n".join(README.read_text(encoding="utf-8").splitlines()[:SETUP_COMMANDS_WITHIN_LINES])
    commands = [body for _, body in code_blocks(first_screen)]
    assert any("pip install" in c and "parabench run suite smoke" in c for c in commands), (
        f"the install-and-smoke command is not in a code block within the first {SETUP_COMMANDS_WITHIN_LINES} lines"
    )
    assert any(ci_test_command() in c.splitlines() for c in commands), (
        f"the test command of .ci/run is not a line of a code block within the first "
        f"{SETUP_COMMANDS_WITHIN_LINES} lines"
    )


def test_readme_test_command_is_what_ci_runs():
    command = ci_test_command()
    readme_lines = {
        line.strip() for _, body in code_blocks(README.read_text(encoding="utf-8")) for line in body.splitlines()
    }
    assert command in readme_lines, f"README.md does not show .ci/run's command verbatim:\n{command}"


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.name)
def test_prose_lines_are_short(path):
    long = [
        f"{path.name}:{n}: {len(line)} characters"
        for n, line in prose_lines(path)
        if len(line) > PROSE_LINE_MAX_CHARS and not line.lstrip().startswith("![")
    ]
    assert not long, "prose lines over {} characters:\n{}".format(PROSE_LINE_MAX_CHARS, "\n".join(long))


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.name)
def test_no_issue_references(path):
    found = [
        f"{path.name}:{n}: {m.group(0)!r}"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for pattern in ISSUE_REFERENCES
        for m in pattern.finditer(line)
    ]
    assert not found, "references to issues a reader cannot open:\n" + "\n".join(found)


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.name)
def test_relative_links_resolve(path):
    text = "\n".join(line for _, line in prose_lines(path))
    # Tables hold links too (the run index, the validation table): check them, code blocks excepted.
    text += "\n" + "\n".join(
        line for line in path.read_text(encoding="utf-8").splitlines() if line.lstrip().startswith("|")
    )
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"{path.name} links to paths that do not exist: {broken}"


def test_the_checks_can_fail(tmp_path):
    """Each check rejects the thing it guards against."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "As the planner's issue asks (issue 52), see [gone](missing.md).\n"
        + "x" * 121
        + "\n```\n"
        + "y" * 200
        + "\n```\n"
    )
    assert [n for n, line in prose_lines(doc) if len(line) > PROSE_LINE_MAX_CHARS] == [2]
    hits = [p.pattern for p in ISSUE_REFERENCES if p.search(doc.read_text())]
    assert len(hits) >= 2
    assert LINK.findall(doc.read_text()) == ["missing.md"]
    assert not any(p.search("the host's time to issue one call; the issue of one tiny op") for p in ISSUE_REFERENCES)
