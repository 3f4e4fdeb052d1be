"""CPU timings labelled for what they are: two smoke runs of the same code, one on a busy host and one
on a quiet one, show the same first screen but for the columns marked as timing; a busy host's
manifest earns a warning naming its figures; the runner's host-load arithmetic.

Pure Python over the committed CPU smoke baseline (results/baselines/cpu-smoke): no launch."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from parabench.meters import host
from parabench.report import frames, overview
from parabench.report.html import render_report
from parabench.results import load_run
from parabench.stats import combine_launches

BASELINE = Path(__file__).resolve().parent.parent / "results" / "baselines" / "cpu-smoke"
RATES = ("mfu", "hfu", "roofline_fraction")


def _slowed(value, factor: float, key: str = ""):
    """``value`` as a host ``factor`` times slower would have measured it: times grow, rates shrink."""
    if isinstance(value, dict):
        return {k: _slowed(v, factor, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_slowed(v, factor, key) for v in value]
    if not isinstance(value, float):
        return value
    if "per_s" in key or key in RATES:
        return value / factor
    if key.endswith("_s") or "_s_" in key or key.endswith("_ms"):
        return value * factor
    return value


def _smoke_run_on_a_host(tmp_path: Path, name: str, seed: int, host_load: dict) -> Path:
    """The baseline's records with every case's timings moved by its own factor in 0.5x-4x, as a
    busy laptop moved them (0.58x-4.4x per case between two smoke runs), and ``host_load`` in the manifest."""
    rng = random.Random(seed)
    run = tmp_path / name
    (run / "cases").mkdir(parents=True)
    manifest = json.loads((BASELINE / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, "run_id": name, "host_load": host_load}))
    for path in sorted((BASELINE / "cases").glob("*.json")):
        factor = 2 ** rng.uniform(-1, 2)
        record = json.loads(path.read_text())
        (run / "cases" / path.name).write_text(json.dumps(_slowed(record, factor)))
    return run


def _load(wall_s=600.0, other_pct=2.0, load_start=0.3, cpus=2) -> dict:
    other = other_pct / 100 * wall_s * cpus
    return {
        "wall_s": wall_s,
        "host_cpus": cpus,
        "load_average_start": [load_start, 0.5, 0.5],
        "load_average_end": [2.1, 1.0, 0.7],
        "host_busy_cpu_s": 900.0 + other,
        "run_cpu_s": 900.0,
        "other_cpu_s": other,
        "other_cpu_pct": other_pct,
    }


def _first_screen(html: str) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Each first-screen table: its headers and its rows' cells (whole ``<td>`` elements, sort keys included)."""
    out = {}
    for id_, body in re.findall(r'<table[^>]*id="tbl-(overview[\w-]*)"[^>]*>(.*?)</table>', html, re.S):
        heads = re.findall(r"<th>(.*?)</th>", body)
        rows = [re.findall(r"<td.*?</td>", tr, re.S) for tr in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)[1:]]
        out[id_] = (heads, rows)
    return out


def _fastest_peers(run: Path) -> dict[tuple, str]:
    problems = []
    manifest, records = load_run(run, problems)
    assert not problems  # every perturbed record is still a valid one
    rows = frames.case_rows([(manifest, combine_launches(records))])
    return {
        key[1:]: max(rs, key=lambda r: r["tokens_per_s_per_device"])["variant"]
        for key, rs in overview.groups(rows, "peer").items()
    }


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> tuple[Path, Path]:
    """The smoke baseline as a busy host and a quiet one would have timed it."""
    tmp = tmp_path_factory.mktemp("hosts")
    busy = _smoke_run_on_a_host(tmp, "busy", 1, _load(other_pct=40.0, load_start=3.5))
    return busy, _smoke_run_on_a_host(tmp, "quiet", 2, _load())


def test_a_busy_and_a_quiet_smoke_run_show_the_same_first_screen(two_hosts):
    busy, quiet = two_hosts
    # the two runs' timings would put different libraries first
    fastest_busy, fastest_quiet = _fastest_peers(busy), _fastest_peers(quiet)
    assert fastest_busy.keys() == fastest_quiet.keys()
    assert any(fastest_busy[k] != fastest_quiet[k] for k in fastest_busy)

    html_busy, html_quiet = (render_report([run], with_figures=False) for run in (busy, quiet))
    screen_busy, screen_quiet = _first_screen(html_busy), _first_screen(html_quiet)
    assert set(screen_busy) == {"overview-choice", "overview", "overview-references"} == set(screen_quiet)
    for id_, (heads, rows) in screen_busy.items():
        heads_quiet, rows_quiet = screen_quiet[id_]
        assert heads == heads_quiet and len(rows) == len(rows_quiet) > 0
        for row, row_quiet in zip(rows, rows_quiet):
            moved = {heads[i] for i, (a, b) in enumerate(zip(row, row_quiet)) if a != b}
            # what a busy host moves is a timing, and its header says so; the order and the rest stay
            assert all(overview.CPU_SPEED_LABEL in h for h in moved), (id_, moved)
    assert any(overview.CPU_SPEED_LABEL in h for h in screen_busy["overview"][0])

    header_busy, header_quiet = (re.search(r"<header>.*?</header>", h, re.S).group(0) for h in (html_busy, html_quiet))
    for header in (header_busy, header_quiet):
        assert "Timings on CPU (gloo) are not a ranking" in header
    assert "Busy host during smoke/busy: other processes took 40 % of the CPU time of 2 CPUs" in header_busy
    assert "load average 3.5 at the start" in header_busy
    assert "Busy host" not in header_quiet


def test_the_throughput_figure_on_cpu_is_in_order_of_name(two_hosts, monkeypatch):
    pd = pytest.importorskip("pandas")
    from parabench.report import figures

    # the bars each figure would draw, without drawing them
    monkeypatch.setattr(figures, "_bar_page", lambda page, *args: [list(rows.bar) for _, rows in page])
    monkeypatch.setattr(figures, "figure_entries", lambda id_, title, caption, figs: (title, figs))
    shown = []
    for run in two_hosts:
        manifest, records = load_run(run)
        df = pd.DataFrame(frames.case_rows([(manifest, combine_launches(records))]))
        shown.append(figures.throughput(figures.with_names(df[df.status == "ok"])))
    (title, bars), (title_quiet, bars_quiet) = shown
    assert overview.CPU_SPEED_LABEL in title and "higher is better" not in title
    assert bars == bars_quiet and sum(len(panel) for fig in bars for panel in fig) == 48


def test_a_gpu_report_is_not_labelled():
    rows = [
        {"status": "ok", "device": "cuda (NVIDIA H100)", "kind": "peer"},
        {"status": "ok", "device": "cuda (NVIDIA H100)", "kind": "reference"},
    ]
    assert overview.timing_notes(rows, [{"suite": "s", "run_id": "1"}]) == []
    assert overview._label_speed(overview.PEER_COLUMNS, cpu=False) == overview.PEER_COLUMNS
    headers = [h for _, h, _ in overview._label_speed(overview.PEER_COLUMNS, cpu=True)]
    assert "tok/s/device (CPU: not a ranking)" in headers and "roofline % (CPU: not a ranking)" in headers


@pytest.mark.parametrize(
    ("load", "busy"),
    [
        (_load(other_pct=2.0, load_start=0.3), False),
        (_load(other_pct=overview.BUSY_OTHER_CPU_PCT, load_start=0.3), True),
        (_load(other_pct=2.0, load_start=2.0, cpus=2), True),  # saturated before the run began
        (_load(other_pct=2.0, load_start=1.9, cpus=2), False),
        ({**_load(load_start=0.1), "other_cpu_pct": None, "other_cpu_s": None}, False),  # no /proc/stat
        ({"other_cpu_pct": 10**400, "load_average_start": ["x"], "host_cpus": float("nan")}, False),  # hostile
    ],
)
def test_busy_host_threshold(load, busy):
    assert (overview.busy_host(load) is not None) is busy


def test_a_resumed_run_is_judged_by_each_invocation():
    resumed = {"created_at": "2026-11-29T07:00:00+00:00", "host_load": _load(other_pct=55.0)}
    manifest = {"suite": "smoke", "run_id": "r", "host_load": _load(), "resumed": [resumed]}
    (note,) = overview.timing_notes([], [manifest])
    assert note.startswith("Busy host during smoke/r (resumed 2026-11-29T07:00:00+00:00): other processes took 55 %")
    first, again = overview.host_load_text(manifest).split("; ")
    assert not first.endswith("(busy)") and again.startswith("resumed 2026-11-29") and again.endswith("(busy)")


def test_run_host_load_counts_the_cpu_time_outside_the_run():
    start = {"wall_s": 100.0, "host_busy_s": 5000.0, "run_cpu_s": 10.0, "load_average": [0.5, 0.4, 0.3], "host_cpus": 4}
    end = {"wall_s": 200.0, "host_busy_s": 5300.0, "run_cpu_s": 250.0, "load_average": [3.9, 1.2, 0.6], "host_cpus": 4}
    load = host.run_host_load(start, end)
    assert (load["other_cpu_s"], load["other_cpu_pct"], load["run_cpu_s"]) == (60.0, 15.0, 240.0)
    assert (load["load_average_start"], load["load_average_end"]) == ([0.5, 0.4, 0.3], [3.9, 1.2, 0.6])
    assert overview.busy_host(load) is not None
    blind = host.run_host_load({**start, "host_busy_s": None}, end)
    assert blind["other_cpu_s"] is None and blind["other_cpu_pct"] is None and blind["wall_s"] == 100.0
    now = host.run_clock()
    assert set(now) == set(start) and now["host_cpus"] >= 1


def test_a_smoke_run_records_its_host_load(smoke_run):
    manifest, _ = load_run(smoke_run)
    load = manifest["host_load"]
    assert load["wall_s"] > 0 and load["run_cpu_s"] > 0
    assert load["other_cpu_s"] is not None and load["other_cpu_pct"] >= 0
    assert len(load["load_average_start"]) == len(load["load_average_end"]) == 3
