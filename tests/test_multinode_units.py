"""The node-aware pieces without a launch: the hierarchical all-reduce and the intra/inter-node
split of the communication meter (4 gloo processes laid out as 2 emulated nodes of 2), the
theory of that split, the rendezvous-failure messages, the GPU emulation's environment, the
sbatch script, and the "node" option sizes resolved from the launch layout."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from parabench import multinode
from parabench.distributed import run_on_gloo
from parabench.slurm import SlurmError, parse_sbatch, sbatch_script

ROOT = Path(__file__).resolve().parent.parent

N = 4096  # elements all-reduced (fp32): 16 KiB


def _allreduce_both() -> dict:
    from parabench.meters.comm import CommMeter
    from reference_impls.collectives import hierarchical_allreduce, node_groups, ring_allreduce

    rank = dist.get_rank()
    intra, inter = node_groups(2, 2)
    x = torch.arange(N, dtype=torch.float32) * (rank + 1)
    expected = torch.arange(N, dtype=torch.float32) * 10  # 1 + 2 + 3 + 4
    out = {}
    for name, fn in (
        ("flat", lambda t: ring_allreduce(t)),
        ("hier", lambda t: hierarchical_allreduce(t, intra, inter)),
    ):
        t = x.clone()
        with CommMeter() as meter:
            fn(t)
        out[name] = {"ok": bool(torch.equal(t, expected)), "by_link": meter.summary()["by_link"]}
    return out


def test_hierarchical_allreduce_sends_less_across_nodes(monkeypatch):
    monkeypatch.setenv("PARABENCH_NODE_SIZE", "2")  # 4 ranks as 2 nodes of 2 (the meter's layout)
    results = run_on_gloo(_allreduce_both, 4)
    nbytes = N * 4
    for rank, res in enumerate(results):
        assert res["flat"]["ok"] and res["hier"]["ok"], rank
        hier = res["hier"]["by_link"]
        assert hier["nodes"] == 2 and hier["ranks_per_node"] == 2
        # the meter counts what a rank sends and what it receives (point-to-point kinds send, recv):
        # inside, a reduce-scatter and an all-gather of N/2 each way; across, a 2-rank ring of the N/2 shard
        assert hier["intra_node"]["wire_bytes"] == 2 * nbytes
        assert hier["inter_node"]["wire_bytes"] == nbytes
    # the flat ring over 4: each rank either sends to or receives from the other node, 2(n-1)/n N each step set
    flat_inter = [r["flat"]["by_link"]["inter_node"]["wire_bytes"] for r in results]
    assert flat_inter == [nbytes * 3 // 2] * 4
    assert [r["flat"]["by_link"]["intra_node"]["wire_bytes"] for r in results] == [nbytes * 3 // 2] * 4


def test_node_layout_and_fractions():
    layout = multinode.NodeLayout.from_env({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "5"})
    assert (layout.nnodes, layout.local_world_size, layout.node_rank) == (2, 4, 1)
    assert layout.span([0, 1, 2, 3]) == 1 and layout.span([0, 4]) == 2
    from parabench.multinode import inter_node_fraction

    assert inter_node_fraction("all_reduce", [0, 1, 2, 3], layout) == 0.0
    assert inter_node_fraction("all_reduce", list(range(8)), layout) == 2 / 8
    assert inter_node_fraction("all_to_all", list(range(8)), layout) == 4 / 7
    assert inter_node_fraction("send", list(range(8)), layout, peer=4, me=3) == 1.0
    assert inter_node_fraction("send", list(range(8)), layout, peer=2, me=3) == 0.0


def test_theory_by_link_for_hsdp_and_ddp():
    layout = multinode.NodeLayout(2, 2)
    hsdp = SimpleNamespace(strategy="ref.hsdp", options={"shard_size": 2})
    split = multinode.theory_by_link(hsdp, {"all_gather": 1000, "reduce_scatter": 1000, "all_reduce": 400}, layout)
    # shards inside the node: (2-1)/2 of 2000; replicas across: 2(2-1)/2 of 400, all of it inter-node
    assert split == {"intra_node": {"wire_bytes": 1000}, "inter_node": {"wire_bytes": 400}}
    ddp = SimpleNamespace(strategy="ref.ddp", options={})
    split = multinode.theory_by_link(ddp, {"all_reduce": 4000}, layout)
    assert split["inter_node"]["wire_bytes"] == 3000 and split["intra_node"]["wire_bytes"] == 3000
    assert (
        multinode.theory_by_link(SimpleNamespace(strategy="ref.tp", options={"tp": 2}), {"all_reduce": 1}, layout)
        is None
    )
    assert multinode.theory_by_link(ddp, {"all_reduce": [3000, 4000]}, layout) is None  # a range: no split
    one = multinode.theory_by_link(ddp, {"all_reduce": 4000}, multinode.NodeLayout(1, 4))
    assert one["inter_node"]["wire_bytes"] == 0


def test_rendezvous_failure_names_the_node():
    server = "torch.distributed.DistStoreError: Timed out after 4 seconds waiting for clients. 1/2 clients joined."
    assert multinode.rendezvous_failure(server, 2, 0, "h:1").startswith("node 1 did not arrive")
    three = multinode.rendezvous_failure(server.replace("1/2", "1/3"), 3, 0, "h:1")
    assert three.startswith("2 of nodes 1, 2 did not arrive")
    client = "The client socket has timed out after 3000ms while trying to connect to (10.0.0.1, 29500)."
    assert multinode.rendezvous_failure(client, 2, 1, "10.0.0.1:29500").startswith(
        "node 0 (the rendezvous host 10.0.0.1:29500)"
    )
    assert multinode.rendezvous_failure("RuntimeError: something else", 2, 0, "h:1") is None
    lost = multinode.lost_node_message(["gloo: Connection closed by peer [127.0.0.1]:5"], 2, 0, 4)
    assert lost.startswith("node 1 (ranks 4-7) was lost mid-case")
    assert multinode.lost_node_message(["gloo: Connection closed by peer"], 1, 0, 4) is None


def test_disagreement_names_both_sides():
    a = {"node": 0, "host": "a", "suite": "s1", "n_cases": 3, "cases": ["x"]}
    assert multinode.disagreement([a, {**a, "node": 1, "host": "b"}]) is None
    why = multinode.disagreement([a, {**a, "node": 1, "host": "b", "suite": "s2", "n_cases": 2}])
    assert "node 0 (a)" in why and "node 1 (b)" in why and "s2 (2 cases)" in why
    why = multinode.disagreement([a, {**a, "node": 1, "host": "b", "cases": ["y"]}])
    assert "launched different cases" in why


def test_emulation_env_splits_the_gpus_and_forces_sockets():
    env0, env1 = multinode.emulation_env(0, 2), multinode.emulation_env(1, 2)
    assert env0["CUDA_VISIBLE_DEVICES"] == "0,1" and env1["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env0["NCCL_HOSTID"] != env1["NCCL_HOSTID"]  # NCCL then sees two hosts: no P2P/SHM across
    assert env0["NCCL_NET"] == "Socket" and env0["NCCL_IB_DISABLE"] == "1"
    manifest = multinode.emulation_manifest(2, 2, "socket")
    assert "emulation" in manifest["note"] and len(manifest["env_per_node"]) == 2
    with pytest.raises(ValueError):
        multinode.emulation_env(0, 2, "infiniband")


def test_torchrun_args_static_rendezvous_per_launch():
    from parabench.launch import LaunchOptions

    opts = LaunchOptions(nnodes=2, node_rank=1, rdzv_endpoint="h:29500", rdzv_id="job", rdzv_timeout_s=30)
    args = opts.torchrun_args(4, launch_number=3)
    assert args[args.index("--rdzv-backend") + 1] == "static"
    assert args[args.index("--node-rank") + 1] == "1" and args[args.index("--rdzv-id") + 1] == "job-3"
    assert args[args.index("--rdzv-conf") + 1] == "timeout=30"
    assert "--standalone" in LaunchOptions().torchrun_args(2)


def test_sbatch_script_runs_the_suite_through_srun_and_torchrun():
    text = sbatch_script("h100x8", nodes=4, gpus_per_node=8, partition="gpu", time_limit="02:00:00", rdzv_timeout_s=900)
    parsed = parse_sbatch(text)
    opts = parsed["options"]
    assert opts["nodes"] == "4" and opts["ntasks-per-node"] == "1" and opts["gpus-per-node"] == "8"
    assert opts["partition"] == "gpu" and opts["time"] == "02:00:00"
    srun = parsed["srun"]
    assert srun[0] == "srun" and "--nodes=4" in srun and "--ntasks-per-node=1" in srun
    task = parsed["task"]
    assert task[:4] == ["parabench", "run", "suite", "h100x8"]
    flag = {task[i]: task[i + 1] for i in range(4, len(task) - 1) if task[i].startswith("--")}
    assert flag["--nnodes"] == "4" and flag["--node-rank"] == "$SLURM_NODEID"
    assert flag["--rdzv-endpoint"] == "$PARABENCH_RDZV_HOST:$PARABENCH_RDZV_PORT"
    assert flag["--rdzv-timeout"] == "900" and flag["--run-id"] == "$PARABENCH_RUN_ID"
    # the node-dependent parts are left to each task's shell: single-quoted in the srun line
    line = next(line for line in text.splitlines() if line.startswith("srun "))
    assert shlex.split(line)[-1].count("$SLURM_NODEID") == 1 and "'" in line
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in parsed["exports"]["PARABENCH_RDZV_HOST"]
    assert text.startswith("#!/bin/bash\n") and "set -euo pipefail" in text
    for bad in ({"time_limit": "2h"}, {"partition": "gpu;rm -rf"}, {"nodes": 0}):
        with pytest.raises(SlurmError):
            sbatch_script("smoke", **{"nodes": 2, "gpus_per_node": 8, **bad})


def test_slurm_cli_writes_the_script(tmp_path, capsys):
    from parabench.cli import main

    path = tmp_path / "job.sbatch"
    assert main(["slurm", "smoke", "--nodes", "2", "--gpus-per-node", "4", "-o", str(path)]) == 0
    assert parse_sbatch(path.read_text())["options"]["nodes"] == "2"
    assert main(["slurm", "smoke", "--nodes", "2", "--gpus-per-node", "4", "--time", "x"]) == 2
    assert os.path.exists(path)


def _candidate(strategy, dp, pp=1, tp=1, comm=None, options=None, step_s=1.0, tok=1000.0):
    workload = SimpleNamespace(strategy=strategy, world_size=dp * pp * tp, dp=dp, pp=pp, tp=tp, comm_bytes=comm or {})
    prediction = SimpleNamespace(step_s=step_s, tokens_per_s_per_gpu=tok)
    return SimpleNamespace(workload=workload, prediction=prediction, options=options or {})


def test_cluster_prices_only_what_crosses_nodes():
    from parabench.plan.cluster import Cluster, ClusterError, price

    cluster = Cluster(2, 8, 400.0)  # 50 GB/s per GPU between nodes
    gb = 1e9
    ddp = price(_candidate("ref.ddp", 16, comm={"all_reduce": 16 * gb}), cluster)
    # a 16-rank ring over 2 nodes: 2 x 15/16 x 16 GB = 30 GB per rank at 50 GB/s, 2/16 of it across
    assert ddp.inter_node_s == pytest.approx(0.6) and ddp.inter_node_bytes == pytest.approx(30 * gb / 8)
    assert ddp.step_s == pytest.approx(1.6) and ddp.tokens_per_s_per_gpu == pytest.approx(1000 / 1.6)
    # HSDP sharded inside the node (shard 8): only the replica all-reduce (2 ranks, one per node) crosses
    hsdp = _candidate("ref.hsdp", 16, comm={"all_gather": 16 * gb, "all_reduce": gb}, options={"shard_size": 8})
    p = price(hsdp, cluster)
    assert p.spanning == ["all_reduce"] and p.inter_node_bytes == pytest.approx(gb)
    assert p.inter_node_s == pytest.approx(gb / 50e9)
    # tensor parallel inside a node, pipeline stages across: only the stage-to-stage sends cross
    tp_pp = price(_candidate("torch.tp", 1, pp=2, tp=8, comm={"all_reduce": 9 * gb, "send": gb}), cluster)
    assert tp_pp.spanning == ["send"] and tp_pp.inter_node_bytes == pytest.approx(gb)
    # 16 stages over 2 nodes: one boundary of 15 crosses, and it paces the pipeline
    pp16 = price(_candidate("ref.pp_1f1b", 1, pp=16, comm={"send": gb}), cluster)
    assert pp16.inter_node_bytes == pytest.approx(gb / 15) and pp16.inter_node_s == pytest.approx(gb / 50e9)
    # the link is a parameter: InfiniBand at 8x the bandwidth costs an eighth of the time
    fast = price(_candidate("ref.ddp", 16, comm={"all_reduce": 16 * gb}), Cluster(2, 8, 3200.0))
    assert fast.inter_node_s == pytest.approx(ddp.inter_node_s / 8)
    assert price(_candidate("ref.ddp", 8, comm={"all_reduce": gb}), Cluster(1, 8, 400.0)).inter_node_s == 0
    with pytest.raises(ClusterError):
        Cluster(2, 8, 0.0)
    with pytest.raises(ClusterError):
        price(_candidate("ref.ddp", 8), cluster)


def test_plan_cli_refuses_inconsistent_cluster(capsys):
    from parabench.cli import main

    assert main(["plan", "--model", "gpt-125m", "--gpus", "8", "--nodes", "2", "--gpus-per-node", "8"]) == 2
    assert "--gpus 8 is not --nodes 2 x --gpus-per-node 8" in capsys.readouterr().err


def test_placement_note_when_inner_groups_straddle_nodes():
    case = SimpleNamespace(strategy="ref.hsdp", world_size=8, options={"shard_size": 4}, label="hsdp")
    assert multinode.placement_note(case, 2) is None  # nodes of 4 hold whole shard groups
    note = multinode.placement_note(SimpleNamespace(**{**vars(case), "options": {"shard_size": 4}}), 4)
    assert "straddle the nodes of 2 ranks" in note
    hpz = SimpleNamespace(
        strategy="ref.zeropp", world_size=8, options={"hpz": True, "hpz_partition_size": 8}, label="z"
    )
    assert "hpz_partition_size 8" in multinode.placement_note(hpz, 2)
    assert '(shard_size 2, or "node", keeps them inside a node)' in note
    assert multinode.placement_note(case, 1) is None


def _handshake_both(port: int, suites=("s1", "s1"), timeout_s: float = 20) -> list:
    """Both nodes' handshakes, in two threads of this process: what each returned or raised."""
    import threading

    out: list = [None, None]

    def node(rank: int) -> None:
        try:
            out[rank] = multinode.handshake(
                f"127.0.0.1:{port}", 2, rank, "t", suites[rank], 3, timeout_s, ["a", "b"] if rank == 0 else ["zzz"]
            )
        except multinode.HandshakeFailed as exc:
            out[rank] = exc

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_handshake_gives_node_0s_kept_records_to_every_node():
    from parabench.distributed import free_port

    assert _handshake_both(free_port()) == [{"a", "b"}, {"a", "b"}]
    apart = _handshake_both(free_port(), suites=("s1", "s2"))
    assert all(isinstance(e, multinode.HandshakeFailed) and "different suites" in str(e) for e in apart)


def test_handshake_names_the_node_that_never_arrives():
    from parabench.distributed import free_port

    with pytest.raises(multinode.HandshakeFailed, match="node 1 did not arrive"):
        multinode.handshake(f"127.0.0.1:{free_port()}", 2, 0, "t", "s1", 3, 1)


def test_the_report_says_a_run_emulated_its_nodes(tmp_path):
    from parabench.report.html import render_report

    run = tmp_path / "run"
    shutil.copytree(ROOT / "results" / "studies" / "omp-threads-h200x1" / "20261129-044102", run)
    manifest = json.loads((run / "manifest.json").read_text())
    assert "nodes emulated" not in render_report([run], with_figures=False)
    manifest["emulation"] = {**multinode.emulation_manifest(2, 2, "socket"), "note": "nodes emulated on one host"}
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert "nodes emulated on one host" in render_report([run], with_figures=False)


def test_node_group_size_is_one_nodes_data_parallel_ranks():
    assert multinode.node_group_size("shard_size", 4, 1) == 4  # one node: the whole data-parallel degree
    assert multinode.node_group_size("shard_size", 4, 2) == 2  # 2 nodes x 2 ranks
    assert multinode.node_group_size("hpz_partition_size", 16, 2, pp=2, tp=2) == 2  # 8 ranks a node over pp x tp
    assert multinode.node_group_size("shard_size", 4, 4) == 1  # 4 nodes of 1 rank
    with pytest.raises(ValueError, match=r"undefined on 4 nodes of 2 ranks: .* pp x tp = 1 x 4 = 4 ranks"):
        multinode.node_group_size("shard_size", 8, 4, tp=4)
    with pytest.raises(ValueError, match="world_size 6 does not split into 4 nodes"):
        multinode.node_group_size("shard_size", 6, 4)


def _case(strategy: str, **options):
    from parabench.case import Case

    return Case(model="tiny", strategy=strategy, world_size=4, device="cpu", options=options)


def test_resolve_node_options_names_the_integer_that_runs():
    hsdp = _case("ref.hsdp", shard_size="node")
    for nnodes, size in ((1, 4), (2, 2), (4, 1)):
        (resolved,) = multinode.resolve_node_options([hsdp], nnodes)
        same = _case("ref.hsdp", shard_size=size)
        assert resolved.options == {"shard_size": size}
        assert resolved.label == same.label and resolved.case_hash == same.case_hash
    zeropp = _case("ref.zeropp", hpz=True, hpz_partition_size="node", qgz=True)
    (resolved,) = multinode.resolve_node_options([zeropp], 2)
    assert resolved.options == {"hpz": True, "hpz_partition_size": 2, "qgz": True}
    # a case that becomes another of the suite runs once, in both its series
    a, b = _case("ref.hsdp", shard_size=2), dataclasses.replace(hsdp, scaling=("weak",))
    (only,) = multinode.resolve_node_options([a, b], 2)
    assert only.options == {"shard_size": 2} and only.scaling == ("weak",)
    assert multinode.suite_fingerprint(multinode.resolve_node_options([hsdp], 2)) == multinode.suite_fingerprint([a])
    assert multinode.placement_note(multinode.resolve_node_options([hsdp], 2)[0], 2) is None


def test_resolve_node_options_refuses_a_size_the_layout_cannot_run():
    from parabench.suite import SuiteError

    ds = _case("deepspeed.zeropp", hpz=True, hpz_partition_size="node")
    assert multinode.resolve_node_options([ds], 2)[0].options["hpz_partition_size"] == 2
    with pytest.raises(SuiteError) as err:
        multinode.resolve_node_options([ds], 4)
    msg = str(err.value)
    assert msg.startswith(ds.label) and "hpz_partition_size 'node' is 1 on 4 nodes of 1 rank" in msg, msg
    assert "use hpz_partition_size >= 2" in msg
    # ref.zeropp takes a secondary partition of 1
    ref = _case("ref.zeropp", hpz=True, hpz_partition_size="node")
    assert multinode.resolve_node_options([ref], 4)[0].options["hpz_partition_size"] == 1
    with pytest.raises(SuiteError, match="shard_size 'node': world_size 4 does not split into 3 nodes"):
        multinode.resolve_node_options([_case("torch.hsdp", shard_size="node")], 3)


def test_the_runner_and_run_case_resolve_node_before_anything_runs(tmp_path, capsys):
    from parabench.cli import main
    from parabench.launch import LaunchOptions
    from parabench.runner import Runner
    from parabench.suite import Suite

    suite = Suite("s", tmp_path / "s.toml", "", [_case("ref.hsdp", shard_size="node")])
    runner = Runner(suite, tmp_path / "r", LaunchOptions(nnodes=2, node_rank=0))
    assert [c.options for c in runner.suite.cases] == [{"shard_size": 2}]
    assert suite.cases[0].options == {"shard_size": "node"}  # the caller's suite is left as it was
    options = json.dumps({"hpz": True, "hpz_partition_size": "node"})
    argv = ["run", "case", "--model", "tiny", "--strategy", "deepspeed.zeropp", "--world-size", "4"]
    argv += ["--device", "cpu", "--options", options, "--out", str(tmp_path / "out"), "--no-report"]
    rc = main([*argv, "--nnodes", "4", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "hpz_partition_size 'node' is 1 on 4 nodes of 1 rank" in err and "nothing was run" in err, err
    assert not (tmp_path / "out").exists()
