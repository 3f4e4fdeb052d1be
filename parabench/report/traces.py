"""Report section: links to the traces and memory snapshots kept beside the records.

Reads only result records (``per_rank[r]["trace"]`` and ``["memory_snapshot"]``, written for cases
with ``options.trace`` / ``options.memory_snapshot``; see ``parabench.meters.traces``) and never
imports training code. A file's path in the record is relative to its run folder; the link is
relative to the folder the report is written to, so it works wherever the report sits beside its
runs (and the files are moved together).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

from parabench.report.frames import run_name

COLUMNS = [
    ("label", "case", "str"),
    ("rank", "rank", "int"),
    ("trace", "Chrome/Perfetto trace", "str"),
    ("trace_MiB", "trace MiB (gzip)", "f2"),
    ("memory_snapshot", "CUDA memory snapshot", "str"),
    ("memory_snapshot_MiB", "snapshot MiB", "f2"),
]

NOTE = (
    "Per rank, the profiled extra step (untimed, after the timed steps) as a gzipped Chrome trace: open it in "
    "https://ui.perfetto.dev or chrome://tracing. The memory snapshot is one more untimed step with the CUDA "
    "allocator's history on: open it in https://pytorch.org/memory_viz. Both files sit in the run folder's traces/."
)


def _href(run_dir: Path, relative: str, link_from: Path | None) -> str:
    target = Path(run_dir) / relative
    if link_from is not None:
        target = Path(os.path.relpath(target.resolve(), Path(link_from).resolve()))
    return quote(target.as_posix())


def _cell(entry: dict | None, run_dir: Path, link_from: Path | None) -> tuple[str | None, str | None, float | None]:
    """(text, href, MiB) of one trace entry: the file's name and link, or why there is none."""
    if not entry:
        return None, None, None
    path = entry.get("path")
    if not path:
        return f"not available: {entry.get('reason') or 'no reason recorded'}", None, None
    size = entry.get("bytes")
    return Path(path).name, _href(run_dir, path, link_from), size / 2**20 if isinstance(size, int) else None


def rows(runs, run_dirs: list[Path], link_from: Path | None = None) -> list[dict]:
    out = []
    for (manifest, records), run_dir in zip(runs, run_dirs):
        for r in records:
            for i, pr in enumerate(r.get("per_rank") or []):
                if not (pr.get("trace") or pr.get("memory_snapshot")):
                    continue
                trace, trace_href, trace_mib = _cell(pr.get("trace"), run_dir, link_from)
                snap, snap_href, snap_mib = _cell(pr.get("memory_snapshot"), run_dir, link_from)
                out.append(
                    {
                        "run": run_name(manifest),
                        "label": r.get("label", ""),
                        "rank": pr.get("rank", i),
                        "trace": trace,
                        "trace_href": trace_href,
                        "trace_MiB": trace_mib,
                        "memory_snapshot": snap,
                        "memory_snapshot_href": snap_href,
                        "memory_snapshot_MiB": snap_mib,
                    }
                )
    return out


def table_specs(runs, run_dirs: list[Path], run_col: list, link_from: Path | None = None) -> list[dict]:
    found = rows(runs, run_dirs, link_from)
    if not found:
        return []
    return [
        {
            "id_": "traces-table",
            "title": "Traces and memory snapshots",
            "columns": run_col + COLUMNS,
            "rows": found,
            "note": NOTE,
        }
    ]
