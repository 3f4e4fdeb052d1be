"""parabench.collectives_scaling tells the seeds' laws apart: times made from one law are fitted best by
that law, with its α and β recovered, and a message size's time against K is called linear or
logarithmic as it was made; the committed CPU study carries its fit. Pure python, no ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from parabench.collectives_scaling import FIT_FILE, LAWS, fit

ROOT = Path(__file__).resolve().parents[1]
ALPHA, BETA = 20e-6, 1e-9  # 20 µs a message, 1 GB/s
SIZES = [1024 * 4**i for i in range(6)]


def _results(make) -> list[dict]:
    """Collectives result documents at K = 2, 4, 8 whose all-reduce times come from ``make(algo, K, N)``."""
    docs = []
    for k in (2, 4, 8):
        rows = [
            {"op": "all_reduce", "algorithm": algo, "bytes": n, "time_s_median": make(algo, k, n), "correct": True}
            for algo in LAWS
            for n in SIZES
        ]
        docs.append({"world_size": k, "device": {"type": "cpu"}, "rows": rows})
    return docs


def _by_law(algo, k, n):
    steps, per_byte, _ = LAWS[algo]
    return ALPHA * steps(k) + BETA * per_byte(k) * n


@pytest.mark.parametrize("algo", list(LAWS))
def test_each_law_is_recovered_from_its_own_times(algo):
    doc = fit(_results(_by_law))
    entry = doc["algorithms"][algo]
    assert entry["own_law_fits_best"] and entry["own_law_rel_rms_error"] < 1e-6
    assert entry["fits"][algo]["alpha_s"] == pytest.approx(ALPHA, rel=1e-6)
    assert entry["fits"][algo]["beta_s_per_byte"] == pytest.approx(BETA, rel=1e-6)


def test_the_laws_are_told_apart():
    """Times of the parameter server's law are not fitted as well by halving-doubling's, nor the reverse."""
    entries = fit(_results(_by_law))["algorithms"]
    assert entries["ps"]["fits"]["halving_doubling"]["rel_rms_error"] > 0.1
    assert entries["halving_doubling"]["fits"]["ps"]["rel_rms_error"] > 0.1
    small = entries["ps"]["by_size"][0]  # latency-bound: 2(K-1) steps, linear in K
    assert small["closer"] == "linear in K"
    assert entries["tree"]["by_size"][0]["closer"] == "log K"


def test_a_mislabelled_algorithm_shows_as_not_fitting_its_law():
    """Ring-labelled times that grow as log K (a tree in disguise) fail the ring's own law."""

    def swapped(algo, k, n):
        return _by_law("tree" if algo == "ring" else algo, k, n)

    entry = fit(_results(swapped))["algorithms"]["ring"]
    assert entry["best_law"] == "tree" and not entry["own_law_fits_best"]


def test_the_committed_cpu_study_carries_its_fit():
    fits = sorted((ROOT / "results" / "studies" / "collectives-scaling-cpu").glob(f"*/{FIT_FILE}"))
    assert fits, "no committed collectives-scaling-cpu run with its fit"
    doc = json.loads(fits[-1].read_text())
    assert doc["world_sizes"] == [2, 4, 8]
    assert set(LAWS) <= set(doc["algorithms"])
    for entry in doc["algorithms"].values():
        assert all(math.isfinite(f["rel_rms_error"]) for f in entry["fits"].values())
