"""Device time of a profiled step by kernel class, from the Chrome traces the ``trace`` option writes
(``traces/<case>.rank<r>.json.gz`` in a run folder), small enough to commit where the traces are not.

Elementwise adds (PyTorch's ``CUDAFunctor_add``) are listed by launch grid as well: a kernel's grid
grows with the elements it adds, which tells a weight gradient's in-place add (d x d to 4d x d
elements) from an activation's (rows x sequence x d).

    python scripts/trace_kernels.py RUN_DIR [--out summary.json]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

from parabench.meters.step_breakdown import length, merge

CLASSES = (
    ("nccl", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention", re.I)),
    ("add", re.compile(r"CUDAFunctor_add|AddFunctor")),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|sm90_xmma|cublas", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam", re.I)),
    ("copy", re.compile(r"copy|cast|Memcpy|Memset", re.I)),
)


def kernel_class(name: str) -> str:
    return next((label for label, pattern in CLASSES if pattern.search(name)), "other")


def summarize_trace(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        return {"trace": path.name, "kernels": 0}
    by_class = collections.defaultdict(lambda: [0, 0.0])
    adds = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        label = kernel_class(e["name"])
        by_class[label][0] += 1
        by_class[label][1] += e["dur"] / 1e6
        if label == "add":
            grid = (e.get("args") or {}).get("grid") or [0]
            adds[int(grid[0])][0] += 1
            adds[int(grid[0])][1] += e["dur"] / 1e6
    first = min(e["ts"] for e in kernels)
    last = max(e["ts"] + e["dur"] for e in kernels)
    return {
        "trace": path.name,
        "kernels": len(kernels),
        "span_s": (last - first) / 1e6,
        # kernels on different streams overlap (NCCL beside compute): their sum is not the busy time
        "kernel_s": sum(e["dur"] for e in kernels) / 1e6,
        "busy_s": length(merge((e["ts"], e["ts"] + e["dur"]) for e in kernels)) / 1e6,
        "by_class": {k: {"calls": n, "s": s} for k, (n, s) in sorted(by_class.items())},
        "adds_by_grid_x": [{"grid_x": g, "calls": n, "s": s} for g, (n, s) in sorted(adds.items())],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    traces = sorted(Path(a.run_dir).glob("traces/*.json.gz"))
    if not traces:
        raise SystemExit(f"no traces under {a.run_dir}/traces (run the cases with option trace = true)")
    labels = {}
    for case in Path(a.run_dir).glob("cases/*.json"):
        rec = json.loads(case.read_text())
        labels[rec["case_hash"]] = rec["label"]
    out = []
    for t in traces:
        s = summarize_trace(t)
        s["case"] = labels.get(t.name.split(".")[0])
        out.append(s)
        print(
            f"{t.name}: {s.get('span_s', 0) * 1e3:.1f} ms span, {s.get('busy_s', 0) * 1e3:.1f} ms busy; "
            + ", ".join(f"{k} {v['s'] * 1e3:.1f} ms ({v['calls']})" for k, v in s.get("by_class", {}).items())
        )
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
