"""``parabench slurm SUITE --nodes N --gpus-per-node G``: an sbatch script that runs the suite on N
nodes through ``srun`` (one task per node) and torchrun's rendezvous, nothing of parabench's own.

Every task runs the same ``parabench run suite`` with ``--node-rank $SLURM_NODEID``; the first host
of the allocation is the rendezvous endpoint; the job id names the rendezvous and the run folder,
so a resubmission with ``--resume`` (``PARABENCH_RUN_ID``) continues the same run. Node 0 writes the
records (``parabench.multinode``); the others keep their logs under ``nodes/<rank>/``.
"""

from __future__ import annotations

import re
import shlex

DEFAULT_PORT = 29500
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")
_NAME = re.compile(r"^[A-Za-z0-9_.,+-]+$")


class SlurmError(ValueError):
    pass


def sbatch_script(
    suite: str,
    nodes: int,
    gpus_per_node: int,
    partition: str | None = None,
    time_limit: str | None = None,
    out: str = "results",
    port: int = DEFAULT_PORT,
    rdzv_timeout_s: int | None = None,
    account: str | None = None,
    extra_run_args: list[str] | None = None,
) -> str:
    """The script's text. ``suite``: a suite name or .toml path, passed to ``parabench run suite``."""
    if nodes < 1 or gpus_per_node < 1:
        raise SlurmError(f"--nodes and --gpus-per-node must be >= 1 (got {nodes}, {gpus_per_node})")
    if time_limit is not None and not _TIME.match(time_limit):
        raise SlurmError(f"--time {time_limit!r} is not a SLURM time (minutes, HH:MM:SS or D-HH:MM:SS)")
    for flag, value in (("--partition", partition), ("--account", account)):
        if value is not None and not _NAME.match(value):
            raise SlurmError(f"{flag} {value!r}: letters, digits and _.,+- only")
    if not 1 <= port <= 65535:
        raise SlurmError(f"port {port} is out of range")
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", suite.rsplit("/", 1)[-1].removesuffix(".toml"))
    head = [
        "#!/bin/bash",
        f"#SBATCH --job-name=parabench-{job}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        "#SBATCH --exclusive",
        f"#SBATCH --output=parabench-{job}-%j.out",
    ]
    if partition:
        head.append(f"#SBATCH --partition={partition}")
    if account:
        head.append(f"#SBATCH --account={account}")
    if time_limit:
        head.append(f"#SBATCH --time={time_limit}")
    run = [
        "parabench",
        "run",
        "suite",
        suite,
        "--out",
        out,
        "--nnodes",
        str(nodes),
        *(["--rdzv-timeout", str(rdzv_timeout_s)] if rdzv_timeout_s else []),
        *(extra_run_args or []),
    ]
    # Quoted here; the node-dependent parts are expanded by each task's own shell.
    per_task = (
        shlex.join(run)
        + ' --node-rank "$SLURM_NODEID" --rdzv-endpoint "$PARABENCH_RDZV_HOST:$PARABENCH_RDZV_PORT"'
        + ' --rdzv-id "parabench-$SLURM_JOB_ID" --run-id "$PARABENCH_RUN_ID"'
    )
    body = [
        "set -euo pipefail",
        "# the first host of the allocation hosts the rendezvous (node 0: it writes the records)",
        'export PARABENCH_RDZV_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        f'export PARABENCH_RDZV_PORT="${{PARABENCH_RDZV_PORT:-{port}}}"',
        'export PARABENCH_RUN_ID="${PARABENCH_RUN_ID:-slurm-$SLURM_JOB_ID}"',
        "# one task per node; a node that stops makes the next rendezvous of the others fail, and they stop too",
        f"srun --nodes={nodes} --ntasks-per-node=1 bash -c {shlex.quote(per_task)}",
    ]
    return "\n".join(head + [""] + body) + "\n"


def parse_sbatch(text: str) -> dict:
    """The script read back: its ``#SBATCH`` options, exported variables and the srun command's
    words (the ``bash -c`` command split too), as a test or a dry check needs them."""
    options, exports, srun = {}, {}, None
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH ") :].partition("=")
            options[key.lstrip("-")] = value
        elif line.startswith("export "):
            key, _, value = line[len("export ") :].partition("=")
            exports[key] = value
        elif line.startswith("srun "):
            srun = shlex.split(line)
    if srun is None:
        raise SlurmError("no srun line in the script")
    inner = shlex.split(srun[srun.index("-c") + 1]) if "-c" in srun else []
    return {"options": options, "exports": exports, "srun": srun, "task": inner}


def slurm_main(args) -> int:
    import sys

    try:
        text = sbatch_script(
            args.suite,
            args.nodes,
            args.gpus_per_node,
            partition=args.partition,
            time_limit=args.time,
            out=args.out,
            port=args.port,
            rdzv_timeout_s=args.rdzv_timeout,
            account=args.account,
        )
    except SlurmError as exc:
        print(f"parabench: error: {exc}", file=sys.stderr)
        return 2
    if args.output and args.output != "-":
        with open(args.output, "w") as f:
            f.write(text)
        print(f"parabench: wrote {args.output}; submit it with: sbatch {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def add_arguments(p) -> None:
    p.add_argument("suite", help="suite name or .toml path, as for `parabench run suite`")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--time", help="SLURM time limit (minutes, HH:MM:SS, D-HH:MM:SS)")
    p.add_argument("--out", default="results", help="results folder on the nodes (default results)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"rendezvous port on node 0 (default {DEFAULT_PORT})")
    p.add_argument("--rdzv-timeout", type=int, default=None, help="seconds a launch waits for every node")
    p.add_argument("-o", "--output", help="write the script here (default: standard output)")
