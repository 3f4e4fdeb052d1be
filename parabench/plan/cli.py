"""``parabench plan``: arguments and output (cli.py keeps a two-line hook)."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import fields
from pathlib import Path

import tomllib

SHAPE_FLAGS = ("layers", "hidden", "heads", "vocab", "seq")


def add_arguments(p) -> None:
    p.add_argument(
        "--model",
        help="a model of the ladder (parabench list), a shape name custom-L<layers>-d<width>-h<heads>[-v<vocab>], "
        "or 'custom' with the shape flags or --shape",
    )
    p.add_argument(
        "--shape",
        metavar="TOML",
        help="custom shape: a TOML file with n_layers, d_model, n_heads[, vocab_size, seq_len]",
    )
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int, help="sequence length (also overrides a ladder model's)")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu", default="h100-80g", help="GPU kind (h100-80g, ...)")
    p.add_argument(
        "--recipe",
        default="master",
        help="master (bf16 params, fp32 masters), amp (fp32 params, autocast) or fp8 (amp with float8 block linears, compiled)",
    )
    p.add_argument(
        "--global-batch", type=int, help="sequences per optimizer step (fixes micro-batch x accumulation x dp)"
    )
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--dropped", type=int, default=8, help="list this many dropped configurations with their reason")
    p.add_argument("--write-suite", metavar="FILE", help="write a suite TOML of the top configurations")
    p.add_argument(
        "--calibration", metavar="DIR", help="folder of <kind>.json calibrations (default results/calibration)"
    )


class PlanError(ValueError):
    pass


def resolve_model(args):
    from parabench.models import (
        CUSTOM_MODEL,
        CUSTOM_MODEL_FORM,
        MODEL_LADDER,
        GPTConfig,
        custom_model_name,
        model_config,
    )

    custom = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    if args.shape:
        data = tomllib.loads(Path(args.shape).read_text())
        data = data.get("model", data)
        known = {f.name for f in fields(GPTConfig)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"{args.shape}: unknown shape keys {unknown}; valid: {', '.join(sorted(known))}")
        cfg = GPTConfig(**data)
        return custom_model_name(cfg) or "custom", cfg
    if args.model in (None, "custom"):
        need = ("layers", "hidden", "heads")
        if not all(k in custom for k in need):
            raise PlanError(
                "give --model NAME, or a custom shape with --layers --hidden --heads [--vocab --seq] or --shape FILE"
            )
        if custom["hidden"] % custom["heads"]:
            raise PlanError(f"--heads {custom['heads']} does not divide --hidden {custom['hidden']}")
        cfg = GPTConfig(
            n_layers=custom["layers"],
            d_model=custom["hidden"],
            n_heads=custom["heads"],
            vocab_size=custom.get("vocab", 50304),
            seq_len=custom.get("seq", 2048),
        )
        return custom_model_name(cfg), cfg
    dense = [n for n, c in MODEL_LADDER.items() if not c.is_moe]
    if args.model not in dense and not CUSTOM_MODEL.fullmatch(args.model):
        raise PlanError(f"unknown model {args.model!r}; valid models: {', '.join(dense)}, or {CUSTOM_MODEL_FORM}")
    return args.model, model_config(args.model, seq_len=custom.get("seq"), vocab_size=custom.get("vocab"))


def tie_note(validation_path: Path) -> str | None:
    """How far apart two predicted rows must be before the order means something, from the
    calibration's own leave-one-out validation (``parabench.plan.validate``), or None without one."""
    try:
        loo = json.loads(validation_path.read_text())["leave_one_out"]
        band, strict = loo["fastest_share"], loo["fastest_strict_share"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (
        f"Rows within 3 % of #1 are ties at the model's accuracy: leaving each measured configuration out, "
        f"it named the fastest within 3 % in {band:.0%} of groups and exactly in {strict:.0%} "
        f"({validation_path.name}); measure the tied ones (--write-suite)."
    )


# The one measured remedy for a trainer's launch spread (docs/results.md, "2026-11-28 morning"):
# compiled torch.fsdp2's ranks each pause for a full garbage collection at a different step.
FSDP2_GC_REMEDY = (
    "Where compiled torch.fsdp2 was measured both ways (gpt-1.3b, 4 GPUs), its spread was Python's garbage "
    'collector: with option python_gc = "scheduled" three launches lay 0.7 % apart, against 9.3 % without '
    "(docs/results.md)."
)


def erratic_note(shown: list, spread: dict) -> str | None:
    """The shown rows' implementations whose measured launches of one configuration lay more than
    ERRATIC_LAUNCH_SPREAD apart (the calibration's ``launch_spread``), or None; with the remedy
    where one was measured."""
    from parabench.plan.calibrate import ERRATIC_LAUNCH_SPREAD

    impls = sorted({c.workload.impl for c in shown if c.workload is not None})
    erratic = [(i, spread[i]) for i in impls if spread.get(i, {}).get("median", 0.0) > ERRATIC_LAUNCH_SPREAD]
    if not erratic:
        return None
    parts = [
        f"{impl} {s['median']:.0%} (up to {s['max']:.0%}, {s['configurations']} configurations)" for impl, s in erratic
    ]
    note = (
        "Measured launches of one configuration lay apart, slowest to fastest, by a median of: "
        + "; ".join(parts)
        + ". The prediction is one step time; a launch of these may land that far from it (docs/results.md)."
    )
    erratic_impls = {impl for impl, _ in erratic}
    compiled_fsdp2 = any(
        c.workload is not None
        and c.workload.strategy == "torch.fsdp2"
        and c.workload.compiled
        and c.workload.impl in erratic_impls
        for c in shown
    )
    return note + (" " + FSDP2_GC_REMEDY if compiled_fsdp2 else "")


def plan_main(args) -> int:
    from parabench.plan import calibrate as C
    from parabench.plan import search as S
    from parabench.recipes import RECIPES

    try:
        if args.gpu not in S.GPUS:
            raise PlanError(f"unknown GPU {args.gpu!r}; valid GPUs: {', '.join(S.GPUS)}")
        if args.recipe not in RECIPES:
            raise PlanError(f"unknown recipe {args.recipe!r}; valid recipes: {', '.join(RECIPES)}")
        if args.gpus < 1:
            raise PlanError("--gpus must be at least 1")
        model, cfg = resolve_model(args)
        kind = S.GPUS[args.gpu][0]
        cal = C.load_kind(kind, args.calibration)
        if cal is None:
            have = sorted(
                p.stem
                for p in Path(args.calibration or C.CALIBRATION_DIR).glob("*.json")
                if not p.stem.startswith("validation")
            )
            raise PlanError(
                f"no calibration for {args.gpu} ({kind}); calibrated kinds: {', '.join(have) or 'none'} "
                f"(python -m parabench.plan.calibrate --kind {kind})"
            )
        if args.recipe == "fp8" and "inv_rate_fp8" not in cal.get("time_fitted", ()):
            raise PlanError(
                f"recipe fp8: the {kind} calibration holds no fp8 record to fit float8's matmul rate and casts "
                "(run suites/plan-data-h100x1.toml on this GPU kind, then python -m parabench.plan.calibrate)"
            )
    except (PlanError, C.CalibrationError, OSError, tomllib.TOMLDecodeError, TypeError, KeyError) as exc:
        print(f"parabench plan: {exc}", file=sys.stderr)
        return 2
    ok, dropped = S.plan(model, cfg, args.gpus, args.gpu, cal, args.recipe, args.global_batch)
    print(
        f"{model}: {cfg.n_layers} layers, d {cfg.d_model}, {cfg.n_heads} heads, vocab {cfg.vocab_size}, seq "
        f"{cfg.seq_len}; {args.gpus}x {args.gpu}, bf16-{args.recipe}"
        + (f", global batch {args.global_batch}" if args.global_batch else "")
        + f"; calibration {kind}"
        + (f" derived from {cal['derived_from']['kind']}" if "derived_from" in cal else "")
        + f" ({cal['configurations']} configurations)"
        + (f"\n{cal['derived_from']['doc']}" if "derived_from" in cal else "")
    )
    print(f"{len(ok)} of {len(ok) + len(dropped)} configurations fit; predicted, ranked by tokens/s per GPU:\n")
    print(S.table(ok, args.top) if ok else "(none fits)")
    tie = tie_note(Path(args.calibration or C.CALIBRATION_DIR) / f"validation-{kind}.json")
    if ok and tie:
        print(f"\n{tie}")
    erratic = erratic_note(ok[: args.top], cal.get("launch_spread") or {})
    if erratic:
        print(f"\n{erratic}")
    shown = [c for c in dropped if not c.dropped.startswith("invalid")][: args.dropped]
    if shown:
        print("\ndropped (first of each kind):")
        for c in shown:
            print(f"  {S.describe(c):42s} mb {c.micro_batch:<3} {c.dropped}")
    if args.write_suite:
        if model == "custom":
            from parabench.models import CUSTOM_MODEL_FORM

            print(
                f"parabench plan: --write-suite: suites name a custom model by its shape ({CUSTOM_MODEL_FORM}), "
                "which cannot carry this one's other fields (MLP ratio, experts, layout)",
                file=sys.stderr,
            )
            return 2
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", Path(args.write_suite).stem)
        text = S.suite_toml(name, model, cfg, ok[: args.top], args.gpu)
        Path(args.write_suite).write_text(text)
        from parabench.suite import load_suite

        suite = load_suite(str(args.write_suite))
        print(f"\nwrote {args.write_suite}: {len(suite.cases)} cases (parabench run suite {args.write_suite})")
    return 0
