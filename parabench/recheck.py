"""``parabench recheck RUN...``: set recorded measurements beside the *current* theory.

Why: the analytic models grow (16-bit tensor/sequence-parallel traffic, for one, was modelled after
the first GPU runs), but a GPU run is scarce. The measurements of a record (per-rank bytes by
kind, model-state bytes) do not depend on the theory, so they can be checked again without
running anything: this recomputes ``theory`` and ``checks`` from the record's own case with this
parabench, leaves every measured field untouched, and notes what it did in ``theory_recheck``
(when, with which commit, and the verdict the record carried before), so nobody mistakes a
re-derived expectation for one computed at run time. A record whose theory and checks come out
as they are stored is not written at all (same bytes, same mtime): a recheck that changes nothing
leaves a committed run's files, and the tree, as they were.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from parabench.case import Case, launch_key
from parabench.record import checks_for, theory_for
from parabench.results import _json_default, case_record_path, git_output, load_run, write_json_atomic
from parabench.stats import launch_index


class StaleImplementation(ValueError):
    """The strategy changed what it measures since the record was made (its version is part of the
    case hash): a newer theory describes the new code, not the measured one."""


def _same_on_disk(a, b) -> bool:
    """Whether two record sections would be written as the same JSON (tuples are lists there,
    key order does not matter, NaN equals NaN)."""
    return json.dumps(a, sort_keys=True, default=_json_default) == json.dumps(b, sort_keys=True, default=_json_default)


def recheck_record(rec: dict) -> dict | None:
    """The record with theory and checks recomputed; None when there is nothing to check, or
    when the recomputed theory and checks equal the stored ones (nothing to write)."""
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
    if _same_on_disk(new["theory"], rec.get("theory")) and _same_on_disk(new["checks"], rec.get("checks")):
        return None
    previous = rec.get("theory_recheck", {}).get("original_checks", rec.get("checks", {}))
    new["theory_recheck"] = {
        "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "parabench_commit": git_output("rev-parse", "HEAD"),
        "original_checks": {k: previous.get(k) for k in ("ok", "comm_ok", "state_ok")},
    }
    return new


def recheck_run(run_dir: Path, strategies: list[str] | None = None) -> list[tuple[str, object, object]]:
    """Rewrite every finished record of a run whose theory or checks the current theory changes
    (only those of ``strategies``, names or prefixes ending in ``*``, when given: a strategy whose
    code changed since the run must not be judged by the new theory); returns (label, comm_ok
    before, comm_ok after) for each rewritten record, (label, "unchanged", comm_ok) for each one
    the current theory leaves as it is (not written), or (label, "stale", why) for a record whose
    strategy version changed since it ran (left untouched)."""
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
            if rec.get("status") == "ok" and rec.get("per_rank"):
                changes.append((rec["label"], "unchanged", rec.get("checks", {}).get("comm_ok")))
            continue
        write_json_atomic(case_record_path(run_dir, launch_key(rec["case_hash"], launch_index(rec))), new)
        changes.append((rec["label"], rec.get("checks", {}).get("comm_ok"), new["checks"].get("comm_ok")))
    return changes
