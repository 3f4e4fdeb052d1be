"""docs/seeds.md is what ``python -m parabench.seeds`` makes of the committed records: regenerated here and
compared, and a record changed under it (a copy of the tree's sources in a temporary root) changes the text."""

from __future__ import annotations

import json
import shutil

from parabench import seeds


def test_the_document_is_what_the_records_give():
    assert seeds.main(["--check"]) == 0, "docs/seeds.md is stale: run python -m parabench.seeds"


def test_every_seed_is_cited_by_file_name_and_every_record_linked():
    text = (seeds.ROOT / seeds.DOC).read_text()
    for name in ("000_88bdc561a8f154f5.txt", "001_49cb7c694370cc74.txt", "003_e2e346ed8bfc8aec.txt"):
        assert f"`{name}`" in text
    for path in seeds.RECORDS.values():
        assert f"(../{path})" in text, path


def test_a_changed_record_changes_the_text(tmp_path):
    for path in seeds.RECORDS.values():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(seeds.ROOT / path, tmp_path / path)
    (tmp_path / seeds.DOC).parent.mkdir(parents=True)
    shutil.copy(seeds.ROOT / seeds.DOC, tmp_path / seeds.DOC)
    assert seeds.main(["--check", "--root", str(tmp_path)]) == 0
    record = tmp_path / seeds.RECORDS["bubble_1f1b"]
    doc = json.loads(record.read_text())
    doc["per_rank"][0]["pipeline"]["bubble_fraction_measured"] = 0.5
    record.write_text(json.dumps(doc))
    assert seeds.main(["--check", "--root", str(tmp_path)]) == 1
