"""The report's first screen (``parabench.report.overview``): production libraries ranked within a
micro-batch, ties where the launches cannot tell cases apart, references kept to their own
question; and the figure and table fixes that keep one case per bar."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parabench.report import frames, overview
from parabench.report.html import render_report
from parabench.results import load_run
from parabench.stats import combine_launches

RESULTS = Path(__file__).resolve().parent.parent / "results"
REPEATED = RESULTS / "repeatability" / "a"  # ref.zero2 and torch.fsdp2, 3 launches each, gpt-760m, 2x H100
H100X2 = [RESULTS / "h100x2" / "20261126-085905", RESULTS / "h100x2" / "20261126-093352"]


def case(strategy, tps, *, mb=4, launches=1, ci=None, model="gpt-1.3b", kind=None, precision="bf16-master"):
    """A row as ``frames.case_rows`` gives it, with only what the first screen reads."""
    low, high = ci if ci else (None, None)
    return {
        "run_idx": 0,
        "run": "suite/1",
        "model": model,
        "params": 1.4e9,
        "world_size": 2,
        "precision": precision,
        "micro_batch": mb,
        "status": "ok",
        "kind": kind or ("reference" if strategy.startswith("ref.") else "peer"),
        "strategy": strategy,
        "variant": strategy,
        "tokens_per_s_per_device": tps,
        "launches": launches,
        "tps_device_ci_low": low,
        "tps_device_ci_high": high,
    }


def ranks(rows):
    return {r["variant"]: r["rank_text"] for r in overview.peer_rows(rows)}


def test_clear_winner_by_launch_intervals():
    rows = [
        case("torch.fsdp2", 100.0, launches=3, ci=(99.0, 101.0)),
        case("deepspeed.zero3", 90.0, launches=3, ci=(89.0, 91.0)),
    ]
    assert ranks(rows) == {"torch.fsdp2": "1", "deepspeed.zero3": "2"}


def test_overlapping_intervals_tie_even_beyond_three_percent():
    rows = [
        case("torch.fsdp2", 100.0, launches=3, ci=(90.0, 110.0)),
        case("deepspeed.zero3", 94.0, launches=3, ci=(85.0, 105.0)),
    ]
    assert ranks(rows) == {"torch.fsdp2": "1 (tie)", "deepspeed.zero3": "1 (tie)"}


def test_tight_intervals_separate_cases_closer_than_three_percent():
    rows = [
        case("torch.fsdp2", 100.0, launches=3, ci=(99.8, 100.2)),
        case("deepspeed.zero3", 98.5, launches=3, ci=(98.3, 98.7)),
    ]
    assert ranks(rows) == {"torch.fsdp2": "1", "deepspeed.zero3": "2"}
    assert overview.peer_rows(rows)[0]["ranked_on"].startswith("intervals")


def test_single_launch_differences_under_three_percent_are_ties():
    rows = [case("torch.fsdp2", 100.0), case("deepspeed.zero2", 98.0), case("deepspeed.zero3", 90.0)]
    ranked = overview.peer_rows(rows)
    assert {r["variant"]: r["rank_text"] for r in ranked} == {
        "torch.fsdp2": "1 (tie)",
        "deepspeed.zero2": "1 (tie)",
        "deepspeed.zero3": "3",
    }
    assert ranked[0]["ranked_on"].startswith("one launch")
    assert [round(r["vs_fastest_pct"], 1) for r in ranked] == [0.0, -2.0, -10.0]


def test_micro_batches_are_ranked_apart_and_references_kept_out():
    rows = [
        case("torch.fsdp2", 100.0, mb=4),
        case("deepspeed.zero3", 50.0, mb=4),
        case("deepspeed.zero3", 120.0, mb=8),  # faster only because of its micro-batch
        case("ref.zero3", 130.0, mb=4),
        case("ref.zero3", 118.0, mb=8),
        case("ref.tp", 10.0, mb=2),  # no peer ran this shape
    ]
    peer = overview.peer_rows(rows)
    assert [(r["micro_batch"], r["variant"], r["rank_text"], r["group_start"]) for r in peer] == [
        (4, "torch.fsdp2", "1", True),
        (4, "deepspeed.zero3", "2", False),
        (8, "deepspeed.zero3", "1", True),
    ]
    refs = {(r["variant"], r["micro_batch"]): r for r in overview.reference_rows(rows)}
    assert refs[("ref.zero3", 4)]["best_peer"] == "torch.fsdp2"
    assert refs[("ref.zero3", 4)]["ratio"] == pytest.approx(1.3)
    assert refs[("ref.zero3", 4)]["verdict"] == "faster"
    assert refs[("ref.zero3", 8)]["best_peer"] == "deepspeed.zero3"
    assert refs[("ref.zero3", 8)]["verdict"] == "tie"  # 1.7 % from one launch each
    assert refs[("ref.tp", 2)]["best_peer"] is None and refs[("ref.tp", 2)]["ratio"] is None


def test_recipes_are_ranked_apart():
    rows = [case("torch.ddp", 100.0, precision="bf16-amp"), case("torch.fsdp2", 50.0)]
    assert [(r["precision"], r["rank_text"]) for r in overview.peer_rows(rows)] == [
        ("bf16-amp", "1"),
        ("bf16-master", "1"),
    ]


def test_layouts_are_ranked_apart_and_references_meet_their_own_layout():
    fused = {**case("deepspeed.zero3", 30.0), "layout": "fused"}
    rows = [case("torch.fsdp2", 20.0), fused, case("ref.zero3", 25.0)]
    assert [(r.get("layout"), r["rank_text"]) for r in overview.peer_rows(rows)] == [(None, "1"), ("fused", "1")]
    (ref,) = overview.reference_rows(rows)
    assert ref["best_peer"] == "torch.fsdp2"  # not the faster peer on the fused model


def test_committed_repeats_rank_by_their_launch_intervals():
    manifest, records = load_run(REPEATED)
    rows = frames.case_rows([(manifest, combine_launches(records))])
    (peer,) = overview.peer_rows(rows)
    assert (peer["variant"], peer["launches"], peer["rank_text"]) == ("torch.fsdp2", 3, "1")
    (ref,) = overview.reference_rows(rows)
    assert ref["variant"] == "ref.zero2" and ref["best_peer"] == "torch.fsdp2"
    assert ref["ranked_on"] == "intervals over ≥3 launches" and ref["verdict"] == "faster"
    assert ref["ratio"] == pytest.approx(ref["tokens_per_s_per_device"] / peer["tokens_per_s_per_device"])


def _table(html: str, id_: str) -> str:
    m = re.search(rf'<table[^>]*id="tbl-{id_}".*?</table>', html, re.S)
    assert m, f"no table {id_}"
    return m.group(0)


def test_first_screen_in_the_report_of_committed_runs():
    html = render_report([REPEATED], with_figures=False)
    head = re.findall(r"<th>(.*?)</th>", _table(html, "overview"))
    assert len(head) == len(set(head))  # no two columns named alike
    assert {
        "micro-batch",
        "rank",
        "tok/s/device",
        "MFU %",
        "peak memory GiB",
        "s per 1M tokens",
        "Wh per 1M tokens",
    } <= set(head)
    assert "roofline % (CPU)" not in head  # no empty column on GPU
    assert "How close is a from-scratch implementation" in html
    assert "ref.zero2" not in _table(html, "overview")


def test_comparison_notes_say_each_sentence_once():
    html = render_report(H100X2, with_figures=False)
    notes = re.findall(r'<td class="wrapcell">(.*?)</td></tr>', _table(html, "cmp-1"), re.S)
    assert notes and any(n.strip() for n in notes)
    for note in notes:
        parts = [p.split(": ", 1)[-1] for p in note.split("; ") if p]
        assert len(parts) == len(set(parts)), note
    # long tables start collapsed to their first rows (the page script reads data-collapse)
    assert 'id="tbl-cases" data-collapse="110"' in html


def test_every_bar_of_a_figure_is_one_case():
    pd = pytest.importorskip("pandas")
    from parabench.report.figures import with_names

    runs = [(m, combine_launches(r)) for m, r in map(load_run, H100X2 + [RESULTS / "h100x2" / "20261126-025621"])]
    df = pd.DataFrame(frames.case_rows(runs))
    named = with_names(df[df.status == "ok"])
    assert not named.duplicated(["panel", "bar"]).any()
    assert named.bar.str.contains(" seed 2 ").any() and named.bar.str.contains(" mb8").any()


def test_log_axes_get_several_tick_labels():
    from parabench.report import figures

    fig, ax = figures.plt.subplots()
    ax.plot([4e8, 3e9], [3000, 50000])
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        figures._log_ticks(axis)
        lo, hi = sorted(axis.get_view_interval())
        shown = [t for t in axis.get_major_locator()() if lo <= t <= hi]
        assert len(shown) >= 3, shown
    figures.plt.close(fig)


def test_cpu_groups_are_ordered_by_deterministic_bytes_not_ranked_by_time():
    rows = [
        {**case("torch.ddp", 9000.0), "device": "cpu (x86_64)", "model_state_MiB": 16.0, "comm_MiB": 4.0},
        {**case("deepspeed.zero3", 12000.0), "device": "cpu (x86_64)", "model_state_MiB": 8.0, "comm_MiB": 6.0},
        {**case("torch.fsdp2", 5000.0), "device": "cpu (x86_64)", "model_state_MiB": 8.0, "comm_MiB": 5.0},
    ]
    peer = overview.peer_rows(rows)
    assert [(r["variant"], r["rank_text"]) for r in peer] == [
        ("torch.fsdp2", "not ranked (CPU)"),
        ("deepspeed.zero3", "not ranked (CPU)"),
        ("torch.ddp", "not ranked (CPU)"),
    ]
    # the same cases twice as fast or slow in another launch: the same order
    faster = [{**r, "tokens_per_s_per_device": r["tokens_per_s_per_device"] * f} for r, f in zip(rows, (3, 0.5, 1))]
    assert [r["variant"] for r in overview.peer_rows(faster)] == [r["variant"] for r in peer]
    (choice,) = overview.choice_rows(peer)
    assert (choice["chosen"], choice["ties"]) == ("torch.fsdp2", "–")
    assert "not a ranking" in choice["chosen_by"]
    ref = {**case("ref.zero3", 20000.0), "device": "cpu (x86_64)"}
    assert overview.reference_rows(rows + [ref])[0]["verdict"] == "not judged (CPU)"


def test_the_answer_gives_time_and_energy_per_million_tokens_beside_memory():
    rows = [
        {**case("torch.fsdp2", 40000.0), "tokens_per_s": 80000.0, "tokens_per_j": 100.0, "peak_mem_GiB": 30.0},
        {**case("torch.ddp", 39500.0), "tokens_per_s": 79000.0, "tokens_per_j": 99.0, "peak_mem_GiB": 50.0},
        {**case("deepspeed.zero1", 20000.0), "tokens_per_s": 40000.0, "tokens_per_j": 50.0, "peak_mem_GiB": 40.0},
    ]
    (choice,) = overview.choice_rows(overview.peer_rows(rows))
    assert (choice["chosen"], choice["ties"], choice["peak_mem_GiB"]) == ("torch.fsdp2", "torch.ddp", 30.0)
    assert choice["s_per_mtok"] == pytest.approx(12.5)  # 1e6 tokens at 80,000 tok/s on both devices
    assert choice["wh_per_mtok"] == pytest.approx(1e6 / 100 / 3600)
    specs = overview.first_screen([{**r, "tokens_per_j": None} for r in rows])
    assert specs[0]["id_"] == "overview-choice" and "Energy: not recorded" in specs[0]["note"]
    assert "Energy: not recorded" not in overview.first_screen(rows)[0]["note"]


def test_figures_keep_text_readable_and_within_one_screen():
    pd = pytest.importorskip("pandas")
    from parabench.report import figures

    assert figures.MIN_TEXT_PT * figures.DPI / 72 >= 11  # px at the size the page shows the figure
    assert figures.MAX_HEIGHT_IN * figures.DPI <= 1200
    fig, ax = figures.plt.subplots(figsize=(20, 40))
    label = ax.text(0, 0, "tiny", fontsize=5)
    figures._readable(fig)
    assert label.get_fontsize() >= figures.MIN_TEXT_PT
    assert tuple(fig.get_size_inches()) == (figures.MAX_WIDTH_IN, figures.MAX_HEIGHT_IN)
    figures.plt.close(fig)
    # 150 bars in two panels: split into figures of at most one screen, every bar kept, in order
    panels = [("a", pd.DataFrame({"x": range(30)})), ("b", pd.DataFrame({"x": range(120)}))]
    pages = figures.pages(panels)
    assert len(pages) > 1
    for page in pages:
        assert sum(figures.BAR_IN * len(rows) + 0.9 for _, rows in page) <= figures.MAX_HEIGHT_IN
    assert [x for page in pages for _, rows in page for x in rows.x] == list(range(30)) + list(range(120))
