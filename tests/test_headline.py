"""The headline (README's Results, docs/headline.md) is what the committed records say, and only what they
may say: no superseded run, no single launch of a library whose launches spread, no unlike pair unlabelled."""

from __future__ import annotations

import copy

import pytest

from parabench import headline
from parabench.headline import HeadlineError, Row, Superseded

LAYOUT_STUDY = "results/studies/peer-fidelity-layout-gpu/20261127-042116"  # one launch of FSDP2, of ref.zero3


@pytest.fixture(scope="module")
def outputs():
    return headline.generate()


def test_the_committed_text_agrees_with_the_records(outputs):
    stale = headline.diff(outputs)
    assert stale == "", "README.md or docs/headline.md disagree with the records; run `parabench headline`:\n" + stale


def test_a_changed_figure_is_caught(outputs, tmp_path):
    readme = next(path for path in outputs if path.name == "README.md")
    now, new = outputs[readme]
    assert "1.62 (1.60-1.73)" in new  # a ratio the committed records give
    tampered = now.replace("1.62 (1.60-1.73)", "1.65 (1.60-1.73)")
    block = new[new.index(headline.BEGIN) : new.index(headline.END) + len(headline.END)]
    assert headline.splice(tampered, block) == new  # regenerating puts the records' figure back
    stale = headline.diff({tmp_path / "README.md": (tampered, new)})
    assert "-| 1x H200, gpt-1.3b, mb 8 | ref.zero3 / deepspeed.zero3 | 1.65" in stale
    assert "+| 1x H200, gpt-1.3b, mb 8 | ref.zero3 / deepspeed.zero3 | 1.62" in stale
    with pytest.raises(HeadlineError, match="no <!-- headline:begin -->"):
        headline.splice("# a README without the section\n", block)


def _config(tmp_path, run: str, rows: str):
    path = tmp_path / "headline.toml"
    path.write_text(f'[runs]\nr = "{run}"\n' + rows, encoding="utf-8")
    return headline.load_config(path)


def test_a_superseded_run_is_refused(tmp_path):
    config = _config(
        tmp_path,
        "results/h100x2/20261126-180901",
        '[[rows]]\nrun = "r"\nreference = "ref.zero3"\npeer = "torch.fsdp2"\nwhere = { model = "gpt-1.3b" }\n',
    )
    with pytest.raises(HeadlineError, match=r"row 1 .*results/h100x2/20261126-180901 is superseded by"):
        headline.evaluate(config, headline.load_superseded(), None)


def test_a_superseded_strategy_covers_its_records_only():
    entry = Superseded("results/x/1", "version 1", "results/x/2", strategies=("ref.pp_zb",))
    assert entry.covers("ref.pp_zb") and not entry.covers("ref.pp_1f1b")
    assert Superseded("results/x/1", "old", "results/x/2").covers("anything")
    from parabench.registry import STRATEGIES

    for e in headline.load_superseded():  # each names a committed run, and strategies that exist
        assert (headline.ROOT / e.run / "manifest.json").is_file(), e.run
        assert set(e.strategies) <= set(STRATEGIES), e.strategies


def test_a_single_launch_of_a_high_spread_peer_is_refused(tmp_path):
    from parabench import noise

    rows = (
        '[[rows]]\nrun = "r"\nreference = "ref.zero3"\npeer = "torch.fsdp2"\nwhere = { layout = "separate" }\n'
        '[[rows]]\nrun = "r"\nreference = "ref.zero3"\npeer = "deepspeed.zero3"\nwhere = { layout = "fused" }\n'
    )
    with pytest.raises(HeadlineError) as refused:
        headline.evaluate(_config(tmp_path, LAYOUT_STUDY, rows), [], noise.load())
    message = str(refused.value)
    assert "row 1" in message and "torch.fsdp2 (tuned) has 1 launch and its launches spread up to" in message
    # ref.zero3's one launch is GPU-bound, and its launches move < 1 %: it may stand alone, as in row 2
    assert "ref.zero3 has 1 launch" not in message and "row 2" not in message


def _record(strategy, tps, *, world_size=2, layout=None, dtype="torch.bfloat16", device="cuda", profile=None):
    return {
        "label": strategy,
        "status": "ok",
        "case": {
            "model": "gpt-1.3b",
            "strategy": strategy,
            "world_size": world_size,
            "precision": "bf16",
            "recipe": "master",
            "micro_batch": 4,
            "seq_len": 2048,
            "grad_accum": 1,
            "device": device,
            "options": {"profile": profile} if profile else {},
            **({"layout": layout} if layout else {}),
        },
        "device": {"type": device},
        "model": {"params": {"total": 1.4e9}},
        "metrics": {"tokens_per_s_per_device": sorted(tps)[len(tps) // 2]},
        "launches": [{"status": "ok", "tokens_per_s_per_device": t, "gpu_util_pct_mean_min": 80.0} for t in tps],
        "per_rank": [{"comm": {"by_kind": {"reduce_scatter": {"dtypes": [dtype]}}}}],
    }


ROW = Row(number=1, run="r", reference="ref.zero3", peer="torch.fsdp2")
MANIFEST = {"devices": [{"name": "NVIDIA H200"}] * 2}
METRIC = "tokens_per_s_per_device"


def test_a_reduce_dtype_mismatch_is_labelled(outputs):
    ref = _record("ref.zero3", [100, 101, 102])
    peer = _record("torch.fsdp2", [90, 91, 92], dtype="torch.float32", layout="fused")
    row = headline.evaluate_row(ROW, "r", MANIFEST, [ref, peer], METRIC, None)
    assert row["differs"] == ["layout separate / fused", "gradient reduction bf16 / fp32"]
    assert row["launches"] == "3 / 3" and row["ratio"] == pytest.approx(101 / 91)
    same = headline.evaluate_row(ROW, "r", MANIFEST, [ref, _record("torch.fsdp2", [90, 91, 92])], METRIC, None)
    assert same["differs"] == []
    # on one GPU FSDP2 issues no collective: its row's declared reduce dtype stands in for the measurement
    alone = _record("torch.fsdp2", [90, 91, 92], world_size=1, profile="tuned")
    alone["per_rank"] = [{"comm": {"by_kind": {}}}]
    one_gpu = headline.evaluate_row(
        ROW, "r", MANIFEST, [_record("ref.zero3", [100, 101, 102], world_size=1), alone], METRIC, None
    )
    assert one_gpu["differs"] == ["gradient reduction bf16 / fp32"]
    # the committed tuned FSDP2 reduces in fp32, and the README says so beside its ratio
    readme = next(new for path, (_, new) in outputs.items() if path.name == "README.md")
    assert "| ref.zero3 / torch.fsdp2 | 1.00 (1.00-1.00) | reduce bf16 / fp32 |" in readme


def test_few_launches_unlike_pairs_and_cpu_timings_are_refused():
    ref = _record("ref.zero3", [100, 101, 102])
    spread = {"settings": {"min_cases": 3}, "entries": {"torch.fsdp2:tuned|host": {"n_cases": 5, "p95": 0.35}}}
    one = _record("torch.fsdp2", [90], profile="tuned")
    with pytest.raises(HeadlineError, match=r"torch.fsdp2 \(tuned\) has 1 launch and its launches spread up to 35 %"):
        headline.evaluate_row(ROW, "r", MANIFEST, [ref, one], METRIC, spread)
    with pytest.raises(HeadlineError, match="has 1 launch and no known launch-to-launch spread"):
        headline.evaluate_row(ROW, "r", MANIFEST, [ref, one], METRIC, None)
    calm = copy.deepcopy(spread)
    calm["entries"]["torch.fsdp2:tuned|host"]["p95"] = 0.02
    assert headline.evaluate_row(ROW, "r", MANIFEST, [ref, one], METRIC, calm)["launches"] == "3 / 1"
    wider = _record("torch.fsdp2", [90, 91, 92], world_size=4)
    with pytest.raises(HeadlineError, match="not a pair: world_size 2 / 4"):
        headline.evaluate_row(ROW, "r", MANIFEST, [ref, wider], METRIC, None)
    cpu = [_record("ref.zero3", [1, 2, 3], device="cpu"), _record("torch.fsdp2", [1, 2, 3], device="cpu")]
    with pytest.raises(HeadlineError, match="ran on cpu: not a GPU timing"):
        headline.evaluate_row(ROW, "r", MANIFEST, cpu, METRIC, None)
    with pytest.raises(HeadlineError, match="2 cases .* match"):
        headline.evaluate_row(ROW, "r", MANIFEST, [ref, ref, one], METRIC, None)


def test_a_superseded_run_is_found_from_its_folder():
    """What the report's first lines show for a run (``parabench.report.html.superseded_notes``)."""
    folders = [headline.ROOT / "results" / "h100x2" / "20261126-180901", headline.ROOT / LAYOUT_STUDY]
    notes = [e.text() for d in folders for e in headline.superseded_entries(d)]
    assert len(notes) == 1
    assert notes[0].startswith("results/h100x2/20261126-180901 is superseded by results/h200x1/20261129-075224")


def test_a_library_far_behind_shows_its_own_script_beside_it(outputs):
    """The reference 3.78x ahead of DeepSpeed ZeRO-3: the row says what the library's own script
    measured, and that the script ran on a host too different in speed to judge (the run's NOTES.md)."""
    readme = next(new for path, (_, new) in outputs.items() if path.name == "README.md")
    assert "| ref.zero3 / deepspeed.zero3 | 3.78 (3.62-4.10) | - | 0.52x, hosts apart |" in readme
    assert "| ref.ddp / torch.ddp | 0.99 (0.99-1.00) | - | - |" in readme  # no script run: nothing claimed


def test_an_unreadable_script_result_is_named_not_raised(tmp_path):
    (tmp_path / "fidelity").mkdir()
    peer = {"case_hash": "abc"}
    assert headline.peer_fidelity(tmp_path, peer) == "-"
    (tmp_path / "fidelity" / "abc.json").write_text('{"status": "ok", "result": ')  # cut short
    assert headline.peer_fidelity(tmp_path, peer) == "script result unreadable"
    (tmp_path / "fidelity" / "abc.json").write_text("[1, 2]")
    assert headline.peer_fidelity(tmp_path, peer) == "script result unreadable"
