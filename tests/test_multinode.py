"""Several nodes on one host (issue 56): two runners, each with its own torchrun agent, form two
"nodes" over gloo through torchrun's static rendezvous on localhost.

- the smoke suite's HSDP cases (shard group inside a node, replicas across) as 2 nodes x 2
  processes give the same losses and per-rank bytes as the smoke run's 1 x 4, recorded once, by node 0;
- a "node"-sized hpZ partition is recorded as the size the 2 nodes resolved it to;
- a node with another suite, a node that never arrives and a node killed mid-case each end with
  one clear message, and no process of any node is left behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from parabench import multinode
from parabench.distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
NODE_MARK = "PARABENCH_TEST_NODE"  # every process a test node starts inherits it: the node's processes

TINY_SUITE = """
[suite]
name = "{name}"
device = "cpu"
warmup = 0
steps = 1
seq_len = 16
micro_batch = 1
timeout_s = 60

{matrix}
"""
DDP = '[[matrix]]\nmodel = "tiny"\nstrategy = "{strategy}"\nworld_size = 2\n{extra}'


def _suite(tmp: Path, name: str, *strategies: str, hang_on_rank: int | None = None) -> Path:
    blocks = [DDP.format(strategy=s, extra="") for s in strategies]
    if hang_on_rank is not None:  # a first case whose rank on node 1 stops answering: node 0 waits in a collective
        fault = f'options = {{inject_fault = {{kind = "hang", rank = {hang_on_rank}, step = 0}}}}\n'
        blocks.insert(0, DDP.format(strategy=strategies[0], extra=fault))
    path = tmp / f"{name}.toml"
    path.write_text(TINY_SUITE.format(name=name, matrix="\n".join(blocks)))
    return path


def _node(suite, out: Path, rank: int, port: int, mark: str, *args: str, nnodes: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "parabench.cli", "run", "suite", str(suite), "--out", str(out), "--run-id", "t"]
    cmd += ["--nnodes", str(nnodes), "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}", "--no-report"]
    env = {**os.environ, NODE_MARK: f"{mark}-{rank}"}
    return subprocess.Popen(
        [*cmd, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _node_processes(mark: str, rank: int | None = None) -> list[int]:
    """Live processes of test node ``rank`` (every node of the test when None); zombies have no environment."""
    needle = f"\0{NODE_MARK}={mark}-{'' if rank is None else f'{rank}' + chr(0)}".encode()
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in b"\0" + f.read() + b"\0":
                    found.append(int(d))
        except OSError:
            continue
    return found


def _finish(nodes: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str]]:
    out = []
    for p in nodes:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((p.returncode, text))
    return out


def _no_orphans(mark: str) -> None:
    deadline = time.monotonic() + 10
    while _node_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _node_processes(mark) == [], "processes of a node outlived its runner"


def _records(run_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (run_dir / "cases").glob("*.json")}


def test_two_nodes_equal_one_node(smoke_run, tmp_path):
    """2 nodes x 2 processes = the smoke run's 1 x 4, to the bit: losses and per-rank bytes."""
    mark, port = uuid.uuid4().hex, free_port()
    args = ("--filter", "hsdp", "--filter", "fp32", "--rdzv-timeout", "60")
    nodes = [_node("smoke", tmp_path, r, port, mark, *args) for r in (0, 1)]
    (rc0, out0), (rc1, out1) = _finish(nodes)
    assert rc0 == 0 and rc1 == 0, out0[-3000:] + out1[-3000:]
    run_dir = tmp_path / "smoke" / "t"
    two = _records(run_dir)
    assert len(two) == 2 and all(r["status"] == "ok" for r in two.values())
    # node 1 wrote no record, no manifest: only its logs
    node1 = run_dir / "nodes" / "1"
    assert not (node1 / "cases").exists() and not (node1 / "manifest.json").exists()
    assert list((node1 / "logs").glob("*.log")) and "(recorded by node 0)" in out1
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["nodes"]["nnodes"] == 2
    one = _records(smoke_run)
    for key, rec in two.items():
        base = one[key]
        assert rec["launch"]["nnodes"] == 2 and rec["launch"]["nproc_per_node"] == 2
        assert base["launch"]["nnodes"] == 1
        assert [r["losses"] for r in rec["per_rank"]] == [r["losses"] for r in base["per_rank"]]
        for mine, theirs in zip(rec["per_rank"], base["per_rank"], strict=True):
            assert mine["comm"]["by_kind"] == theirs["comm"]["by_kind"]
        # the node split of the bytes: shards inside a node, replicas across
        split = rec["per_rank"][0]["comm"]["by_link"]
        assert split["intra_node"]["wire_bytes"] > 0 and split["inter_node"]["wire_bytes"] > 0
        assert base["per_rank"][0]["comm"]["by_link"]["inter_node"]["wire_bytes"] == 0
    _no_orphans(mark)


def test_node_groups_resolve_to_the_nodes_ranks(tmp_path):
    """hpz_partition_size "node" on 2 nodes of 1 process runs and records hpz_partition_size 1 (its
    hash, its label), where the default 2 would straddle the nodes: no such warning."""
    from parabench.suite import load_suite

    mark, port = uuid.uuid4().hex, free_port()
    extra = 'options = {hpz = true, hpz_partition_size = "node"}\n'
    suite = tmp_path / "mn.toml"
    suite.write_text(TINY_SUITE.format(name="mn", matrix=DDP.format(strategy="ref.zeropp", extra=extra)))
    (written,) = load_suite(str(suite)).cases
    straddling = dataclasses.replace(written, options={"hpz": True})
    assert "straddle" in multinode.placement_note(straddling, 2)
    nodes = [_node(suite, tmp_path, r, port, mark, "--rdzv-timeout", "60") for r in (0, 1)]
    (rc0, out0), (rc1, out1) = _finish(nodes)
    assert rc0 == 0 and rc1 == 0, out0[-3000:] + out1[-3000:]
    assert "straddle" not in out0 + out1
    (record,) = _records(tmp_path / "mn" / "t").values()
    ran = dataclasses.replace(written, options={"hpz": True, "hpz_partition_size": 1})
    assert record["status"] == "ok" and record["case"]["options"] == ran.options
    assert record["case_hash"] == ran.case_hash and record["label"] == ran.label
    _no_orphans(mark)


def test_node_with_another_suite_stops_every_node(tmp_path):
    mark, port = uuid.uuid4().hex, free_port()
    a = _suite(tmp_path, "mn", "ref.ddp")
    other = tmp_path / "other"
    other.mkdir()
    b = _suite(other, "mn", "torch.ddp")  # same suite name, another case list
    nodes = [
        _node(a, tmp_path / "out", 0, port, mark, "--rdzv-timeout", "30"),
        _node(b, tmp_path / "out", 1, port, mark, "--rdzv-timeout", "30"),
    ]
    for rc, out in _finish(nodes):
        assert rc == 2, out[-3000:]
        errors = [line for line in out.splitlines() if line.startswith("parabench: error:")]
        assert len(errors) == 1 and "the nodes run different suites" in errors[0], out[-3000:]
        assert "node 0" in errors[0] and "node 1" in errors[0] and "nothing was run" in errors[0]
    assert _records(tmp_path / "out" / "mn" / "t") == {}
    _no_orphans(mark)


def test_node_that_never_arrives(tmp_path):
    mark, port = uuid.uuid4().hex, free_port()
    suite = _suite(tmp_path, "mn", "ref.ddp", "torch.ddp")
    [(rc, out)] = _finish([_node(suite, tmp_path, 0, port, mark, "--rdzv-timeout", "2")])
    assert rc == 2, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("parabench: error:")]
    assert len(errors) == 1 and "node 1 did not arrive" in errors[0], out[-3000:]
    assert "nothing was run" in errors[0]
    assert _records(tmp_path / "mn" / "t") == {}
    _no_orphans(mark)


def test_node_killed_mid_case(tmp_path):
    """Node 1 dies while node 0's rank waits for it in a collective: the case is crashed with node
    1 named, the suite goes on and stops cleanly at the next rendezvous, which cannot form."""
    mark, port = uuid.uuid4().hex, free_port()
    suite = _suite(tmp_path, "mn", "ref.ddp", hang_on_rank=1)
    nodes = [_node(suite, tmp_path, r, port, mark, "--rdzv-timeout", "2") for r in (0, 1)]
    scratch = tmp_path / "mn" / "t" / ".scratch"
    deadline = time.monotonic() + 90
    while not list(scratch.glob("*/launch-1/*.started")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(scratch.glob("*/launch-1/*.started")), "the first case never started"
    time.sleep(1.0)
    for pid in _node_processes(mark, 1):  # the whole of node 1, as when its host dies
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    (rc0, out0), _ = _finish(nodes)
    assert rc0 == 2, out0[-3000:]
    records = {r["label"]: r for r in _records(tmp_path / "mn" / "t").values()}
    crashed = [r for r in records.values() if r["status"] == "crashed"]
    assert len(crashed) == 1 and "node 1 (rank 1) was lost mid-case" in crashed[0]["error"]["message"], records
    errors = [line for line in out0.splitlines() if line.startswith("parabench: error:")]
    assert len(errors) == 1 and "node 1 did not arrive" in errors[0], out0[-3000:]
    _no_orphans(mark)


def test_runner_refuses_nodes_without_rank(tmp_path):
    from parabench.launch import LaunchOptions, OutputError
    from parabench.runner import Runner
    from parabench.suite import load_suite

    suite = load_suite(_suite(tmp_path, "mn", "ref.ddp"))
    with pytest.raises(OutputError, match="needs --node-rank"):
        Runner(suite, tmp_path / "r", LaunchOptions(nnodes=2))
    with pytest.raises(OutputError, match="--emulate-link needs --gpus-per-node"):
        Runner(suite, tmp_path / "r", LaunchOptions(nnodes=2, node_rank=0, emulate_link="socket"))
