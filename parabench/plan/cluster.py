"""The planner on a cluster: ``parabench plan --nodes N --gpus-per-node G --inter-node-gbps B``.

The calibrated model (``parabench.plan.model``) prices one machine, every collective at the
bandwidth it measured there. On N nodes, each configuration's collectives are laid on the rank grid
``arange(world).view(dp, pp, tp)`` (``parabench.topology``) with nodes of G consecutive ranks
(torchrun's layout), and every collective whose group spans more than one node is priced again on
the inter-node link:

- a ring over several nodes is paced by its slowest hop, so the collective's whole wire volume per
  rank (nccl-tests' bus factor: 2(n-1)/n for an all-reduce, (n-1)/n for an all-gather or a
  reduce-scatter) moves at ``B`` Gb/s; likewise a pipeline whose stages span nodes is paced by the
  stage boundary that crosses them, its sends priced at ``B``. ``B`` is per GPU (one NIC per
  GPU, as on H100/H200 clusters: 400 Gb/s for NDR InfiniBand, the same figure a socket-forced
  emulation measures as its loopback rate);
- that time is added to the one-machine step and taken as exposed: the model's overlap of
  communication with compute was calibrated on NVLink, and a link 5-10x slower hides less;
- each collective kind is put on the group that carries it: HSDP's all-gathers and
  reduce-scatters on its shard group and its all-reduces on its replica group; pipeline sends
  along the stages (inter-node bytes: the crossing boundaries' share of the pp - 1); tensor-parallel traffic on the tp group where the grid has no data
  parallelism; everything else on the data-parallel group (a conservative choice where tensor
  and data parallelism share a kind).

The inter-node bytes per rank follow the communication meter's convention
(``parabench.meters.comm``: k/n of a ring's wire bytes for a group of n ranks over k nodes), so the
planner's figure and a record's ``by_link`` measurement compare directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from parabench.multinode import NodeLayout, link_groups, shard_size

WIRE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
MAX_GBPS = 100_000.0


class ClusterError(ValueError):
    pass


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    inter_node_gbps: float  # per GPU

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ClusterError(f"--nodes and --gpus-per-node must be >= 1 (got {self.nodes}, {self.gpus_per_node})")
        if not 0 < self.inter_node_gbps <= MAX_GBPS:
            raise ClusterError(
                f"--inter-node-gbps must be above 0 and at most {MAX_GBPS:g}, got {self.inter_node_gbps}"
            )

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def inter_node_bytes_per_s(self) -> float:
        return self.inter_node_gbps * 1e9 / 8

    @property
    def layout(self) -> NodeLayout:
        return NodeLayout(self.nodes, self.gpus_per_node)


def kind_groups(strategy: str, world: int, dp: int, pp: int, tp: int, options: dict) -> dict[str, list[int]]:
    """Rank 0's group for each collective kind of one configuration (see the module docstring)."""
    dp_group = [d * pp * tp for d in range(dp)]
    tp_group = list(range(tp))
    groups = {kind: dp_group for kind in WIRE}
    if link_groups(strategy) == "hybrid_shard":
        shard = shard_size(strategy, options)
        groups.update(all_gather=dp_group[:shard], reduce_scatter=dp_group[:shard], all_reduce=dp_group[::shard])
    elif tp > 1 and dp == 1:
        groups = {kind: tp_group for kind in WIRE}
    groups["send"] = groups["recv"] = [p * tp for p in range(pp)]  # the stages, in order
    return groups


@dataclass
class ClusterPrice:
    inter_node_bytes: float  # per rank per step, under the meter's convention
    inter_node_s: float  # added to the one-machine step
    spanning: list[str]  # the collective kinds whose group crosses nodes
    step_s: float
    tokens_per_s_per_gpu: float


def price(candidate, cluster: Cluster) -> ClusterPrice:
    """The cluster's step for one evaluated configuration of ``parabench.plan.search``."""
    from parabench.multinode import inter_node_fraction

    w, p = candidate.workload, candidate.prediction
    if w.world_size != cluster.gpus:
        raise ClusterError(f"the configuration has {w.world_size} ranks, the cluster {cluster.gpus} GPUs")
    groups = kind_groups(w.strategy, w.world_size, w.dp, w.pp, w.tp, candidate.options)
    layout = cluster.layout
    seconds = inter = 0.0
    spanning = []
    for kind, payload in sorted(w.comm_bytes.items()):
        ranks = groups.get(kind, groups["all_reduce"])
        if layout.span(ranks) <= 1:
            continue
        n = len(ranks)
        wire = payload * (WIRE[kind](n) if kind in WIRE else 1.0)
        seconds += wire / cluster.inter_node_bytes_per_s
        if kind in ("send", "recv"):  # the stage boundaries that cross nodes, of the pp - 1
            crossing = sum(layout.node_of(a) != layout.node_of(b) for a, b in zip(ranks, ranks[1:]))
            inter += wire * crossing / (n - 1)
        else:
            inter += wire * inter_node_fraction(kind, ranks, layout)
        spanning.append(kind)
    step = p.step_s + seconds
    return ClusterPrice(inter, seconds, spanning, step, p.tokens_per_s_per_gpu * p.step_s / step)


def rank(ok: list, cluster: Cluster) -> list[tuple]:
    """(candidate, price) of every feasible configuration, best cluster tokens/s per GPU first."""
    priced = [(c, price(c, cluster)) for c in ok]
    return sorted(priced, key=lambda cp: -cp[1].tokens_per_s_per_gpu)


def table(priced: list[tuple], top: int, cluster: Cluster) -> str:
    from parabench.plan.search import describe

    width = max([42] + [len(describe(c)) for c, _ in priced[:top]])
    head = (
        f"{'#':>3} {'configuration':{width}s} {'degrees':13s} {'mb':>3} {'tok/s/GPU':>10} {'1 node':>8} "
        f"{'inter GB/step':>13} {'inter ms':>9}  across nodes"
    )
    lines = [
        f"cluster: {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs, {cluster.inter_node_gbps:g} Gb/s per GPU "
        "between nodes (collectives spanning nodes priced at that link, taken as exposed)",
        "",
        head,
        "-" * len(head),
    ]
    for i, (c, cp) in enumerate(priced[:top], 1):
        lines.append(
            f"{i:>3} {describe(c):{width}s} {c.degrees:13s} {c.micro_batch:>3} {cp.tokens_per_s_per_gpu:>10.0f} "
            f"{c.prediction.tokens_per_s_per_gpu:>8.0f} {cp.inter_node_bytes / 1e9:>13.3f} {cp.inter_node_s * 1e3:>9.1f}  "
            f"{', '.join(cp.spanning) or '-'}"
        )
    return "\n".join(lines)


def add_arguments(p) -> None:
    g = p.add_argument_group("cluster (several nodes; --gpus must be nodes x gpus-per-node)")
    g.add_argument("--nodes", type=int, default=None, help="nodes of the cluster")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node")
    g.add_argument(
        "--inter-node-gbps", type=float, default=400.0, help="link between nodes, Gb/s per GPU (default 400: NDR)"
    )


def from_args(args) -> Cluster | None:
    """The cluster the arguments describe, None without --nodes; ClusterError when inconsistent."""
    nodes, per_node = getattr(args, "nodes", None), getattr(args, "gpus_per_node", None)
    if nodes is None and per_node is None:
        return None
    if nodes is None or per_node is None:
        raise ClusterError("--nodes and --gpus-per-node go together")
    cluster = Cluster(nodes, per_node, float(args.inter_node_gbps))
    if cluster.gpus != args.gpus:
        raise ClusterError(f"--gpus {args.gpus} is not --nodes {nodes} x --gpus-per-node {per_node}")
    return cluster
