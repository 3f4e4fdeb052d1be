"""``parabench``: run suites or single cases, list what exists, build reports, compare and export runs.

Exit status: 0 success; 1 a case failed (with --strict: or was skipped), or a comparison found a
regression or missing data; 2 bad input (unknown names, out-of-range values, malformed suite or
result files, unwritable output) with nothing run; 130 interrupted (Ctrl-C); 128 + the signal's number
when stopped by another signal, as a shell reports it (143 SIGTERM, 129 SIGHUP).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

from parabench.case import Case
from parabench.names import error_text
from parabench.results import SchemaError, UnsafeNameError, check_path_component
from parabench.shapes import model_config
from parabench.suite import Suite, SuiteError, list_suites, load_suite, validate_case

# Local runs land in a git-ignored folder, so running a suite never dirties the tracked tree (and
# with it the next manifest's ``git.dirty``); ``--out results`` writes a run meant for committing.
DEFAULT_OUT = Path("runs")


# --- argument types: every value checked at parse time, argparse names the flag ------------------


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"out of range: must be >= {low}, got {value}")
        return value

    return parse


def _interrupted(exc: BaseException) -> int:
    """The exit status of a run stopped by a signal: 128 + its number (SIGTERM 143), Ctrl-C's 130."""
    import signal

    from parabench.launch import Stopped

    if isinstance(exc, Stopped) and exc.args and exc.args[0] in signal.Signals.__members__:
        return 128 + signal.Signals[exc.args[0]].value
    return 130


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"out of range: must be a finite number > 0, got {text!r}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"bucket_mb\": 25}}', got a JSON {type(value).__name__}: {text!r}"
        )
    return value


def _folder_name(what: str):
    def parse(text: str) -> str:
        try:
            return check_path_component(text, what)
        except UnsafeNameError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _resume_command(args, run_dir: Path) -> str:
    """The command line that continues this run: the same arguments (suite, --out, filters...),
    pointed at this run folder with --resume."""
    argv, skip = [], False
    for a in args.argv:
        if skip:
            skip = False
            continue
        if a == "--run-id":
            skip = True
            continue
        if a.startswith("--run-id=") or a == "--resume":
            continue
        argv.append(a)
    return shlex.join(["parabench", *argv, "--run-id", run_dir.name, "--resume"])


def _launch_options(args):
    from parabench.launch import LaunchOptions

    return LaunchOptions(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_timeout_s=args.rdzv_timeout,
        emulate_link=args.emulate_link,
        gpus_per_node=args.gpus_per_node,
        extra_args=args.torchrun_arg or [],
        batch=not args.no_batch,
    )


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch (passed to torchrun; multi-node rendezvous is torchrun's)")
    g.add_argument("--nnodes", type=_int_at_least(1), default=1)
    g.add_argument("--node-rank", type=_int_at_least(0), default=None)
    g.add_argument("--rdzv-endpoint", default=None, help="host:port of the c10d rendezvous (multi-node)")
    g.add_argument("--rdzv-id", default="parabench")
    g.add_argument("--rdzv-timeout", type=_int_at_least(1), default=None, help="seconds a launch waits for every node")
    g.add_argument(
        "--emulate-link",
        choices=["socket"],
        help="the nodes are GPU slices of one host, their traffic forced through sockets (recorded as an emulation)",
    )
    g.add_argument("--gpus-per-node", type=_int_at_least(1), default=None, help="with --emulate-link: GPUs per node")
    g.add_argument("--torchrun-arg", action="append", help="extra torchrun argument (repeatable)")
    g.add_argument(
        "--max-cpu-ranks",
        type=_int_at_least(1),
        default=None,
        help="most ranks a CPU case may start on this host (default: 4 per usable core)",
    )
    g.add_argument("--no-batch", action="store_true", help="one torchrun launch per case (slower, fully isolated)")


def _write_run_report(run_dir: Path) -> Path | None:
    """The run's report.html, or None (with the reason on stderr) when it cannot be written."""
    from parabench.report import write_report

    try:
        return write_report([run_dir], run_dir / "report.html")
    except (OSError, SchemaError) as exc:
        print(f"parabench: error: {exc}", file=sys.stderr)
        return None


def _run_suite(suite: Suite, args) -> int:
    from parabench.launch import OutputError
    from parabench.results import load_run
    from parabench.runner import Runner, default_run_dir, reserve_run_dir

    try:
        check_path_component(suite.name, "suite name")
        if args.run_id is not None:
            check_path_component(args.run_id, "--run-id")
    except UnsafeNameError as exc:
        print(f"parabench: error: {exc}", file=sys.stderr)
        return 2
    run_dir = default_run_dir(Path(args.out), suite, args.run_id, args.resume)
    if args.resume and (run_dir / "manifest.json").exists():
        try:  # an unreadable file stops the run before anything is written, and names the file
            load_run(run_dir)
        except (SchemaError, OSError) as exc:
            print(
                f"parabench: error: cannot resume {run_dir}: {exc}\nparabench: nothing was run and no file was "
                f"changed; move the damaged file away (its case then runs again) and resume",
                file=sys.stderr,
            )
            return 2
    if suite.kind == "collectives":
        try:
            counts = _run_collectives(suite, run_dir)
        except OutputError as exc:
            print(f"parabench: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as exc:
            print(f"\nparabench: interrupted; finished world sizes are kept in {run_dir}", file=sys.stderr)
            return _interrupted(exc)
    else:
        launch = _launch_options(args)
        from parabench.multinode import resolve_node_options

        try:  # options "node" take their sizes from --nnodes (the runner does it again, a no-op then)
            suite.cases = resolve_node_options(suite.cases, launch.nnodes)
        except SuiteError as exc:
            print(f"parabench: error: {exc}; nothing was run", file=sys.stderr)
            return 2
        if args.no_skips:
            from parabench.runner import skip_reason

            skips = [(c.label, why) for c in suite.cases if (why := skip_reason(c, launch))]
            if skips:
                print(
                    f"parabench: error: --no-skips: {len(skips)} of {len(suite.cases)} cases would be skipped "
                    "here; nothing was run:\n" + "\n".join(f"  {label}: {why}" for label, why in skips),
                    file=sys.stderr,
                )
                return 2
        from parabench.runner import too_many_cpu_ranks

        crowded = [
            why for c in suite.cases if (why := too_many_cpu_ranks(c, launch, getattr(args, "max_cpu_ranks", None)))
        ]
        if crowded:
            print(
                f"parabench: error: {len(crowded)} case(s) would start more ranks than this host's CPU holds; "
                "nothing was run:\n" + "\n".join(f"  {why}" for why in crowded),
                file=sys.stderr,
            )
            return 2
        try:
            if args.run_id is None and not (run_dir / "manifest.json").exists():
                run_dir = reserve_run_dir(run_dir)
        except OutputError as exc:
            print(f"parabench: error: {exc}", file=sys.stderr)
            return 2
        print(f"parabench: suite {suite.name}: {len(suite.cases)} cases -> {run_dir}", flush=True)
        runner = Runner(suite, run_dir, launch, resume=args.resume, retry_failed=args.retry_failed)
        try:
            counts = runner.run()
        except OutputError as exc:
            print(f"parabench: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as exc:
            print(
                f"\nparabench: interrupted; finished cases are kept in {run_dir}; continue with: "
                f"{_resume_command(args, run_dir)}",
                file=sys.stderr,
            )
            if not args.no_report and (run_dir / "manifest.json").exists():
                path = _write_run_report(run_dir)
                if path:
                    print(f"parabench: report of the finished cases: {path}")
            return _interrupted(exc)
        print("parabench: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v), flush=True)
    if not args.no_report and not getattr(args, "node_rank", None):  # the report is node 0's, beside its records
        path = _write_run_report(run_dir)
        if path is None:
            return 2
        print(f"parabench: report: {path}")
    return run_exit_status(counts, args.strict)


def run_exit_status(counts: dict, strict: bool) -> int:
    """1 when a case failed; with ``strict`` also when one was skipped or measured off its theory."""
    from parabench.runner import OFF_THEORY

    failed = sum(v for k, v in counts.items() if k not in ("ok", "skipped", "kept", OFF_THEORY))
    return 1 if failed or (strict and (counts.get("skipped") or counts.get(OFF_THEORY))) else 0


def _run_collectives(suite: Suite, run_dir: Path) -> dict:
    """One torchrun launch per world size; each writes collectives-w<N>.json in the run folder.
    The run folder is the runner's for the whole run: locked (``RunFolderBusy`` when another
    runner has it), its launches ended on a signal."""
    import torch

    from parabench.collectives_bench import run_collectives_suite
    from parabench.collectives_config import suite_config
    from parabench.launch import LaunchOwner
    from parabench.results import make_manifest, write_json_atomic

    cfg = suite_config(suite)
    counts = {"ok": 0, "skipped": 0, "crashed": 0}
    on_gpu = cfg.get("device", "auto") != "cpu" and torch.cuda.is_available()
    owner = LaunchOwner(run_dir)
    with owner.owning():
        write_json_atomic(run_dir / "manifest.json", make_manifest(suite, run_dir.name, sys.argv))
        for n in suite.raw["collectives"].get("world_sizes", [2]):
            if on_gpu and n > torch.cuda.device_count():
                print(f"parabench: collectives w{n}: skipped, this machine has {torch.cuda.device_count()} GPUs")
                counts["skipped"] += 1
                continue
            try:
                out = run_collectives_suite(suite, run_dir, n, owner=owner)
                print(f"parabench: collectives w{n}: {out}")
                counts["ok"] += 1
            except RuntimeError as exc:
                print(f"parabench: collectives w{n} failed: {exc}", file=sys.stderr)
                counts["crashed"] += 1
    from parabench.collectives_scaling import FIT_FILE, fit_run

    scaling = fit_run(run_dir)  # time against the number of ranks, fitted to each algorithm's law
    if scaling is not None:
        write_json_atomic(run_dir / FIT_FILE, scaling)
    return counts


def cmd_run_suite(args) -> int:
    try:
        suite = load_suite(args.suite)
        if args.proxy_model:
            model_config(args.proxy_model)
    except (SuiteError, KeyError) as exc:
        print(f"parabench: error: {error_text(exc)}", file=sys.stderr)
        return 2
    if args.filter:
        suite.cases = [c for c in suite.cases if all(f in c.label for f in args.filter)]
    if args.repeats is not None:
        from dataclasses import replace

        suite.cases = [replace(c, repeats=args.repeats) for c in suite.cases]
    if args.proxy_model:
        suite = _cpu_proxy(suite, args.proxy_model)
    return _run_suite(suite, args)


def _cpu_proxy(suite: Suite, model: str) -> Suite:
    """The suite's code paths on CPU processes: every case with ``model`` at its own sequence
    length on gloo. Cases that then coincide run once; cases the small model cannot take (more
    stages than layers...) are dropped with a note. Results go to ``<suite>-cpu-proxy``."""
    from dataclasses import replace

    from parabench.shapes import model_config

    model_config(model)
    seen, dropped = {}, []
    for c in suite.cases:
        p = replace(
            c,
            model=model,
            seq_len=None,
            device="cpu",
            timeout_s=min(c.timeout_s, 600),
            micro_batch=min(c.micro_batch, 8) if not c.options.get("pp") else c.micro_batch,
        )
        try:
            validate_case(p)
        except (SuiteError, ValueError) as exc:
            dropped.append(f"{c.label}: {exc}")
            continue
        seen.setdefault(p.case_hash, p)
    for d in dropped:
        print(f"parabench: proxy: dropped {d}")
    return Suite(
        name=f"{suite.name}-cpu-proxy",
        path=suite.path,
        description=f"CPU proxy ({model}) of: {suite.description}",
        cases=list(seen.values()),
        kind=suite.kind,
        raw=suite.raw,
    )


def cmd_run_case(args) -> int:
    fields = {
        k: getattr(args, k)
        for k in (
            "model",
            "strategy",
            "world_size",
            "precision",
            "recipe",
            "layout",
            "micro_batch",
            "grad_accum",
            "seq_len",
            "steps",
            "warmup",
            "seed",
            "lr",
            "device",
            "timeout_s",
            "repeats",
        )
        if getattr(args, k) is not None
    }
    try:
        fields["options"] = args.options or {}
        case = Case(**fields)
        from parabench.registry import get_strategy
        from parabench.shapes import model_config

        get_strategy(case.strategy)
        model_config(case.model)
        validate_case(case)
    except (SuiteError, KeyError, ValueError) as exc:
        print(f"parabench: error: {error_text(exc)}", file=sys.stderr)
        return 2
    suite = Suite(name=args.name, path=Path(__file__), description="ad-hoc case from the command line", cases=[case])
    return _run_suite(suite, args)


def _table(rows: list[tuple], indent: str = "  ") -> list[str]:
    """Rows of cells as lines, each column as wide as its widest cell (the last column left free)."""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]) - 1)] if rows else []
    return [
        (indent + "  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)) + "  " + str(row[-1])).rstrip()
        for row in rows
    ]


def _clip(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def cmd_list(args) -> int:
    """Strategies, models and the user suites in brief; with --all each strategy and model in full
    and the studies (suites/studies/) too."""
    import textwrap

    from parabench.registry import STRATEGIES
    from parabench.shapes import CUSTOM_MODEL_FORM, MODEL_LADDER

    width = 120  # the project's line length: a default listing reads in one screen
    by_kind: dict[str, list[str]] = {}
    for name, info in sorted(STRATEGIES.items(), key=lambda kv: (kv[1].kind, kv[0])):
        by_kind.setdefault(info.kind, []).append(name)
    if args.all:
        from parabench.shapes import parameter_count

        print("strategies:")
        rows = [
            (n, STRATEGIES[n].kind, "/".join(STRATEGIES[n].recipes), STRATEGIES[n].description)
            for names in by_kind.values()
            for n in names
        ]
        print("\n".join(_table(rows)))
        print("models:")
        rows = []
        for name, cfg in MODEL_LADDER.items():
            rows.append(
                (
                    name,
                    f"{parameter_count(cfg)['total'] / 1e6:>9.1f} M params",
                    f"L={cfg.n_layers} d={cfg.d_model} heads={cfg.n_heads} seq={cfg.seq_len} vocab={cfg.vocab_size}",
                )
            )
        print("\n".join(_table(rows)))
        print(f"  {CUSTOM_MODEL_FORM}: any other dense shape, e.g. custom-L20-d2304-h18 (vocab 50304 unless -v)")
    else:
        print(f"strategies ({len(STRATEGIES)}; `parabench list --all` gives each one's recipes and description):")
        kind_width = max(map(len, by_kind))
        for kind, names in by_kind.items():
            lead = f"  {kind:<{kind_width}}  "
            print(textwrap.fill(" ".join(names), width, initial_indent=lead, subsequent_indent=" " * len(lead)))
        models = " ".join([*MODEL_LADDER, CUSTOM_MODEL_FORM])
        print(textwrap.fill(models, width, initial_indent="models: ", subsequent_indent="  "))

    groups = [("suites:", list_suites())]
    studies = list_suites(studies=True)
    if args.all:
        groups.append(("studies (one-off, suites/studies/; run by name or as studies/<name>):", studies))
    rows_by_group = []
    for _, names in groups:
        rows = []
        for name in names:
            try:
                s = load_suite(name)
                rows.append((name.removeprefix("studies/"), s.kind, f"{len(s.cases):>3} cases", s.description))
            except SuiteError as exc:
                rows.append((name.removeprefix("studies/"), "INVALID", "", str(exc)))
        rows_by_group.append(rows)
    # one set of widths over every group, so that the columns line up from the first suite to the last study
    lines = _table([row for rows in rows_by_group for row in rows])
    start = 0
    for (title, _), rows in zip(groups, rows_by_group):
        print(title)
        for line in lines[start : start + len(rows)]:
            print(line if args.all else _clip(line, width))
        start += len(rows)
    if not args.all:
        print(f"{len(studies)} one-off studies in suites/studies/: `parabench list --all`")
    return 0


def cmd_report(args) -> int:
    from parabench.report import write_report

    try:
        path = write_report([Path(r) for r in args.runs], Path(args.output))
    except (OSError, SchemaError) as exc:
        print(f"parabench: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def cmd_recheck(args) -> int:
    from parabench.names import unknown_name_message
    from parabench.recheck import recheck_run
    from parabench.registry import STRATEGIES

    unknown = [s for s in args.strategy or [] if not s.endswith("*") and s not in STRATEGIES]
    if unknown:  # a misspelt filter would otherwise recheck nothing, silently
        message = unknown_name_message("strategy", unknown[0], sorted(STRATEGIES))
        print(f"parabench: error: --strategy: {message}", file=sys.stderr)
        return 2
    for run in args.runs:
        try:
            changes = recheck_run(Path(run), args.strategy)
        except (OSError, SchemaError) as exc:
            print(f"parabench: error: {exc}", file=sys.stderr)
            return 2
        verdict = {True: "comm=theory", False: "comm!=theory", None: "no comm verdict"}
        for label, before, after in changes:
            if before == "stale":
                print(f"{run}: skipped: {after}")
                continue
            if before == "unchanged":
                print(f"{run}: {label}: {verdict[after]}  (theory and checks as recorded; file untouched)")
                continue
            mark = "" if before == after else f"  (was: {verdict[before]})"
            print(f"{run}: {label}: {verdict[after]}{mark}")
    return 0


def cmd_export(args) -> int:
    from parabench.data import ExportError, export, load

    fmt, path = ("parquet", args.parquet) if args.parquet else ("csv", args.csv)
    try:
        frame = load(args.runs, per_rank=args.per_rank)
        export(frame, path, fmt)
    except (OSError, SchemaError, ExportError) as exc:
        print(f"parabench: error: {exc}", file=sys.stderr)
        return 2
    rows = "case x rank rows" if args.per_rank else "case launch rows"
    print(f"parabench: {len(frame):,} {rows}, {len(frame.columns):,} columns -> {path}")
    return 0


def cmd_compare(args) -> int:
    from parabench.compare import main as compare_main

    return compare_main(args)


def cmd_fidelity(args) -> int:
    """Each peer case of a run beside its library's minimal script (``parabench.fidelity``)."""
    from parabench.fidelity import run_fidelity
    from parabench.launch import OutputError

    run_dir = Path(args.run)
    try:
        counts = run_fidelity(run_dir, filters=args.filter, redo=args.redo, launches=args.launches)
    except (OutputError, SchemaError, FileNotFoundError, UnsafeNameError) as exc:
        print(f"parabench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"\nparabench: interrupted; finished scripts are kept in {run_dir / 'fidelity'}", file=sys.stderr)
        return _interrupted(exc)
    print("parabench: fidelity: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v), flush=True)
    if not args.no_report:
        path = _write_run_report(run_dir)
        if path is None:
            return 2
        print(f"parabench: report: {path}")
    return 1 if counts["failed"] or counts["timeout"] else 0


def cmd_plan(args) -> int:
    from parabench.plan.cli import plan_main

    return plan_main(args)


def cmd_env(args) -> int:
    from parabench.results import device_inventory, library_versions, recorded_env

    print(json.dumps({"versions": library_versions(), "devices": device_inventory(), "env": recorded_env()}, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="parabench", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="run a suite or one case")
    run_sub = run.add_subparsers(dest="what", required=True)
    for name in ("suite", "case"):
        p = run_sub.add_parser(name)
        if name == "suite":
            p.add_argument("suite", help="suite name (see `parabench list`) or path to a .toml file")
            p.add_argument(
                "--proxy-model",
                help="run the suite's cases on CPU processes with this small model "
                "(e.g. tiny-deep), to prove a GPU suite's code paths without GPUs",
            )
            p.add_argument(
                "--filter",
                action="append",
                help="run only cases whose label contains this text (repeatable; a case must contain every one)",
            )
            p.set_defaults(func=cmd_run_suite)
        else:
            p.add_argument("--model", required=True)
            p.add_argument("--strategy", required=True)
            p.add_argument("--world-size", type=_int_at_least(1), default=1)
            p.add_argument("--precision")
            p.add_argument("--recipe", help="bf16/fp16 precision recipe: master (default), amp or (bf16) fp8")
            p.add_argument(
                "--layout", choices=("separate", "fused"), help="model layout: separate q, k, v (default) or fused qkv"
            )
            p.add_argument("--micro-batch", type=_int_at_least(1))
            p.add_argument("--grad-accum", type=_int_at_least(1))
            p.add_argument("--seq-len", type=_int_at_least(1))
            p.add_argument("--steps", type=_int_at_least(1), help="timed steps (>= 1)")
            p.add_argument("--warmup", type=_int_at_least(0), help="untimed steps before them (>= 0)")
            p.add_argument("--seed", type=int)
            p.add_argument("--lr", type=_finite_float)
            p.add_argument("--device", choices=("auto", "cpu", "cuda"))
            p.add_argument("--timeout-s", type=_positive_seconds)
            p.add_argument(
                "--options", type=_json_object, help="strategy options as a JSON object, e.g. '{\"bucket_mb\": 25}'"
            )
            p.add_argument(
                "--name",
                default="adhoc",
                type=_folder_name("--name"),
                help="results go to <out>/<name>/<run-id> (one folder name)",
            )
            p.set_defaults(func=cmd_run_case)
        p.add_argument(
            "--out",
            default=str(DEFAULT_OUT),
            help=f"results root (default: {DEFAULT_OUT}, git-ignored; --out results for a run to commit)",
        )
        p.add_argument("--run-id", type=_folder_name("--run-id"), help="run folder name (default: a timestamp)")
        p.add_argument("--resume", action="store_true", help="skip cases already recorded in the run folder")
        p.add_argument("--retry-failed", action="store_true", help="with --resume: run failed cases again")
        p.add_argument("--no-report", action="store_true")
        p.add_argument(
            "--strict",
            action="store_true",
            help="exit 1 also when a case was skipped (e.g. more ranks than devices) or measured off its theory "
            "(a communication, state or NVMe check failed); a failed case always exits 1",
        )
        p.add_argument(
            "--no-skips",
            action="store_true",
            help="before the first launch, check that no case would be skipped here (a missing package "
            "such as torchao, too few GPUs); if one would, name each with its reason, run nothing, exit 2",
        )
        p.add_argument(
            "--repeats",
            type=_int_at_least(1),
            help="separate launches per case, interleaved over the suite "
            "(overrides the suite's repeats; the regression gate needs >= 3)",
        )
        _add_launch_flags(p)

    p = sub.add_parser("list", help="strategies, models and suites")
    p.add_argument("--all", action="store_true", help="each strategy and model in full, and the one-off studies")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("report", help="HTML report from one or more run folders")
    p.add_argument("runs", nargs="+")
    p.add_argument("-o", "--output", default="report.html")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "recheck",
        help="recompute theory and checks of recorded runs with this parabench "
        "(measurements untouched; rerun `parabench report` afterwards)",
    )
    p.add_argument("runs", nargs="+")
    p.add_argument(
        "--strategy",
        action="append",
        metavar="NAME",
        help="only these strategies (repeatable; 'ref.tp*' matches a prefix)",
    )
    p.set_defaults(func=cmd_recheck)

    p = sub.add_parser(
        "export",
        help="case records as a table (one row per case launch, or per case and rank), as parabench.load reads them",
    )
    p.add_argument("runs", nargs="+", help="run folders, or folders holding run folders")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--csv", metavar="PATH", help="write CSV here (list and dict cells as JSON text)")
    where.add_argument(
        "--parquet", metavar="PATH", help="write Parquet here (needs pyarrow: pip install 'parabench[parquet]')"
    )
    p.add_argument("--per-rank", action="store_true", help="one row per case launch and rank")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("compare", help="regression gate: compare a candidate run with a baseline")
    from parabench.compare import add_arguments as _compare_arguments

    _compare_arguments(p)  # baseline, candidate, --threshold, --mem-threshold, --alpha, --json, --markdown, --all
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser(
        "noise-model",
        help="rebuild results/baselines/noise-model.json (launch-to-launch spread per implementation and regime, "
        "which compare uses to judge single launches) from the committed runs, cross-validated",
    )
    from parabench.compare import DEFAULT_THRESHOLD as _gate_threshold
    from parabench.noise import add_arguments as _noise_arguments
    from parabench.noise import main as _noise_main

    _noise_arguments(p)
    p.set_defaults(func=_noise_main, gate_threshold=_gate_threshold)  # the threshold the model is validated with

    p = sub.add_parser(
        "fidelity",
        help="run each peer case's minimal library script (parabench/fidelity/scripts) beside it; "
        "writes RUN/fidelity/<case_hash>.json and the report's peer-fidelity table",
    )
    p.add_argument("run", help="a run folder with finished peer cases")
    p.add_argument("--filter", action="append", help="only cases whose label contains this text (repeatable)")
    p.add_argument("--redo", action="store_true", help="run scripts again where a result exists")
    p.add_argument(
        "--launches",
        type=_int_at_least(1),
        default=1,
        help="launches of each script (default 1); the report compares medians over launches, with an "
        "interval for the ratio, against the adapter's `--repeats` launches",
    )
    p.add_argument("--no-report", action="store_true")
    p.set_defaults(func=cmd_fidelity)

    p = sub.add_parser("plan", help="predict and rank the configurations of a model on N GPUs (calibrated model)")
    from parabench.plan.cli import add_arguments as _plan_arguments

    _plan_arguments(p)
    p.set_defaults(func=cmd_plan)

    # the planner's loop: plan --write-suite, run suite, check; calibrate refits its constants
    from parabench.plan.check import add_calibrate_arguments, add_check_arguments, calibrate_main, check_main

    p = sub.add_parser("check", help="a planned suite's run against the predictions written beside the suite")
    add_check_arguments(p)
    p.set_defaults(func=check_main)
    p = sub.add_parser("calibrate", help="refit a GPU kind's planner calibration from the committed records")
    add_calibrate_arguments(p)
    p.set_defaults(func=calibrate_main)

    p = sub.add_parser("slurm", help="write an sbatch script running a suite on N nodes (srun + torchrun rendezvous)")
    from parabench.slurm import add_arguments as _slurm_arguments
    from parabench.slurm import slurm_main

    _slurm_arguments(p)
    p.set_defaults(func=slurm_main)

    p = sub.add_parser(
        "headline",
        help="write the README's results table and docs/headline.md from the runs results/headline.toml names "
        "(--check: exit 1 with a diff when the text and the records disagree)",
    )
    from parabench.headline import add_arguments as _headline_arguments
    from parabench.headline import main as _headline_main

    _headline_arguments(p)
    p.set_defaults(func=_headline_main)

    p = sub.add_parser("env", help="versions, devices and recorded environment variables")
    p.set_defaults(func=cmd_env)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except BrokenPipeError:
        # the reader stopped early (`parabench list | head`): what it read is all it wanted, and the
        # interpreter's last flush must not fail again on the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # SIGPIPE's status, as a shell reports a writer it stopped


if __name__ == "__main__":
    sys.exit(main())
