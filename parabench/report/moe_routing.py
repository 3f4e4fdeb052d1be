"""Report section: expert routing of the MoE strategies (``ref.ep``, ``deepspeed.moe``).

Reads only result records and never imports training code. Per rank, ``per_rank[i]["strategy_stats"]``
holds the routing of the last micro-batch per MoE layer (``{"ep": 2, "moe_layers": {"1": {...}}}``):

* ``tokens_per_expert``: E counts, this rank's *kept* assignments per expert (both strategies);
* ``dropped``: this rank's assignments cut by the capacity (both; 0 when dropless);
* ``routed_per_expert``, ``capacity``, ``padding_rows`` (deepspeed.moe only): its all-to-alls are
  dense, E x capacity rows each way, and ``padding_rows`` of them carry no token;
* ``received_per_local_expert`` (ref.ep only): rows its local experts received.

``per_rank[i]["comm"]["by_kind"]["all_to_all"]`` holds the all-to-all payload of one instrumented step.

Expert load imbalance of a layer: the global load per expert is ``tokens_per_expert`` summed over
ranks, and the imbalance is its max over its mean. 1.0 is perfectly balanced; each token sends at most
one assignment to an expert, so no expert can get more than 1/k of the assignments and the ceiling is
E/k (8 experts, top-2: 4.0), reached when every token picks the same k experts: routing collapse.
Rank r holds experts ``r*E/ep .. (r+1)*E/ep - 1``; a rank whose local experts all got zero tokens in
a layer does no expert work there ("starved").
"""

from __future__ import annotations

from parabench.registry import reporting
from parabench.report.frames import MiB, as_number, dig, records_of

COLLAPSE_FRACTION = 0.9  # max/mean at or above this share of E/top_k counts as collapsed

CASE_COLUMNS = [
    ("strategy", "strategy", "str"),
    ("model", "model", "str"),
    ("precision", "precision", "str"),
    ("shape", "micro-batch x seq", "str"),
    ("experts", "experts (top-k, ep)", "str"),
    ("capacity", "capacity", "str"),
    ("tokens_per_s", "tok/s", "int"),
    ("step_time_ms", "step ms", "f2"),
    ("a2a_MiB", "all-to-all MiB/step (rank 0)", "f2"),
    ("a2a_calls", "all-to-all calls", "int"),
    ("dropped", "assignments dropped", "int"),
    ("padding_rows", "padding rows", "int"),
    ("padding_pct", "padding % of sent rows", "f1"),
    ("worst_imbalance", "worst layer max/mean", "f3"),
    ("worst_layer", "worst layer", "str"),
    ("worst_zero_experts", "experts at 0 there", "int"),
    ("ceiling", "ceiling E/k", "f2"),
    ("collapsed_layers", "layers ≥ 0.9·E/k", "int"),
    ("starved_layers", "layers with a starved rank", "int"),
    ("moe_layers", "MoE layers", "int"),
    ("collapsed", "routing collapsed", "str"),
]
LAYER_COLUMNS = [
    ("strategy", "strategy", "str"),
    ("model", "model", "str"),
    ("precision", "precision", "str"),
    ("layer", "layer", "int"),
    ("load", "global load per expert (kept assignments)", "str"),
    ("assignments", "assignments", "int"),
    ("imbalance", "max/mean", "f3"),
    ("zero_experts", "experts at 0", "int"),
    ("starved_ranks", "starved ranks", "str"),
    ("dropped", "dropped", "int"),
    ("padding_rows", "padding rows", "int"),
]
FAILED_COLUMNS = [
    ("label", "case", "str"),
    ("status", "status", "str"),
    ("error", "error", "wrap"),
    ("diagnosis", "diagnosis", "wrap"),
]

NOTE = (
    "MoE cases (ref.ep, deepspeed.moe), the routing of the last micro-batch of the instrumented step. "
    "Load imbalance of a layer: each expert's kept assignments summed over ranks, max over mean; 1.0 is "
    "balanced, E/k (the ceiling: an expert gets at most one assignment per token) means every token "
    "picked the same k experts. The worst layer is shown, with how many experts got no token there; "
    "a rank is starved in a layer when all of its local experts got none. Dropped: assignments cut by "
    "the capacity, summed over ranks and layers. Padding rows (deepspeed.moe): its all-to-alls carry "
    "E x capacity rows whatever the routing, and these carry no token. All-to-all: rank 0's payload "
    "and calls on the instrumented step (ref.ep sends only the rows routed, so its ranks differ)."
)
COLLAPSE_NOTE = (
    "Routing collapsed at initialisation on this synthetic data in {cases}: expert work concentrates "
    "on few experts/ranks, so these numbers (step time, all-to-all bytes, padding, drops) measure "
    "that collapse, not a balanced MoE."
)


def _ints(v) -> list[int] | None:
    return [int(x) for x in v] if isinstance(v, list) and v and all(as_number(x) is not None for x in v) else None


def layer_stats(per_rank_stats: list[dict], n_experts: int | None, top_k: int | None) -> list[dict]:
    """Per MoE layer (numeric order): the global load per expert, its max/mean, the experts at zero,
    the starved ranks, and the dropped assignments and padding rows summed over ranks."""
    layers: dict[str, list[dict]] = {}
    for s in per_rank_stats:
        for name, st in (s.get("moe_layers") or {}).items():
            if isinstance(st, dict):
                layers.setdefault(str(name), []).append(st)
    ep = as_number(dig(per_rank_stats, 0, "ep")) or len(per_rank_stats)
    out = []
    for name in sorted(layers, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n)):
        ranks = layers[name]
        counts = [_ints(st.get("tokens_per_expert")) for st in ranks]
        load = None
        if counts and None not in counts and len({len(c) for c in counts}) == 1 and len(ranks) == len(per_rank_stats):
            load = [sum(col) for col in zip(*counts)]
        E = n_experts or (len(load) if load else None)
        total = sum(load) if load else 0
        imbalance = max(load) * len(load) / total if load and total > 0 else None
        starved = None
        if load and total > 0 and ep and isinstance(ep, int) and len(load) % ep == 0:
            local = len(load) // ep
            starved = [r for r in range(ep) if not any(load[r * local : (r + 1) * local])]
        at_ceiling = bool(imbalance is not None and E and top_k and imbalance >= COLLAPSE_FRACTION * E / top_k)
        dropped = [as_number(st.get("dropped")) for st in ranks]
        padding = [as_number(st.get("padding_rows")) for st in ranks]
        sent = [as_number(st.get("sent_rows")) for st in ranks]
        out.append(
            {
                "layer": int(name) if name.isdigit() else name,
                "load": load,
                "assignments": total if load else None,
                "imbalance": imbalance,
                "zero_experts": sum(1 for x in load if x == 0) if load else None,
                "starved_ranks": starved,
                "collapsed": at_ceiling or bool(starved),
                "at_ceiling": at_ceiling,
                "dropped": sum(dropped) if None not in dropped else None,
                "padding_rows": sum(padding) if padding and None not in padding else None,
                "sent_rows": sum(sent) if sent and None not in sent else None,
            }
        )
    return out


def _sum(values):
    nums = [v for v in values if v is not None]
    return sum(nums) if nums and len(nums) == len(values) else None


def routing_rows(runs) -> tuple[list[dict], list[dict], list[dict]]:
    """Per ok MoE case, per layer of those, and per failed MoE case."""
    cases, layers, failed = [], [], []
    for idx, run, r in records_of(runs, reporting("moe_routing")):
        c = r.get("case") or {}
        cfg = dig(r, "model", "config") or {}
        strategy, model = str(c.get("strategy")), str(c.get("model"))
        sort_key = (
            idx,
            model,
            str(c.get("precision")),
            c.get("micro_batch") or 0,
            c.get("seq_len") or 0,
            strategy,
            r.get("label", ""),
        )
        if r.get("status") != "ok":
            err = r.get("error") or {}
            failed.append(
                {
                    "_sort": sort_key,
                    "run": run,
                    "label": r.get("label", ""),
                    "status": r.get("status", "?"),
                    "error": err.get("message"),
                    "diagnosis": err.get("diagnosis"),
                }
            )
            continue
        per_rank = r.get("per_rank") or []
        stats = [pr.get("strategy_stats") or {} for pr in per_rank]
        E, k = as_number(cfg.get("n_experts")), as_number(cfg.get("top_k"))
        per_layer = layer_stats(stats, E, k) if stats else []
        rated = [lay for lay in per_layer if lay["imbalance"] is not None]
        worst = max(rated, key=lambda lay: lay["imbalance"]) if rated else None  # first of equals: lowest layer
        a2a = dig(per_rank, 0, "comm", "by_kind", "all_to_all") or {}
        padding = _sum([lay["padding_rows"] for lay in per_layer]) if per_layer else None
        sent = _sum([lay["sent_rows"] for lay in per_layer]) if per_layer else None
        ep = dig(stats, 0, "ep")
        cf = cfg.get("capacity_factor")
        seq_len = c.get("seq_len") or cfg.get("seq_len")
        step = as_number(dig(r, "metrics", "step_time_s_median"))
        collapsed = any(lay["collapsed"] for lay in per_layer)
        cases.append(
            {
                "_sort": sort_key,
                "run": run,
                "label": r.get("label", ""),
                "strategy": strategy,
                "model": model,
                "precision": str(c.get("precision")),
                "shape": f"{c.get('micro_batch')} x {seq_len}",
                "experts": f"{E} (top-{k}, ep {ep})",
                "capacity": "dropless" if cf is None else f"factor {cf}",
                "tokens_per_s": as_number(dig(r, "metrics", "tokens_per_s")),
                "step_time_ms": step * 1e3 if step else None,
                "a2a_bytes": as_number(a2a.get("payload_bytes")),
                "a2a_calls": as_number(a2a.get("calls")),
                "a2a_MiB": a2a["payload_bytes"] / MiB if as_number(a2a.get("payload_bytes")) is not None else None,
                "dropped": _sum([lay["dropped"] for lay in per_layer]) if per_layer else None,
                "padding_rows": padding,
                "padding_pct": padding / sent * 100 if padding is not None and sent else None,
                "worst_imbalance": worst["imbalance"] if worst else None,
                "worst_layer": str(worst["layer"]) if worst else None,
                "worst_zero_experts": worst["zero_experts"] if worst else None,
                "ceiling": E / k if E and k else None,
                "collapsed_layers": sum(1 for lay in per_layer if lay["at_ceiling"]) if per_layer else None,
                "starved_layers": sum(1 for lay in per_layer if lay["starved_ranks"]) if per_layer else None,
                "moe_layers": len(per_layer) or None,
                "collapsed": ("yes" if collapsed else "no") if rated else None,
                "per_layer": per_layer,
            }
        )
        for lay in per_layer:
            layers.append(
                {
                    "_sort": sort_key + (lay["layer"] if isinstance(lay["layer"], int) else 0,),
                    "run": run,
                    "strategy": strategy,
                    "model": model,
                    "precision": str(c.get("precision")),
                    "layer": lay["layer"],
                    "load": " ".join(str(x) for x in lay["load"]) if lay["load"] else None,
                    "assignments": lay["assignments"],
                    "imbalance": lay["imbalance"],
                    "zero_experts": lay["zero_experts"],
                    "starved_ranks": (", ".join(str(x) for x in lay["starved_ranks"]) or "none")
                    if lay["starved_ranks"] is not None
                    else None,
                    "dropped": lay["dropped"],
                    "padding_rows": lay["padding_rows"],
                    "collapsed": lay["collapsed"],
                }
            )
    for rows in (cases, layers, failed):
        rows.sort(key=lambda row: row["_sort"])
    return cases, layers, failed


def table_specs(runs, run_col: list) -> list[dict]:
    """The section's tables as keyword arguments of ``parabench.report.html._table`` (none without
    ref.ep / deepspeed.moe records)."""
    cases, layers, failed = routing_rows(runs)
    specs = []
    if cases:
        several = len({r["run"] for r in cases}) > 1
        collapsed = [f"{r['run']} {r['label']}" if several else r["label"] for r in cases if r["collapsed"] == "yes"]
        specs.append(
            {
                "id_": "moe-routing",
                "title": "Expert routing (MoE): expert load, all-to-all, drops",
                "columns": run_col + CASE_COLUMNS,
                "rows": cases,
                "note": NOTE,
                "footer": COLLAPSE_NOTE.format(cases="; ".join(collapsed)) if collapsed else "",
                "row_class": lambda r: "bad-row" if r["collapsed"] == "yes" else "",
            }
        )
    if layers:
        specs.append(
            {
                "id_": "moe-routing-layers",
                "title": "Expert routing (MoE) per layer",
                "columns": run_col + LAYER_COLUMNS,
                "rows": layers,
                "note": "Each MoE layer of the cases above: the kept assignments per expert summed over ranks "
                "(experts in order; rank r holds the r-th block of E/ep), their max/mean, and the "
                "ranks whose local experts got none.",
                "row_class": lambda r: "bad-row" if r["collapsed"] else "",
            }
        )
    if failed:
        specs.append(
            {
                "id_": "moe-routing-failed",
                "title": "Expert routing (MoE), failed cases",
                "columns": run_col + FAILED_COLUMNS,
                "rows": failed,
                "note": "MoE cases that did not finish, with the error and, where one was written into the "
                "record after the run, its diagnosis.",
                "row_class": lambda r: "bad-row",
            }
        )
    return specs
