"""Communication terms: alpha-beta cost of each collective (nccl-tests bus factors), its launches,
and the part that overlaps backward."""

from __future__ import annotations

import math

from parabench.plan.terms.common import Workload, ddp_stages, uses_fp16_optimizer


# Collective kinds and how many times the payload crosses a link per rank (nccl-tests bus factor).
def bus_factor(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # send, recv, broadcast, reduce


# Which collectives suite op stands in for a kind the suite does not time.
BENCH_OP = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "send": "all_gather",
    "recv": "all_gather",
    "broadcast": "all_gather",
    "all_to_all": "all_gather",
}


def exposure_class(w: Workload, kind: str) -> str:
    if kind in ("send", "recv"):
        return "exp_p2p"
    if w.family == "model_parallel":
        return "exp_tp" if w.tp > 1 else "exp_dp"
    return "exp_shard" if w.family == "sharded" else "exp_dp"


def group_size(w: Workload, kind: str) -> int:
    if kind in ("send", "recv"):
        return 2
    if w.family == "model_parallel" and w.tp > 1:
        return w.tp
    return w.dp


def collective_fit(collectives: dict, kind: str, n: int) -> dict:
    """The alpha-beta fit for ``kind`` in a group of n: the measured group size nearest n from
    below (the smallest measured one for smaller groups), or the op's top-level fit where the
    calibration has no sizes."""
    c = collectives.get(BENCH_OP.get(kind, "all_reduce")) or collectives.get("all_reduce")
    sizes = sorted(int(k) for k in (c.get("by_group") or {}))
    if not sizes:
        return c
    below = [s for s in sizes if s <= n]
    return c["by_group"][str(below[-1] if below else sizes[0])]


def unmeasured_group_notes(w: Workload, collectives: dict) -> list[str]:
    """A note per collective whose group size the calibration did not measure: it is priced with
    the nearest measured size below (NCCL's bus bandwidth grows with the group on one host)."""
    notes = []
    for kind, nbytes in w.comm_bytes.items():
        n = group_size(w, kind)
        c = collective_fit(collectives, kind, n)
        if nbytes > 0 and n > 1 and c.get("group_size", n) < n:
            notes.append(f"{kind} over {n} ranks priced with the {c['group_size']}-rank fit: no measurement of {n}")
    return notes


def collective_s(collectives: dict, kind: str, nbytes: float, n: int, calls: float, queued: bool = False) -> float:
    """alpha-beta time of ``calls`` collectives moving ``nbytes`` payload in a group of n. ``queued``:
    the calls are issued back to back (a bucket loop with nothing between), so every call after the
    first costs a queued call's alpha and bandwidth (the collectives suite's bursts), where measured."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    c = collective_fit(collectives, kind, n)
    if queued and calls > 1 and "alpha_queued_s" in c:
        first = nbytes / calls
        return (
            c["alpha_s"]
            + first * bus_factor(kind, n) / c["busbw_Bps"]
            + (calls - 1) * c["alpha_queued_s"]
            + (nbytes - first) * bus_factor(kind, n) / c["busbw_queued_Bps"]
        )
    return calls * c["alpha_s"] + nbytes * bus_factor(kind, n) / c["busbw_Bps"]


# Sharded trainers that issue one collective per unit (each block, and the root: embeddings, final
# norm, head) and pass, whatever its size: reference_impls/fsdp.py's ``_gather`` and ``_grad_ready``,
# FSDP2's ``foreach_all_gather`` and ``foreach_reduce`` per ``fully_shard`` module; HSDP adds one
# all-reduce across replicas per unit. (Their rows: ``PlanFacts.per_unit_launches``.)


def comm_calls(w: Workload, kind: str, nbytes: float) -> float:
    """Collective launches per step: per layer and pass for tensor parallelism and pipelines, per
    unit and pass for the per-unit sharded trainers (all-gathers in forward and again in backward),
    25 MiB buckets for the other gradient traffic (the default of DDP and the references)."""
    if kind in ("send", "recv"):
        return 2 * w.passes
    if w.family == "model_parallel" and w.tp > 1:
        return 4 * w.n_layers / w.pp * w.passes
    if uses_fp16_optimizer(w) and kind == "all_reduce":  # buffered_allreduce_fallback's 16-bit buckets
        return max(1.0, math.ceil(nbytes / 2 / DEEPSPEED_REDUCE_BUCKET_ELEMS))
    if w.facts.per_unit_launches and kind in ("all_gather", "reduce_scatter", "all_reduce"):
        return (2 if kind == "all_gather" else 1) * (w.n_layers + 1) * w.passes
    if w.family == "sharded":
        return max(1.0, nbytes / (25 << 20), w.n_layers)
    return max(1.0, nbytes / (25 << 20))


# Gradient buckets of the references (reference_impls/dp_common.plan_buckets, ``bucket_mb`` 25) and
# torch DDP (``bucket_cap_mb`` 25), and DeepSpeed ZeRO-1/2's reduce bucket (``reduce_bucket_size``
# 5e8 elements, its default; the tuned profile writes none); the stage-0 engine's all-reduce buckets
# (``buffered_allreduce_fallback``, MEMORY_OPT_ALLREDUCE_SIZE) hold as many.
BUCKET_BYTES = 25 * 2**20
DEEPSPEED_REDUCE_BUCKET_ELEMS = 5e8
# Which share of a pass's compute a collective issued during it can hide behind: gradient traffic
# is launched from backward hooks (backward: 2 of 3 matmul passes), ZeRO-3 / FSDP gathers run one
# unit ahead in forward and backward (the whole pass).
BACKWARD_SHARE = 2 / 3


def comm_overlap(w: Workload, kind: str, nbytes: float) -> tuple | None:
    """How the code overlaps ``kind``: None where it is issued with nothing to hide behind, else
    (share of a pass's compute it runs beside, collectives it is issued as per communicating pass,
    bytes of the last of them, passes that communicate). Read off each implementation:

    - ref.ddp / torch.ddp: all-reduce per 25 MiB bucket from backward hooks, the last micro-batch
      only (no_sync); the last bucket holds the token embedding (V x d), whose gradient is made last.
    - ref.zero1 / zero2: reduce-scatter per bucket from backward hooks (zero1 on the last
      micro-batch, zero2 on every one); the all-gather of the updated shards follows the update:
      serial.
    - ref.zero3 / ref.fsdp / torch.fsdp2 / deepspeed.zero3 (and HSDP's): one all-gather per unit
      (block) in forward and again in backward, prefetched one unit ahead; one reduce-scatter (HSDP:
      and one all-reduce across replicas) per unit from backward; every micro-batch.
    - deepspeed.zero1 / zero2 tuned (overlap_comm on): reduce per 5e8-element bucket beside
      backward; matched (DeepSpeed's default overlap_comm off at stages 0-2), zero0, ref.ps: serial.
    - torch.pp_gpipe / 1f1b / interleaved from version 3 (``ddp_stages``): each of the rank's stage
      modules is DDP-wrapped and all-reduces in DDP's rebuilt buckets (the first closes at 1 MiB,
      the rest at 25 MiB) during the last micro-batch's backward only: the compute it hides behind
      is one micro-batch's backward of the rank's stage(s); rank 0's last bucket holds the token
      embedding. Earlier versions, torch.pp_zb and the other pipelines' data parallelism: serial."""
    f = w.facts
    elem = 2 if w.recipe != "amp" else 4  # the gradient / gathered dtype on the wire
    embed = w.vocab_size * w.d_model / (w.tp if w.family == "model_parallel" else 1) * elem
    if kind == "all_reduce" and w.tp == 1 and not w.offload and ddp_stages(w):
        # DDP's rebuilt first bucket, as the theory counts it (the planner's torch.ddp keeps its
        # calibrated 25 MiB pieces); imported here to keep torch out of the planner's import
        from parabench.families.model_parallel import DDP_FIRST_BUCKET_BYTES

        chunks = w.virtual_stages  # one DDP, so one 1 MiB first bucket, per stage module of the rank
        units = chunks + max(0.0, nbytes - chunks * DDP_FIRST_BUCKET_BYTES) / BUCKET_BYTES
        return BACKWARD_SHARE, units, max(BUCKET_BYTES, embed), 1
    if w.family == "model_parallel" or kind in ("send", "recv") or w.offload:
        return None
    grad_passes = 1 if f.grad_sync_once_per_step else w.passes
    per_pass = nbytes / grad_passes
    if f.grad_sync == "all_reduce" and kind == "all_reduce":
        return BACKWARD_SHARE, max(1.0, per_pass / BUCKET_BYTES), max(BUCKET_BYTES, embed), grad_passes
    if f.grad_sync == "reduce_scatter" and kind == "reduce_scatter":
        return BACKWARD_SHARE, max(1.0, per_pass / BUCKET_BYTES), max(BUCKET_BYTES, embed), grad_passes
    if f.grad_sync == "per_unit":
        units = w.n_layers + 1  # blocks and the root (embeddings, final norm, head)
        if kind == "all_gather":  # forward and backward each gather every unit
            per_pass = nbytes / w.passes
            return 1.0, 2 * units, per_pass / (2 * units), w.passes
        if kind in ("reduce_scatter", "all_reduce"):  # HSDP: each unit's shard all-reduced across replicas
            per_pass = nbytes / w.passes
            return BACKWARD_SHARE, units, max(per_pass / units, embed), w.passes
    return None


def overlap_tail_s(comm_s: float, hide_s: float, units: float, last_share: float) -> float:
    """Seconds of a collective issued in ``units`` equal pieces as the compute it overlaps
    (``hide_s``) produces them, that end after that compute: each piece starts when it is ready and
    the previous one is done, so the end is max(hide_s + the last piece, the first piece's ready
    time + all the communication). The last piece is ``last_share`` of the traffic (the embedding's
    bucket), at least 1/units."""
    if comm_s <= 0:
        return 0.0
    units = max(1.0, units)
    last = comm_s * min(1.0, max(last_share, 1 / units))
    return max(last, comm_s - hide_s * (1 - 1 / units))


# Collectives whose output is not their input: at one rank NCCL copies the input to the output
# (step_breakdown memcpy at 1 GPU, results/h100x4/20261126-203946, gpt-1.3b mb4: 2.9 ms for ref.zero1/2/3,
# one 2 B x params reduce-scatter; 0.5 ms for ref.ddp and torch.ddp, whose all-reduce is in place). The
# references' and FSDP2's all-gathers are in place (the local shard is a slot of the output).
OUT_OF_PLACE = ("reduce_scatter",)
