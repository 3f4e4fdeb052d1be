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
import errno
import hashlib
import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from parabench.version import SCHEMA_VERSION

# Environment variables worth recording, never the whole environment: tokens and keys live there,
# and results get shared. A variable is recorded when its name is listed or starts with a listed
# prefix; its value is still replaced when the name looks like a credential (NCCL_IB_PASSWD).
ENV_NAMES = frozenset(
    {
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "NODE_RANK",
        "SLURM_NNODES",
        "SLURM_NTASKS",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_NODEID",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_JOB_ID",
        "SLURM_JOB_NUM_NODES",
        "SLURM_JOB_NODELIST",
        "SLURM_JOB_PARTITION",
        "PARABENCH_GIT_COMMIT",
        "PARABENCH_HOST_SHARED",  # what else ran on the host's other GPUs meanwhile (device_run.sh)
    }
)


def host_shared(manifest: dict) -> str | None:
    """What else ran on the host while this run did (the manifest's PARABENCH_HOST_SHARED, set by
    scripts/device_run.sh / device_streams.sh), or None for a host the run had to itself."""
    return ((manifest.get("env") or {}).get("PARABENCH_HOST_SHARED") or "").strip() or None


ENV_PREFIXES = (
    "NCCL_",
    "TORCH_",
    "TORCHELASTIC_",
    "CUDA_",
    "OMP_",
    "DS_",
    "PYTORCH_",
    "MASTER_",
    "NVSHMEM_",
    "GLOO_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
)
# A name component (split on _ - .) equal to one of these marks a credential; the short ones must
# match a whole component (KEY, not MONKEY; PAT, not PATH), the long ones may sit inside one (APITOKEN).
CREDENTIAL_COMPONENTS = frozenset({"PASS", "PWD", "KEY", "KEYS", "PAT", "SIG"})
CREDENTIAL_WORDS = (
    "PASSWD",
    "PASSWORD",
    "PASSPHRASE",
    "SECRET",
    "TOKEN",
    "APIKEY",
    "AUTH",
    "BEARER",
    "PRIVATE",
    "CREDENTIAL",
    "ACCOUNT",
    "COOKIE",
    "SESSION",
    "SIGNATURE",
)
REDACTED = "<redacted>"


class SchemaError(ValueError):
    """A result file this parabench cannot read: not JSON (truncated), not a JSON object, or of
    another schema version. The message starts with the file's path."""


class UnsafeNameError(ValueError):
    """A name that would become a path outside its folder, or nested folders."""


def check_path_component(name, what: str) -> str:
    """``name`` when it is safe as one folder or file name under the results root: one path
    component, not empty, no separators, no leading dot (so neither ``.`` nor ``..``), no control
    characters. Suite names, run ids and ``run case --name`` all pass through here."""
    problem = None
    if not isinstance(name, str) or not name:
        problem = "must be a non-empty string"
    elif "/" in name or "\\" in name or (os.altsep and os.altsep in name) or os.path.isabs(name):
        problem = "must be a single folder name, without '/' or '\\'"
    elif name.startswith("."):
        problem = "must not start with '.' (no '..', no hidden folders)"
    elif any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        problem = "must not contain control characters"
    if problem:
        raise UnsafeNameError(f"{what} {name!r} {problem}; it names a folder under the results root")
    return name


def looks_like_credential(name: str) -> bool:
    parts = [p for p in re.split(r"[_\-.]+", name.upper()) if p]
    return any(p in CREDENTIAL_COMPONENTS or any(w in p for w in CREDENTIAL_WORDS) for p in parts)


# Credentials by value: what an allowlisted name (TORCH_, NCCL_, MASTER_...) or a command-line word
# may still carry. Over-redaction is the safe error: a recorded value is for reading, never reused.
_URL_USERINFO = re.compile(r"(://)\S*@")  # up to the last @: a password may hold @ or /
_KEY_VALUE = re.compile(
    r"(?i)\b(password|passwd|pwd|pass|passphrase|secret|token|access_token|refresh_token|id_token|api_?key|"
    r"auth|sig|signature|credentials?|client_secret)(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s;&,]+)"
)
_AUTH_SCHEME = re.compile(r"(?i)\b(bearer|basic|digest|token)(\s+)[A-Za-z0-9._~+/=:-]{4,}")
_AUTH_HEADER = re.compile(r"(?i)\b(authorization|proxy-authorization|x-api-key|cookie)(\s*[:=]\s*).+")
_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.S)
_LONG_TOKEN = re.compile(r"[A-Za-z0-9+_=.~-]{24,}")
# A random token of base64 or similar letters carries about 5 bits a character; words, paths, host
# lists and hex hashes (a commit, 4 bits at most) stay below this.
_TOKEN_ENTROPY_BITS = 4.0


def _entropy_bits(text: str) -> float:
    counts = {c: text.count(c) for c in set(text)}
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


def _looks_random(token: str) -> bool:
    return (
        any(c.islower() for c in token)
        and any(c.isupper() for c in token)
        and any(c.isdigit() for c in token)
        and _entropy_bits(token) >= _TOKEN_ENTROPY_BITS
    )


def _scrub(value: str) -> str:
    """A value with credentials in it replaced: URL user:password, key=value pairs of credential
    keys (``;Password=X``, ``?token=X``), ``Bearer X``, an Authorization header, private-key blocks
    and long random-looking tokens."""
    if not isinstance(value, str):
        return value
    value = _PRIVATE_KEY.sub(REDACTED, value)
    value = _AUTH_HEADER.sub(lambda m: m.group(1) + m.group(2) + REDACTED, value)
    value = _URL_USERINFO.sub(r"\1" + REDACTED + "@", value)
    value = _KEY_VALUE.sub(lambda m: m.group(1) + m.group(2) + REDACTED, value)
    value = _AUTH_SCHEME.sub(lambda m: m.group(1) + m.group(2) + REDACTED, value)
    return _LONG_TOKEN.sub(lambda m: REDACTED if _looks_random(m.group(0)) else m.group(0), value)


def recorded_env(environ=None) -> dict:
    environ = os.environ if environ is None else environ
    return {
        k: REDACTED if looks_like_credential(k) else _scrub(v)
        for k, v in sorted(environ.items())
        if k in ENV_NAMES or k.startswith(ENV_PREFIXES)
    }


def _redact_word(word: str) -> str:
    name, eq, rest = word.partition("=")
    if not eq:
        return _scrub(word)
    if looks_like_credential(name.lstrip("-")):
        return f"{name}={REDACTED}"
    return f"{name}={_redact_word(rest)}"  # --torchrun-arg=--rdzv-conf=token=X


# A word after which the next word is the credential: ``Authorization:`` ``Bearer`` ``X`` as three words.
_CREDENTIAL_PREFIX_WORD = re.compile(r"(?i)(bearer|basic|digest|(proxy-)?authorization:?|x-api-key:?)")


def redact_argv(argv: list[str]) -> list[str]:
    """The command line with the values of credential-looking flags and ``NAME=VALUE`` words
    replaced: ``--token X``, ``--password=X``, ``HF_TOKEN=X``, and URLs' ``user:password@``."""
    out: list[str] = []
    hide_next = False
    for arg in map(str, argv):
        if hide_next and not arg.startswith("--"):
            out.append(REDACTED)
        else:
            out.append(_redact_word(arg))
        hide_next = (arg.startswith("-") and "=" not in arg and looks_like_credential(arg.lstrip("-"))) or bool(
            _CREDENTIAL_PREFIX_WORD.fullmatch(arg)
        )
    return out


def file_mode() -> int:
    """The mode a plain ``open()`` would give a new file (0666 less the umask; 0644 under the usual
    022): records, manifest and report are shared alike. tempfile's 0600 would keep them private."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write to a temporary file in the same folder, then rename: never half a file on disk, and
    no temporary file left behind when the write fails (a full disk, a folder in the way). A device
    or a pipe (``--out /dev/null``, ``/dev/stdout``) is written in place: a rename would replace it
    with a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a folder; name a file to write", str(path))
    if path.exists() and not path.is_file():
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=False, default=_json_default))


def _json_default(o):
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    return str(o)


# No record comes near this (the largest of the committed runs is about 120 kB): a bigger file is
# refused before it is read, so a hostile run folder cannot make a reader take the machine's memory.
MAX_RESULT_FILE_BYTES = 32 << 20
# Integers longer than this cannot be a float (1.8e308): read as +/-inf, which every reader treats as
# not finite, rather than as an int that overflows the first float() or statistics call.
_MAX_INT_DIGITS = 308


def _parse_int(text: str):
    digits = text.lstrip("-")
    if len(digits) > _MAX_INT_DIGITS:
        return float("-inf") if text.startswith("-") else float("inf")
    return int(text)


def load_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError:
        size = 0  # a pipe or a vanished file: the read below says what is wrong
    if size > MAX_RESULT_FILE_BYTES:
        raise SchemaError(f"{path}: {size} bytes, larger than any result file ({MAX_RESULT_FILE_BYTES} bytes at most)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{path}: not valid JSON (truncated or edited?): {exc}") from None
    except UnicodeDecodeError as exc:
        raise SchemaError(f"{path}: not UTF-8 text: {exc}") from None
    except (RecursionError, ValueError) as exc:
        raise SchemaError(f"{path}: not readable as a result file: {exc}") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: expected a JSON object, found {type(data).__name__}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{path}: schema version {version!r}; this parabench reads version {SCHEMA_VERSION} only")
    return data


def git_output(*args: str) -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except Exception:
        return None


def library_versions() -> dict:
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception:
        v["nccl"] = None
    from importlib.metadata import PackageNotFoundError, version

    for package in ("deepspeed", "torchao"):  # the peers' library; the fp8 recipe's float8 training
        try:
            v[package] = version(package)
        except PackageNotFoundError:
            v[package] = None
    from parabench.version import __version__

    v["parabench"] = __version__
    return v


def device_inventory() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return [{"type": "cpu", "name": platform.processor() or platform.machine(), "count": os.cpu_count()}]
    return [
        {
            "type": "cuda",
            "index": i,
            "name": torch.cuda.get_device_name(i),
            "memory_bytes": torch.cuda.get_device_properties(i).total_memory,
        }
        for i in range(torch.cuda.device_count())
    ]


def cpu_model() -> str | None:
    """The CPU's model name (Linux /proc/cpuinfo; else what platform knows): host-bound libraries
    run at the speed of this CPU, so two machines with one core count can differ."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def host_facts() -> dict:
    """The host's CPU and memory, and the cores this process may run on (a stream pinned with
    taskset beside another on a shared host sees fewer than cpu_count)."""
    facts = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
    }
    if hasattr(os, "sched_getaffinity"):
        facts["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        facts["memory_bytes"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        facts["memory_bytes"] = None
    return facts


def _git_identity(status: str | None) -> dict:
    """The commit the tree was made from. A copy of the tree sent to an offline GPU machine names it
    in PARABENCH_GIT_COMMIT, which wins: the copy may carry a stale .git of its own (the device
    machine's copy holds the session's first commit), whose HEAD and dirty flag describe nothing."""
    named = os.environ.get("PARABENCH_GIT_COMMIT")
    if named:
        return {"commit": named, "dirty": None, "source": "PARABENCH_GIT_COMMIT"}
    return {"commit": git_output("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def make_manifest(suite, run_id: str, argv: list[str] | None = None) -> dict:
    status = git_output("status", "--porcelain")
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
        "versions": library_versions(),
        "devices": device_inventory(),
        "host": host_facts(),
        "env": recorded_env(),
        "argv": redact_argv(argv or []),
        "n_cases": len(suite.cases),
    }


def new_run_id() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def case_record_path(run_dir: Path, case_hash: str) -> Path:
    return Path(run_dir) / "cases" / f"{case_hash}.json"


# manifest key -> type, for the keys readers format or index; a manifest that breaks one is refused
MANIFEST_FIELDS = {
    "suite": str,
    "run_id": str,
    "suite_file": str,
    "suite_description": str,
    "created_at": str,
    "git": dict,
    "versions": dict,
    "devices": list,
    "host": dict,
    "env": dict,
    "argv": list,
    "n_cases": int,
    "host_load": dict,  # parabench.meters.host.run_host_load
}


def load_manifest(path: str | os.PathLike) -> dict:
    """A run's manifest, its fields' types checked; ``SchemaError`` names the file and field."""
    manifest = load_json(path)
    for key, kind in MANIFEST_FIELDS.items():
        v = manifest.get(key)
        if v is not None and (not isinstance(v, kind) or isinstance(v, bool)):
            raise SchemaError(f"{path}: field {key!r}: expected {kind.__name__}, found {type(v).__name__}")
    for key in ("devices",):
        for i, item in enumerate(manifest.get(key) or []):
            if not isinstance(item, dict):
                raise SchemaError(f"{path}: field '{key}[{i}]': expected an object, found {type(item).__name__}")
    for key in ("git", "versions", "host"):  # read as "name: value" lines
        for k, v in (manifest.get(key) or {}).items():
            if isinstance(v, (dict, list)) and key != "host":
                raise SchemaError(f"{path}: field '{key}.{k}': expected a value, found {type(v).__name__}")
    # A manifest written before values were scrubbed, or by hand, must not carry a credential into a report
    if isinstance(manifest.get("env"), dict):
        manifest["env"] = {
            k: REDACTED if looks_like_credential(str(k)) else _scrub(v) for k, v in manifest["env"].items()
        }
    if isinstance(manifest.get("argv"), list):
        manifest["argv"] = redact_argv([str(a) for a in manifest["argv"]])
    return manifest


def _report_problem(message: str) -> None:
    print(f"parabench: {message}", file=sys.stderr)


def load_run(run_dir: str | os.PathLike, problems: list[str] | None = None) -> tuple[dict, list[dict]]:
    """The manifest and every valid case record of a run folder (records sorted by label).

    Run folders are shared, so every file is untrusted input. A file that is not a readable result
    file of this schema (truncated, not JSON, another version, the manifest broken) raises
    ``SchemaError`` naming it. A record that reads but fails ``record.validate_record`` (a field of
    the wrong type, a case hash that is not hex, a launch file whose name is not its own launch's,
    such as a copy) is left out, with one line "FILE: field 'X': why" per record: appended to
    ``problems`` when given, else written to stderr. Values a valid record keeps but that are no
    possible measurement (NaN tokens/s) are named there too."""
    from parabench.record import RecordProblem, launch_file_name, validate_record

    run_dir = Path(run_dir)
    if not (run_dir / "manifest.json").exists():
        raise FileNotFoundError(f"{run_dir} is not a parabench run folder (no manifest.json)")
    manifest = load_manifest(run_dir / "manifest.json")
    note = problems.append if problems is not None else _report_problem
    records = []
    for p in sorted((run_dir / "cases").glob("*.json")):
        if p.is_symlink() or not p.is_file():
            note(f"{p}: left out: not a regular file")
            continue
        rec = load_json(p)
        try:
            notices = validate_record(rec)
            expected = launch_file_name(rec)
            if p.name != expected:
                raise RecordProblem(
                    "case_hash", f"this launch's file is {expected}; a record under another name is not a launch"
                )
        except RecordProblem as exc:
            note(f"{p}: left out: {exc}")
            continue
        for notice in notices:
            note(f"{p}: {notice}")
        records.append(rec)
    return manifest, sorted(records, key=lambda r: r["label"])


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
