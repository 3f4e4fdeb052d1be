"""Host terms: libraries whose Python runs per parameter tensor on the critical path (step =
max(device, host)), their calibrated per-tensor costs, and the per-implementation time factors."""

from __future__ import annotations

from parabench.plan.terms.common import Workload, facts, parameter_tensors, uses_fp16_optimizer


def time_factor_cause(impl: str) -> str | None:
    return facts(impl.split(":", 1)[0]).time_factor_cause


HOST_FLOOR_NOTE = (
    "pipeline actions at the host floor (the host time per block outlasts their device work): they follow "
    "the host's speed, which changed between launches on the GPU hosts measured (0.3-0.9 ms to issue a "
    "one-row block forward); one- and two-row micro-batches moved up to 29 % (docs/planner.md)"
)


def is_host_bound(w: "Workload") -> bool:
    f = w.facts
    if not f.host_bound or w.offload:
        return False
    if w.compiled and f.host_bound_eager_only:
        return False
    return f.host_bound_versions is None or (w.strategy_version or "1") in f.host_bound_versions


def has_host_floor(w: "Workload") -> bool:
    return w.profile is not None and w.profile in w.facts.host_floor_profiles


def waits_on_host(w: "Workload") -> bool:
    """Whether ``w``'s step is max(device time, host time): host-bound, or with a host floor."""
    return is_host_bound(w) or has_host_floor(w)


def host_key(w: "Workload") -> str:
    return f"{w.impl}|{w.recipe}"


# Host-bound strategies whose host work is the same mechanism, for one without a calibrated record:
# the zero-bubble engines' W runs one autograd call per parameter-owning module (or parameter group)
# and micro-batch (ref.pp_zb version 1's backward_weight, torch's stage_backward_weight), and
# torch.pp_zb's timelines show its W waiting on the host (results/collectives-h100x4/20261127-212327/NOTES.md).
# (Their rows: ``PlanFacts.host_analogue``.)


def host_cost(w: "Workload", host_cal: dict) -> tuple[float | None, str | None]:
    """(seconds per parameter tensor, the key it was calibrated under): the implementation's own
    (per recipe, then any recipe); else the same library under another profile, whose hooks or
    dispatch run once per parameter tensor all the same (DeepSpeed ZeRO-3's fetch/release hooks,
    FSDP2's pre/post hooks: a profile changes buckets and prefetch, not the per-tensor Python);
    else its row's ``host_analogue``'s."""
    keys = [host_key(w), w.impl, f"{w.strategy}|{w.recipe}", w.strategy]
    keys += sorted(k for k in host_cal if k.startswith(w.strategy + ":") and k.endswith(f"|{w.recipe}"))
    keys += sorted(k for k in host_cal if k.startswith(w.strategy + ":") and "|" not in k)
    analogue = w.facts.host_analogue
    if analogue:
        keys += [f"{analogue}|{w.recipe}", analogue]
    for k in keys:
        if k in host_cal:
            return host_cal[k], k
    return None, None


def impl_factor(w: "Workload", impl_time: dict) -> tuple[float, str | None]:
    """(step-time factor, the implementation it was calibrated on): ``w``'s own; else the same
    library under another profile, whose engine runs the same per-step passes but for the ones a
    profile switches; else 1 (None)."""
    if w.impl in impl_time:
        return impl_time[w.impl], w.impl
    others = sorted(k for k in impl_time if k.split(":", 1)[0] == w.strategy)
    return (impl_time[others[0]], others[0]) if others else (1.0, None)


def host_units(w: "Workload") -> float:
    """Parameter tensors one rank's hooks visit per step: tensors of its stage x passes."""
    return parameter_tensors(w) * w.passes


def ds_stage0_tensors(w: "Workload") -> float:
    """Parameter tensors whose overflow check waits on the host per step (``uses_fp16_optimizer``):
    ``CheckOverflow.has_overflow_serial`` takes each gradient's amax and amin and tests the result's
    truth on the host, a synchronisation per tensor, before anything else of the step is issued."""
    return parameter_tensors(w) if uses_fp16_optimizer(w) else 0.0
