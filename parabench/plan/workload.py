"""Workloads from a stored record (no torch: the report uses this) or from a configuration the
planner has not run (the theory's expectation, computed now)."""

from __future__ import annotations

import json

from parabench.plan.model import BUCKET_BYTES, Workload, facts, unmodelled_reason
from parabench.record import byte_high

# Options that change what is recorded, not what is timed or held (meters, traces): configurations
# that differ only in these are the same configuration.
INSTRUMENT_OPTIONS = frozenset(
    {
        "step_breakdown",
        "memory_breakdown",
        "trace",
        "memory_snapshot",
        "roofline",
        "telemetry",
        "timed_meters",
        "record_timeline",
        "step_sync",
        "python_gc",
    }
)


def config_options(options: dict | None) -> dict:
    return {k: v for k, v in sorted((options or {}).items()) if k not in INSTRUMENT_OPTIONS}


def _sum_bytes(d) -> float | None:
    if not isinstance(d, dict):
        return None
    vals = [byte_high(v) for v in d.values()]
    return None if any(v is None for v in vals) else float(sum(vals))


def _grad_buffer_bytes(d) -> float:
    """The working set's gradient buffers (``grad_buffers``), or 0."""
    v = byte_high(d.get("grad_buffers")) if isinstance(d, dict) and "grad_buffers" in d else None
    return float(v or 0.0)


# FSDP2's sharded parameters are fp32 in every recipe (its MixedPrecisionPolicy casts only what it
# gathers): they are the master weights (4 bytes), their sharded gradients are fp32 too, and Adam
# holds the two moments (8). The ZeRO paper's split (2 + 2 + 12) would keep 2 bytes more alive
# through backward than exist. (Their rows: ``PlanFacts.fp32_sharded_params``.)


def _state_parts(theory: dict, strategy: str, params: int, world_size: int) -> tuple[dict | None, str]:
    """{params, grads, optimizer} bytes of the heaviest rank: the theory's layout, else the ZeRO
    paper's line split into its terms (mixed precision, Adam: 2Ψ parameters, 2Ψ gradients, 12Ψ
    optimizer, each /N from the stage that shards it; ZeRO-Offload keeps the 2Ψ parameters only)."""
    state = theory.get("state_bytes")
    if isinstance(state, dict):
        state = [state]
    if isinstance(state, list):
        parts = [{k: byte_high(v) for k, v in s.items()} if isinstance(s, dict) else None for s in state]
        if parts and all(p is not None and None not in p.values() for p in parts):
            heaviest = max(parts, key=lambda p: sum(p.values()))
            return {k: float(heaviest.get(k, 0)) for k in ("params", "grads", "optimizer")}, "theory"
    paper = theory.get("paper_state_bytes")
    if not isinstance(paper, (int, float)):
        return None, "none"
    f = facts(strategy)
    stage = f.zero_stage
    psi, n = float(params), max(1, world_size)
    parts = {
        "params": 2 * psi / (n if stage >= 3 else 1),
        "grads": 2 * psi / (n if stage >= 2 else 1),
        "optimizer": 12 * psi / (n if stage >= 1 else 1),
    }
    if f.fp32_sharded_params:  # the same 16Ψ/N, split as these trainers hold it
        parts = {"params": 4 * psi / n, "grads": 4 * psi / n, "optimizer": 8 * psi / n}
    if f.offload:  # the figure is the 16-bit parameters left on the GPU
        return {"params": float(paper), "grads": 0.0, "optimizer": 0.0}, "zero-paper"
    total = sum(parts.values())
    if total and abs(total - paper) > 1e-6 * paper:  # a shard group smaller than the world (HSDP)
        parts = {k: v * paper / total for k, v in parts.items()}
    return parts, "zero-paper"


def _cpu_state(theory: dict, strategy: str, params: int, world_size: int) -> float:
    """Bytes of optimizer state on the host: the theory's figure, else the ZeRO-Offload layout
    (fp32 master, gradients and two moments: 16 bytes per parameter, sharded over the ranks)."""
    if facts(strategy).offload != "cpu":
        return 0.0
    return _sum_bytes(theory.get("cpu_state_bytes")) or 16.0 * params / world_size


def _degrees(strategy: str, world_size: int, options: dict, n_layers: int) -> dict:
    tp = int(options.get("tp") or 1)
    pp = int(options.get("pp") or 1)
    f = facts(strategy)
    if f.family != "model_parallel":
        tp = pp = 1
    m = options.get("microbatches")
    m = int(m) if m else 2 * pp
    interleaved = f.pipeline_schedule == "interleaved"
    split = options.get("stage_layers")
    if f.pipeline_schedule == "gpipe":
        schedule = "gpipe"
    elif f.pipeline_schedule == "zb_h1" and pp > 1:
        schedule = "zb_h1"
    elif pp > 1:
        schedule = options.get("schedule") or "1f1b"
    else:
        schedule = None
    return {
        "tp": tp,
        "pp": pp,
        "dp": max(1, world_size // (tp * pp)),
        "microbatches": m if pp > 1 else 1,
        "virtual_stages": int(options.get("virtual_stages") or 2) if interleaved else 1,
        "schedule": schedule,
        "sp": bool(options.get("sp")) or f.sequence_parallel,
        # blocks per stage: one stage per rank only (validation refuses it interleaved)
        "stage_layers": tuple(split) if split and pp > 1 and not interleaved else None,
    }


def build(
    *,
    model: str,
    shape: dict,
    params: int,
    flops_per_token: float,
    hw_flops_per_token: float,
    strategy: str,
    world_size: int,
    precision: str,
    recipe: str | None,
    micro_batch: int,
    grad_accum: int,
    options: dict,
    theory: dict | None,
    layout: str = "separate",
    zb_times: tuple | None = None,
    zb_keeps_done_graphs: bool = False,
    strategy_version: str | None = None,
) -> Workload | None:
    """A workload from plain values; None for a strategy family the planner does not model."""
    family = facts(strategy).family
    if family is None or shape.get("n_experts"):
        return None
    theory = theory or {}
    parts, source = _state_parts(theory, strategy, params, world_size)
    comm = {k: float(byte_high(v) or 0) for k, v in (theory.get("comm_payload_bytes") or {}).items()}
    return Workload(
        model=model,
        n_layers=shape["n_layers"],
        d_model=shape["d_model"],
        n_heads=shape["n_heads"],
        vocab_size=shape["vocab_size"],
        seq_len=shape["seq_len"],
        params=int(params),
        flops_per_token=float(flops_per_token),
        hw_flops_per_token=float(hw_flops_per_token),
        strategy=strategy,
        family=family,
        world_size=world_size,
        precision=precision,
        recipe=recipe,
        micro_batch=micro_batch,
        grad_accum=grad_accum or 1,
        checkpointing=bool(options.get("activation_checkpointing")),
        offload=facts(strategy).offload == "cpu",
        profile=options.get("profile"),
        compiled=bool(options.get("compile")),
        state_bytes=sum(parts.values()) if parts else None,
        state_parts=parts,
        state_source=source,
        working_set_bytes=_sum_bytes(theory.get("working_set_bytes")) or 0.0,
        working_set_grad_bytes=_grad_buffer_bytes(theory.get("working_set_bytes")),
        cpu_state_bytes=_cpu_state(theory, strategy, params, world_size),
        comm_bytes={k: v for k, v in comm.items() if v > 0},
        layout=layout or "separate",
        zb_times=zb_times,
        zb_keeps_done_graphs=zb_keeps_done_graphs,
        strategy_version=strategy_version,
        unmodelled=unmodelled_reason(recipe, options),
        split_bucket_bytes=_split_bucket_bytes(strategy, options),
        **_degrees(strategy, world_size, options, shape["n_layers"]),
    )


def _split_bucket_bytes(strategy: str, options: dict) -> float | None:
    """The bucket size at which Dynamo's DDPOptimizer (torch.ddp) or its copy in the reference
    (ref.ddp, ``peers.common.bucket_split_backend``) cuts each compiled block; None where the blocks
    are not compiled, or compiled whole (option ``ddp_optimizer``, whose default is the strategy's)."""
    from parabench.registry import STRATEGIES

    if not (facts(strategy).compiled_bucket_split and options.get("compile")):
        return None
    if not options.get("ddp_optimizer", getattr(STRATEGIES[strategy].options, "ddp_optimizer", False)):
        return None
    return float(options["bucket_mb"]) * 2**20 if "bucket_mb" in options else BUCKET_BYTES


def measured_zb_times(record: dict) -> tuple | None:
    """ZB-H1's (T_F, T_B, T_W) from the record's pipeline stages: each kind's compute summed over
    the stages (only the ratio enters the bubble), or None where no stage timed them."""
    sums = {"F": 0.0, "B": 0.0, "W": 0.0}
    for pr in record.get("per_rank") or []:
        by_kind = (pr.get("pipeline") or {}).get("compute_s_by_kind") or {}
        for k in sums:
            sums[k] += float(by_kind.get(k) or 0.0)
    return (sums["F"], sums["B"], sums["W"]) if all(v > 0 for v in sums.values()) else None


def from_record(record: dict) -> Workload | None:
    """The workload a stored record ran, with the record's own theory (no torch)."""
    from parabench.registry import recipe_of

    case = record.get("case") or {}
    model = record.get("model") or {}
    metrics = record.get("metrics") or {}
    shape = dict(model.get("config") or {})
    if not shape or case.get("precision") == "fp32":
        return None
    if case.get("seq_len"):
        shape["seq_len"] = case["seq_len"]
    fpt = model.get("flops_per_token")
    if not fpt or not (model.get("params") or {}).get("total"):
        return None
    return build(
        model=case.get("model"),
        shape=shape,
        params=model["params"]["total"],
        flops_per_token=fpt,
        hw_flops_per_token=metrics.get("hardware_flops_per_token") or fpt,
        strategy=case.get("strategy"),
        world_size=case.get("world_size"),
        precision=case.get("precision"),
        recipe=recipe_of(case),
        micro_batch=case.get("micro_batch"),
        grad_accum=case.get("grad_accum") or 1,
        options=config_options(case.get("options")),
        theory=record.get("theory"),
        layout=case.get("layout") or shape.get("layout") or "separate",
        zb_times=measured_zb_times(record),
        # ref.pp_zb version 1 kept every finished micro-batch's graph to the step's end
        zb_keeps_done_graphs=(record.get("strategy_version") or "1")
        in facts(case.get("strategy") or "").done_graphs_kept_versions,
        strategy_version=record.get("strategy_version"),
    )


def for_config(
    *,
    model: str,
    cfg,
    strategy: str,
    world_size: int,
    precision: str = "bf16",
    recipe: str | None = "master",
    micro_batch: int = 1,
    grad_accum: int = 1,
    options: dict | None = None,
) -> Workload | None:
    """The workload of a configuration nobody ran: the theory's expectation computed now."""
    from parabench.case import Case
    from parabench.registry import STRATEGIES, expected
    from parabench.shapes import hardware_flops_per_token, is_model_name, model_flops_per_token, parameter_count

    options = dict(options or {})
    case = Case(
        model=model if is_model_name(model) else "gpt-125m",
        strategy=strategy,
        world_size=world_size,
        precision=precision,
        recipe=recipe,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        seq_len=cfg.seq_len,
        options=options,
        layout=cfg.layout,
    )
    deg = _degrees(strategy, world_size, case.options, cfg.n_layers)
    exp = expected(case, cfg, deg["dp"])
    return build(
        model=model,
        shape=cfg.to_dict(),
        params=parameter_count(cfg)["total"],
        flops_per_token=model_flops_per_token(cfg),
        hw_flops_per_token=hardware_flops_per_token(cfg, bool(options.get("activation_checkpointing"))),
        strategy=strategy,
        world_size=world_size,
        precision=precision,
        recipe=case.recipe,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        options=config_options(case.options),
        theory=json.loads(json.dumps(exp or {}, default=float)),
        layout=cfg.layout,
        # the version the current code runs
        strategy_version=STRATEGIES[strategy].version if strategy in STRATEGIES else None,
    )
