"""``parabench recheck RUN...``: set recorded measurements beside the *current* theory.

Why: the analytic models grow (16-bit tensor/sequence-parallel traffic, for one, was modelled after
the first GPU runs), but a GPU run is scarce. The measurements of a record (per-rank bytes by
kind, model-state bytes) do not depend on the theory, so they can be checked again without
running anything: this recomputes ``theory`` and ``checks`` from the record's own case with this
parabench, leaves every measured field untouched, and notes what it did in ``theory_recheck``
(when, with which commit, and the verdict the record carried before), so nobody mistakes a
re-derived expectation for one computed at run time.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from parabench.case import Case, launch_key
from parabench.record import checks_for, theory_for
from parabench.results import case_record_path, git_output, load_run, write_json_atomic
from parabench.stats import launch_index


class StaleImplementation(ValueError):
    """The strategy changed what it measures since the record was made (its version is part of the
    case hash): a newer theory describes the new code, not the measured one."""


def recheck_record(rec: dict) -> dict | None:
    """The record with theory and checks recomputed; None when there is nothing to check."""
    if rec.get("status") != "ok" or not rec.get("per_rank"):
        return None
    case = Case.from_dict(rec["case"])
    if case.case_hash != rec.get("case_hash"):
        raise StaleImplementation(
            f"{rec.get('label')}: case hash {rec.get('case_hash')} was made by another "
            f"version of {case.strategy} (now {case.case_hash}); not rechecked"
        )
    new = dict(rec)
    new["theory"] = theory_for(case, rec["per_rank"])
    new["checks"] = checks_for(new["theory"], rec["per_rank"], rec.get("loss_scale"))
    previous = rec.get("theory_recheck", {}).get("original_checks", rec.get("checks", {}))
    new["theory_recheck"] = {
        "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "parabench_commit": git_output("rev-parse", "HEAD"),
        "original_checks": {k: previous.get(k) for k in ("ok", "comm_ok", "state_ok")},
    }
    return new


def recheck_run(run_dir: Path, strategies: list[str] | None = None) -> list[tuple[str, object, object]]:
    """Rewrite every finished record of a run (only those of ``strategies``, names or prefixes
    ending in ``*``, when given: a strategy whose code changed since the run must not be judged
    by the new theory); returns (label, comm_ok before, comm_ok after), or (label, "stale", why)
    for a record whose strategy version changed since it ran (left untouched)."""
    _, records = load_run(run_dir)
    changes = []
    for rec in records:
        name = rec["case"]["strategy"]
        if strategies and not any(name == s or (s.endswith("*") and name.startswith(s[:-1])) for s in strategies):
            continue
        try:
            new = recheck_record(rec)
        except StaleImplementation as exc:
            changes.append((rec["label"], "stale", str(exc)))
            continue
        if new is None:
            continue
        write_json_atomic(case_record_path(run_dir, launch_key(rec["case_hash"], launch_index(rec))), new)
        changes.append((rec["label"], rec.get("checks", {}).get("comm_ok"), new["checks"].get("comm_ok")))
    return changes
