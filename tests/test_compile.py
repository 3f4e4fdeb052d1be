"""Option ``compile``: torch.compile per transformer block (``peers.common.compile_blocks``).

A compiled case trains the tiny model to the losses of the eager one, its record carries the
first warm-up step apart (``first_step_s`` per rank, metrics ``first_step_s_max`` and
``compile_s``), the option is in the case's hash and label, a strategy without the hook refuses it
at validation with its reason, and a compiler that fails is named as the case's cause.

CPU, gloo, the tiny model. Inductor compiles a block in 20-40 s on a cold cache (two graphs here:
the plain block, and the same block inside DDP's hooks); its FX graph cache
(``/tmp/torchinductor_<user>``) brings a rerun down to a few seconds.
"""

from __future__ import annotations

import pytest
import torch

from parabench.case import Case
from parabench.distributed import run_on_gloo
from parabench.models import compiled_loss, global_batch, lm_loss, model_config, token_cross_entropy
from parabench.record import build_record
from parabench.registry import get_strategy
from parabench.suite import SuiteError, validate_case
from parabench.topology import Topology
from parabench.trainer import OptimConfig, TrainSpec
from parabench.worker import compile_failure, run_case

# No matmul roofline and no telemetry: both would only add seconds to a CPU test.
QUIET = {"roofline": False, "telemetry": False}


def mk(strategy: str, compile: bool, world_size: int = 2, **options) -> Case:
    return Case(
        model="tiny",
        strategy=strategy,
        world_size=world_size,
        micro_batch=2,
        steps=3,
        warmup=1,
        lr=1e-3,
        device="cpu",
        options={**QUIET, **options, "compile": compile},
    )


def test_compile_is_validated_hashed_and_labelled():
    for strategy in ("single", "torch.ddp", "ref.ddp", "torch.fsdp2", "torch.tp"):
        options = {"tp": 2} if strategy == "torch.tp" else {}
        validate_case(mk(strategy, True, 1 if strategy == "single" else 2, **options))
    eager, compiled = mk("torch.ddp", False), mk("torch.ddp", True)
    assert eager.case_hash != compiled.case_hash
    assert "compile=True" in compiled.label and "compile=False" in eager.label
    # A strategy whose builder has no hook refuses the option, naming the strategy and the reason.
    with pytest.raises(SuiteError, match=r"deepspeed\.zero2 does not support compile = true: .*DeepSpeed"):
        validate_case(mk("deepspeed.zero2", True))
    validate_case(mk("deepspeed.zero2", False))


def _run_cases(cases: list[dict]) -> list[dict | None]:
    """Each case through the worker's own ``run_case`` on this rank (rank 0 keeps the results)."""
    return [run_case(Case.from_dict(d), torch.device("cpu")) for d in cases]


def test_compiled_ddp_and_reference_match_eager_and_record_compile_time():
    # The reference's compiled case compiles its loss too (option compile_loss): the same losses again.
    cases = [
        mk("torch.ddp", False),
        mk("torch.ddp", True),
        mk("ref.ddp", False),
        mk("ref.ddp", True, compile_loss=True),
    ]
    raws = run_on_gloo(_run_cases, 2, [c.to_dict() for c in cases])[0]
    records = [build_record(c, "ok", raw) for c, raw in zip(cases, raws)]
    assert "compile_loss=True" in records[3]["label"]
    for eager, compiled in (records[:2], records[2:]):
        e, c = eager["metrics"], compiled["metrics"]
        # Inductor reorders reductions: equal to float rounding, not bit for bit.
        assert c["losses"] == pytest.approx(e["losses"], rel=1e-5), (compiled["label"], c["losses"], e["losses"])
        assert all(r["first_step_s"] > 0 for r in compiled["per_rank"])
        assert c["first_step_s_max"] == max(r["first_step_s"] for r in compiled["per_rank"])
        assert c["compile_s"] == pytest.approx(c["first_step_s_max"] - c["step_time_s_median"])
        assert e["compile_s"] is None and e["first_step_s_max"] > 0
    # The compiler's work is the first step's: far more than a timed step of the tiny model.
    assert records[1]["metrics"]["compile_s"] > 5 * records[1]["metrics"]["step_time_s_median"]


def test_compiled_compression_offload_and_hook_peers_match_eager():
    """References and peers whose builders call the hook beyond plain data parallelism: gradient
    compression (its compressor runs on the gradients, outside the compiled blocks), torch's DDP
    communication hooks, and ZeRO-Offload (its AdamW on the CPU)."""
    strategies = ("ref.ddp_powersgd", "torch.ddp_fp16_hook", "ref.zero2_offload")
    cases = [mk(s, compiled) for s in strategies for compiled in (False, True)]
    for c in cases:
        validate_case(c)
    raws = run_on_gloo(_run_cases, 2, [c.to_dict() for c in cases])[0]
    records = [build_record(c, "ok", raw) for c, raw in zip(cases, raws)]
    for eager, compiled in zip(records[::2], records[1::2]):
        e, c = eager["metrics"], compiled["metrics"]
        # the hook ran: the first step carries the compiler's work, far more than a step of the tiny model
        assert c["compile_s"] > 5 * c["step_time_s_median"] and e["compile_s"] is None, compiled["label"]
        assert c["losses"] == pytest.approx(e["losses"], rel=1e-5), (compiled["label"], c["losses"], e["losses"])
    with pytest.raises(SuiteError, match=r"torch\.local_sgd does not support compile = true"):
        validate_case(mk("torch.local_sgd", True))


def _run_cases_counting_graphs(cases: list[dict]) -> list[tuple[dict | None, int]]:
    """``_run_cases``, with the number of graphs AOTAutograd compiled for each case."""
    from torch._dynamo.utils import counters

    out = []
    for d in cases:
        counters.clear()
        raw = run_case(Case.from_dict(d), torch.device("cpu"))
        out.append((raw, counters["aot_autograd"]["total"]))
    return out


def test_reference_ddp_option_ddp_optimizer_splits_its_blocks_at_its_buckets_and_trains_the_same():
    """ref.ddp with ddp_optimizer cuts each compiled block where its buckets end (Dynamo's DDPOptimizer,
    ``peers.common.bucket_split_backend``): more graphs than the whole block's one, the same losses.
    Buckets of 10 KB cut the tiny model's blocks (a whole block's parameters take 200 KB)."""
    cases = [mk("ref.ddp", True), mk("ref.ddp", True, ddp_optimizer=True, bucket_mb=0.01)]
    (whole, whole_graphs), (split, split_graphs) = run_on_gloo(
        _run_cases_counting_graphs, 2, [c.to_dict() for c in cases]
    )[0]
    assert whole_graphs >= 1 and split_graphs > whole_graphs + 2, (whole_graphs, split_graphs)
    w, c = (build_record(case, "ok", raw)["metrics"]["losses"] for case, raw in zip(cases, (whole, split)))
    assert c == pytest.approx(w, rel=1e-5)


def test_compile_loss_runs_the_compiled_cross_entropy_only_inside_its_context():
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    eager = token_cross_entropy(logits, targets)
    (eager_grad,) = torch.autograd.grad(eager, logits)
    with compiled_loss(True) as compiled_calls:
        loss = lm_loss(logits, targets)
        (grad,) = torch.autograd.grad(loss, logits)
        assert compiled_calls() == 1
    assert loss.item() == pytest.approx(eager.item(), rel=1e-6)
    assert torch.allclose(grad.float(), eager_grad.float(), rtol=1e-2, atol=1e-4)  # bf16 gradients
    lm_loss(logits, targets)
    assert compiled_calls() == 1  # outside the context, the eager function again
    with compiled_loss(False) as compiled_calls:
        lm_loss(logits, targets)
        assert compiled_calls() == 0


def test_compile_loss_is_refused_where_the_loss_is_not_lm_loss():
    with pytest.raises(SuiteError, match=r"ref\.tp does not support compile_loss = true: .*vocabulary-parallel"):
        validate_case(mk("ref.tp", False, tp=2, compile_loss=True))
    with pytest.raises(SuiteError, match=r"ref\.pp_1f1b does not support compile_loss = true: .*per stage"):
        validate_case(mk("ref.pp_1f1b", False, pp=2, compile_loss=True))
    validate_case(mk("deepspeed.zero2", False, compile_loss=True))  # eager blocks, compiled loss


def _one_rank_spec(micro_batch: int, options: dict) -> TrainSpec:
    return TrainSpec(
        model=model_config("tiny"),
        seed=1234,
        device=torch.device("cpu"),
        precision="fp32",
        topology=Topology(world_size=1, rank=0),
        micro_batch=micro_batch,
        optim=OptimConfig(lr=1e-3),
        options=options,
    )


def _single_losses(compile: bool, n_steps: int = 3) -> list[float]:
    cfg = model_config("tiny")
    trainer = get_strategy("single").build(_one_rank_spec(4, {"compile": compile}))
    assert ("forward" in vars(trainer.module.blocks[0])) == compile  # the hook ran, or did not
    return [float(trainer.train_step(*global_batch(step, 4, cfg, 1234))) for step in range(n_steps)]


def test_compiled_single_matches_eager():
    assert _single_losses(True) == pytest.approx(_single_losses(False), rel=1e-5)


def _compile_with_broken_compiler(case_dict: dict) -> str | None:
    import os

    import torch._inductor.config as inductor_config

    # Inductor reads CXX once, at import, and the gloo fork server imported it before this test set
    # the variable (parabench.distributed._gloo_context): hand the broken compiler over explicitly.
    inductor_config.cpp.cxx = (None, os.environ["CXX"])
    case = Case.from_dict(case_dict)
    try:
        run_case(case, torch.device("cpu"))
    except Exception as exc:
        return compile_failure(case, exc)
    return "no error"


def test_compiler_failure_is_the_recorded_cause(tmp_path, monkeypatch):
    # A real failure: inductor's C++ compiler does not exist, and a cache of its own keeps an
    # earlier compilation of the same graph from hiding that.
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    case = mk("single", True, world_size=1)
    cause = run_on_gloo(_compile_with_broken_compiler, 1, case.to_dict())[0]
    assert cause is not None and cause.startswith("compilation failed (option compile = true"), cause
    assert "no-such-c++" in cause or "compiler" in cause.lower(), cause
    assert compile_failure(mk("single", False, world_size=1), RuntimeError("x")) is None


def _optimize_ddp_after_build(options: dict) -> object:
    get_strategy("torch.ddp").build(_one_rank_spec(2, {"compile": True, **options}))
    return torch._dynamo.config.optimize_ddp


def test_torch_ddp_option_ddp_optimizer_sets_dynamos_ddp_optimizer_per_case():
    validate_case(mk("torch.ddp", True, ddp_optimizer=False))
    assert run_on_gloo(_optimize_ddp_after_build, 1, {"ddp_optimizer": False})[0] is False
    assert run_on_gloo(_optimize_ddp_after_build, 1, {})[0] is True  # torch's default, torchtitan's choice


def test_torch_ddp_refuses_buckets_the_ddp_optimizer_cannot_cut():
    """Dynamo's DDPOptimizer asserts at the first compiled step when DDP's buckets are under its 1 MiB first
    bucket: the suite refuses the case up front, naming both ways out."""
    with pytest.raises(SuiteError, match=r"bucket_mb >= 1 .* not 0\.5: raise bucket_mb or set ddp_optimizer = false"):
        validate_case(mk("torch.ddp", True, bucket_mb=0.5))
    validate_case(mk("torch.ddp", True, bucket_mb=0.5, ddp_optimizer=False))
    validate_case(mk("torch.ddp", False, bucket_mb=0.5))
    validate_case(mk("torch.ddp", True, bucket_mb=1))
