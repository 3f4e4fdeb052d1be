"""Report section: the causal load imbalance of ring attention, contiguous split vs zig-zag.

Reads only result records (``per_rank[i]["strategy_stats"]`` of ``ref.cp_ring`` cases, written by
``reference_impls.context_parallel.RingStats``) and never imports training code, so the analytic
side is derived here from the same two rules the implementation follows:

* which chunks a rank holds (``chunks_of``): contiguous, chunk r of cp; zig-zag, chunks r and
  2cp-1-r of 2cp;
* the causal skip in ``ring_attention`` (``chunk_pairs``): a query chunk attends to a key chunk
  only if the key chunk is not later (kc <= qc); kc == qc is a diagonal pair, counted as a whole
  pair (the fused causal kernel skips most of its masked half).

``tests/test_cp_balance.py`` checks both against ``chunks_of`` and against the FLOPs measured by
real 2- and 4-rank runs.
"""

from __future__ import annotations

from parabench.registry import reporting
from parabench.report.frames import as_number, dig, records_of

SPLIT_ORDER = ("contiguous", "zigzag")  # contiguous first: the imbalanced row above its remedy


def chunks_held(rank: int, cp: int, split: str) -> list[int]:
    """The sequence chunks rank ``rank`` holds (mirrors ``reference_impls.context_parallel.chunks_of``)."""
    if split == "contiguous":
        return [rank]
    if split == "zigzag":
        return [rank, 2 * cp - 1 - rank]
    raise ValueError(f"unknown cp split {split!r}")


def chunk_pairs(cp: int, split: str) -> list[tuple[int, int]]:
    """Per rank, the (full, diagonal) chunk pairs one forward pass of one layer computes: every key
    chunk of every rank (the ring visits them all) against each local query chunk it does not
    lie in the future of."""
    out = []
    for rank in range(cp):
        full = diagonal = 0
        for qc in chunks_held(rank, cp, split):
            for src in range(cp):
                for kc in chunks_held(src, cp, split):
                    full += kc < qc
                    diagonal += kc == qc
        out.append((full, diagonal))
    return out


def analytic_imbalance(cp: int, split: str, masked_half_skipped: bool = False) -> float:
    """Max over mean of the per-rank attention FLOPs. All chunks of one split have the same size,
    so the FLOPs are proportional to the pair counts. As counted (``RingStats``) a diagonal pair
    costs a whole pair; a kernel that skips the masked upper triangle (FlashAttention, and the
    fused kernels ``ref.cp_ring`` calls since its ring became a fused custom autograd function)
    pays about half. Contiguous: 2cp/(cp+1) counted, (2cp-1)/cp with the half skipped; zig-zag: 1
    either way."""
    diagonal_weight = 0.5 if masked_half_skipped else 1.0
    work = [full + diagonal_weight * diagonal for full, diagonal in chunk_pairs(cp, split)]
    return max(work) / (sum(work) / cp)


def analytic_flops_per_rank(cp: int, split: str, config: dict, micro_batch: int, grad_accum: int) -> list[int] | None:
    """Forward attention FLOPs per rank for one step as ``RingStats`` counts them: 4·b·a·c²·d per
    pair (QKᵀ and PV, 2 FLOPs per multiply-add), summed over layers and micro-batches;
    b = micro_batch x grad_accum x cp samples a step (the cp group all-gathers its ranks' samples),
    c = seq_len / number of chunks, a·d = d_model."""
    layers, d_model, seq_len = (as_number(config.get(k)) for k in ("n_layers", "d_model", "seq_len"))
    if None in (layers, d_model, seq_len) or not all(isinstance(n, int) for n in (micro_batch, grad_accum)):
        return None
    n_chunks = cp * len(chunks_held(0, cp, split))
    if seq_len % n_chunks:
        return None
    c = seq_len // n_chunks
    per_pair = 4 * micro_batch * grad_accum * cp * c * c * d_model
    return [layers * per_pair * (full + diagonal) for full, diagonal in chunk_pairs(cp, split)]


def _clock(record: dict, stats: dict) -> tuple[str, bool]:
    """How the compute time was taken, and whether it measures compute at all."""
    clock = stats.get("attn_compute_clock")
    on_cuda = dig(record, "device", "type") == "cuda"
    if clock == "cuda_event":
        return "CUDA events", True
    if on_cuda:  # before the marker existed every record used the host clock: launch time only
        return "host clock on CUDA (kernel launches, not compute)", False
    return "host clock (CPU: synchronous)", True


def _ratio(values: list) -> float | None:
    nums = [v for v in values if as_number(v) is not None]
    if len(nums) != len(values) or not nums or sum(nums) <= 0:
        return None
    return max(nums) / (sum(nums) / len(nums))


def balance_rows(runs) -> tuple[list[dict], list[dict], list[str]]:
    """Per case and per rank rows, and the runs whose GPU compute times came from host clocks."""
    cases, ranks, untrusted_runs = [], [], []
    for idx, run, r in records_of(runs, reporting("cp_balance")):
        c = r.get("case") or {}
        split = str((c.get("options") or {}).get("cp_split", "zigzag"))
        cp = c.get("world_size")
        seq_len = c.get("seq_len") or dig(r, "model", "config", "seq_len")
        stats = [pr.get("strategy_stats") or {} for pr in r.get("per_rank") or []]
        known = isinstance(cp, int) and split in SPLIT_ORDER
        analytic = (
            analytic_flops_per_rank(
                cp, split, dig(r, "model", "config") or {}, c.get("micro_batch"), c.get("grad_accum", 1)
            )
            if known
            else None
        )
        clock, trusted = _clock(r, stats[0]) if stats else (None, None)
        if trusted is False and run not in untrusted_runs:
            untrusted_runs.append(run)
        flops = [s.get("attn_flops_fwd") for s in stats]
        times = [s.get("attn_compute_s_fwd") for s in stats]
        group = (
            f"{c.get('strategy')} {c.get('model')} s={seq_len} cp={cp} {c.get('precision')} mb{c.get('micro_batch')}"
        )
        sort_key = (
            idx,
            str(c.get("strategy")),
            str(c.get("model")),
            seq_len or 0,
            cp or 0,
            str(c.get("precision")),
            c.get("micro_batch") or 0,
            c.get("grad_accum") or 0,
            SPLIT_ORDER.index(split) if split in SPLIT_ORDER else len(SPLIT_ORDER),
        )
        cases.append(
            {
                "_sort": sort_key,
                "run": run,
                "group": group,
                "split": split,
                "status": r.get("status", "?"),
                "tokens_per_s": as_number(dig(r, "metrics", "tokens_per_s")),
                "step_time_ms": (as_number(dig(r, "metrics", "step_time_s_median")) or 0) * 1e3 or None,
                "max_rank_flops_G": max(flops) / 1e9
                if stats and all(as_number(f) is not None for f in flops)
                else None,
                "flops_ratio": _ratio(flops) if stats else None,
                "flops_ratio_analytic": analytic_imbalance(cp, split) if known else None,
                "useful_ratio_analytic": analytic_imbalance(cp, split, masked_half_skipped=True) if known else None,
                "flops_match": (flops == analytic) if stats and analytic else None,
                "time_ratio": _ratio(times) if stats and trusted else None,
                "clock": clock,
                "time_trusted": trusted,
            }
        )
        mean_flops = sum(flops) / len(flops) if stats and all(as_number(f) is not None for f in flops) else None
        mean_time = sum(times) / len(times) if stats and all(as_number(t) is not None for t in times) else None
        for rank, s in enumerate(stats):
            f, t = as_number(s.get("attn_flops_fwd")), as_number(s.get("attn_compute_s_fwd"))
            ranks.append(
                {
                    "_sort": sort_key + (rank,),
                    "run": run,
                    "group": group,
                    "split": split,
                    "rank": rank,
                    "pairs_full": s.get("attn_pairs_full"),
                    "pairs_diagonal": s.get("attn_pairs_diagonal"),
                    "flops_G": f / 1e9 if f is not None else None,
                    "analytic_flops_G": analytic[rank] / 1e9 if analytic and rank < len(analytic) else None,
                    "flops_vs_mean": f / mean_flops if f is not None and mean_flops else None,
                    "compute_ms": t * 1e3 if t is not None else None,
                    "time_vs_mean": t / mean_time if t is not None and mean_time and trusted else None,
                    "clock": clock,
                    "time_trusted": trusted,
                }
            )
    cases.sort(key=lambda row: row["_sort"])
    ranks.sort(key=lambda row: row["_sort"])
    return cases, ranks, untrusted_runs


CASE_COLUMNS = [
    ("group", "model, seq, cp", "str"),
    ("split", "split", "str"),
    ("status", "status", "str"),
    ("tokens_per_s", "tok/s", "int"),
    ("step_time_ms", "step ms", "f2"),
    ("max_rank_flops_G", "busiest rank GFLOP", "f1"),
    ("flops_ratio", "FLOPs max/mean", "f3"),
    ("flops_ratio_analytic", "analytic max/mean", "f3"),
    ("flops_match", "FLOPs = analytic", "str"),
    ("useful_ratio_analytic", "analytic, masked half skipped", "f3"),
    ("time_ratio", "compute time max/mean", "f3"),
    ("clock", "compute clock", "str"),
    ("time_trusted", "time trusted", "str"),
]
RANK_COLUMNS = [
    ("group", "model, seq, cp", "str"),
    ("split", "split", "str"),
    ("rank", "rank", "int"),
    ("pairs_full", "full pairs", "int"),
    ("pairs_diagonal", "diagonal pairs", "int"),
    ("flops_G", "attn GFLOP fwd", "f1"),
    ("analytic_flops_G", "analytic GFLOP", "f1"),
    ("flops_vs_mean", "FLOPs / mean", "f3"),
    ("compute_ms", "attn compute ms fwd", "f2"),
    ("time_vs_mean", "time / mean", "f3"),
    ("time_trusted", "time trusted", "str"),
]

NOTE = (
    "Ring attention (ref.cp_ring), forward attention work of one step per rank, summed over layers. "
    "Contiguous split: rank r holds chunk r of cp and, by causality, computes r full chunk pairs plus its "
    "diagonal, r+1 pairs of (s/cp)²; the last rank sets the pace, and max/mean = 2cp/(cp+1) "
    "(4/3 at cp=2, 1.6 at cp=4) counting a diagonal pair whole, or (2cp−1)/cp with its masked half "
    "skipped, as the fused causal kernels do (nearly: tiles on the diagonal are computed and masked). Zig-zag split: rank r holds chunks r and "
    "2cp−1−r of 2cp and computes 2cp+1 pairs of (s/2cp)² (2cp with the half skipped), the same on every "
    "rank: 1.0. Every ring hop waits for the slowest rank, so the busiest rank's work paces the step (the "
    "zig-zag split also wastes less on diagonal pairs, whose chunks are half as long). FLOPs = analytic compares every rank's counted FLOPs with 4·b·c²·d_model per pair. "
    "Compute time: each hop's block computations, CUDA events on GPUs, the host clock on CPUs."
)


def table_specs(runs, run_col: list) -> list[dict]:
    """The section's tables as keyword arguments of ``parabench.report.html._table`` (none
    without ring-attention cases)."""
    cases, ranks, untrusted_runs = balance_rows(runs)
    if not cases:
        return []
    note = NOTE
    if untrusted_runs:
        note += (
            f" Not trusted: the GPU compute times of {', '.join(untrusted_runs)} were taken with host clocks "
            "around asynchronous kernel launches (records from before the attn_compute_clock marker), so they "
            "measure launch time, not compute; only the FLOPs and chunk pairs are trusted there, and their "
            "time ratios are left out."
        )
    specs = [
        {
            "id_": "cp-balance",
            "title": "Ring attention load balance: contiguous vs zig-zag split",
            "columns": run_col + CASE_COLUMNS,
            "rows": cases,
            "note": note,
            "row_class": lambda r: "" if r["status"] == "ok" else "bad-row",
        }
    ]
    if ranks:
        specs.append(
            {
                "id_": "cp-balance-ranks",
                "title": "Ring attention work per rank",
                "columns": run_col + RANK_COLUMNS,
                "rows": ranks,
                "note": "Per rank of each ring-attention case above; / mean is against the mean over the "
                "case's ranks. Where the compute time is not trusted its reading stays, flagged, "
                "and time / mean is left out.",
            }
        )
    return specs
