"""Report section: ZeRO-Infinity's disk traffic against the theory and against the disk itself.

Reads only result records: per rank, ``strategy_stats`` of ``deepspeed.zero3_nvme`` cases (written
by ``parabench.peers.deepspeed_nvme``: the bytes the process read and wrote between the starts of
its second and last steps, and the sequential O_DIRECT probe of the swap folder before training),
the record's ``theory.nvme_io_bytes_per_step`` and its ``checks.nvme_io`` verdict. Bandwidths are
per rank and, summed, for the host's disk: every rank of a launch swaps to the same disk.
"""

from __future__ import annotations

from parabench.registry import reporting
from parabench.report.frames import as_number, dig, records_of

GB = 1e9
COLUMNS = [
    ("label", "case", "str"),
    ("status", "status", "str"),
    ("step_s", "step s", "f1"),
    ("read_gb", "read GB per rank per step", "f1"),
    ("theory_read", "theory read GB", "str"),
    ("write_gb", "written GB per rank per step", "f1"),
    ("theory_write", "theory written GB", "str"),
    ("check", "bytes = theory", "str"),
    ("read_gbps", "read GB/s, all ranks", "f2"),
    ("write_gbps", "write GB/s, all ranks", "f2"),
    ("probe", "disk probe read / write GB/s per rank", "str"),
    ("of_probe", "read / write, % of probe", "str"),
]
NOTE = (
    "DeepSpeed ZeRO-Infinity (deepspeed.zero3_nvme): parameters and optimizer states swapped to the local disk "
    "through DeepSpeed's async I/O. Bytes are the process's own disk reads and writes (/proc/self/io) over the "
    "full steps after the first; the theory is the swap traffic read from DeepSpeed's swappers (the read is a "
    "range: parameters still in the swap buffers are not read again for backward). The probe is a sequential "
    "O_DIRECT write and read in the swap folder before training (option disk_probe_mb), by every rank at once; "
    "'% of probe' sets each rank's rate against its own probe."
)


def _gb(v) -> float | None:
    v = as_number(v)
    return v / GB if v is not None else None


def _range_text(v) -> str:
    if isinstance(v, list) and len(v) == 2 and all(as_number(x) is not None for x in v):
        return f"{v[0] / GB:.1f}-{v[1] / GB:.1f}"
    return f"{v / GB:.1f}" if as_number(v) is not None else "–"


def _pair(a, b, spec: str) -> str:
    return "–" if a is None or b is None else f"{format(a, spec)} / {format(b, spec)}"


def nvme_rows(runs) -> list[dict]:
    rows = []
    for _, run, r in records_of(runs, reporting("nvme")):
        stats = [pr.get("strategy_stats") or {} for pr in r.get("per_rank") or []]
        first = stats[0] if stats else {}

        def total(key):
            values = [as_number(s.get(key)) for s in stats]
            return sum(values) / GB if values and None not in values else None

        def worst(key):  # the slowest rank's share of its probe
            values = [as_number(s.get(key)) for s in stats]
            return min(values) * 100 if values and None not in values else None

        theory = dig(r, "theory", "nvme_io_bytes_per_step") or {}
        verdict = dig(r, "checks", "nvme_io_ok")
        rows.append(
            {
                "run": run,
                "label": r.get("label"),
                "status": r.get("status", "?"),
                "step_s": as_number(dig(r, "metrics", "step_time_s_median")),
                "read_gb": _gb(first.get("nvme_read_bytes_per_step")),
                "theory_read": _range_text(theory.get("read")),
                "write_gb": _gb(first.get("nvme_write_bytes_per_step")),
                "theory_write": _range_text(theory.get("write")),
                "check": {True: "yes", False: "NO"}.get(verdict, "–"),
                "read_gbps": total("nvme_read_bytes_per_s"),
                "write_gbps": total("nvme_write_bytes_per_s"),
                "probe": _pair(
                    _gb(first.get("disk_read_bytes_per_s")), _gb(first.get("disk_write_bytes_per_s")), ".2f"
                ),
                "of_probe": _pair(worst("nvme_read_fraction_of_disk"), worst("nvme_write_fraction_of_disk"), ".0f"),
            }
        )
    return rows


def table_specs(runs, run_col: list) -> list[dict]:
    """The section's table as keyword arguments of ``parabench.report.html._table`` (none without
    ZeRO-Infinity cases)."""
    rows = nvme_rows(runs)
    if not rows:
        return []
    return [
        {
            "id_": "nvme-io",
            "title": "ZeRO-Infinity: disk traffic against theory and the disk",
            "columns": run_col + COLUMNS,
            "rows": rows,
            "note": NOTE,
            "row_class": lambda r: "" if r["status"] == "ok" and r["check"] != "NO" else "bad-row",
        }
    ]
