"""Versioned results: one folder per suite run, a manifest and one JSON record per case.

Layout::

    results/<suite>/<run-id>/manifest.json       environment, versions, suite file and hash
    results/<suite>/<run-id>/cases/<hash>.json   one record per case, written atomically
    results/<suite>/<run-id>/report.html         made from the two above, nothing else

Every file carries ``schema_version``; loading a file of another version fails with a message
that says which version it is and which this parabench reads.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import socket
import subprocess
import tempfile
from pathlib import Path

SCHEMA_VERSION = 1
# Environment variables worth recording; never the whole environment (tokens and keys live there).
ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "OMP_", "DS_", "PYTORCH_", "NVSHMEM_", "GLOO_", "MKL_", "KMP_",
                "SLURM_JOB_", "SLURM_NNODES", "SLURM_NTASKS", "OPENBLAS_")
ENV_DENY_SUBSTRINGS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")


class SchemaError(ValueError):
    pass


def write_json_atomic(path: str | os.PathLike, data) -> None:
    """Write to a temporary file in the same folder, then rename: never half a file on disk."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=False, default=_json_default)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_default(o):
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    return str(o)


def load_json(path: str | os.PathLike) -> dict:
    data = json.loads(Path(path).read_text())
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{path}: schema version {version!r}; this parabench reads version {SCHEMA_VERSION} only")
    return data


def _git(*args: str) -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except Exception:
        return None


def _versions() -> dict:
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception:
        v["nccl"] = None
    try:
        from importlib.metadata import version

        v["deepspeed"] = version("deepspeed")
    except Exception:
        v["deepspeed"] = None
    from parabench import __version__

    v["parabench"] = __version__
    return v


def _devices() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return [{"type": "cpu", "name": platform.processor() or platform.machine(), "count": os.cpu_count()}]
    return [{"type": "cuda", "index": i, "name": torch.cuda.get_device_name(i),
             "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
            for i in range(torch.cuda.device_count())]


def recorded_env() -> dict:
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(ENV_PREFIXES) and not any(s in k.upper() for s in ENV_DENY_SUBSTRINGS)}


def _git_identity(status: str | None) -> dict:
    """The commit the tree was made from. A copy of the tree sent to an offline GPU machine names it
    in PARABENCH_GIT_COMMIT, which wins: the copy may carry a stale .git of its own (the device
    machine's copy holds the session's first commit), whose HEAD and dirty flag describe nothing."""
    named = os.environ.get("PARABENCH_GIT_COMMIT")
    if named:
        return {"commit": named, "dirty": None, "source": "PARABENCH_GIT_COMMIT"}
    return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def make_manifest(suite, run_id: str, argv: list[str] | None = None) -> dict:
    status = _git("status", "--porcelain")
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "manifest",
        "suite": suite.name,
        "suite_file": str(suite.path),
        "suite_file_sha256": suite.file_hash,
        "suite_description": suite.description,
        "run_id": run_id,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": _git_identity(status),
        "versions": _versions(),
        "devices": _devices(),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count()},
        "env": recorded_env(),
        "argv": argv or [],
        "n_cases": len(suite.cases),
    }


def new_run_id() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def case_record_path(run_dir: Path, case_hash: str) -> Path:
    return Path(run_dir) / "cases" / f"{case_hash}.json"


def load_run(run_dir: str | os.PathLike) -> tuple[dict, list[dict]]:
    """The manifest and every case record of a run folder (records sorted by label)."""
    run_dir = Path(run_dir)
    if not (run_dir / "manifest.json").exists():
        raise FileNotFoundError(f"{run_dir} is not a parabench run folder (no manifest.json)")
    manifest = load_json(run_dir / "manifest.json")
    records = [load_json(p) for p in sorted((run_dir / "cases").glob("*.json"))]
    return manifest, sorted(records, key=lambda r: r.get("label", ""))


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
