"""Scaling series: strong / weak modes in suite files, the report's efficiency, communication-share
and ZeRO-line frames on synthetic records, and the pipeline-bubble table's flag."""

import re
import textwrap

import pandas as pd
import pytest

from parabench.case import Case
from parabench.report import figures, frames
from parabench.report import scaling as scaling_section
from parabench.suite import SuiteError, load_suite


def write(tmp_path, body):
    p = tmp_path / "s.toml"
    p.write_text(textwrap.dedent(body).lstrip())
    return p


STRONG_AND_WEAK = """
    [suite]
    name = "sc"
    [[matrix]]
    model = "tiny"
    strategy = "ref.ddp"
    world_size = [1, 2, 4]
    scaling = "strong"
    global_batch = 8
    [[matrix]]
    model = "tiny"
    strategy = "ref.ddp"
    world_size = [1, 2, 4]
    scaling = "weak"
    micro_batch = 4
    [[matrix]]
    model = "tiny-deep"
    strategy = "ref.pp_1f1b"
    world_size = [2, 4]
    grad_accum = 2
    scaling = "strong"
    global_batch = 8
    options = {pp = 2, microbatches = 2}
"""


def test_strong_derives_micro_batch_and_a_shared_point_runs_once_in_both_series(tmp_path):
    cases = load_suite(str(write(tmp_path, STRONG_AND_WEAK))).cases
    got = [(c.model, c.world_size, c.micro_batch, c.grad_accum, c.scaling) for c in cases]
    assert got == [
        ("tiny", 1, 8, 1, ("strong",)),
        ("tiny", 2, 4, 1, ("strong", "weak")),  # global batch 8 = 4 per rank x 2: the weak series' point
        ("tiny", 4, 2, 1, ("strong",)),
        ("tiny", 1, 4, 1, ("weak",)),
        ("tiny", 4, 4, 1, ("weak",)),
        ("tiny-deep", 2, 4, 2, ("strong",)),  # dp 1 (pp 2): 8 / (1 x 2)
        ("tiny-deep", 4, 2, 2, ("strong",)),  # dp 2: 8 / (2 x 2)
    ]
    assert all(c.global_batch == 8 for c in cases if "strong" in c.scaling)
    # the mode groups cases, it does not change the measurement: the hash is the unscaled case's,
    # and a record carries the mode back
    shared = cases[1]
    assert shared.case_hash == Case(model="tiny", strategy="ref.ddp", world_size=2, micro_batch=4).case_hash
    assert "scaling=strong+weak" in shared.label
    assert Case.from_dict(shared.to_dict()).scaling == ("strong", "weak")
    assert "scaling" not in Case(model="tiny", strategy="ref.ddp", world_size=2).to_dict()


@pytest.mark.parametrize(
    "matrix, key, words",
    [
        (
            'world_size = [1, 2, 4]\nscaling = "strong"\nglobal_batch = 6',
            "global_batch",
            "not divisible by dp × grad_accum = 4 × 1 at world_size 4",
        ),
        ('world_size = [1, 2]\nscaling = "strong"', "scaling", "give global_batch"),
        ("world_size = [1, 2]\nglobal_batch = 8", "global_batch", 'add scaling = "strong"'),
        ('world_size = [1, 2]\nscaling = "weak"\nglobal_batch = 8', "global_batch", "weak scaling fixes micro_batch"),
        (
            'world_size = [1, 2]\nscaling = "strong"\nglobal_batch = 8\nmicro_batch = 2',
            "micro_batch",
            "derives micro_batch",
        ),
        ('world_size = 2\nscaling = "weak"', "world_size", "at least two world sizes"),
        ('world_size = [1, 2]\nscaling = "linear"', "scaling", "unknown scaling mode 'linear'"),
        ('world_size = [1, 2]\nscaling = ["strong", "weak"]', "scaling", "one scaling mode per [[matrix]]"),
    ],
)
def test_scaling_errors_name_file_line_and_field(tmp_path, matrix, key, words):
    body = '[suite]\nname = "bad"\n[[matrix]]\nmodel = "tiny"\nstrategy = "ref.ddp"\n' + matrix + "\n"
    p = tmp_path / "bad.toml"
    p.write_text(body)
    line = next(i for i, text in enumerate(body.splitlines(), 1) if text.startswith(f"{key} ="))
    with pytest.raises(SuiteError, match=re.escape(f"{p}:{line}: field '{key}'")) as err:
        load_suite(str(p))
    assert words in str(err.value)


# --- report frames on synthetic records -------------------------------------------------------

PSI = 1_000_000
SEQ = 64


def record(strategy, world, mb, step_s, modes, *, comm_share=None, state=None, pipeline=None, options=None):
    case = {
        "model": "tiny",
        "strategy": strategy,
        "world_size": world,
        "precision": "fp32",
        "micro_batch": mb,
        "grad_accum": 1,
        "seed": 1,
        "options": options or {},
    }
    if modes:
        case["scaling"] = list(modes)
    tokens = mb * world * SEQ
    per_rank = []
    for rank in range(world):
        pr = {"rank": rank, "comm": {"payload_bytes": 2 * 4 * PSI if world > 1 else 0}}
        if comm_share is not None:
            pr["step_breakdown"] = {"step_s": 2.0, "comm_s": 2.0 * comm_share, "exposed_comm_s": comm_share}
        if pipeline is not None:
            pr["pipeline"] = pipeline[rank]
        per_rank.append(pr)
    return {
        "case": case,
        "label": f"{strategy} tiny w{world} mb{mb}",
        "status": "ok",
        "model": {"params": {"total": PSI}},
        "metrics": {
            "step_time_s_median": step_s,
            "tokens_per_step": tokens,
            "tokens_per_s": tokens / step_s,
            "tokens_per_s_per_device": tokens / step_s / world,
            "model_state_bytes_max": state,
        },
        "theory": {
            "comm_payload_bytes": {"all_reduce": 2 * 4 * PSI} if world > 1 else {},
            "paper_state_bytes": 16 * PSI,
        },
        "per_rank": per_rank,
    }


PROFILED = {"step_breakdown": True}


def runs_of(*records):
    return [({"suite": "sc", "run_id": "r1"}, list(records))]


SERIES = runs_of(
    # strong, global batch 8: t(1)·1 / (N·t(N)) = 1, 1 / (2 × 0.625) = 0.8, 1 / (4 × 0.5) = 0.5
    # (profiled points and an unprofiled one: step_breakdown adds an untimed step, one series)
    record("ref.ddp", 1, 8, 1.0, ["strong"], state=16 * PSI),
    record("ref.ddp", 2, 4, 0.625, ["strong", "weak"], comm_share=0.1, state=16 * PSI, options=PROFILED),
    record("ref.ddp", 4, 2, 0.5, ["strong"], comm_share=0.3, state=16 * PSI, options=PROFILED),
    # weak, 4 per rank: tokens/s per device 256/0.5 -> 256/0.625 -> 256/1.0 relative to N = 1
    record("ref.ddp", 1, 4, 0.5, ["weak"], state=16 * PSI),
    record("ref.ddp", 4, 4, 1.0, ["weak"], state=16 * PSI),
    # a series that never ran on one device: measured against its smallest N
    record("ref.zero3", 2, 4, 1.0, ["weak"], state=8 * PSI),
    record("ref.zero3", 4, 4, 1.25, ["weak"], state=4 * PSI),
    record("ref.ddp", 2, 16, 1.0, []),  # outside any series: not a row
)


def test_scaling_rows_give_efficiency_per_mode_against_the_smallest_world_size():
    rows = frames.scaling_rows(SERIES)
    got = {(r["mode"], r["series"], r["world_size"]): r for r in rows}
    assert len(rows) == 8
    eff = {k: round(r["efficiency_pct"], 6) for k, r in got.items()}
    assert eff[("strong", "ref.ddp gb8", 1)] == 100
    assert eff[("strong", "ref.ddp gb8", 2)] == 80
    assert eff[("strong", "ref.ddp gb8", 4)] == 50
    assert eff[("weak", "ref.ddp mb4", 2)] == 80
    assert eff[("weak", "ref.ddp mb4", 4)] == 50
    assert eff[("weak", "ref.zero3 mb4", 4)] == 80
    assert got[("weak", "ref.zero3 mb4", 4)]["base_world_size"] == 2
    assert got[("strong", "ref.ddp gb8", 4)]["global_batch"] == 8
    # the communication share of the profiled step, beside the analytic bytes per step
    assert got[("strong", "ref.ddp gb8", 4)]["comm_share_pct"] == pytest.approx(30)
    assert got[("strong", "ref.ddp gb8", 4)]["exposed_comm_share_pct"] == pytest.approx(15)
    assert got[("strong", "ref.ddp gb8", 4)]["theory_comm_bytes"] == 8 * PSI
    assert got[("weak", "ref.ddp mb4", 4)]["comm_share_pct"] is None  # not profiled


def test_zero_lines_at_one_two_and_four_ranks():
    lines = {(r["line"], r["ranks"]): r["bytes"] / PSI for r in frames.zero_line_rows(PSI, [1, 2, 4])}
    assert [lines[("DP: 16Ψ", n)] for n in (1, 2, 4)] == [16, 16, 16]
    assert [lines[("ZeRO-1: 4Ψ + 12Ψ/N", n)] for n in (1, 2, 4)] == [16, 10, 7]
    assert [lines[("ZeRO-2: 2Ψ + 14Ψ/N", n)] for n in (1, 2, 4)] == [16, 9, 5.5]
    assert [lines[("ZeRO-3: 16Ψ/N", n)] for n in (1, 2, 4)] == [16, 8, 4]


def stage(s, measured, m=8, p=4, schedule="1f1b"):
    return {
        "stage": s,
        "stages": p,
        "microbatches": m,
        "schedule": schedule,
        "bubble_fraction_measured": measured,
        "bubble_fraction_theory": (p - 1) / (m + p - 1),
    }


def test_bubble_table_flags_a_mean_more_than_five_points_from_theory():
    theory = 3 / 11
    near = [stage(s, theory + d) for s, d in enumerate((0.03, -0.02, 0.04, 0.0))]
    far = [stage(s, theory + d) for s, d in enumerate((0.02, 0.05, 0.09, 0.08))]
    unmeasured = [stage(s, None) for s in range(4)]
    runs = runs_of(
        record("ref.pp_1f1b", 4, 16, 1.0, [], pipeline=near, options={"pp": 4}),
        record("ref.pp_gpipe", 4, 16, 1.0, [], pipeline=far, options={"pp": 4}),
        record("torch.pp_1f1b", 4, 16, 1.0, [], pipeline=unmeasured, options={"pp": 4}),
    )
    rows = {r["strategy"]: r for r in frames.bubble_rows(runs)}
    assert rows["ref.pp_1f1b"]["agrees"] is True
    assert rows["ref.pp_1f1b"]["theory_pct"] == pytest.approx(300 / 11)
    assert rows["ref.pp_gpipe"]["agrees"] is False
    assert rows["ref.pp_gpipe"]["difference_pct"] == pytest.approx(6)
    assert (rows["ref.pp_gpipe"]["worst_stage"], rows["ref.pp_gpipe"]["worst_difference_pct"]) == (2, pytest.approx(9))
    assert rows["torch.pp_1f1b"]["agrees"] is None and rows["torch.pp_1f1b"]["measured_pct"] is None
    (spec,) = [s for s in scaling_section.table_specs(runs, []) if s["id_"] == "pipeline-bubble"]
    assert spec["footer"].startswith("1 of 3 pipeline cases differ") and "ref.pp_gpipe" in spec["footer"]
    assert "ref.pp_1f1b" not in spec["footer"]


def test_scaling_figures_render_with_one_device_counted():
    entries = {f["id"] for f in scaling_section.figures(SERIES)}
    assert {"scaling-strong-tiny-fp32", "scaling-weak-tiny-fp32", "scaling-memory"} <= entries
    # the generic figure: one series at 1 and 2 devices only (it used to need two counts above 1)
    runs = runs_of(record("ref.ddp", 1, 4, 0.5, []), record("ref.ddp", 2, 4, 0.6, []))
    ok = figures.with_names(pd.DataFrame(frames.case_rows(runs)))
    assert [f["id"] for f in figures.scaling(ok)] == ["scaling"]
