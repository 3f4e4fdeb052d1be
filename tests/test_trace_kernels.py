"""scripts/trace_kernels.py on a hand-made Chrome trace: kernels by class, the adds by launch grid, and
the busy time as the union of kernels that overlap on different streams, not their sum."""

import gzip
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("trace_kernels", ROOT / "scripts" / "trace_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel(name, ts, dur, grid=1):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"grid": [grid, 1, 1]}}


def test_kernels_are_classed_adds_listed_by_grid_and_overlap_counted_once(tmp_path):
    add = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16> >"
    events = [
        _kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 0, 100),
        _kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 50, 100),  # beside the GEMM
        _kernel(add, 200, 10, grid=25600),
        _kernel(add, 210, 40, grid=102400),
        _kernel(add, 250, 10, grid=25600),
        {"cat": "cpu_op", "name": "aten::add_", "ts": 0, "dur": 300},
    ]
    trace = tmp_path / "traces" / "abc.rank0.json.gz"
    trace.parent.mkdir()
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = _module().summarize_trace(trace)
    assert s["kernels"] == 5
    assert s["span_s"] * 1e6 == 260
    assert s["kernel_s"] * 1e6 == 260  # 100 + 100 + 10 + 40 + 10
    assert s["busy_s"] * 1e6 == 210  # [0, 150) and [200, 260)
    assert {k: v["calls"] for k, v in s["by_class"].items()} == {"add": 3, "gemm": 1, "nccl": 1}
    assert s["adds_by_grid_x"] == [
        {"grid_x": 25600, "calls": 2, "s": 20e-6},
        {"grid_x": 102400, "calls": 1, "s": 40e-6},
    ]
