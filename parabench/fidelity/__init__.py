"""Peer fidelity: each library peer beside a minimal script written from that library's docs.

``parabench fidelity RUN_DIR`` takes every finished (``ok``) case of a peer that has a script
(``PEER_SCRIPTS``), launches the script with torchrun on the same shape, micro-batch, steps,
warm-up, seed, learning rate, precision and recipe, and writes ``RUN_DIR/fidelity/<case_hash>.json``
(the script's own JSON under ``result``; ``status`` ok / failed / timeout / skipped, with the reason).
The pipeline peers (``torch.pp_*``) pass their schedule, micro-batches per step and stages per rank
as the adapter reads them from the case; their script runs one pipeline over the whole world.
The report (``parabench.report.fidelity``) then sets adapter beside script: tokens/s per device
(target: adapter >= 0.95x the script) and peak memory (target: adapter <= 1.05x).

Both sides time alike, as ``parabench.worker`` does: a CUDA event after each timed step with no
device sync between steps (the host clock on CPUs), read once at the end; tokens/s per device from
the slowest rank's median step. Beside it both record the timed window's wall clock, from one
device sync before the first timed step to one after the last (``timed_window_s`` /
``window_tokens_per_s_per_device``). The step durations add up to about the window, but their
median leaves out slow steps (a host stall, a garbage collection, a library's periodic sync) that
the window keeps; the report shows both ratios, and where they disagree a median flatters a side.

The torch scripts follow torchtitan, the PyTorch team's reference recipe (FSDP2 groups and
resharding, DDP buckets, the TP and TP+SP plans, the pipeline split, fused AdamW), the DeepSpeed
ones DeepSpeed's documentation and examples. Where that differs from what the case runs, the
script's result says so under ``choices`` ({name: {script, case, source}}), and the report prints
it beside the ratio: such a row compares two recipes, not an adapter with its library.

The scripts live in ``parabench/fidelity/scripts/`` and import torch and DeepSpeed only, never
parabench (a test parses their imports): they are what a user of the library would write, so an
adapter that falls behind its script is the adapter's defect, not the library's. Launches go
through the runner's machinery (``LaunchOwner``: the run folder's lock, marked processes ended
completely, the environment passed through with NCCL_* and the rest).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from parabench.report.fidelity import interval_text, ratios

SCRIPTS_DIR = Path(__file__).resolve().parent / "scripts"


# What the pipeline script takes: the degree (which must be the world size), the micro-batches per
# step and the stages per rank (ModelParallelOptions).
PIPELINE_OPTIONS = ("pp", "microbatches", "virtual_stages")


@dataclass(frozen=True)
class PeerScript:
    script: str
    recipes: tuple[str, ...]  # the bf16 recipes the script runs
    extra_args: tuple[str, ...] = ()
    options: tuple[str, ...] = ()  # case options the script takes (beyond NEUTRAL_OPTIONS)
    # the script takes --profile tuned: the adapter's tuned profile is then checked against the same
    # documented keys in the library's own loop, not against the library's defaults
    tuned_profile: bool = False
    # (case, model config) -> (the script's arguments for the case's options, None) or ([], why not)
    option_args: Callable[[dict, object], tuple[list[str], str | None]] | None = None
    moe: bool = False  # the script builds the MoE GPT (the model's expert settings as arguments)


def _zeropp_args(case: dict, cfg) -> tuple[list[str], str | None]:
    """ZeRO++'s switches under DeepSpeed's config names, as the adapter maps them."""
    from parabench.families.sharded import DeepSpeedZeroPPOptions

    o = DeepSpeedZeroPPOptions.read(case.get("options") or {})
    hpz = o.hpz_partition_size if o.hpz else 1
    return [
        f"--zero-quantized-weights={o.qwz}",
        f"--zero-hpz-partition-size={hpz}",
        f"--zero-quantized-gradients={o.qgz}",
    ], None


def _moe_args(case: dict, cfg) -> tuple[list[str], str | None]:
    """The MoE model's expert settings and the gate's minimum capacity (option ``min_capacity``)."""
    from parabench.families.expert import ExpertOptions

    if cfg.balanced_routing:
        return [], "balanced routing: parabench's bias inside DeepSpeed's gate, which a user's gate does not have"
    o = ExpertOptions.read(case.get("options") or {})
    args = [f"--n-experts={cfg.n_experts}", f"--top-k={cfg.top_k}", f"--moe-every={cfg.moe_every}"]
    args += [f"--aux-loss-coef={cfg.aux_loss_coef}", f"--min-capacity={o.min_capacity}"]
    if cfg.capacity_factor is not None:
        args.append(f"--capacity-factor={cfg.capacity_factor}")
    return args, None


def _deepspeed_zero(stage: int, *extra: str, **kw) -> PeerScript:
    return PeerScript("deepspeed_zero.py", ("master",), ("--stage", str(stage), *extra), tuned_profile=True, **kw)


PEER_SCRIPTS: dict[str, PeerScript] = {
    "torch.ddp": PeerScript("torch_ddp.py", ("amp", "master")),
    "torch.fsdp2": PeerScript("torch_fsdp2.py", ("amp", "master"), options=("compile",)),
    "torch.fsdp2_offload": PeerScript("torch_fsdp2.py", ("amp", "master"), ("--cpu-offload",), options=("compile",)),
    "torch.hsdp": PeerScript("torch_fsdp2.py", ("amp", "master"), options=("shard_size", "compile")),
    "torch.tp": PeerScript("torch_tp.py", ("amp", "master")),
    "torch.tp_sp": PeerScript("torch_tp.py", ("amp", "master"), ("--sequence-parallel",)),
    "torch.cp": PeerScript("torch_cp.py", ("amp",), options=("cp", "cp_split")),
    **{f"deepspeed.zero{stage}": _deepspeed_zero(stage) for stage in (0, 1, 2, 3)},
    "deepspeed.zero2_offload": _deepspeed_zero(2, "--offload-optimizer", "cpu"),
    "deepspeed.zero3_offload": _deepspeed_zero(3, "--offload-optimizer", "cpu"),
    "deepspeed.zeropp": _deepspeed_zero(
        3, options=("qwz", "hpz", "hpz_partition_size", "qgz"), option_args=_zeropp_args
    ),
    "deepspeed.pp": PeerScript("deepspeed_pipe.py", ("master",), options=("pp", "microbatches"), tuned_profile=True),
    "deepspeed.ulysses": PeerScript("deepspeed_ulysses.py", ("amp",), options=("cp", "cp_split")),
    "deepspeed.moe": PeerScript(
        "deepspeed_moe.py",
        ("master",),
        options=("ep", "min_capacity"),
        tuned_profile=True,
        option_args=_moe_args,
        moe=True,
    ),
    **{
        f"torch.pp_{schedule}": PeerScript(
            "torch_pipeline.py", ("amp", "master"), ("--schedule", schedule), PIPELINE_OPTIONS
        )
        for schedule in ("gpipe", "1f1b", "interleaved", "zb")
    },
}
# Library peers without a script, and why: every peer of kind "peer" is in PEER_SCRIPTS or here
# (tests/test_fidelity_scripts.py).
NO_SCRIPT: dict[str, str] = {
    "deepspeed.zero3_nvme": (
        "ZeRO-Infinity's NVMe offload is bound by the drive and its aio settings, which the host decides; "
        "suites/zero-infinity-nvme-gpu.toml sets it beside ref.zero_infinity instead"
    ),
    "torch.ddp_fp16_hook": (
        "a DDP communication hook (one register_comm_hook call on torch_ddp.py's DDP): the compression "
        "study compares its bytes and loss with the reference's; no separate script yet"
    ),
    "torch.ddp_powersgd_hook": (
        "a DDP communication hook (PowerSGDState + powerSGD_hook on torch_ddp.py's DDP): the compression "
        "study compares its bytes and loss with the reference's; no separate script yet"
    ),
    "torch.local_sgd": (
        "PostLocalSGDOptimizer's periodic averaging: the compression study compares its loss with the "
        "reference's; no separate script yet"
    ),
}
# The tensor-parallel scripts use the whole world as their TP group.
TP_PEERS = ("torch.tp", "torch.tp_sp")
# The issue's names and the short ones the scripts take.
RECIPE_NAMES = {"amp": "amp", "master": "master", "bf16-master": "master", "fp16-master": None, "fp16-amp": None}
# Options that change neither the work of a step nor what it holds (meters, the profile's label,
# the TP degree the script takes from the world size): anything else and the script would not be
# the same training.
NEUTRAL_OPTIONS = {
    "tp",
    "profile",
    "telemetry",
    "timed_meters",
    "roofline",
    "step_breakdown",
    "memory_breakdown",
    "record_timeline",
    "step_sync",
    "python_gc",
    "optimizer_in_config",
    "trace",
    "memory_snapshot",
}


def recipe_of(record: dict) -> str | None:
    """The case's precision recipe as the scripts name it; None for fp32. A case from before the
    recipe axis (no ``recipe`` field) ran its strategy's recipe of the time (``parabench.recipes``)."""
    from parabench.registry import recipe_of as case_recipe

    recipe = case_recipe(record["case"])
    return RECIPE_NAMES.get(recipe, recipe)


def plan(record: dict) -> tuple[list[str] | None, str | None]:
    """(script arguments, None) for a case the script can run, else (None, why not)."""
    from parabench.shapes import model_config

    case = record["case"]
    peer = PEER_SCRIPTS[case["strategy"]]
    if case.get("precision") not in ("fp32", "bf16"):
        return None, f"the scripts run fp32 and bf16, not {case.get('precision')}"
    if case.get("grad_accum", 1) != 1:
        return None, "gradient accumulation: the scripts take one micro-batch per step"
    options = case.get("options") or {}
    other = sorted(set(options) - NEUTRAL_OPTIONS - set(peer.options))
    if other:
        return None, f"options the script does not take: {', '.join(other)}"
    tp = int(options.get("tp", 1))
    if case["strategy"] in TP_PEERS and tp != case["world_size"]:
        return None, f"the TP script uses the whole world as its TP group (tp={tp}, world {case['world_size']})"
    if case["strategy"] not in TP_PEERS and tp != 1:
        return None, f"tp={tp}: {case['strategy']}'s script takes no tensor parallelism"
    pipeline_args, why = _pipeline_args(case, peer)
    if why is not None:
        return None, why
    shard_args, why = _shard_args(case, peer)
    if why is not None:
        return None, why
    recipe = recipe_of(record)
    if recipe is not None and recipe not in peer.recipes:
        return None, f"{case['strategy']}'s script has no recipe {recipe!r} (it runs {', '.join(peer.recipes)})"
    layout = case.get("layout") or "separate"  # records of the default layout carry no field
    if layout != "separate" and case["strategy"] in TP_PEERS:
        return None, "the TP script shards the separate q, k, v linears by heads"
    cfg = model_config(case["model"], case.get("seq_len"), layout=layout)
    if cfg.is_moe != peer.moe or cfg.mlp_ratio != 4:
        return None, "the script builds the MoE GPT" if peer.moe else "the scripts build the dense GPT with a 4x MLP"
    option_args, why = peer.option_args(case, cfg) if peer.option_args else ([], None)
    if why is not None:
        return None, why
    device = (record.get("device") or {}).get("type") or ("cpu" if case.get("device") == "cpu" else "cuda")
    args = [
        str(SCRIPTS_DIR / peer.script),
        *peer.extra_args,
        f"--n-layer={cfg.n_layers}",
        f"--n-head={cfg.n_heads}",
        f"--d-model={cfg.d_model}",
        f"--vocab={cfg.vocab_size}",
        f"--seq-len={cfg.seq_len}",
        f"--micro-batch={case['micro_batch']}",
        f"--steps={case['steps']}",
        f"--warmup={case['warmup']}",
        f"--seed={case['seed']}",
        f"--lr={case['lr']}",
        f"--precision={case['precision']}",
        f"--device={device}",
    ]
    if recipe is not None:
        args.append(f"--recipe={recipe}")
    if peer.tuned_profile and options.get("profile") == "tuned":
        args.append("--profile=tuned")
    if options.get("compile"):  # a script that takes it (peer.options), or the case was refused above
        args.append("--compile")
    args += pipeline_args + shard_args + option_args
    if layout != "separate":
        args.append(f"--layout={layout}")
    return args, None


def _pipeline_args(case: dict, peer: PeerScript) -> tuple[list[str], str | None]:
    """The pipeline script's degree, micro-batches and stages per rank as the adapter
    (parabench/peers/torch_pipeline.py) reads them from the case; ([], None) for other scripts."""
    if "pp" not in peer.options:
        return [], None
    from parabench.families.model_parallel import INTERLEAVED_STRATEGIES, ModelParallelOptions

    o = ModelParallelOptions.read(case.get("options") or {})
    if o.pp != case["world_size"]:
        return [], (
            f"the pipeline script runs one pipeline over the whole world (pp={o.pp}, world "
            f"{case['world_size']}): no data parallelism beside it"
        )
    v = o.virtual_stages if case["strategy"] in INTERLEAVED_STRATEGIES else 1  # the adapter's
    return [f"--microbatches={o.n_microbatches}", f"--virtual-stages={v}"], None


def _shard_args(case: dict, peer: PeerScript) -> tuple[list[str], str | None]:
    """HSDP's shard-group size as the adapter (``build_hsdp``) reads it; ([], None) for other scripts."""
    if "shard_size" not in peer.options:
        return [], None
    from parabench.families.sharded import ShardedPeerOptions

    shard = ShardedPeerOptions.read(case.get("options") or {}).shard_size
    if shard < 1 or case["world_size"] % shard:
        return [], f"shard_size={shard} does not divide the world size {case['world_size']}"
    return [f"--shard-size={shard}"], None


def peer_records(records: list[dict]) -> list[dict]:
    """A run's finished peer cases that have a script, one per case hash (the first launch)."""
    seen, out = set(), []
    for r in records:
        case = r.get("case") or {}
        if r.get("status") != "ok" or case.get("strategy") not in PEER_SCRIPTS or case.get("repeat", 0):
            continue
        if r["case_hash"] not in seen:
            seen.add(r["case_hash"])
            out.append(r)
    return out


def fidelity_path(run_dir: Path, case_hash: str) -> Path:
    """``fidelity/<hash>.json`` in the run folder. The hash comes from a record in a shared folder:
    anything but hex digits, or a ``fidelity`` folder that leads elsewhere (a link), is refused, so
    nothing is ever written outside the run folder."""
    from parabench.record import CASE_HASH_PATTERN
    from parabench.results import UnsafeNameError

    if not isinstance(case_hash, str) or not CASE_HASH_PATTERN.fullmatch(case_hash):
        raise UnsafeNameError(f"case_hash {case_hash!r} is not a case hash (hex digits); it would name a file")
    return fidelity_folder(run_dir) / f"{case_hash}.json"


def fidelity_folder(run_dir: Path) -> Path:
    """``RUN/fidelity``, refused (``UnsafeNameError``) when it or its ``logs`` is a link or a file:
    a shared run folder must not lead the writes elsewhere."""
    from parabench.results import UnsafeNameError

    folder = Path(run_dir) / "fidelity"
    for f in (folder, folder / "logs"):
        if f.is_symlink() or (f.exists() and not f.is_dir()):
            raise UnsafeNameError(f"{f} is not a folder of the run (a link or a file); nothing is written there")
    return folder


def run_fidelity(
    run_dir: Path, filters: list[str] | None = None, redo: bool = False, launches: int = 1, echo=print
) -> dict:
    """Run the script of every eligible peer case of ``run_dir``, ``launches`` times each (a case
    that already has some ok launches gets only the missing ones); return counts by status.

    Host-bound peers (DeepSpeed ZeRO-3 at small micro-batches) move by 20-40 % between launches of
    the same code, the script as much as the adapter: one launch a side cannot tell a defect from
    that spread. The entry keeps every launch (``launches``); ``result`` is the first ok one."""
    from parabench.launch import LaunchOwner
    from parabench.results import load_run, write_json_atomic
    from parabench.stats import combine_launches

    run_dir = Path(run_dir)
    _, run_records = load_run(run_dir)
    records = [r for r in peer_records(run_records) if all(f in r.get("label", "") for f in filters or [])]
    # each line judges the adapter's launches (--repeats) against the script's so far, as the report does
    pooled = {r.get("case_hash"): r for r in combine_launches(run_records)}
    counts = {"ok": 0, "failed": 0, "timeout": 0, "skipped": 0, "kept": 0}
    owner = LaunchOwner(run_dir, echo)
    (fidelity_folder(run_dir) / "logs").mkdir(parents=True, exist_ok=True)
    with owner.owning():
        for r in records:
            case, key = r["case"], r["case_hash"]
            out_path = fidelity_path(run_dir, key)
            previous = _read_entry(out_path) if not redo else None
            done = [x for x in (previous or {}).get("launches") or _legacy_launches(previous) if x["status"] == "ok"]
            if previous is not None and (previous.get("status") == "skipped" or len(done) >= launches):
                counts["kept"] += 1
                continue
            base = {"case_hash": key, "label": r.get("label"), "strategy": case["strategy"], "recipe": None}
            args, reason = plan(r)
            if args is None:
                write_json_atomic(out_path, {**base, "status": "skipped", "reason": reason})
                counts["skipped"] += 1
                echo(f"fidelity: skipped {r.get('label')}: {reason}")
                continue
            base["recipe"] = recipe_of(r)
            for _ in range(launches - len(done)):
                entry = _launch_script(owner, run_dir, r, args, done)
                if entry["status"] == "ok":
                    done.append(entry)
                written = _entry({**base, "script": entry["script"], "argv": entry["argv"]}, done, entry)
                write_json_atomic(out_path, written)
                counts[entry["status"]] += 1
                echo(fidelity_line(pooled.get(key, r), written if entry["status"] == "ok" else entry))
                if entry["status"] != "ok":
                    break
    return counts


def _read_entry(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _legacy_launches(entry: dict | None) -> list[dict]:
    """An entry written before ``launches`` existed: its one launch."""
    if not entry or "result" not in entry:
        return []
    keep = ("status", "result", "started_at", "duration_s", "log")
    return [{k: entry[k] for k in keep if k in entry}]


def _entry(base: dict, ok_launches: list[dict], last: dict) -> dict:
    """The case's fidelity entry: every ok launch, the first one's result as ``result``; a failed
    last launch (status, reason, log tail) when no launch succeeded."""
    if not ok_launches:
        return {**base, **{k: v for k, v in last.items() if k not in ("script", "argv")}}
    first = ok_launches[0]
    return {**base, "status": "ok", "result": first["result"], "log": first.get("log"), "launches": ok_launches}


def _is_deepspeed(script: str) -> bool:
    return Path(script).name.startswith("deepspeed_")


def _launch_script(owner, run_dir: Path, record: dict, args: list[str], done: list[dict]) -> dict:
    """One torchrun launch of the case's script; its outcome as a launch entry."""
    from parabench.launch import LaunchOptions

    case, key = record["case"], record["case_hash"]
    device = next(a.split("=", 1)[1] for a in args if a.startswith("--device="))
    suffix = f".{len(done)}" if done else ""
    result_file = owner.scratch / f"{key}{suffix}.script.json"
    result_file.unlink(missing_ok=True)
    # a DeepSpeed script on CPUs starts without building DeepSpeed's shm op, as its adapter does
    entry = ["-m", "parabench.fidelity.deepspeed_cpu"] if device == "cpu" and _is_deepspeed(args[0]) else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *LaunchOptions().torchrun_args(case["world_size"]),
        *entry,
        *args,
        f"--out={result_file}",
    ]
    log = run_dir / "fidelity" / "logs" / f"{key}{suffix}.log"
    started = time.time()
    rc, timed_out = owner.run_torchrun(cmd, owner.launch_env(device), log, float(case.get("timeout_s", 600)))
    entry = {
        "script": str(Path(args[0]).relative_to(SCRIPTS_DIR.parent.parent.parent)),
        "argv": [Path(args[0]).name, *args[1:]],
        "started_at": started,
        "duration_s": time.time() - started,
        "log": str(log.relative_to(run_dir)),
    }
    if result_file.exists() and rc == 0:
        entry.update(status="ok", result=json.loads(result_file.read_text()))
    else:
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        status = "timeout" if timed_out else "failed"
        entry.update(status=status, reason=f"exit status {rc}", log_tail=tail)
    return entry


def fidelity_line(record: dict, entry: dict) -> str:
    if entry["status"] != "ok":
        return f"fidelity: {entry['status']} {record.get('label')}: {entry.get('reason')}"
    r = ratios(record, entry)

    def f(v, spec):
        return format(v, spec) if v is not None else "-"

    pooled = f", interval {interval_text(r['tps_interval'])}" if r["tps_interval"] else ""
    return (
        f"fidelity: {record.get('label')}: tok/s/dev adapter {f(r['adapter_tps'], ',.0f')} script "
        f"{f(r['script_tps'], ',.0f')} ({f(r['tps_ratio'], '.3f')}x{pooled}; medians of {r['launches']} launches; "
        f"window {f(r['window_ratio'], '.3f')}x), "
        f"peak adapter/script {f(r['mem_ratio'], '.3f')}x, "
        f"host dispatch µs adapter/script {f(r['adapter_dispatch_us'], '.1f')}/{f(r['script_dispatch_us'], '.1f')}: "
        f"{r['verdict']}"
    )
