"""Multi-node runs: torchrun's rendezvous joins the nodes, parabench only agrees on what they run.

Each node runs the same command with its own ``--node-rank``::

    parabench run suite SUITE --nnodes N --node-rank R --rdzv-endpoint HOST:PORT

and its runner starts one torchrun agent per launch, as on one node. What parabench adds:

- **rendezvous**: torchrun's ``static`` backend with the node rank given. Its c10d backend orders
  the nodes by hostname and agent pid, so "node 0 writes the records" would name whichever node
  sorts first; with ``static`` torchrun's GROUP_RANK is ``--node-rank`` and node 0's agent hosts
  the store. ``--rdzv-timeout`` bounds how long a launch waits for every node.
- **agreement**: before the first launch the runners meet on a ``torch.distributed`` TCPStore at
  the rendezvous endpoint and compare their suite fingerprints (the case hashes in suite order,
  ``handshake``); then every launch, once its process group forms, compares the cases it runs on
  each node (``check_nodes_agree``: one tiny all-gather). A node that runs another suite, other
  filters or another commit, or resumed other cases, stops every node with one message naming both
  sides; the runners stop the suite there (``MultiNodeStop``).
- **who writes what**: node 0's runner writes the manifest and the records; every other node's
  runner keeps only its logs and scratch in ``<run folder>/nodes/<R>/``. Each node's local rank 0
  stamps the cases its launch started and finished, so every runner takes the same decisions
  (which case to blame, which cases to launch again) without reading another node's files.
- **failures**: a launch whose rendezvous does not form names the node that did not arrive
  (``rendezvous_failure``) and stops the suite cleanly: the rendezvous cannot form again without
  it. A case whose ranks lose their peers on another node is ``crashed`` with that node named
  (``lost_node_message``); the suite goes on, and stops at the next launch if that node is gone.

``NodeLayout`` is the node grid torchrun reports (LOCAL_WORLD_SIZE, GROUP_RANK): the communication
meter splits bytes into intra- and inter-node with it, the theory states the same split
(``theory_by_link``), the hierarchical all-reduce builds its groups from it
(``reference_impls.collectives.node_groups``), and the runner warns where HSDP's shard groups or
hpZ's partitions (consecutive ranks) would straddle nodes (``placement_note``). Option value
``"node"`` for ``shard_size`` and ``hpz_partition_size`` asks for groups of one node's data-parallel
ranks; the runner resolves it to the integer for its ``--nnodes`` before anything is hashed or
recorded (``resolve_node_options``).

On one GPU host, ``emulation_env`` splits the GPUs into emulated nodes whose traffic crosses the
"node" boundary through sockets (see its docstring); the manifest records it as an emulation.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import dataclass

RDZV_TIMEOUT_S = 600  # torchrun's own default for the static rendezvous


class NodesDisagree(RuntimeError):
    """The nodes of one launch run different suites or different cases."""


@dataclass(frozen=True)
class NodeLayout:
    """Nodes of equal size holding consecutive ranks, as torchrun lays them out."""

    nnodes: int
    local_world_size: int
    node_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.local_world_size

    @staticmethod
    def from_env(env: dict | None = None) -> NodeLayout:
        """From torchrun's variables; one node holding the whole world when they are absent. An
        ``PARABENCH_NODE_SIZE`` override lays out emulated nodes inside one launch (tests)."""
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        local = int(env.get("PARABENCH_NODE_SIZE") or env.get("LOCAL_WORLD_SIZE") or world)
        if local < 1 or world % local:
            return NodeLayout(1, world, 0)
        rank = int(env.get("RANK", "0"))
        return NodeLayout(world // local, local, rank // local)

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.local_world_size, (node + 1) * self.local_world_size))

    def span(self, ranks) -> int:
        """How many nodes the ranks (global ranks of one group) lie on."""
        return len({self.node_of(r) for r in ranks})


# -- agreement at rendezvous ---------------------------------------------------------------


def suite_fingerprint(cases) -> str:
    """The suite as the nodes must agree on it: its case hashes, launches included, in order."""
    text = json.dumps([f"{c.case_hash}.r{c.repeats}" for c in cases])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


SUITE_ENV = "PARABENCH_SUITE_FINGERPRINT"  # the runner's fingerprint, handed to its ranks
SUITE_CASES_ENV = "PARABENCH_SUITE_CASES"  # how many cases the fingerprint covers (for the message)


def disagreement(views: list[dict]) -> str | None:
    """What the nodes' views of a launch (one per rank: node, host, suite, cases) disagree on."""
    by_node: dict[int, dict] = {}
    for v in views:
        by_node.setdefault(v["node"], v)
    first = by_node[min(by_node)]
    for node in sorted(by_node):
        other = by_node[node]
        if other["suite"] != first["suite"]:
            return (
                f"the nodes run different suites: node {first['node']} ({first['host']}) has suite fingerprint "
                f"{first['suite']} ({first['n_cases']} cases), node {node} ({other['host']}) has {other['suite']} "
                f"({other['n_cases']} cases); every node must run the same suite file with the same filters, "
                "options and commit"
            )
        if other["cases"] != first["cases"]:
            return (
                f"the nodes launched different cases: node {first['node']} ({first['host']}) {first['cases']}, "
                f"node {node} ({other['host']}) {other['cases']}; a node resumed or skipped cases the others did not"
            )
    return None


class HandshakeFailed(RuntimeError):
    """The nodes did not meet before the suite, or do not run the same suite."""


def handshake(
    endpoint: str,
    nnodes: int,
    node_rank: int,
    rdzv_id: str,
    fingerprint: str,
    n_cases: int,
    timeout_s: float,
    kept: list[str] = (),
) -> set[str]:
    """Before the first launch: every node's runner meets the others on a ``torch.distributed``
    TCPStore at the rendezvous endpoint (node 0 hosts it, for this exchange only; torchrun's agent
    takes the port over for each launch) and publishes its suite fingerprint, node 0 also the
    record keys it keeps (``--resume``), which every node returns. Raises ``HandshakeFailed``
    naming the node that did not arrive within ``timeout_s``, or both sides of a different suite,
    on every node alike; nothing has run then."""
    import datetime

    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    try:
        store = TCPStore(host, int(port), nnodes, node_rank == 0, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as exc:  # DistStoreError, DistNetworkError
        why = rendezvous_failure(str(exc), nnodes, node_rank, endpoint)
        raise HandshakeFailed(why or f"the nodes could not meet at {endpoint}: {exc}") from None
    prefix = f"parabench/{rdzv_id}"
    mine = {"node": node_rank, "host": socket.gethostname(), "suite": fingerprint, "n_cases": n_cases, "cases": []}
    if node_rank == 0:
        mine["kept"] = list(kept)
    try:
        store.set(f"{prefix}/suite/{node_rank}", json.dumps(mine))
        views = [json.loads(store.get(f"{prefix}/suite/{r}")) for r in range(nnodes)]
        store.set(f"{prefix}/read/{node_rank}", "1")
        if node_rank == 0:  # the store goes with this process: not before every node has read it
            store.wait([f"{prefix}/read/{r}" for r in range(nnodes)])
    except (RuntimeError, ValueError) as exc:
        raise HandshakeFailed(f"the nodes lost each other while comparing their suites at {endpoint}: {exc}") from None
    finally:
        del store
    why = disagreement(views)
    if why:
        raise HandshakeFailed(why)
    return set(views[0].get("kept") or ())


def check_nodes_agree(keys: list[str], scratch: str) -> None:
    """On every rank of a launch, right after the process group forms: raise ``NodesDisagree``
    on every rank alike when the nodes do not run the same suite and cases, its message in
    ``<scratch>/nodes.rank<r>.error.json`` for the runner. One all-gather of a few hundred bytes,
    before any case is measured; nothing on one node."""
    import time

    import torch.distributed as dist

    from parabench.results import write_json_atomic

    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) <= 1:
        return
    mine = {
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "host": socket.gethostname(),
        "suite": os.environ.get(SUITE_ENV, "?"),
        "n_cases": int(os.environ.get(SUITE_CASES_ENV, "0")),
        "cases": list(keys),
    }
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    why = disagreement(views)
    if why:
        rank = dist.get_rank()
        error = {"rank": rank, "type": NodesDisagree.__name__, "message": why, "traceback": "", "time": time.time()}
        write_json_atomic(os.path.join(scratch, f"nodes.rank{rank}.error.json"), error)
        raise NodesDisagree(why)


# -- failures: a node that does not arrive, a node that is lost ------------------------------------

_SERVER_WAIT = re.compile(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined")
_CLIENT_WAIT = re.compile(r"client socket has timed out after (\d+)ms while trying to connect to \(([^)]*)\)")
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Socket closed|NCCL.*remote process exited"
    r"|ncclRemoteError|failed to recv, got 0 bytes|Connection refused",
    re.IGNORECASE,
)


def rendezvous_failure(log_tail: str, nnodes: int, node_rank: int, endpoint: str | None) -> str | None:
    """Why a launch's rendezvous did not form, naming the node(s) that did not arrive, or None."""
    m = _SERVER_WAIT.search(log_tail)
    if m:
        waited, joined, expected = (int(g) for g in m.groups())
        missing = expected - joined
        others = [n for n in range(nnodes) if n != node_rank]
        who = f"node {others[0]}" if len(others) == 1 else f"{missing} of nodes {', '.join(map(str, others))}"
        return (
            f"{who} did not arrive at the rendezvous ({endpoint}) within {waited} s ({joined}/{expected} nodes joined): "
            "it never started, runs another suite's launch, or is gone"
        )
    m = _CLIENT_WAIT.search(log_tail)
    if m:
        return (
            f"node 0 (the rendezvous host {m.group(2).replace(', ', ':')}) did not arrive within "
            f"{int(m.group(1)) / 1000:.0f} s: it never started, stopped, or is unreachable"
        )
    return None


def lost_node_message(texts: list[str], nnodes: int, node_rank: int, local_world_size: int) -> str | None:
    """When this node's ranks failed because peers on another node went away: which node, or None."""
    if nnodes <= 1 or not any(_PEER_LOST.search(t or "") for t in texts):
        return None
    others = [n for n in range(nnodes) if n != node_rank]

    def ranks(n: int) -> str:
        first, last = n * local_world_size, (n + 1) * local_world_size - 1
        return f"rank {first}" if first == last else f"ranks {first}-{last}"

    who = (
        f"node {others[0]} ({ranks(others[0])})"
        if len(others) == 1
        else "one of nodes " + ", ".join(f"{n} ({ranks(n)})" for n in others)
    )
    return (
        f"{who} was lost mid-case: the ranks on node {node_rank} lost their connection to it "
        "(it died, was killed or its network went down)"
    )


# -- a GPU host as several nodes ----------------------------------------------------------------

EMULATED_LINKS = ("socket",)


def emulation_env(node_rank: int, gpus_per_node: int, link: str = "socket") -> dict[str, str]:
    """The environment that makes node ``node_rank`` of one GPU host a node of its own.

    - ``CUDA_VISIBLE_DEVICES``: the node's slice of the host's GPUs;
    - ``NCCL_HOSTID``: NCCL tells hosts apart by a hash of the host name unless this is set; a
      distinct value per emulated node makes NCCL treat the other slices as other hosts, so the
      P2P (NVLink) and shared-memory transports stay inside a node and every byte across the
      boundary takes the network transport, as between real hosts;
    - ``NCCL_NET=Socket``, ``NCCL_IB_DISABLE=1``, ``NCCL_SOCKET_IFNAME=lo``: that network is TCP
      sockets over the loopback, the slow link of the emulation, even where an InfiniBand NIC is present;
    - ``NCCL_NVLS_ENABLE=0``, ``NCCL_MNNVL_ENABLE=0``: no NVLink multicast or multi-node NVLink
      that could join the slices again.
    """
    if link not in EMULATED_LINKS:
        raise ValueError(f"unknown emulated inter-node link {link!r} (known: {', '.join(EMULATED_LINKS)})")
    gpus = range(node_rank * gpus_per_node, (node_rank + 1) * gpus_per_node)
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
        "NCCL_HOSTID": f"parabench-emulated-node-{node_rank}",
        "NCCL_NET": "Socket",
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_MNNVL_ENABLE": "0",
    }


def emulation_manifest(nnodes: int, gpus_per_node: int, link: str) -> dict:
    """The manifest's ``emulation`` entry: what a report must say about these numbers."""
    return {
        "kind": "nodes on one host",
        "nnodes": nnodes,
        "gpus_per_node": gpus_per_node,
        "inter_node_link": link,
        "env_per_node": [emulation_env(r, gpus_per_node, link) for r in range(nnodes)],
        "note": "an emulation: the nodes share one host; traffic between them is forced through TCP sockets "
        "(NCCL's P2P and shared-memory transports kept inside each node), so it is slower than inside a node as "
        "on a cluster, but its bandwidth is the loopback's, not a real network's",
    }


# -- theory: the same bytes split by link ----------------------------------------------------------

_WIRE_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def link_groups(strategy: str) -> str | None:
    """The row's ``link_groups`` fact (``parabench.strategies.StrategySpec``)."""
    from parabench.registry import get_strategy

    return get_strategy(strategy).link_groups


def shard_size(strategy: str, options: dict) -> int:
    """HSDP's shard group size for these options, the strategy's default where they name none."""
    from parabench.registry import get_strategy

    value = get_strategy(strategy).options.read(options).shard_size
    if value == NODE:
        raise ValueError("shard_size 'node' has no size before the runner resolves it (resolve_node_options)")
    return int(value)


def kind_groups(case, world: int) -> dict[str, list[int]] | None:
    """Rank 0's group for each collective kind of ``case`` where one group carries every op of that
    kind: the world for a data-parallel-only grid, HSDP's shard group (consecutive ranks) for its
    all-gathers and reduce-scatters and its replica group (every shard_size-th rank) for its
    all-reduces. None where kinds share several groups (tensor, pipeline parallel grids)."""
    if case.options.get("pp", 1) != 1 or case.options.get("tp", 1) != 1:
        return None
    everyone = list(range(world))
    # ZeRO++'s hpZ gathers from its secondary group in backward and the world in forward, and
    # DeepSpeed's qgZ reduces in two hops: one kind over several groups, no split to state here
    groups_fact = link_groups(case.strategy)
    if groups_fact == "two_hop_reduce" or (groups_fact == "secondary_partition" and case.options.get("hpz")):
        return None
    if groups_fact == "hybrid_shard":
        shard = shard_size(case.strategy, case.options)
        return {
            "all_gather": everyone[:shard],
            "reduce_scatter": everyone[:shard],
            "all_reduce": everyone[::shard],
        }
    return {kind: everyone for kind in _WIRE_FACTOR}


def inter_node_fraction(kind: str, ranks: list[int], layout, peer: int | None = None, me: int | None = None) -> float:
    """Share of the wire bytes of one op over the group ``ranks`` that crosses nodes (the convention of
    ``parabench.meters.comm``'s docstring)."""
    if kind in ("send", "recv") and peer is not None and me is not None:
        return float(layout.node_of(peer) != layout.node_of(me))
    n, k = len(ranks), layout.span(ranks)
    if k <= 1 or n <= 1:
        return 0.0
    if kind == "all_to_all":
        return (n - n / k) / (n - 1)
    return k / n


def theory_by_link(case, payload_by_kind: dict, layout: NodeLayout) -> dict | None:
    """Rank 0's wire bytes inside and across nodes, from the theory's payload per kind, under the
    communication meter's attribution (``parabench.meters.comm``); None where no group is known."""
    groups = kind_groups(case, layout.world_size)
    if groups is None or not payload_by_kind:
        return None
    wire = inter = 0.0
    for kind, payload in payload_by_kind.items():
        # a range (a library whose bytes vary with an adaptive choice) has no one split to state
        if kind not in groups or kind not in _WIRE_FACTOR or not isinstance(payload, (int, float)):
            return None
        ranks = groups[kind]
        w = payload * _WIRE_FACTOR[kind](len(ranks))
        wire += w
        inter += w * inter_node_fraction(kind, ranks, layout)
    return {"intra_node": {"wire_bytes": int(round(wire - inter))}, "inter_node": {"wire_bytes": int(round(inter))}}


LINK_TOLERANCE = 1e-3  # measured and theory differ by rounding per op kind only


def link_check(record: dict, case) -> None:
    """Add the theory of the intra/inter-node split to a finished record, and its check against
    rank 0's measured split (``theory.comm_wire_bytes_by_link``, ``checks.comm_by_link``)."""
    launch = record.get("launch") or {}
    per_rank = record.get("per_rank") or []
    theory = record.get("theory") or {}
    measured = ((per_rank[0] if per_rank else {}).get("comm") or {}).get("by_link")
    if not measured or not theory.get("comm_payload_bytes") or not launch.get("nproc_per_node"):
        return
    layout = NodeLayout(int(launch.get("nnodes", 1)), int(launch["nproc_per_node"]))
    expect = theory_by_link(case, theory["comm_payload_bytes"], layout)
    if expect is None:
        return
    theory["comm_wire_bytes_by_link"] = expect
    rows = {}
    for link in ("intra_node", "inter_node"):
        e, m = expect[link]["wire_bytes"], measured[link]["wire_bytes"]
        rows[link] = {
            "expected_bytes": e,
            "measured_bytes": m,
            "ok": abs(m - e) <= max(8.0, LINK_TOLERANCE * max(e, m)),
        }
    record.setdefault("checks", {})["comm_by_link"] = rows


def placement_note(case, nnodes: int) -> str | None:
    """Where a hierarchical case's inner groups straddle nodes on this layout: HSDP's shard groups
    and hpZ's secondary partitions are consecutive data-parallel ranks, inside one node only when
    the node's ranks hold whole groups (shard_size x pp x tp divides the ranks per node)."""
    if nnodes <= 1 or case.world_size % nnodes:
        return None
    per_node = case.world_size // nnodes
    inner = None
    groups_fact = link_groups(case.strategy)
    if groups_fact == "hybrid_shard":
        inner = ("shard_size", shard_size(case.strategy, case.options))
    elif groups_fact in ("secondary_partition", "two_hop_reduce") and case.options.get("hpz"):
        inner = ("hpz_partition_size", int(case.options.get("hpz_partition_size", 2)))
    if inner is None:
        return None
    model_span = case.options.get("pp", 1) * case.options.get("tp", 1)
    if per_node % (inner[1] * model_span) == 0:
        return None
    fits = f' ({inner[0]} {per_node // model_span}, or "node", keeps them inside a node)'
    return (
        f"{case.label}: {inner[0]} {inner[1]} groups straddle the nodes of {per_node} ranks; their traffic crosses "
        f"the slow link" + (fits if per_node % model_span == 0 else "")
    )


# -- groups of one node's ranks ---------------------------------------------------------------------

NODE = "node"  # option value: the data-parallel ranks of one node
NODE_OPTIONS = ("shard_size", "hpz_partition_size")  # the options that take it


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def node_layout_text(world_size: int, nnodes: int) -> str:
    """``4 nodes of 1 rank``: the launch layout, as messages name it."""
    return f"{nnodes} node{'' if nnodes == 1 else 's'} of {_ranks(world_size // nnodes)}"


def node_group_size(key: str, world_size: int, nnodes: int, pp: int = 1, tp: int = 1) -> int:
    """Option ``key = "node"`` on ``nnodes`` nodes: one node's data-parallel ranks, the ranks per
    node over the model-parallel span, (world_size // nnodes) // (pp x tp); ValueError where a node
    holds no whole number of model-parallel groups."""
    if world_size % nnodes:
        raise ValueError(f"{key} 'node': world_size {world_size} does not split into {nnodes} nodes of equal size")
    per_node, span = world_size // nnodes, pp * tp
    if per_node % span:
        raise ValueError(
            f"{key} 'node' is undefined on {node_layout_text(world_size, nnodes)}: a node does not hold whole "
            f"model-parallel groups of pp x tp = {pp} x {tp} = {span} ranks"
        )
    return per_node // span


def resolve_node_options(cases, nnodes: int) -> list:
    """``cases`` with every ``"node"`` option (``NODE_OPTIONS``) replaced by its integer on ``nnodes``
    nodes (``node_group_size``; one node: the whole data-parallel degree), so the hash, the label and
    the record name the size that ran and every node of a launch derives the same cases. A resolved
    case is validated again: a SuiteError names the case, the value and the layout. Cases that then
    coincide run once, in every scaling series either belonged to (as ``load_suite`` merges them)."""
    from dataclasses import replace

    from parabench.suite import SuiteError, merge_duplicates, validate_case

    out = []
    for case in cases:
        keys = [k for k in NODE_OPTIONS if case.options.get(k) == NODE]
        if keys:
            pp, tp = case.options.get("pp", 1), case.options.get("tp", 1)
            try:
                values = {k: node_group_size(k, case.world_size, nnodes, pp, tp) for k in keys}
            except ValueError as exc:
                raise SuiteError(f"{case.label}: {exc}") from None
            resolved = replace(case, options={**case.options, **values})
            try:
                validate_case(resolved)
            except ValueError as exc:
                sizes = ", ".join(f"{k} 'node' is {v}" for k, v in values.items())
                layout = node_layout_text(case.world_size, nnodes)
                raise SuiteError(f"{case.label}: {sizes} on {layout}: {exc}") from None
            case = resolved
        out.append(case)
    return merge_duplicates(out)
