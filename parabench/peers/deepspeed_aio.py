"""Whether DeepSpeed's async I/O op (ZeRO-Infinity's NVMe swapping, ``peers.deepspeed_nvme``) runs
on this machine, asked of DeepSpeed in a fresh interpreter. The runner asks before it launches a
``deepspeed.zero3_nvme`` case, so this module imports neither torch nor DeepSpeed itself.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

_VERDICT = """
import json, os, sys
if sys.argv[1] == "cpu":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
import io, contextlib
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("AsyncIOBuilder")
said = io.StringIO()
with contextlib.redirect_stdout(said):
    ok = bool(builder.is_compatible(verbose=True))
out = {"builder": type(builder).__module__ + "." + type(builder).__name__, "is_compatible": ok,
       "message": (said.getvalue() + str(builder.error_log or "")).strip()[-1500:]}
if ok:
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            builder.load(verbose=False)
        out["loaded"] = True
    except Exception as exc:
        out["loaded"] = False
        out["message"] = (out["message"] + f" load: {type(exc).__name__}: {exc}").strip()[-1500:]
print("VERDICT " + json.dumps(out))
"""


@functools.lru_cache(maxsize=None)
def aio_verdict(device_type: str) -> dict:
    """DeepSpeed's own answer, in a fresh interpreter (the accelerator choice is process-global):
    the AsyncIOBuilder's ``is_compatible()`` (a test program linked against libaio), and if it says
    yes, the op loaded (JIT-built once into torch's extension cache, which the ranks then reuse)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _VERDICT, device_type], capture_output=True, text=True, timeout=900
        )
    except subprocess.TimeoutExpired:
        return {"is_compatible": None, "loaded": False, "message": "the async_io op check ran past 900 s"}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("VERDICT ")), None)
    if line is None:
        return {"is_compatible": None, "loaded": False, "message": (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(line[len("VERDICT ") :])


def aio_unavailable(device_type: str) -> str | None:
    """Why ZeRO-Infinity cannot run here (the runner skips the case with it), or None."""
    v = aio_verdict(device_type)
    if v.get("is_compatible") and v.get("loaded"):
        return None
    return (
        f"DeepSpeed's async I/O op is unavailable: {v.get('builder', 'AsyncIOBuilder')}.is_compatible() = "
        f"{v.get('is_compatible')}, loaded = {v.get('loaded')}: {v.get('message', '')}"
    )
