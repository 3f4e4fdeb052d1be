"""The smoke suite end to end: every case ok, and the fp32 loss curves of every strategy on
2 processes agree with the 1-process run of the same model and global batch."""

from parabench.results import load_run


def _by(records, **want):
    return [r for r in records if all(r["case"][k] == v for k, v in want.items())]


def test_every_case_ok_and_recorded(smoke_run):
    manifest, records = load_run(smoke_run)
    assert manifest["n_cases"] == len(records) >= 40
    bad = [(r["label"], r["status"], (r.get("error") or {}).get("message")) for r in records if r["status"] != "ok"]
    assert not bad, bad
    for r in records:
        m = r["metrics"]
        assert m["tokens_per_s"] > 0 and m["step_time_s_median"] > 0 and m["peak_rss_bytes"] > 0
        assert len(m["losses"]) == r["case"]["warmup"] + r["case"]["steps"] + 1


def test_fp32_losses_match_single_process_to_1e4(smoke_run):
    _, records = load_run(smoke_run)
    (single,) = _by(records, strategy="single", precision="fp32")
    truth = single["metrics"]["losses"]
    assert truth[-1] < truth[0]
    checked = 0
    for r in _by(records, precision="fp32"):
        if r["case"]["strategy"] == "single":
            continue
        losses = r["metrics"]["losses"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, truth))
        assert worst < 1e-4, (r["label"], losses, truth)
        checked += 1
    assert checked >= 20


def test_measured_communication_matches_theory(smoke_run):
    """Wherever the record carries an analytic communication volume, the meter agrees."""
    _, records = load_run(smoke_run)
    with_theory = [r for r in records if r["checks"].get("comm_ok") is not None and r["case"]["precision"] == "fp32"]
    assert len(with_theory) >= 15
    off = [(r["label"], r["checks"]["comm"]) for r in with_theory if not r["checks"]["comm_ok"]]
    assert not off, off
