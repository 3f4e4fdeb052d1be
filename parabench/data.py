"""Results as data: the case records of run folders as one tidy pandas DataFrame.

``parabench.load(run_dirs)`` gives one row per case launch record (``cases/<hash>[.r<k>].json``):
the run, the case's identity (strategy, model, model layout, world size, precision, recipe, batch shape, options
as a JSON string), its status, every figure of ``record["metrics"]`` under its own name, the
main check verdicts, and a few figures read from elsewhere in the record (rank 0's communication
payload, the analytic state and communication bytes). ``per_rank=True`` gives one row per case
launch and rank instead: that rank's median step time, memory peaks, model-state bytes by part,
communication bytes by collective kind, and its NVML telemetry (columns ``telemetry_*``).

Rows are built by ``case_row`` and ``rank_rows`` from plain dicts, without pandas or torch, so
the report builds its case table from the same reading of a record (``report.frames``).

Values that are lists or dicts (``step_times_s``, ``losses``, ``loss_scale``...) stay Python
objects in the frame; ``export`` writes them as JSON text, so a CSV or Parquet file has
scalar cells only.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from parabench.record import byte_high, rank0_comm, theory_state_total
from parabench.registry import recipe_of
from parabench.results import file_mode, load_run

if TYPE_CHECKING:
    import pandas as pd

# The identity of a row, in column order; every metric of ``record["metrics"]`` follows them.
CASE_COLUMNS = (
    "run",
    "suite",
    "run_id",
    "case_hash",
    "label",
    "repeat",
    "strategy",
    "kind",
    "family",
    "model",
    "layout",
    "params",
    "world_size",
    "precision",
    "recipe",
    "scaling",
    "micro_batch",
    "grad_accum",
    "seq_len",
    "steps",
    "options",
    "device",
    "status",
    "error",
    "duration_s",
)
# column -> key of ``record["checks"]``: the verdicts a reader filters on.
CHECK_COLUMNS = {"check_ok": "ok", "comm_ok": "comm_ok", "state_ok": "state_ok"}
# Read from outside ``metrics``: rank 0's payload of the instrumented step (what the regression
# gate compares) and the analytic figures it is checked against.
DERIVED_COLUMNS = ("comm_payload_bytes", "theory_state_bytes", "theory_comm_bytes")
RANK_ID_COLUMNS = (
    "run",
    "suite",
    "run_id",
    "case_hash",
    "label",
    "repeat",
    "strategy",
    "kind",
    "family",
    "model",
    "layout",
    "world_size",
    "precision",
    "recipe",
    "micro_batch",
    "grad_accum",
    "seq_len",
    "options",
    "status",
)


def _number(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _scalar(v) -> bool:
    return v is None or isinstance(v, (int, float, str, bool))


def _dig(d, *keys):
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


@functools.cache
def _registry_facts() -> dict[str, tuple[str, str]]:
    """strategy -> (kind, family) from the strategy registry; {} where it cannot be imported (a
    machine that reads results without torch)."""
    try:
        from parabench.registry import STRATEGIES
    except ImportError:
        return {}
    return {name: (spec.kind, spec.family) for name, spec in STRATEGIES.items()}


def strategy_facts(name, *, registry: bool = True) -> tuple[str | None, str | None]:
    """(kind, family) of a strategy, from its registry row; with ``registry=False`` (the report's
    tables, which name no family) the kind only. None for a strategy the registry does not have."""
    if not isinstance(name, str) or name not in _registry_facts():
        return None, None
    kind, family = _registry_facts()[name]
    return (kind, family) if registry else (kind, None)


def case_row(manifest: dict, record: dict, *, registry: bool = True) -> dict:
    """One record (a launch, or a case combined over launches) as a flat row: identity columns,
    check verdicts, ``metrics`` under their own names, then the derived byte figures. A metric
    named like an identity column is kept as ``metrics.<name>``."""
    case = record.get("case") or {}
    metrics = record.get("metrics") or {}
    checks = record.get("checks") or {}
    kind, family = strategy_facts(case.get("strategy"), registry=registry)
    theory_comm = _dig(record, "theory", "comm_payload_bytes")
    row = {
        "run": f"{manifest.get('suite')}/{manifest.get('run_id')}",
        "suite": manifest.get("suite"),
        "run_id": manifest.get("run_id"),
        "case_hash": record.get("case_hash"),
        "label": record.get("label"),
        "repeat": int(case.get("repeat") or 0),
        "strategy": case.get("strategy"),
        "kind": kind,
        "family": family,
        "model": case.get("model"),
        # the model's parameter layout; records of the default one carry no field
        "layout": case.get("layout") or "separate",
        "params": _number(_dig(record, "model", "params", "total")),
        "world_size": case.get("world_size"),
        "precision": case.get("precision"),
        "recipe": recipe_of(case),
        "scaling": case.get("scaling"),
        "micro_batch": case.get("micro_batch"),
        "grad_accum": case.get("grad_accum"),
        "seq_len": case.get("seq_len") or _dig(record, "model", "config", "seq_len"),
        "steps": case.get("steps"),
        "options": json.dumps(case.get("options") or {}, sort_keys=True),
        "device": _dig(record, "device", "name"),
        "status": record.get("status"),
        "error": _dig(record, "error", "message"),
        "duration_s": _number(record.get("duration_s")),
    }
    for col, key in CHECK_COLUMNS.items():
        row[col] = checks.get(key)
    for name, value in metrics.items():
        row[f"metrics.{name}" if name in row or name in DERIVED_COLUMNS else name] = value
    row["comm_payload_bytes"] = _number((rank0_comm(record) or {}).get("payload_bytes"))
    row["theory_state_bytes"] = theory_state_total(record)
    row["theory_comm_bytes"] = (
        sum(byte_high(v) or 0 for v in theory_comm.values()) if isinstance(theory_comm, dict) else None
    )
    return row


def rank_rows(manifest: dict, record: dict, *, registry: bool = True) -> list[dict]:
    """One row per rank of a record's ``per_rank`` (none for a case that did not run)."""
    ident = {k: v for k, v in case_row(manifest, record, registry=registry).items() if k in RANK_ID_COLUMNS}
    out = []
    for pr in record.get("per_rank") or []:
        times = [t for t in pr.get("step_times_s") or [] if _number(t) is not None]
        coords = pr.get("coords") or {}
        row = {
            **ident,
            "rank": pr.get("rank"),
            "dp": coords.get("dp"),
            "pp": coords.get("pp"),
            "tp": coords.get("tp"),
            "timed_steps": len(times),
            "step_time_s_median": statistics.median(times) if times else None,
            "setup_s": _number(pr.get("setup_s")),
        }
        for key, v in (pr.get("memory") or {}).items():
            row[key] = _number(v)
        state = pr.get("state_bytes") or {}
        for part, v in state.items():
            row[f"state_{part}_bytes"] = _number(v)
        parts = [_number(v) for v in state.values()]
        row["state_bytes"] = sum(parts) if parts and None not in parts else None
        comm = pr.get("comm") or {}
        row["comm_payload_bytes"] = _number(comm.get("payload_bytes"))
        row["comm_wire_bytes"] = _number(comm.get("wire_bytes"))
        for kind, c in sorted((comm.get("by_kind") or {}).items()):
            row[f"comm_{kind}_payload_bytes"] = _number((c or {}).get("payload_bytes"))
            row[f"comm_{kind}_calls"] = _number((c or {}).get("calls"))
        for key, v in (pr.get("telemetry") or {}).items():
            row[f"telemetry_{key}"] = v
        for key, v in (pr.get("pipeline") or {}).items():
            if _scalar(v):
                row[f"pipeline_{key}"] = v
        out.append(row)
    return out


def run_folders(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Run folders named by ``paths``: a folder with a ``manifest.json`` is one run; any other
    folder stands for every run folder below it (``results/h100x2``, or ``results`` itself)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in map(Path, paths):
        if (p / "manifest.json").is_file():
            out.append(p)
            continue
        if not p.is_dir():
            raise FileNotFoundError(f"{p}: no such run folder")
        below = sorted(m.parent for m in p.rglob("manifest.json"))
        if not below:
            raise FileNotFoundError(f"{p} is not a parabench run folder and holds none (no manifest.json below it)")
        out += below
    return out


def rows(runs: Iterable[tuple[dict, list[dict]]], *, per_rank: bool = False, registry: bool = True) -> list[dict]:
    """The rows of ``load`` from runs as ``results.load_run`` gives them (manifest, records)."""
    out: list[dict] = []
    for manifest, records in runs:
        for r in records:
            if per_rank:
                out += rank_rows(manifest, r, registry=registry)
            else:
                out.append(case_row(manifest, r, registry=registry))
    return out


def load(run_dirs: str | os.PathLike | Iterable[str | os.PathLike], per_rank: bool = False) -> pd.DataFrame:
    """Every case launch record of ``run_dirs`` as a DataFrame, one row per record (or per record
    and rank with ``per_rank``). A folder without a manifest stands for every run folder below it.
    Unreadable files raise ``results.SchemaError`` naming the file."""
    import pandas as pd

    frame = pd.DataFrame(rows((load_run(d) for d in run_folders(run_dirs)), per_rank=per_rank))
    if frame.empty:
        return pd.DataFrame(columns=list(RANK_ID_COLUMNS if per_rank else CASE_COLUMNS))
    if per_rank:
        # a rank whose step was counted and sent no collective of a kind sent 0 bytes of it
        counted = frame["comm_payload_bytes"].notna()
        for col in frame.columns:
            if col.startswith("comm_") and col.endswith(("_calls", "_payload_bytes")) and col != "comm_payload_bytes":
                frame.loc[counted, col] = frame.loc[counted, col].fillna(0)
    return frame


def _json_cell(v):
    return v if _scalar(v) else json.dumps(v, default=str)


def flat(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with list and dict cells written as JSON text, so every cell is a scalar."""
    out = frame.copy()
    for col in out.columns:
        if out[col].dtype == object and not out[col].map(_scalar).all():
            out[col] = out[col].map(_json_cell)
    return out


class ExportError(RuntimeError):
    """An export that cannot be written as asked (a format whose library is missing, a target that
    is a folder or cannot be written); the message names the file."""


EXPORT_FORMATS = ("csv", "parquet")


def export(frame: pd.DataFrame, path: str | os.PathLike, fmt: str) -> Path:
    """Write ``frame`` as ``fmt`` ("csv" or "parquet") to ``path``; Parquet needs pyarrow.

    The table goes to a temporary file beside ``path`` and is renamed over it only once complete:
    a full disk or an interrupted export leaves the earlier file as it was and no partial one."""
    path = Path(path)
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: csv or parquet")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ExportError(
                f"cannot write {path}: writing Parquet needs pyarrow, which parabench does not install by "
                "default: pip install 'parabench[parquet]' (or pip install pyarrow), or export with --csv"
            ) from None
    if path.is_dir():
        raise ExportError(f"cannot write {path}: it is a folder; name a file to write")
    table = flat(frame)
    if path.exists() and not path.is_file():  # /dev/stdout, a pipe: a rename would replace it with a file
        with open(path, "wb") as f:
            _write_table(table, f, fmt)
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise ExportError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            _write_table(table, f, fmt)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ExportError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _write_table(table: pd.DataFrame, f, fmt: str) -> None:
    if fmt == "csv":
        table.to_csv(f, index=False, encoding="utf-8")
    else:
        table.to_parquet(f, index=False, engine="pyarrow")
