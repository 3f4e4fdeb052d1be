"""``parabench plan``: arguments and output (cli.py keeps a two-line hook)."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import tomllib
from dataclasses import fields
from pathlib import Path

SHAPE_FLAGS = ("layers", "hidden", "heads", "vocab", "seq")
# The ranges every shape number must lie in, flag or --shape field alike: wide enough for any model
# the planner can price (gpt-13b is 40 x 5120 x 40), narrow enough that no value makes it run for
# minutes or take the machine's memory before it answers.
SHAPE_RANGES = {
    "n_layers": ("--layers", 1, 1024),
    "d_model": ("--hidden", 1, 131072),
    "n_heads": ("--heads", 1, 4096),
    "vocab_size": ("--vocab", 1, 4194304),
    "seq_len": ("--seq", 1, 2097152),
    "mlp_ratio": (None, 1, 64),
    "n_experts": (None, 0, 4096),
    "top_k": (None, 1, 64),
    "moe_every": (None, 1, 1024),
}
MAX_GPUS = 4096  # the search over layouts grows with the divisors of --gpus: 1,024 take about 30 s
MAX_GLOBAL_BATCH = 1 << 24
# The planner's search is pure Python: past this it stops with a message instead of running on
DEFAULT_PLAN_SECONDS = 120.0


def int_in(low: int, high: int):
    """argparse type: an int from ``low`` to ``high``, the range named when refused."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {value}")
        return value

    return parse


def seconds_in(low: float, high: float):
    import argparse
    import math

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"must be a number of seconds from {low:g} to {high:g}, got {text!r}")
        return value

    return parse


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
    for key, (flag, low, high) in SHAPE_RANGES.items():
        if flag:
            p.add_argument(
                flag,
                type=int_in(low, high),
                help="sequence length (also overrides a ladder model's)" if key == "seq_len" else None,
            )
    p.add_argument("--gpus", type=int_in(1, MAX_GPUS), required=True)
    p.add_argument(
        "--gpu",
        default="h100-80g",
        help="GPU kind: h100-80g (calibrated) or h200-141g (derived from h100); an error lists the accepted ones",
    )
    p.add_argument(
        "--include-references",
        action="store_true",
        help="rank the from-scratch references beside the production libraries (labelled [reference])",
    )
    p.add_argument(
        "--host-ram-gib",
        type=float,
        help="RAM of one host, GiB, for the CPU-offload configurations (default: this machine's when it holds "
        "GPUs of the kind planned; else 126 GiB per GPU of a host, as on the committed runs' hosts)",
    )
    p.add_argument(
        "--nvme-gib",
        type=float,
        help="NVMe capacity of one host, GiB, for NVMe-offload configurations (refused without it)",
    )
    p.add_argument(
        "--recipe",
        default="master",
        help="master (bf16 params, fp32 masters), amp (fp32 params, autocast) or fp8 (amp with float8 block linears, compiled)",
    )
    p.add_argument(
        "--global-batch",
        type=int_in(1, MAX_GLOBAL_BATCH),
        help="sequences per optimizer step (fixes micro-batch x accumulation x dp)",
    )
    p.add_argument("--top", type=int_in(1, 100000), default=10)
    p.add_argument(
        "--dropped",
        type=int_in(0, 100000),
        default=8,
        help="list this many dropped configurations with their reason",
    )
    p.add_argument(
        "--write-suite",
        metavar="FILE",
        help="write a suite TOML of the top configurations, and their predictions beside it "
        "(FILE's stem + .predictions.json) for `parabench check RUN`",
    )
    p.add_argument("--force", action="store_true", help="let --write-suite replace an existing file")
    p.add_argument(
        "--max-seconds",
        type=seconds_in(1, 86400),
        default=DEFAULT_PLAN_SECONDS,
        help=f"stop the search with a message after this long (default {DEFAULT_PLAN_SECONDS:g} s)",
    )
    p.add_argument(
        "--calibration", metavar="DIR", help="folder of <kind>.json calibrations (default results/calibration)"
    )
    from parabench.plan.cluster import add_arguments as add_cluster_arguments

    add_cluster_arguments(p)


class PlanError(ValueError):
    pass


class PlanTimeout(RuntimeError):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise PlanTimeout in the main thread after ``seconds`` (SIGALRM; no limit elsewhere)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        caller = frame
        while caller is not None:  # never inside an import: a half-imported module stays broken
            if caller.f_code.co_filename.startswith("<frozen importlib"):
                signal.setitimer(signal.ITIMER_REAL, 0.05)
                return
            caller = caller.f_back
        raise PlanTimeout(
            f"the search took longer than {seconds:g} s (--max-seconds) and was stopped; "
            "plan fewer GPUs, fix --global-batch, or allow more time"
        )

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def resolve_model(args):
    from parabench.shapes import (
        CUSTOM_MODEL,
        CUSTOM_MODEL_FORM,
        MODEL_LADDER,
        GPTConfig,
        custom_model_name,
        model_config,
    )

    custom = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    if args.shape:
        data = tomllib.loads(Path(args.shape).read_text(encoding="utf-8"))
        data = data.get("model", data)
        if not isinstance(data, dict):
            raise PlanError(f"{args.shape}: [model] must be a table of shape keys")
        known = {f.name for f in fields(GPTConfig)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"{args.shape}: unknown shape keys {unknown}; valid: {', '.join(sorted(known))}")
        check_shape(data, str(args.shape), GPTConfig)
        cfg = GPTConfig(**data)
        return custom_model_name(cfg) or "custom", cfg
    if args.model in (None, "custom"):
        need = ("layers", "hidden", "heads")
        if not all(k in custom for k in need):
            raise PlanError(
                "give --model NAME, or a custom shape with --layers --hidden --heads [--vocab --seq] or --shape FILE"
            )
        if custom["hidden"] % custom["heads"]:  # ranges: argparse (SHAPE_RANGES)
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


def check_shape(data: dict, where: str, config_class) -> None:
    """PlanError naming the field and its range for a shape value of the wrong type or out of range
    (``config_class``: the GPT config dataclass whose fields ``data`` sets)."""
    for key, (_, low, high) in SHAPE_RANGES.items():
        if key not in data:
            continue
        v = data[key]
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
            raise PlanError(f"{where}: field {key!r} must be a whole number from {low} to {high}, got {v!r}")
    for f in fields(config_class):
        if f.name in data and f.name not in SHAPE_RANGES:
            v = data[f.name]
            if f.name == "layout":
                ok = isinstance(v, str)
            elif f.name == "balanced_routing":
                ok = isinstance(v, bool)
            else:  # capacity_factor, aux_loss_coef: finite, not negative
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e6
            if not ok:
                raise PlanError(f"{where}: field {f.name!r} has a value of the wrong type or range: {v!r}")
    if "d_model" in data and "n_heads" in data and data["d_model"] % data["n_heads"]:
        raise PlanError(f"{where}: n_heads {data['n_heads']} does not divide d_model {data['d_model']}")


def check_suite_target(path: Path, force: bool) -> None:
    """PlanError, before anything is planned, for a --write-suite target that cannot be written."""
    if path.is_dir():
        raise PlanError(f"--write-suite {path}: it is a folder; name a .toml file to write")
    if not path.parent.is_dir():
        raise PlanError(f"--write-suite {path}: the folder {path.parent} does not exist")
    if path.exists() and not force:
        raise PlanError(f"--write-suite {path}: the file exists; give --force to replace it")
    if path.exists() and not path.is_file():
        raise PlanError(f"--write-suite {path}: not a regular file")
    from parabench.plan.check import predictions_path

    if predictions_path(path).exists() and not force:
        raise PlanError(f"--write-suite {path}: {predictions_path(path)} exists; give --force to replace it")
    import os
    import tempfile

    try:  # a probe file: os.access says yes to root in /proc and on a read-only mount
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise PlanError(f"--write-suite {path}: cannot write in {path.parent}: {exc.strerror or exc}") from None


def suite_name_for(path: Path) -> str:
    """A suite name from the file name: one safe folder name (no leading dot, no separators)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", path.stem).lstrip(".-") or "plan"


def write_suite_checked(path: Path, text: str):
    """Write the suite to a temporary file beside ``path``, load it as ``parabench run suite`` would,
    and only then rename it into place: a suite that would not load is never left behind."""
    import os
    import tempfile

    from parabench.results import file_mode
    from parabench.suite import load_suite

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".toml")
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        suite = load_suite(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return suite


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


# The one measured remedy for a trainer's launch spread (results/studies/gc-peers-h100x4/20261128-031009):
# compiled torch.fsdp2's ranks each pause for a full garbage collection at a different step.
FSDP2_GC_REMEDY = (
    "Where compiled torch.fsdp2 was measured both ways (gpt-1.3b, 4 GPUs), its spread was Python's garbage "
    'collector: with option python_gc = "scheduled" three launches lay 0.7 % apart, against 9.3 % without '
    "(docs/results.md)."
)


def first_of_each_kind(dropped: list, most: int) -> list:
    """Up to ``most`` dropped configurations: the first of each reason (the text before its colon),
    then the others in order."""
    seen, first, rest = set(), [], []
    for c in dropped:
        kind = c.dropped.split(":")[0]
        (rest if kind in seen else first).append(c)
        seen.add(kind)
    return (first + rest)[:most]


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
        + ". The prediction is one step time; a launch of these may land that far from it. Where a step waits on"
        " the host, a launch follows the speed of the host core it ran on, which moved 1.6x within an hour on one"
        " H200 machine, for a library's own script as for its adapter (docs/findings.md)."
    )
    erratic_impls = {impl for impl, _ in erratic}
    compiled_fsdp2 = any(
        c.workload is not None
        and c.workload.facts.compiled_gc_remedy
        and c.workload.compiled
        and c.workload.impl in erratic_impls
        for c in shown
    )
    return note + (" " + FSDP2_GC_REMEDY if compiled_fsdp2 else "")


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU, its "information" naming the model


def this_machine(kind: str) -> tuple[int, float] | None:
    """(GPUs, host RAM bytes) of this machine where its GPUs are of ``kind``, else None. Read from the
    NVIDIA driver's files, not torch: importing torch would take seconds before the search starts."""
    import os

    from parabench.plan.calibrate import device_kind

    names = []
    try:
        for gpu in sorted(NVIDIA_GPUS.iterdir()):
            info = (gpu / "information").read_text(errors="replace")
            names += [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Model:")]
        memory = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return None
    if not names or any(device_kind(n) != kind for n in names):
        return None
    return len(names), memory


def host_limits_for(args, kind: str, cluster):
    """``gpus -> HostLimits``: the hosts a plan on that many GPUs runs on. RAM per host: --host-ram-gib;
    else this machine's where its GPUs are of ``kind``; else ``search.DEFAULT_HOST_RAM_PER_GPU`` per
    GPU. GPUs per host: --gpus-per-node; else this machine's; else up to ``DEFAULT_GPUS_PER_HOST``."""
    from parabench.plan import model as M
    from parabench.plan import search as S

    here = this_machine(kind) if args.host_ram_gib is None or cluster is None else None
    nvme = args.nvme_gib * M.GIB if args.nvme_gib is not None else None

    def limits(gpus: int):
        per_host = cluster.gpus_per_node if cluster else (here[0] if here else min(gpus, S.DEFAULT_GPUS_PER_HOST))
        if args.host_ram_gib is not None:
            return S.HostLimits(args.host_ram_gib * M.GIB, per_host, nvme, "--host-ram-gib")
        if here:
            return S.HostLimits(here[1], per_host, nvme, "this machine's")
        ram = S.DEFAULT_HOST_RAM_PER_GPU * per_host
        source = f"assumed {S.DEFAULT_HOST_RAM_PER_GPU / M.GIB:.0f} GiB per GPU; --host-ram-gib to set"
        return S.HostLimits(ram, per_host, nvme, source)

    return limits


def gpu_refusal(name: str, accepted: dict[str, str]) -> str:
    """The one line that refuses a GPU kind, listing the accepted ones with how each is calibrated."""
    listed = ", ".join(f"{n} ({how})" for n, how in accepted.items()) or "none"
    return f"unknown or uncalibrated GPU {name!r}; accepted: {listed}"


def answer(model: str, gpus: int, gpu: str, ok: list, tie_band: float) -> str:
    """The plan's first line: one sentence with the recommended library configuration, its predicted
    tokens/s per GPU and peak memory, and the runner-up it ties with (within ``tie_band``, the
    validation's band for naming the fastest), or how far behind the runner-up is."""
    from parabench.plan import model as M
    from parabench.plan import search as S

    libraries = [c for c in ok if not S.is_reference(c)]
    pool = libraries or ok
    if not pool:
        return ""
    best, rest = pool[0], pool[1:]
    p = best.prediction
    where = f"{best.degrees}, micro-batch {best.micro_batch}" + (f" x {best.grad_accum}" if best.grad_accum > 1 else "")
    head = (
        ("Recommended" if libraries else "No production library fits; the best reference")
        + f" for {model} on {gpus}x {gpu}: {S.describe(best)} ({where}) at {p.tokens_per_s_per_gpu:,.0f} "
        f"tokens/s per GPU, peak {p.peak_bytes / M.GIB:.1f} GiB"
    )
    if not rest:
        return head + "; the only configuration that works."
    second = rest[0]
    share = second.prediction.tokens_per_s_per_gpu / p.tokens_per_s_per_gpu
    if share >= 1 - tie_band:
        return (
            head + f"; it ties with {S.describe(second)} ({second.degrees}, micro-batch {second.micro_batch}, "
            f"{1 - share:.1%} slower: within the {tie_band:.0%} the model cannot order)."
        )
    return head + f"; the runner-up, {S.describe(second)}, is {1 - share:.0%} slower (no tie within {tie_band:.0%})."


def nothing_works(model: str, gpus: int, gpu: str, dropped: list, found) -> str:
    """The first line where no configuration works: the reasons counted, and the smallest GPU count
    of the kind at which one would (``found``: ``search.smallest_working_count``'s answer)."""
    from parabench.plan import search as S

    kinds: dict[str, int] = {}
    for c in dropped:
        if not c.dropped.startswith(("invalid", "needs at least", "trains the")):
            kinds[c.dropped.split(":")[0]] = kinds.get(c.dropped.split(":")[0], 0) + 1
    why = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    head = f"Nothing works for {model} on {gpus}x {gpu}" + (f" ({why})" if why else "")
    if found is None:
        return head + f"; nor on any count up to {S.MIN_GPUS_SEARCH_MAX} GPUs of this kind."
    if found == "stopped":
        return head + "; the search for a count that works reached --max-seconds and was stopped."
    n, best = found
    return (
        head + f"; the smallest count of {gpu} at which a configuration works is {n} "
        f"({S.describe(best)}, {best.prediction.tokens_per_s_per_gpu:,.0f} tokens/s per GPU predicted; "
        f"data-parallel, sharded and offload layouts searched; parabench plan --gpus {n} ranks them all)."
    )


def plan_main(args) -> int:
    from parabench.plan import calibrate as C
    from parabench.plan import search as S
    from parabench.recipes import RECIPES

    try:
        accepted = S.accepted_gpus(args.calibration)
        if args.gpu not in accepted:
            raise PlanError(gpu_refusal(args.gpu, accepted))
        if args.recipe not in RECIPES:
            raise PlanError(f"unknown recipe {args.recipe!r}; valid recipes: {', '.join(RECIPES)}")
        if not 1 <= args.gpus <= MAX_GPUS:
            raise PlanError(f"--gpus must be from 1 to {MAX_GPUS}, got {args.gpus}")
        if args.write_suite:
            check_suite_target(Path(args.write_suite), getattr(args, "force", False))
        model, cfg = resolve_model(args)
        from parabench.plan import cluster as CL

        cluster = CL.from_args(args)  # None on one machine
        kind = S.GPUS[args.gpu][0]
        cal = C.load_kind(kind, args.calibration)
        if cal is None:
            raise PlanError(gpu_refusal(args.gpu, accepted))
        for flag in ("host_ram_gib", "nvme_gib"):
            value = getattr(args, flag, None)
            if value is not None and not 0 < value < 1e9:
                raise PlanError(f"--{flag.replace('_', '-')} must be a positive number of GiB, got {value}")
        if args.recipe == "fp8" and "inv_rate_fp8" not in cal.get("time_fitted", ()):
            raise PlanError(
                f"recipe fp8: the {kind} calibration holds no fp8 record to fit float8's matmul rate and casts "
                "(run suites/plan-data-h100x1.toml on this GPU kind, then parabench calibrate)"
            )
    except (
        PlanError,
        C.CalibrationError,
        OSError,
        UnicodeDecodeError,
        tomllib.TOMLDecodeError,
        TypeError,
        KeyError,
        ValueError,
    ) as exc:
        print(f"parabench plan: {exc}", file=sys.stderr)
        return 2
    from parabench.plan.validate import FASTEST_NOISE

    limits_for = host_limits_for(args, kind, cluster)
    found = None
    try:
        with time_limit(getattr(args, "max_seconds", DEFAULT_PLAN_SECONDS)):
            ok, dropped = S.plan(
                model,
                cfg,
                args.gpus,
                args.gpu,
                cal,
                args.recipe,
                args.global_batch,
                args.include_references,
                limits_for(args.gpus),
            )
            if not ok:
                try:
                    found = S.smallest_working_count(
                        model, cfg, args.gpus, args.gpu, cal, limits_for, args.recipe, args.global_batch
                    )
                except PlanTimeout:  # the answer for --gpus stands; only the larger counts go unsearched
                    found = "stopped"
    except PlanTimeout as exc:
        print(f"parabench plan: {exc}", file=sys.stderr)
        return 2
    print(
        answer(model, args.gpus, args.gpu, ok, FASTEST_NOISE)
        if ok
        else nothing_works(model, args.gpus, args.gpu, dropped, found)
    )
    limits = limits_for(args.gpus)
    print(
        f"{model}: {cfg.n_layers} layers, d {cfg.d_model}, {cfg.n_heads} heads, vocab {cfg.vocab_size}, seq "
        f"{cfg.seq_len}; {args.gpus}x {args.gpu}, bf16-{args.recipe}"
        + (f", global batch {args.global_batch}" if args.global_batch else "")
        + f"; calibration {kind}"
        + (f" derived from {cal['derived_from']['kind']}" if "derived_from" in cal else "")
        + f" ({cal['configurations']} configurations)"
        + (f"\n{cal['derived_from']['doc']}" if "derived_from" in cal else "")
        + f"\nhosts of {limits.gpus_per_host} GPU{'s' if limits.gpus_per_host > 1 else ''} and {limits.ram_bytes / 2**30:.0f} GiB RAM ({limits.source})"
        + (f", {limits.nvme_bytes / 2**30:.0f} GiB NVMe" if limits.nvme_bytes else "")
        + f"; predictions under {S.MFU_FLOOR:.0%} MFU dropped unless the host's launches bound them"
    )
    ranked = "production libraries and references" if args.include_references else "production libraries"
    print(
        f"{len(ok)} of {len(ok) + len(dropped)} configurations work; {ranked}, predicted, ranked by tokens/s per GPU"
        + ("" if args.include_references else " (--include-references adds the from-scratch references)")
        + ":\n"
    )
    print(S.table(ok, args.top) if ok else "(none fits)")
    if cluster and ok:
        print("\n" + CL.table(CL.rank(ok, cluster), args.top, cluster))
    tie = tie_note(Path(args.calibration or C.CALIBRATION_DIR) / f"validation-{kind}.json")
    if ok and tie:
        print(f"\n{tie}")
    erratic = erratic_note(ok[: args.top], cal.get("launch_spread") or {})
    if erratic:
        print(f"\n{erratic}")
    shown = first_of_each_kind([c for c in dropped if not c.dropped.startswith("invalid")], args.dropped)
    if shown:
        print("\ndropped (first of each kind):")
        for c in shown:
            print(f"  {S.describe(c):42s} mb {c.micro_batch:<3} {c.dropped}")
    if not ok:  # the first line said why and where something would work
        if args.write_suite:
            print(f"parabench plan: --write-suite {args.write_suite}: nothing to write", file=sys.stderr)
        return 1
    if args.write_suite:
        if model == "custom":
            from parabench.shapes import CUSTOM_MODEL_FORM

            print(
                f"parabench plan: --write-suite: suites name a custom model by its shape ({CUSTOM_MODEL_FORM}), "
                "which cannot carry this one's other fields (MLP ratio, experts, layout)",
                file=sys.stderr,
            )
            return 2
        from parabench.suite import SuiteError

        target = Path(args.write_suite)
        text = S.suite_toml(suite_name_for(target), model, cfg, ok[: args.top], args.gpu)
        try:
            check_suite_target(target, getattr(args, "force", False))  # again: planning took a while
            suite = write_suite_checked(target, text)
        except OSError as exc:
            print(f"parabench plan: cannot write the suite to {target}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        except (PlanError, SuiteError) as exc:
            print(f"parabench plan: cannot write the suite: {exc}", file=sys.stderr)
            return 2
        from parabench.plan.check import write_predictions

        try:
            sidecar = write_predictions(target, kind, args.calibration)
        except (OSError, ValueError, KeyError) as exc:
            print(f"parabench plan: cannot write the predictions beside the suite: {exc}", file=sys.stderr)
            return 2
        print(
            f"\nwrote {args.write_suite}: {len(suite.cases)} cases, and their predictions in {sidecar} "
            f"(parabench run suite {args.write_suite}, then parabench check RUN)"
        )
    return 0
