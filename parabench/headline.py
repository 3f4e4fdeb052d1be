"""The headline: the README's results section and docs/headline.md, generated from named committed runs.

What a reader quotes is a ratio of a from-scratch reference to the production library beside it. Such a
ratio goes stale when the records behind it are replaced, and misleads when it rests on one lucky launch
or on two sides that did different work. So no ratio is typed by hand: ``results/headline.toml`` names
the runs and, per row, the reference and peer cases to set side by side, and ``parabench headline``
writes the text from their records. ``parabench headline --check`` (and a test in CI) fails when the
committed text and the records disagree.

The generator refuses a row, naming it and the rule, when

- its run, or the records of that strategy in it, is listed in ``results/superseded.toml``;
- a side has fewer than ``MIN_LAUNCHES`` ok launches and its implementation's launch-to-launch spread
  (``parabench.noise``: the noise model's 95th percentile for that implementation and regime) is above
  ``MAX_SPREAD_FEW_LAUNCHES``, or unknown: a single launch of a library whose launches span 40 % says
  which launch it was, not how fast the library is;
- the two sides differ in model, device count, precision, sequence length or gradient accumulation (they
  are not a pair), or ran on a CPU (gloo timings on a shared CPU are not a ranking);
- a selection matches no case, or more than one.

Where the two sides differ in precision recipe, model layout (separate or fused q/k/v), micro-batch,
compilation or the dtype their gradients are reduced in, the row says so beside the ratio.

The ratio is reference over peer tokens/s per device, the ratio of the launch medians, with the
distribution-free interval of ``parabench.stats.ratio_ci`` (pairwise launch ratios; 3 launches a side:
90 % coverage).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from parabench.superseded import SUPERSEDED, Superseded, load_superseded, superseded_entries  # noqa: F401 (re-exported)

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "results" / "headline.toml"
README = ROOT / "README.md"
DOCS_PAGE = ROOT / "docs" / "headline.md"
BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"

MIN_LAUNCHES = 3
MAX_SPREAD_FEW_LAUNCHES = 0.10  # p95 of max/min - 1 between two launches of the same code
README_ROWS = 8  # README.md must stay under 15,000 bytes (tests/test_docs.py); every row is in the docs page
WIDTH = 118  # prose line length of README.md and docs/
# What both sides must share to be a pair at all; a difference in any of these refuses the row.
SAME_WORK = ("model", "world_size", "precision", "seq_len", "grad_accum", "device")
# Case fields a row's ``where`` may select on (the shared ones and those printed when they differ).
SELECTABLE = SAME_WORK + ("micro_batch", "recipe", "layout")
ROW_KEYS = (
    "run",
    "reference",
    "peer",
    "where",
    "reference_where",
    "peer_where",
    "reference_options",
    "peer_options",
    "readme",
)
DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
GRAD_REDUCTIONS = ("reduce_scatter", "all_reduce")  # the kinds that carry a data-parallel gradient reduction


class HeadlineError(Exception):
    """The headline cannot be generated: every refused row, each with its reason."""


# --- the configuration --------------------------------------------------------------------------------


@dataclass
class Row:
    number: int  # 1-based position in the file, for messages
    run: str  # a name from [runs]
    reference: str
    peer: str
    where: dict = field(default_factory=dict)
    reference_where: dict = field(default_factory=dict)
    peer_where: dict = field(default_factory=dict)
    reference_options: dict = field(default_factory=dict)
    peer_options: dict = field(default_factory=dict)
    readme: bool = False

    def name(self) -> str:
        sel = ", ".join(f"{k}={v}" for k, v in self.where.items())
        return f"row {self.number} ({self.reference} / {self.peer}, {self.run}{': ' + sel if sel else ''})"


@dataclass
class Config:
    runs: dict[str, str]  # name -> folder relative to the repository
    rows: list[Row]
    metric: str = "tokens_per_s_per_device"


def load_config(path: Path | str = CONFIG) -> Config:
    """``results/headline.toml``; a row whose ``where`` gives a list expands into one row per value."""
    from parabench.stats import TIMING_METRICS

    path = Path(path)
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    runs = data.get("runs") or {}
    for name, folder in runs.items():
        if not isinstance(folder, str):  # a dotted bare key ("a-2.7b") parses as a nested table
            raise HeadlineError(f"{path}: [runs] {name!r} must name a folder; quote a name that holds a dot")
    metric = data.get("metric", "tokens_per_s_per_device")
    if metric not in TIMING_METRICS:
        raise HeadlineError(f"{path}: metric {metric!r} is not a launch-level timing ({', '.join(TIMING_METRICS)})")
    rows: list[Row] = []
    for i, r in enumerate(data.get("rows") or []):
        unknown = set(r) - set(ROW_KEYS)
        if unknown:
            raise HeadlineError(f"{path}: rows entry {i + 1}: unknown keys {sorted(unknown)}")
        for key in ("run", "reference", "peer"):
            if not isinstance(r.get(key), str):
                raise HeadlineError(f"{path}: rows entry {i + 1}: {key} must be a string")
        if r["run"] not in runs:
            raise HeadlineError(f"{path}: rows entry {i + 1}: run {r['run']!r} is not in [runs]")
        for sel in ("where", "reference_where", "peer_where"):
            bad = set(r.get(sel) or {}) - set(SELECTABLE)
            if bad:
                raise HeadlineError(f"{path}: rows entry {i + 1}: {sel} selects on {sorted(bad)}; use {SELECTABLE}")
        where = dict(r.get("where") or {})
        lists = [k for k, v in where.items() if isinstance(v, list)]
        expansions = [where]
        for k in lists:
            expansions = [{**w, k: v} for w in expansions for v in where[k]]
        for w in expansions:
            rows.append(
                Row(
                    number=len(rows) + 1,
                    run=r["run"],
                    reference=r["reference"],
                    peer=r["peer"],
                    where=w,
                    reference_where=dict(r.get("reference_where") or {}),
                    peer_where=dict(r.get("peer_where") or {}),
                    reference_options=dict(r.get("reference_options") or {}),
                    peer_options=dict(r.get("peer_options") or {}),
                    readme=bool(r.get("readme", False)),
                )
            )
    return Config(runs=dict(runs), rows=rows, metric=metric)


# --- facts of a record --------------------------------------------------------------------------------


def _case(record: dict) -> dict:
    return record.get("case") if isinstance(record.get("case"), dict) else {}


def layout_of(record: dict) -> str:
    return _case(record).get("layout") or "separate"  # records name a layout only where it is not the default


def recipe_text(record: dict) -> str:
    from parabench.registry import recipe_of

    return recipe_of(_case(record)) or _case(record).get("precision") or "?"


def reduce_dtype(record: dict) -> str | None:
    """The dtype a case's gradients were reduced in: as the record measured it, the dtypes of its
    reduce-scatter (sharded strategies) or else its all-reduce traffic on rank 0's instrumented step;
    where it holds no such traffic (FSDP2 issues no collective on one GPU, where the references reduce
    over a group of one; a record without the meter), the dtype its strategy's row declares
    (``parabench.registry.grad_reduce_dtype``). Measured first: a record says what ran, the row what
    the code does now, and a profile option changes it (FSDP2's tuned profile reduces in fp32)."""
    from parabench.registry import grad_reduce_dtype

    for rank in record.get("per_rank") or []:
        by_kind = ((rank or {}).get("comm") or {}).get("by_kind") or {}
        for kind in GRAD_REDUCTIONS:
            dtypes = (by_kind.get(kind) or {}).get("dtypes")
            if dtypes:
                return "+".join(sorted(DTYPE_NAMES.get(d, d) for d in dtypes))
        break  # rank 0's step is the one metered
    return grad_reduce_dtype(_case(record))


def implementation_text(record: dict) -> str:
    c = _case(record)
    profile = (c.get("options") or {}).get("profile")
    return f"{c.get('strategy')}" + (f" ({profile})" if profile else "")


def _selects(record: dict, strategy: str, where: dict, options: dict) -> bool:
    c = _case(record)
    if c.get("strategy") != strategy:
        return False
    facts = {**c, "layout": layout_of(record), "recipe": recipe_text(record)}
    if any(facts.get(k) != v for k, v in where.items()):
        return False
    opts = c.get("options") or {}
    return all(opts.get(k) == v for k, v in options.items())


# --- one row ------------------------------------------------------------------------------------------


def _spread_problem(record: dict, n: int, noise_model: dict | None) -> str | None:
    """Why ``n`` launches of ``record`` cannot carry a ratio, or None where they can."""
    if n >= MIN_LAUNCHES:
        return None
    from parabench.noise import lookup

    found = lookup(noise_model, record) if noise_model else None
    what = f"{implementation_text(record)} has {n} launch{'es' if n != 1 else ''}"
    if found is None:
        return f"{what} and no known launch-to-launch spread; run {MIN_LAUNCHES} launches a side"
    key, entry = found
    if entry["p95"] > MAX_SPREAD_FEW_LAUNCHES:
        return (
            f"{what} and its launches spread up to {_pct(entry['p95'])} (noise model {key!r}, 95th percentile, "
            f"above {_pct(MAX_SPREAD_FEW_LAUNCHES)}); run {MIN_LAUNCHES} launches a side"
        )
    return None


def differences(ref: dict, peer: dict, short: bool = False) -> list[str]:
    """What the two sides of a pair do differently, in words, for the row's note (``short``: the
    README's)."""
    out = []
    r, p = _case(ref), _case(peer)
    if recipe_text(ref) != recipe_text(peer):
        out.append(f"recipe {recipe_text(ref)} / {recipe_text(peer)}")
    if layout_of(ref) != layout_of(peer):
        out.append(f"layout {layout_of(ref)} / {layout_of(peer)}")
    if r.get("micro_batch") != p.get("micro_batch"):
        out.append(f"micro-batch {r.get('micro_batch')} / {p.get('micro_batch')}")
    rc, pc = bool((r.get("options") or {}).get("compile")), bool((p.get("options") or {}).get("compile"))
    if rc != pc:
        out.append(f"compiled {'yes' if rc else 'no'} / {'yes' if pc else 'no'}")
    rd, pd = reduce_dtype(ref), reduce_dtype(peer)
    if rd != pd:
        out.append(
            f"reduce {rd or 'none'} / {pd or 'none'}"
            if short
            else f"gradient reduction {rd or 'none'} / {pd or 'none'}"
        )
    return out


STRUCTURE = ("tp", "pp", "microbatches", "stage_layers")  # options that say how the model is split


def _structure(record: dict) -> list[str]:
    opts = _case(record).get("options") or {}
    out = [f"{k} {opts[k]}" for k in STRUCTURE if opts.get(k) is not None]
    return out + (["compiled"] if opts.get("compile") else [])


def _gpus_text(manifest: dict, record: dict) -> str:
    names = {d.get("name") for d in manifest.get("devices") or [] if isinstance(d, dict)}
    name = names.pop() if len(names) == 1 else "mixed GPUs"
    return f"{_case(record).get('world_size')}x {name.removeprefix('NVIDIA ')}"


def evaluate_row(row: Row, run_path: str, manifest: dict, records: list[dict], metric: str, noise_model) -> dict:
    """One table row from a run's combined records; raises HeadlineError naming the row and the rule."""
    from parabench.stats import launch_values, median, ratio_ci

    def pick(strategy, where, options):
        found = [r for r in records if _selects(r, strategy, where, options)]
        if len(found) != 1:
            if not found:
                raise HeadlineError(f"{row.name()}: no case of {strategy} in {run_path} matches the row's selection")
            labels = ", ".join(r.get("label", "?") for r in found)
            raise HeadlineError(
                f"{row.name()}: {len(found)} cases of {strategy} in {run_path} match ({labels}); narrow the selection"
            )
        return found[0]

    ref = pick(row.reference, {**row.where, **row.reference_where}, row.reference_options)
    peer = pick(row.peer, {**row.where, **row.peer_where}, row.peer_options)
    problems = []
    for side in (ref, peer):
        if side.get("status") != "ok":
            problems.append(f"{implementation_text(side)} did not finish ok ({side.get('status')})")
        if _case(side).get("device") != "cuda":
            problems.append(f"{implementation_text(side)} ran on {_case(side).get('device')}: not a GPU timing")
    unlike = [k for k in SAME_WORK if _case(ref).get(k) != _case(peer).get(k)]
    if unlike:
        problems.append("not a pair: " + ", ".join(f"{k} {_case(ref).get(k)} / {_case(peer).get(k)}" for k in unlike))
    a, b = launch_values(ref, metric), launch_values(peer, metric)
    for side, n in ((ref, len(a)), (peer, len(b))):
        if (why := _spread_problem(side, n, noise_model)) is not None:
            problems.append(why)
    if not a or not b:
        problems.append(f"no {metric} on {'both sides' if not a and not b else 'one side'}")
    if problems:
        raise HeadlineError(f"{row.name()}: " + "; ".join(problems))
    est, low, high, coverage = ratio_ci(a, b)
    c = _case(ref)
    return {
        "row": row,
        "run": run_path,
        "gpus": _gpus_text(manifest, ref),
        "model": c.get("model"),
        "micro_batch": c.get("micro_batch"),
        "shape": ", ".join([f"mb {c.get('micro_batch')}", recipe_text(ref), layout_of(ref), *_structure(ref)]),
        "reference": implementation_text(ref),
        "peer": implementation_text(peer),
        "reference_name": c.get("strategy"),
        "peer_name": _case(peer).get("strategy"),
        "ref_value": median(a),
        "peer_value": median(b),
        "ratio": est,
        "low": low,
        "high": high,
        "coverage": coverage,
        "launches": f"{len(a)} / {len(b)}",
        "differs": differences(ref, peer),
        "differs_short": differences(ref, peer, short=True),
        "layout": layout_of(ref),
        "fidelity": peer_fidelity(ROOT / run_path, peer),
    }


def peer_fidelity(run_dir: Path, peer: dict) -> str:
    """The peer case beside its library's script in this run (``parabench fidelity``): the verdict and
    the speed ratio, or "-" where the script has not run. A reference far ahead of a library is first
    a question about the library's configuration; this column says how far the script answered it."""
    from parabench.report.fidelity import ratios

    path = run_dir / "fidelity" / f"{peer.get('case_hash')}.json"
    if not path.is_file():
        return "-"
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return "script result unreadable"
    if not isinstance(entry, dict):
        return "script result unreadable"
    if entry.get("status") != "ok":
        return f"script {entry.get('status')}"
    r = ratios(peer, entry)
    ratio = f"{r['tps_ratio']:.2f}x" if r["tps_ratio"] is not None else "-"
    if r["verdict"] and "hosts apart" in r["verdict"]:
        return f"{ratio}, hosts apart"
    return f"{ratio}, {r['verdict'] or 'not judged'}"


# --- the whole headline -------------------------------------------------------------------------------


def evaluate(config: Config, superseded: list[Superseded], noise_model: dict | None) -> list[dict]:
    """Every row of ``config`` (HeadlineError listing every refused row)."""
    from parabench.results import SchemaError, load_run
    from parabench.stats import combine_launches

    errors, out, loaded = [], [], {}
    for row in config.rows:
        run_path = config.runs[row.run]
        stale = [e for e in superseded if (ROOT / e.run).resolve() == (ROOT / run_path).resolve()]
        stale = [e for e in stale if e.covers(row.reference) or e.covers(row.peer)]
        if stale:
            errors.append(f"{row.name()}: {stale[0].text()}; cite the run that replaces it")
            continue
        if run_path not in loaded:
            try:
                manifest, records = load_run(ROOT / run_path)
            except (OSError, SchemaError, ValueError) as exc:
                errors.append(f"{row.name()}: cannot read {run_path}: {exc}")
                continue
            loaded[run_path] = (manifest, combine_launches(records))
        manifest, records = loaded[run_path]
        try:
            out.append(evaluate_row(row, run_path, manifest, records, config.metric, noise_model))
        except HeadlineError as exc:
            errors.append(str(exc))
    if errors:
        raise HeadlineError("\n".join(errors))
    return out


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.0f} %"


def _wrap(text: str, width: int = WIDTH, **kw) -> list[str]:
    """Prose lines; a link or path is never split (a hyphen in a run name is no break point)."""
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False, **kw)


def _ratio_text(r: dict, coverage: bool = True) -> str:
    if r["coverage"] <= 0:  # one launch a side: no interval
        return f"{r['ratio']:.2f}"
    cover = f", {_pct(r['coverage'])}" if coverage else ""
    return f"{r['ratio']:.2f} ({r['low']:.2f}-{r['high']:.2f}{cover})"


def _unit(metric: str) -> str:
    return {"tokens_per_s_per_device": "tok/s per GPU", "tokens_per_s": "tok/s"}.get(metric, metric)


def _table(rows: list[dict], metric: str) -> list[str]:
    lines = [
        f"| GPUs | model | shape | reference / peer | {_unit(metric)} | ratio (interval, coverage) | launches "
        "| differs | library / its script |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['gpus']} | {r['model']} | {r['shape']} | {r['reference']} / {r['peer']} "
            f"| {r['ref_value']:,.0f} / {r['peer_value']:,.0f} | {_ratio_text(r)} | {r['launches']} "
            f"| {'; '.join(r['differs']) or '-'} | {r['fidelity']} |"
        )
    return lines


def _short_table(rows: list[dict]) -> list[str]:
    """The README's few columns: README.md must stay short."""
    lines = [
        "| GPUs, model, micro-batch | reference / library | ratio (interval) | differs | library / its script |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        layout = "" if r["layout"] == "separate" else f" {r['layout']}"
        lines.append(
            f"| {r['gpus']}, {r['model']}{layout}, mb {r['micro_batch']} | {r['reference_name']} / {r['peer_name']} "
            f"| {_ratio_text(r, coverage=False)} | {'; '.join(r['differs_short']) or '-'} | {r['fidelity']} |"
        )
    return lines


def _run_links(rows: list[dict], prefix: str) -> str:
    runs = list(dict.fromkeys(r["run"] for r in rows))
    return ", ".join(f"[{p.removeprefix('results/')}]({prefix}{p})" for p in runs)


def readme_block(rows: list[dict], metric: str) -> str:
    shown = [r for r in rows if r["row"].readme]
    if len(shown) > README_ROWS:
        raise HeadlineError(
            f"{len(shown)} rows have readme = true; the README holds at most {README_ROWS} (the rest stay in the docs page)"
        )
    coverages = sorted({_pct(r["coverage"]) for r in shown if r["coverage"] > 0})
    intro = (
        f"Reference over library, {_unit(metric)}: the ratio of launch medians and its distribution-free interval "
        f"({' or '.join(coverages) or 'no'} coverage)."
    )
    names = ", ".join(dict.fromkeys(r["row"].run for r in shown))
    outro = (
        f"Runs {names}, as [results/headline.toml](results/headline.toml) names them; every row, the run folders and "
        "the rules: [docs/headline.md](docs/headline.md). `parabench headline` writes this table; CI checks it."
    )
    if any(r["fidelity"] != "-" for r in shown):
        from parabench.report.fidelity import HOST_SPEED_TOLERANCE

        apart = round((HOST_SPEED_TOLERANCE - 1) * 100)
        outro += (
            " Last column: the library's case over a script written from its docs (`parabench fidelity`); "
            f'"hosts apart": on two machines (older records: host speeds over {apart} % apart), speed not judged.'
        )
    lines = [BEGIN, *_wrap(intro), "", *_short_table(shown), "", *_wrap(outro), END]
    return "\n".join(lines)


def docs_page(rows: list[dict], metric: str, superseded: list[Superseded]) -> str:
    what = (
        "Each row sets a from-scratch reference beside the production library that does the same work, in one "
        f"committed run: reference over library, {_unit(metric)}, the ratio of their launch medians with the "
        "distribution-free interval of the pairwise launch ratios and the probability it covers the true ratio "
        "(3 launches a side: 90 %). A ratio above 1: the reference is faster."
    )
    rules = (
        "`parabench headline` (`parabench/headline.py`) writes this page and the README's table from "
        "`results/headline.toml`, and refuses a row drawn from a superseded run; a side with fewer than "
        f"{MIN_LAUNCHES} launches whose implementation's launches spread more than "
        f"{_pct(MAX_SPREAD_FEW_LAUNCHES)} (95th percentile of the noise model, `results/baselines/noise-model.json`); "
        "a CPU timing; and two sides that differ in model, device count, precision, sequence length or "
        "accumulation. Where they differ in precision recipe, layout, micro-batch, compilation or the dtype "
        "their gradients crossed the wire in (as the records measured it), the last column says so. "
        "`parabench headline --check` fails when this text and the records disagree; CI runs it."
    )
    lines = [
        "# Headline ratios",
        "",
        "<!-- generated by `parabench headline` from results/headline.toml; do not edit by hand -->",
        "",
        *_wrap(what),
        "",
        *_wrap(rules),
        "",
        *_table(rows, metric),
        "",
        *_wrap("Runs: " + _run_links(rows, "../") + ".", WIDTH),
        "",
        "## Superseded runs",
        "",
        "Kept for their history, never cited here (`results/superseded.toml`):",
        "",
    ]
    for e in superseded:
        scope = f" ({', '.join(e.strategies)} records)" if e.strategies else ""
        item = f"- [{e.run.removeprefix('results/')}](../{e.run}){scope}: {e.reason} Replaced by {e.by}."
        lines += _wrap(item, WIDTH, subsequent_indent="  ")
    return "\n".join(lines) + "\n"


def splice(readme: str, block: str) -> str:
    """``readme`` with the text between the markers replaced by ``block`` (markers included)."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise HeadlineError(f"README has no {BEGIN} ... {END} section to fill")
    return readme[:start] + block + readme[end + len(END) :]


def generate(
    config_path: Path | str = CONFIG,
    superseded_path: Path | str = SUPERSEDED,
    readme_path: Path | str = README,
    docs_path: Path | str = DOCS_PAGE,
    noise_model: dict | None | str = "committed",
) -> dict[Path, tuple[str, str]]:
    """{path: (text now, text generated)} for the README and the docs page."""
    from parabench import noise

    config = load_config(config_path)
    superseded = load_superseded(superseded_path)
    model = noise.load() if noise_model == "committed" else noise_model
    rows = evaluate(config, superseded, model)
    readme_path, docs_path = Path(readme_path), Path(docs_path)
    readme = readme_path.read_text(encoding="utf-8")
    docs = docs_path.read_text(encoding="utf-8") if docs_path.exists() else ""
    return {
        readme_path: (readme, splice(readme, readme_block(rows, config.metric))),
        docs_path: (docs, docs_page(rows, config.metric, superseded)),
    }


def diff(outputs: dict[Path, tuple[str, str]]) -> str:
    """Unified diff of committed against generated text ('' when they agree)."""
    out = []
    for path, (now, new) in outputs.items():
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        out += difflib.unified_diff(
            now.splitlines(keepends=True), new.splitlines(keepends=True), f"{name} (committed)", f"{name} (records)"
        )
    return "".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff when the text is stale")
    p.add_argument("--config", default=str(CONFIG), help="the rows and runs (default: results/headline.toml)")


def main(args) -> int:
    try:
        outputs = generate(config_path=args.config)
    except (HeadlineError, OSError, ValueError, tomllib.TOMLDecodeError) as exc:
        print(f"parabench headline: refused:\n{exc}", file=sys.stderr)
        return 2
    stale = diff(outputs)
    if args.check:
        if stale:
            sys.stdout.write(stale)
            print("parabench headline: the text disagrees with the records; run `parabench headline`", file=sys.stderr)
            return 1
        print("parabench headline: README and docs/headline.md agree with the records")
        return 0
    from parabench.results import write_text_atomic

    for path, (now, new) in outputs.items():
        if now != new:
            write_text_atomic(path, new)
            print(f"parabench headline: wrote {path}")
    if not stale:
        print("parabench headline: unchanged")
    return 0
