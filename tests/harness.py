"""The training harness the equivalence tests share: train cases on N gloo ranks in one spawned
process group, train the single-process ground truth in-process, and compare the two.

One spawned group runs every case of a test module at one world size (spawning costs far more
than training the tiny models). On each rank a case runs as the worker runs it: ``make_spec``
(model, topology, optimizer from the case), the strategy's trainer, this rank's slice of each
step's global batch. Tests choose per case which steps the communication meter watches, whether
one more untimed step follows, and what else to record (hooks), through ``plan(name, case)``.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.meters.comm import CommMeter
from parabench.models import global_batch
from parabench.record import build_record
from parabench.registry import get_strategy
from parabench.topology import Topology
from parabench.trainer import OptimConfig, TrainSpec
from parabench.worker import local_batches, make_spec, run_case


def record_on_gloo(case: Case) -> dict:
    """The case's record as the runner builds it, from the worker's ``run_case`` on ``world_size``
    ranks forked off the gloo test server: what a torchrun launch would record, without its ~10 s
    of start-up."""
    raw = run_on_gloo(_run_case, case.world_size, case.to_dict())[0]
    return build_record(case, "ok", raw)


def _run_case(case: dict) -> dict | None:
    return run_case(Case.from_dict(case), torch.device("cpu"))


def train_rank(
    case: Case,
    n_steps: int,
    *,
    meter_steps=(),
    measure_state_from: int | None = None,
    extra_step: bool = False,
    want_params: bool = True,
    params_on_every_rank: bool = False,
    want_state: bool = True,
    on_build: Callable | None = None,
    on_step: Callable | None = None,
    on_end: Callable | None = None,
    patch: Callable | None = None,
) -> tuple[dict, dict | None]:
    """Train ``case`` on this rank for ``n_steps`` recorded steps; return (this rank's record, the
    full parameters after those steps, or None).

    ``meter_steps``: step indices run under the communication meter (``n_steps`` is the extra
    step). ``measure_state_from``: the step from which ``trainer.measure_state`` is on.
    ``extra_step``: one more step after the recorded ones, its loss not kept (the instrumented
    step of the worker). Hooks: ``on_build(trainer, case, spec) -> dict`` whose items join the record
    (lists it returns may be filled by the other hooks); ``on_step(trainer, case, step, record)``
    after each recorded step; ``on_end(trainer, case, record)`` before ``close``. ``patch()``: a
    context manager held around the whole case (a deliberately broken operator).

    The record: ``coords``, ``losses`` (None on ranks that never see the loss), ``comm`` (the last
    metered step's meter summary), ``comm_by_step``, ``state`` (after the last step), ``params``
    (this rank's full parameters with ``params_on_every_rank``, else None), and the hooks' items."""
    with patch() if patch else contextlib.nullcontext():
        spec = make_spec(case, torch.device("cpu"))
        trainer = get_strategy(case.strategy).build(spec)
        record = {"coords": spec.topology.coords, "losses": [], "comm": None, "comm_by_step": {}}
        record.update(on_build(trainer, case, spec) if on_build else {})
        batches = local_batches(case, spec, n_steps + extra_step)
        params = None
        for step, (x, y) in enumerate(batches):
            if step == n_steps:
                params = trainer.full_parameters() if want_params else None
            if measure_state_from is not None and step == measure_state_from:
                trainer.measure_state = True
            if step in meter_steps:
                with CommMeter() as meter:
                    loss = trainer.train_step(x, y)
                record["comm"] = record["comm_by_step"][step] = meter.summary()
            else:
                loss = trainer.train_step(x, y)
            if step < n_steps:
                record["losses"].append(None if loss is None else float(loss))
                if on_step:
                    on_step(trainer, case, step, record)
        if not extra_step:
            params = trainer.full_parameters() if want_params else None
        record["state"] = trainer.state_bytes() if want_state else None
        if on_end:
            on_end(trainer, case, record)
        trainer.close()
    record["params"] = params if params_on_every_rank else None
    return record, params


def _cases_on_rank(cases: dict, n_steps: int, plan: Callable | None, with_truth: bool, defaults: dict) -> dict:
    out = {}
    for name, case_dict in cases.items():
        case = Case.from_dict(case_dict)
        record, params = train_rank(case, n_steps, **{**defaults, **(plan(name, case) if plan else {})})
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, record)
        out[name] = {"per_rank": everyone, "params": params if dist.get_rank() == 0 else None}
    if with_truth and dist.get_rank() == 0:
        for name, case_dict in cases.items():
            out[name]["single"] = single_truth(Case.from_dict(case_dict), n_steps)
    return out


def run_cases(
    world_size: int,
    cases: dict[str, Case],
    n_steps: int,
    *,
    plan: Callable | None = None,
    with_truth: bool = False,
    **defaults,
) -> dict[str, dict]:
    """Every case of ``cases`` trained on ``world_size`` spawned gloo ranks, one after another in
    one process group. Per case: ``per_rank`` (every rank's record, see :func:`train_rank`),
    ``params`` (rank 0's full parameters) and, ``with_truth``, ``single`` (:func:`single_truth`,
    computed on rank 0). ``defaults`` are :func:`train_rank` keywords for every case;
    ``plan(name, case) -> dict`` (module level, it is pickled) adds or overrides them per case."""
    payload = {name: case.to_dict() for name, case in cases.items()}
    return run_on_gloo(_cases_on_rank, world_size, payload, n_steps, plan, with_truth, defaults)[0]


_TRUTHS: dict = {}


def single_truth(case: Case, n_steps: int, options: dict | None = None) -> dict:
    """The ground truth: the same model, seed, data, optimizer, precision and recipe, on one process, on
    the whole global batch of ``case`` (in micro-batches of ``global_batch / grad_accum``). Runs in
    the calling process (inside a rank or the test process). ``options``: strategy options of the
    single run (an injected inf). Losses, loss scales and full parameters; cached, since many
    cases share one truth."""
    optim = case.options.get("optim", {})
    # The same precision recipe where the single-process trainer has it (not fp16 "master").
    recipe = case.recipe if case.recipe in get_strategy("single").recipes_for(case.precision) else None
    key = (
        case.model,
        case.layout,
        case.seq_len,
        case.seed,
        case.lr,
        tuple(sorted(optim.items())),
        case.global_batch,
        case.grad_accum,
        case.precision,
        recipe,
        repr(options),
        n_steps,
    )
    if key not in _TRUTHS:
        cfg = case.model_config()
        spec = TrainSpec(
            model=cfg,
            seed=case.seed,
            device=torch.device("cpu"),
            precision=case.precision,
            recipe=recipe,
            topology=Topology(world_size=1, rank=0),
            micro_batch=case.global_batch // case.grad_accum,
            grad_accum=case.grad_accum,
            optim=OptimConfig(lr=case.lr, **optim),
            options=options or {},
        )
        trainer = get_strategy("single").build(spec)
        losses, scales = [], []
        for step in range(n_steps):
            losses.append(float(trainer.train_step(*global_batch(step, case.global_batch, cfg, case.seed))))
            scales.append(trainer.loss_scale())
        _TRUTHS[key] = {"losses": losses, "scales": scales, "params": trainer.full_parameters()}
    return _TRUTHS[key]


def replica_mean_losses(res: dict) -> list[float]:
    """Per step, the mean over data-parallel replicas of the loss the replica's ranks report
    (ranks without the loss, pipeline stages before the last, report None; the tensor-parallel
    ranks of one replica must report the same loss)."""
    steps = []
    for i in range(len(res["per_rank"][0]["losses"])):
        by_dp: dict[int, list[float]] = {}
        for r in res["per_rank"]:
            if r["losses"][i] is not None:
                by_dp.setdefault(r["coords"][0], []).append(r["losses"][i])
        assert by_dp
        for vals in by_dp.values():
            assert max(vals) - min(vals) <= 1e-6 * abs(vals[0]), vals
        steps.append(sum(v[0] for v in by_dp.values()) / len(by_dp))
    return steps


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def params_close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """Names of parameters that differ (empty when all match)."""
    assert a.keys() == b.keys(), (sorted(a)[:5], sorted(b)[:5])
    return [n for n in a if not torch.allclose(a[n], b[n], rtol=rtol, atol=atol)]


def mismatch(losses: list[float], params: dict, truth: dict, *, rtol: float, atol: float) -> tuple[float, list[str]]:
    """(largest relative loss difference over the steps, names of parameters not close)."""
    return max_rel_diff(losses, truth["losses"]), params_close(params, truth["params"], rtol=rtol, atol=atol)


def assert_matches_single(
    res: dict, truth: dict, *, loss_rtol: float, rtol: float, atol: float, losses: list[float] | None = None
) -> None:
    """The truth learns (its loss falls), every step's loss is within ``loss_rtol`` relative of
    it, and every parameter is allclose(rtol, atol). ``losses`` default to
    :func:`replica_mean_losses`."""
    assert truth["losses"][-1] < truth["losses"][0]  # the data is learnable
    loss_diff, bad = mismatch(
        replica_mean_losses(res) if losses is None else losses, res["params"], truth, rtol=rtol, atol=atol
    )
    assert loss_diff < loss_rtol and bad == [], (loss_diff, bad)


def payload_by_kind(summary: dict) -> dict[str, int]:
    """A comm meter summary's payload bytes per collective kind."""
    return {kind: v["payload_bytes"] for kind, v in summary["by_kind"].items()}
