"""``parabench``: run suites or single cases, list what exists, build reports, compare runs.

Exit status: 0 success; 1 a case failed or a comparison found a regression; 2 bad input
(unknown names, malformed suite, unwritable output) with nothing run; 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parabench.suite import Case, Suite, SuiteError, list_suites, load_suite, validate_case

DEFAULT_OUT = Path("results")


def _launch_options(args):
    from parabench.runner import LaunchOptions

    return LaunchOptions(nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                         rdzv_id=args.rdzv_id, extra_args=args.torchrun_arg or [], batch=not args.no_batch)


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch (passed to torchrun; multi-node rendezvous is torchrun's)")
    g.add_argument("--nnodes", type=int, default=1)
    g.add_argument("--node-rank", type=int, default=None)
    g.add_argument("--rdzv-endpoint", default=None, help="host:port of the c10d rendezvous (multi-node)")
    g.add_argument("--rdzv-id", default="parabench")
    g.add_argument("--torchrun-arg", action="append", help="extra torchrun argument (repeatable)")
    g.add_argument("--no-batch", action="store_true", help="one torchrun launch per case (slower, fully isolated)")


def _run_suite(suite: Suite, args) -> int:
    from parabench.runner import OutputError, Runner, default_run_dir

    run_dir = default_run_dir(Path(args.out), suite, args.run_id, args.resume)
    if suite.kind == "collectives":
        counts = _run_collectives(suite, run_dir)
    else:
        print(f"parabench: suite {suite.name}: {len(suite.cases)} cases -> {run_dir}", flush=True)
        runner = Runner(suite, run_dir, _launch_options(args), resume=args.resume, retry_failed=args.retry_failed)
        try:
            counts = runner.run()
        except OutputError as exc:
            print(f"parabench: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"\nparabench: interrupted; finished cases are kept in {run_dir}; continue with: "
                  f"parabench run suite {getattr(args, 'suite', '...')} --resume", file=sys.stderr)
            if not args.no_report and (run_dir / "manifest.json").exists():
                from parabench.report import write_report

                print(f"parabench: report of the finished cases: {write_report([run_dir], run_dir / 'report.html')}")
            return 130
        print("parabench: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v), flush=True)
    if not args.no_report:
        from parabench.report import write_report

        path = write_report([run_dir], run_dir / "report.html")
        print(f"parabench: report: {path}")
    failed = sum(v for k, v in counts.items() if k not in ("ok", "skipped", "kept"))
    return 1 if failed and args.strict else 0


def _run_collectives(suite: Suite, run_dir: Path) -> dict:
    """One torchrun launch per world size; each writes collectives-w<N>.json in the run folder."""
    import torch

    from parabench.collectives_bench import run_collectives_suite, suite_config
    from parabench.results import make_manifest, write_json_atomic

    cfg = suite_config(suite)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "manifest.json", make_manifest(suite, run_dir.name, sys.argv))
    counts = {"ok": 0, "skipped": 0, "crashed": 0}
    on_gpu = cfg.get("device", "auto") != "cpu" and torch.cuda.is_available()
    for n in suite.raw["collectives"].get("world_sizes", [2]):
        if on_gpu and n > torch.cuda.device_count():
            print(f"parabench: collectives w{n}: skipped, this machine has {torch.cuda.device_count()} GPUs")
            counts["skipped"] += 1
            continue
        try:
            out = run_collectives_suite(suite, run_dir, n)
            print(f"parabench: collectives w{n}: {out}")
            counts["ok"] += 1
        except RuntimeError as exc:
            print(f"parabench: collectives w{n} failed: {exc}", file=sys.stderr)
            counts["crashed"] += 1
    return counts


def cmd_run_suite(args) -> int:
    try:
        suite = load_suite(args.suite)
    except (SuiteError, KeyError) as exc:
        print(f"parabench: error: {exc}", file=sys.stderr)
        return 2
    if args.filter:
        suite.cases = [c for c in suite.cases if all(f in c.label for f in args.filter)]
    if args.repeats is not None:
        from dataclasses import replace

        if args.repeats < 1:
            print(f"parabench: error: --repeats must be >= 1 (got {args.repeats})", file=sys.stderr)
            return 2
        suite.cases = [replace(c, repeats=args.repeats) for c in suite.cases]
    if args.proxy_model:
        suite = _cpu_proxy(suite, args.proxy_model)
    return _run_suite(suite, args)


def _cpu_proxy(suite: Suite, model: str) -> Suite:
    """The suite's code paths on CPU processes: every case with ``model`` at its own sequence
    length on gloo. Cases that then coincide run once; cases the small model cannot take (more
    stages than layers...) are dropped with a note. Results go to ``<suite>-cpu-proxy``."""
    from dataclasses import replace

    from parabench.models import model_config

    model_config(model)
    seen, dropped = {}, []
    for c in suite.cases:
        p = replace(c, model=model, seq_len=None, device="cpu", timeout_s=min(c.timeout_s, 600),
                    micro_batch=min(c.micro_batch, 8) if not c.options.get("pp") else c.micro_batch)
        try:
            validate_case(p)
        except (SuiteError, ValueError) as exc:
            dropped.append(f"{c.label}: {exc}")
            continue
        seen.setdefault(p.case_hash, p)
    for d in dropped:
        print(f"parabench: proxy: dropped {d}")
    return Suite(name=f"{suite.name}-cpu-proxy", path=suite.path, description=f"CPU proxy ({model}) of: {suite.description}",
                 cases=list(seen.values()), kind=suite.kind, raw=suite.raw)


def cmd_run_case(args) -> int:
    import json

    fields = {k: getattr(args, k) for k in ("model", "strategy", "world_size", "precision", "micro_batch",
                                             "grad_accum", "seq_len", "steps", "warmup", "seed", "lr", "device",
                                             "timeout_s", "repeats") if getattr(args, k) is not None}
    try:
        fields["options"] = json.loads(args.options) if args.options else {}
        case = Case(**fields)
        from parabench.strategies import get_strategy
        from parabench.models import model_config

        get_strategy(case.strategy)
        model_config(case.model)
        validate_case(case)
    except (SuiteError, KeyError, ValueError) as exc:
        print(f"parabench: error: {exc}", file=sys.stderr)
        return 2
    suite = Suite(name=args.name, path=Path(__file__), description="ad-hoc case from the command line", cases=[case])
    return _run_suite(suite, args)


def cmd_list(args) -> int:
    from parabench.models import MODEL_LADDER, parameter_count
    from parabench.strategies import STRATEGIES

    print("strategies:")
    for name, info in sorted(STRATEGIES.items(), key=lambda kv: (kv[1].kind, kv[0])):
        print(f"  {name:<22} {info.kind:<9} {info.description}")
    print("models:")
    for name, cfg in MODEL_LADDER.items():
        print(f"  {name:<10} {parameter_count(cfg)['total'] / 1e6:>9.1f} M params  L={cfg.n_layers} d={cfg.d_model} "
              f"heads={cfg.n_heads} seq={cfg.seq_len} vocab={cfg.vocab_size}")
    print("suites:")
    for name in list_suites():
        try:
            s = load_suite(name)
            print(f"  {name:<16} {s.kind:<12} {len(s.cases):>3} cases  {s.description}")
        except SuiteError as exc:
            print(f"  {name:<16} INVALID: {exc}")
    return 0


def cmd_report(args) -> int:
    from parabench.report import write_report
    from parabench.results import SchemaError

    try:
        path = write_report([Path(r) for r in args.runs], Path(args.output))
    except (FileNotFoundError, SchemaError) as exc:
        print(f"parabench: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def cmd_recheck(args) -> int:
    from parabench.recheck import recheck_run
    from parabench.results import SchemaError

    for run in args.runs:
        try:
            changes = recheck_run(Path(run), args.strategy)
        except (FileNotFoundError, SchemaError) as exc:
            print(f"parabench: error: {exc}", file=sys.stderr)
            return 2
        verdict = {True: "comm=theory", False: "comm!=theory", None: "no comm verdict"}
        for label, before, after in changes:
            if before == "stale":
                print(f"{run}: skipped: {after}")
                continue
            mark = "" if before == after else f"  (was: {verdict[before]})"
            print(f"{run}: {label}: {verdict[after]}{mark}")
    return 0


def cmd_compare(args) -> int:
    from parabench.compare import main as compare_main

    return compare_main(args)


def cmd_env(args) -> int:
    import json

    from parabench.results import _devices, _versions, recorded_env

    print(json.dumps({"versions": _versions(), "devices": _devices(), "env": recorded_env()}, indent=1))
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
            p.add_argument("--proxy-model", help="run the suite's cases on CPU processes with this small model "
                           "(e.g. tiny-deep), to prove a GPU suite's code paths without GPUs")
            p.add_argument("--filter", action="append", help="run only cases whose label contains this text (repeatable; a case must contain every one)")
            p.set_defaults(func=cmd_run_suite)
        else:
            p.add_argument("--model", required=True)
            p.add_argument("--strategy", required=True)
            p.add_argument("--world-size", type=int, default=1)
            p.add_argument("--precision")
            p.add_argument("--micro-batch", type=int)
            p.add_argument("--grad-accum", type=int)
            p.add_argument("--seq-len", type=int)
            p.add_argument("--steps", type=int)
            p.add_argument("--warmup", type=int)
            p.add_argument("--seed", type=int)
            p.add_argument("--lr", type=float)
            p.add_argument("--device", choices=("auto", "cpu", "cuda"))
            p.add_argument("--timeout-s", type=float)
            p.add_argument("--options", help="strategy options as JSON, e.g. '{\"bucket_mb\": 25}'")
            p.add_argument("--name", default="adhoc", help="results go to <out>/<name>/<run-id>")
            p.set_defaults(func=cmd_run_case)
        p.add_argument("--out", default=str(DEFAULT_OUT), help="results root (default: results)")
        p.add_argument("--run-id", help="run folder name (default: a timestamp)")
        p.add_argument("--resume", action="store_true", help="skip cases already recorded in the run folder")
        p.add_argument("--retry-failed", action="store_true", help="with --resume: run failed cases again")
        p.add_argument("--no-report", action="store_true")
        p.add_argument("--strict", action="store_true", help="exit 1 if any case failed")
        p.add_argument("--repeats", type=int, help="separate launches per case, interleaved over the suite "
                       "(overrides the suite's repeats; the regression gate needs >= 3)")
        _add_launch_flags(p)

    p = sub.add_parser("list", help="strategies, models and suites")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("report", help="HTML report from one or more run folders")
    p.add_argument("runs", nargs="+")
    p.add_argument("-o", "--output", default="report.html")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("recheck", help="recompute theory and checks of recorded runs with this parabench "
                                       "(measurements untouched; rerun `parabench report` afterwards)")
    p.add_argument("runs", nargs="+")
    p.add_argument("--strategy", action="append", metavar="NAME",
                   help="only these strategies (repeatable; 'ref.tp*' matches a prefix)")
    p.set_defaults(func=cmd_recheck)

    p = sub.add_parser("compare", help="regression gate: compare a candidate run with a baseline")
    from parabench.compare import add_arguments as _compare_arguments

    _compare_arguments(p)  # baseline, candidate, --threshold, --mem-threshold, --alpha, --json, --markdown, --all
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("env", help="versions, devices and recorded environment variables")
    p.set_defaults(func=cmd_env)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
