"""Loss against bytes: what a communication-reducing strategy saves and what it costs, from one run's records.

``tradeoff(records)`` pairs every successful case with its uncompressed baseline — the case of the
same model, world size, precision, batch, seed and step counts whose strategy is ``torch.ddp`` for
``torch.*`` peers and ``ref.ddp`` otherwise (``baselines`` overrides this) — and returns one row per
case (baselines included, with zero gaps), each a dict:

* ``strategy``, ``label``, ``case_hash``, ``baseline`` (the baseline's strategy, None if not found);
* ``bytes_per_step``: payload bytes per optimizer step on rank 0 — the metered step's, except where
  the theory gives a per-step average (``comm_payload_bytes_avg_per_step``: ref.local_sgd, whose
  metered step is either a sync or not), then that average; ``bytes_per_step_measured`` is the
  metered step's either way, ``bytes_per_step_theory`` parabench.theory's figure for it (they differ
  where the meter misses collectives, e.g. torch's powerSGD_hook issuing P/Q all-reduces from future
  callbacks on another thread); ``bytes_ratio`` = bytes_per_step / the baseline's;
* ``final_loss``: the loss of the last step (the metered one), mean over ranks;
* ``loss_gap_equal_steps``: final_loss − the baseline's loss at the same step (positive = worse);
* ``step_time_s_median``, ``elapsed_s`` = median step time x number of steps (the run's wall-clock on
  the step axis, warm-up included, so both runs are placed on the same axis);
* ``loss_gap_equal_time``: final_loss − the baseline's loss at the same elapsed time, the baseline's
  curve being ``(median_b x (i + 1), loss_i)`` and interpolated linearly; where the compressed run
  took longer than the whole baseline run, the baseline's final loss is used and
  ``beyond_baseline_time`` is True (the gap is then a lower bound on the baseline's advantage);
* ``time_ratio`` = median step time / the baseline's.
"""

from __future__ import annotations

DEFAULT_BASELINES = (("torch.", "torch.ddp"), ("", "ref.ddp"))
_SAME = ("model", "world_size", "precision", "micro_batch", "grad_accum", "seq_len", "seed", "steps", "warmup",
         "device")


def _key(case: dict) -> tuple:
    return tuple(case.get(k) for k in _SAME)


def _baseline_name(strategy: str, baselines) -> str:
    for prefix, name in baselines:
        if strategy.startswith(prefix):
            return name
    return "ref.ddp"


def _bytes(rec: dict) -> tuple[float | None, float | None]:
    comm = (rec.get("per_rank") or [{}])[0].get("comm")
    measured = comm["payload_bytes"] if comm else None
    avg = (rec.get("theory") or {}).get("comm_payload_bytes_avg_per_step")
    return (sum(avg.values()) if avg is not None else measured), measured


def _interp(xs: list[float], ys: list[float], x: float) -> tuple[float, bool]:
    """Linear interpolation of (xs, ys) at x; (value, x beyond the last point)."""
    if x <= xs[0]:
        return ys[0], False
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0), False
    return ys[-1], True


def tradeoff(records: list[dict], baselines=DEFAULT_BASELINES) -> list[dict]:
    """One row per successful case of a run (see the module docstring)."""
    ok = [r for r in records if r.get("status") == "ok" and r.get("metrics")]
    index = {(r["case"]["strategy"], _key(r["case"])): r for r in ok}
    rows = []
    for rec in ok:
        m = rec["metrics"]
        losses = [l for l in m["losses"] if l is not None]
        name = _baseline_name(rec["case"]["strategy"], baselines)
        base = index.get((name, _key(rec["case"])))
        bps, measured = _bytes(rec)
        median = m["step_time_s_median"]
        row = {"strategy": rec["case"]["strategy"], "label": rec.get("label"), "case_hash": rec.get("case_hash"),
               "baseline": name if base else None, "bytes_per_step": bps, "bytes_per_step_measured": measured,
               "bytes_per_step_theory": sum(((rec.get("theory") or {}).get("comm_payload_bytes") or {}).values())
               if (rec.get("theory") or {}).get("comm_payload_bytes") is not None else None,
               "final_loss": losses[-1] if losses else None, "step_time_s_median": median,
               "elapsed_s": median * len(losses), "bytes_ratio": None, "loss_gap_equal_steps": None,
               "loss_gap_equal_time": None, "beyond_baseline_time": None, "time_ratio": None}
        if base is not None and losses:
            b_losses = [l for l in base["metrics"]["losses"] if l is not None]
            b_median = base["metrics"]["step_time_s_median"]
            b_bytes, _ = _bytes(base)
            n = min(len(losses), len(b_losses))
            at_time, beyond = _interp([b_median * (i + 1) for i in range(len(b_losses))], b_losses, row["elapsed_s"])
            row.update(bytes_ratio=(bps / b_bytes) if bps is not None and b_bytes else None,
                       loss_gap_equal_steps=losses[n - 1] - b_losses[n - 1],
                       loss_gap_equal_time=losses[-1] - at_time, beyond_baseline_time=beyond,
                       time_ratio=median / b_median if b_median else None)
        rows.append(row)
    return sorted(rows, key=lambda r: (r["baseline"] or "", r["bytes_per_step"] is None, -(r["bytes_per_step"] or 0)))


def format_table(rows: list[dict]) -> str:
    """A plain-text table of ``tradeoff`` rows (for the console)."""
    head = f"{'strategy':26s} {'bytes/step':>12s} {'x base':>7s} {'final':>7s} {'gap@steps':>9s} {'gap@time':>9s} {'t/step ms':>9s}"
    out = [head]
    for r in rows:
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        out.append(f"{r['strategy']:26s} {f(r['bytes_per_step'], '12,.0f')} {f(r['bytes_ratio'], '7.3f')} "
                   f"{f(r['final_loss'], '7.4f')} {f(r['loss_gap_equal_steps'], '+9.4f')} "
                   f"{f(r['loss_gap_equal_time'], '+9.4f')}{'*' if r['beyond_baseline_time'] else ' '}"
                   f"{f(r['step_time_s_median'] * 1e3 if r['step_time_s_median'] else None, '8.1f')}")
    return "\n".join(out)
