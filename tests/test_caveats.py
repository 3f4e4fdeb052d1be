"""Strategies' known behaviour travels with their numbers: record and report."""

from __future__ import annotations


def test_caveat_reaches_the_record_and_the_report(tmp_path):
    """A strategy's known behaviour (here DeepSpeed stage 0's unscaled fp16 loss) is written into
    the records of that precision only and shown in the report."""
    from parabench.case import Case
    from parabench.record import build_record
    from parabench.report.html import render_report
    from parabench.results import make_manifest, write_json_atomic
    from parabench.suite import load_suite

    fp16 = build_record(Case(model="tiny", strategy="deepspeed.zero0", world_size=2, precision="fp16"), "skipped")
    bf16 = build_record(Case(model="tiny", strategy="deepspeed.zero0", world_size=2, precision="bf16"), "skipped")
    other = build_record(Case(model="tiny", strategy="deepspeed.zero1", world_size=2, precision="fp16"), "skipped")
    assert "65536x too small" in fp16["caveats"][0]
    assert bf16["caveats"] == [] and other["caveats"] == []

    run = tmp_path / "run"
    write_json_atomic(run / "manifest.json", make_manifest(load_suite("smoke"), "r"))
    for rec in (fp16, bf16):
        write_json_atomic(run / "cases" / f"{rec['case_hash']}.json", rec)
    html = render_report([run], with_figures=False)
    assert "Caveats: known behaviour behind some numbers" in html and "65536x too small" in html


def test_a_shared_host_is_named_at_the_top_of_the_report(tmp_path, monkeypatch):
    """A run whose host ran other work meanwhile says so above its tables, with the CPUs it had; a
    run that had its host to itself shows no such note."""
    from parabench.case import Case
    from parabench.record import build_record
    from parabench.report.html import render_report
    from parabench.results import make_manifest, write_json_atomic
    from parabench.suite import load_suite

    rec = build_record(Case(model="tiny", strategy="ref.ddp", world_size=2), "skipped")
    runs = {}
    for name, shared in (("quiet", None), ("shared", "GPUs 0-1 ran an NVMe case")):
        if shared:
            monkeypatch.setenv("PARABENCH_HOST_SHARED", shared)
        else:
            monkeypatch.delenv("PARABENCH_HOST_SHARED", raising=False)
        run = tmp_path / name
        write_json_atomic(run / "manifest.json", make_manifest(load_suite("smoke"), name))
        write_json_atomic(run / "cases" / f"{rec['case_hash']}.json", rec)
        runs[name] = render_report([run], with_figures=False)
    assert "Shared host" not in runs["quiet"]
    head = runs["shared"].split("</header>")[0]
    assert "Shared host, smoke/shared: GPUs 0-1 ran an NVMe case" in head and "cores" in head
