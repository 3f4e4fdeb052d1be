"""Wire-level cross-check of the communication meter from the c10d flight recorder.

With ``TORCH_FR_BUFFER_SIZE=N`` in the environment, every process group records each collective
it launches (name, input/output sizes and dtypes) in a ring buffer, independently of the Python
dispatcher the :class:`~parabench.meters.comm.CommMeter` watches. The worker notes the last
record id before the instrumented step and summarises the records after it, by kind, with the
same payload conventions as the meter, so the two can be set side by side. On gloo a
reduce-scatter shows up as an all-reduce and point-to-point ops are missing (docs/facts.md).
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

import torch

_DTYPE_BYTES = {
    "Float": 4,
    "BFloat16": 2,
    "Half": 2,
    "Double": 8,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Byte": 1,
    "Char": 1,
    "Bool": 1,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
}


def enabled() -> bool:
    return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) > 0


def _entries() -> list[dict]:
    try:
        return json.loads(torch._C._distributed_c10d._dump_fr_trace_json()).get("entries", [])
    except Exception:
        return []


def last_record_id() -> int:
    ids = [e.get("record_id", -1) for e in _entries()]
    return max(ids, default=-1)


def _kind(profiling_name: str) -> str:
    name = profiling_name.split(":")[-1]
    for prefix, kind in (
        ("all_reduce", "all_reduce"),
        ("allreduce", "all_reduce"),
        ("all_gather", "all_gather"),
        ("allgather", "all_gather"),
        ("_allgather", "all_gather"),
        ("reduce_scatter", "reduce_scatter"),
        ("_reduce_scatter", "reduce_scatter"),
        ("broadcast", "broadcast"),
        ("all_to_all", "all_to_all"),
        ("alltoall", "all_to_all"),
        ("send", "send"),
        ("recv", "recv"),
        ("reduce", "reduce"),
    ):
        if name.startswith(prefix):
            return kind
    return name


def _bytes(sizes: list, dtypes: list) -> int:
    return sum(math.prod(s) * _DTYPE_BYTES.get(d, 4) for s, d in zip(sizes or [], dtypes or []))


def summary_since(record_id: int) -> dict:
    """Per kind: calls and payload bytes of the collectives recorded after ``record_id``."""
    out: dict = defaultdict(lambda: {"calls": 0, "payload_bytes": 0, "names": set()})
    for e in _entries():
        if e.get("record_id", -1) <= record_id:
            continue
        kind = _kind(e.get("profiling_name", "?"))
        use_output = kind == "all_gather"
        size = _bytes(
            e.get("output_sizes" if use_output else "input_sizes"),
            e.get("output_dtypes" if use_output else "input_dtypes"),
        )
        s = out[kind]
        s["calls"] += 1
        s["payload_bytes"] += size
        s["names"].add(e.get("profiling_name", "?"))
    return {k: {**v, "names": sorted(v["names"])} for k, v in sorted(out.items())}
