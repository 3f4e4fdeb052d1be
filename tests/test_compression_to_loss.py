"""The compression-to-loss section sets DDP's last-step loss + 1 % as the target and names the case that reaches
it with the fewest bytes and the one that reaches it soonest; a case that never gets there is not named.
Synthetic records, no training."""

from __future__ import annotations

from parabench.report.compression_to_loss import WINDOW, analyse, table_specs

STEPS = 120


def _record(strategy, losses, bytes_per_step, s_per_step, avg=False):
    theory = {"comm_payload_bytes": {"all_reduce": bytes_per_step}}
    if avg:
        theory = {"comm_payload_bytes": {}, "comm_payload_bytes_avg_per_step": {"all_reduce": bytes_per_step}}
    return {
        "status": "ok",
        "label": strategy,
        "case": {"strategy": strategy, "model": "tiny", "world_size": 2, "precision": "fp32", "steps": STEPS},
        "metrics": {"losses": losses + [0.0], "step_time_s_median": s_per_step},  # the metered step is left out
        "theory": theory,
    }


def _decay(rate, floor):
    return [floor + 5.0 * (1 - rate) ** i for i in range(STEPS)]


def _runs():
    records = [
        _record("ref.ddp", _decay(0.05, 2.0), 4e6, 0.010),
        _record("ref.ddp_fp16_compress", _decay(0.05, 2.0), 2e6, 0.011),  # same loss, half the bytes
        _record("ref.ddp_onebit", _decay(0.05, 2.3), 0.1e6, 0.009),  # cheap, never gets there
        _record("ref.local_sgd", _decay(0.08, 2.0), 3e6, 0.004, avg=True),  # faster steps, fewer bytes on average
    ]
    return [({"suite": "compression-to-loss-cpu", "run_id": "x"}, records)]


def test_the_target_is_ddps_smoothed_last_loss_plus_one_percent():
    (group,) = analyse(_runs())
    ddp_tail = _decay(0.05, 2.0)[-WINDOW:]
    assert abs(group["target"] - sum(ddp_tail) / WINDOW * 1.01) < 1e-12


def test_cheapest_in_bytes_and_fastest_are_named_and_a_miss_is_not():
    (group,) = analyse(_runs())
    by_label = {s["label"]: s for s in group["series"]}
    assert by_label["ref.ddp_onebit"]["reached_step"] is None
    assert group["cheapest_bytes"]["label"] == "ref.ddp_fp16_compress"
    assert group["cheapest_time"]["label"] == "ref.local_sgd"
    (spec,) = table_specs(_runs(), [])
    assert "Cheapest in bytes to the target: ref.ddp_fp16_compress" in spec["note"]
    assert [r["reached_step"] for r in spec["rows"]][-1] == "not reached"


def test_short_runs_take_no_part():
    manifest, records = _runs()[0]
    for r in records:
        r["case"]["steps"] = 29
    assert analyse([(manifest, records)]) == []
