"""Communication volume, seen at the c10d dispatcher whichever library issues it.

Every ``torch.distributed`` collective, eager or functional, goes through an op in the ``c10d``
or ``_c10d_functional`` namespace: DDP's buckets, FSDP2's all-gathers, DeepSpeed's ZeRO, DTensor
redistributions and our reference code all pass there. :class:`CommMeter` is a
``TorchDispatchMode`` that records each such op: kind, payload bytes, dtype and group size.

Conventions (nccl-tests): the *payload* of all-reduce, broadcast and reduce is the tensor; of
all-gather the full gathered output; of reduce-scatter the full input; of all-to-all the input.
The *wire* bytes estimate what one rank sends with bandwidth-optimal algorithms:
all-reduce 2(n-1)/n x payload, all-gather / reduce-scatter / all-to-all (n-1)/n x payload,
broadcast and point-to-point 1 x payload.

Intra- and inter-node bytes (``by_link``): each collective is attributed by its group's node span
(``parabench.multinode.NodeLayout``, from torchrun's LOCAL_WORLD_SIZE). A group inside one node
sends every wire byte inside it. A group of n ranks over k > 1 nodes, each node's ranks adjacent in
the ring, sends k/n of the wire bytes across nodes (the ring crosses k links of n) and the rest inside;
an all-to-all sends to the peers on other nodes, (n - n/k)/(n - 1) of its wire bytes. Point-to-point
ops go across when their peer is on another node. The same convention is the theory's
(``parabench.multinode.theory_by_link``), so the two compare exactly.

Point-to-point ``send``/``recv`` (and their ``isend``/``irecv``/batched forms) pass the same
dispatcher and are recorded as kinds ``send`` and ``recv`` on the rank that issues them.
The meter costs Python time on every op, so the runner enables it only on a dedicated untimed
step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from parabench.multinode import NodeLayout, inter_node_fraction

# namespace -> op name (without trailing underscore) -> (kind, where the payload tensor(s) are).
# The two namespaces reuse names with different argument orders, so they are kept apart.
_OPS = {
    "c10d": {
        # eager torch.distributed: ops take (outputs, inputs, ...) or work in place
        "allreduce": ("all_reduce", "in0"),
        "allreduce_coalesced": ("all_reduce", "in0"),
        "allgather": ("all_gather", "out0"),
        "_allgather_base": ("all_gather", "out0"),
        "allgather_into_tensor_coalesced": ("all_gather", "out0"),
        "allgather_coalesced": ("all_gather", "out0"),
        "reduce_scatter": ("reduce_scatter", "in1"),  # (output shard, [input list])
        "_reduce_scatter_base": ("reduce_scatter", "in1"),
        "reduce_scatter_tensor_coalesced": ("reduce_scatter", "in1"),
        "broadcast": ("broadcast", "in0"),
        "reduce": ("reduce", "in0"),
        "alltoall": ("all_to_all", "in1"),
        "alltoall_base": ("all_to_all", "in1"),
        "gather": ("gather", "in1"),
        "scatter": ("scatter", "in0"),
        "send": ("send", "in0"),
        "recv": ("recv", "in0"),
        "recv_any_source": ("recv", "in0"),
    },
    "_c10d_functional": {
        # functional collectives (DTensor, compiled code): ops take (inputs, ...) and return outputs
        "all_reduce": ("all_reduce", "in0"),
        "all_reduce_coalesced": ("all_reduce", "in0"),
        "all_gather_into_tensor": ("all_gather", "allgather_fn"),
        "all_gather_into_tensor_coalesced": ("all_gather", "allgather_fn"),
        "reduce_scatter_tensor": ("reduce_scatter", "in0"),
        "reduce_scatter_tensor_coalesced": ("reduce_scatter", "in0"),
        "all_to_all_single": ("all_to_all", "in0"),
    },
}
_WIRE_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
SCALAR_BYTES = 64  # collectives this small (loss, overflow flags, norms) are listed apart from volume


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _process_group(args, kwargs):
    """The op's process group, None for the default (world) group or when none is found."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, dist.ProcessGroup):
            return a
        # Eager c10d ops receive the group boxed as a TorchScript object, not a ProcessGroup:
        # without unboxing, every subgroup (TP, PP, expert-data-parallel) read as the world.
        if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith("c10d.ProcessGroup"):
            return dist.ProcessGroup.unbox(a)
        if isinstance(a, str):  # functional collectives name the group
            try:
                from torch._C._distributed_c10d import _resolve_process_group

                return _resolve_process_group(a)
            except Exception:
                continue
    return None


def _group_size(args, kwargs) -> int:
    group = _process_group(args, kwargs)
    if group is not None:
        return group.size()
    return dist.get_world_size() if dist.is_initialized() else 1


def _group_ranks(group) -> list[int]:
    """Global ranks of ``group`` in group-rank order (the world when None or unknown)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if group is None or not dist.is_initialized():
        return list(range(world))
    try:
        return dist.get_process_group_ranks(group)
    except Exception:  # a group this rank does not know by handle (some library-made groups)
        return list(range(group.size())) if group.size() == world else [dist.get_rank()] * group.size()


@dataclass
class CommEvent:
    kind: str
    payload_bytes: int
    dtype: str
    group_size: int
    inter_node_fraction: float = 0.0

    @property
    def wire_bytes(self) -> float:
        return self.payload_bytes * _WIRE_FACTOR.get(self.kind, lambda n: 1.0)(self.group_size)


class CommMeter(TorchDispatchMode):
    """Records every collective issued inside ``with CommMeter() as m:`` on this rank."""

    def __init__(self):
        super().__init__()
        self.events: list[CommEvent] = []
        self.layout = NodeLayout.from_env()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(t) for t in _tensors(args)):
            return NotImplemented  # let DTensor decompose into plain collectives first
        ops = _OPS.get(func.namespace)
        if ops is not None:
            name = func._schema.name.split("::")[-1].rstrip("_")
            if name in ops:
                self._record(ops[name], args, kwargs)
        return func(*args, **kwargs)

    def _record(self, op: tuple[str, str], args, kwargs) -> None:
        kind, where = op
        group = _process_group(args, kwargs)
        n = group.size() if group is not None else (dist.get_world_size() if dist.is_initialized() else 1)
        inter = 0.0
        if self.layout.nnodes > 1:
            ranks = _group_ranks(group)
            peer = None
            if kind in ("send", "recv") and len(args) > 2 and isinstance(args[2], int) and args[2] < len(ranks):
                peer = ranks[args[2]]
            inter = inter_node_fraction(kind, ranks, self.layout, peer, dist.get_rank())
        if where == "allgather_fn":  # functional all-gather: output is input x group size
            tensors = _tensors(args[0])
            n = args[1] if len(args) > 1 and isinstance(args[1], int) else n
            payload = sum(t.numel() * t.element_size() for t in tensors) * n
        else:
            pos = 0 if where.endswith("0") else 1
            tensors = _tensors(args[pos]) if len(args) > pos else []
            payload = sum(t.numel() * t.element_size() for t in tensors)
        dtype = str(tensors[0].dtype) if tensors else "?"
        self.events.append(CommEvent(kind, payload, dtype, n, inter))

    def summary(self) -> dict:
        """Per kind: calls, payload and wire bytes, dtypes and group sizes; tiny scalar ops apart."""
        out: dict[str, dict] = defaultdict(
            lambda: {"calls": 0, "payload_bytes": 0, "wire_bytes": 0.0, "dtypes": set(), "group_sizes": set()}
        )
        scalars: dict[str, dict] = defaultdict(lambda: {"calls": 0, "payload_bytes": 0})
        inter_wire = 0.0
        for e in self.events:
            if e.payload_bytes <= SCALAR_BYTES:
                scalars[e.kind]["calls"] += 1
                scalars[e.kind]["payload_bytes"] += e.payload_bytes
                continue
            inter_wire += e.wire_bytes * e.inter_node_fraction
            s = out[e.kind]
            s["calls"] += 1
            s["payload_bytes"] += e.payload_bytes
            s["wire_bytes"] += e.wire_bytes
            s["dtypes"].add(e.dtype)
            s["group_sizes"].add(e.group_size)
        by_kind = {
            k: {
                **v,
                "wire_bytes": int(round(v["wire_bytes"])),
                "dtypes": sorted(v["dtypes"]),
                "group_sizes": sorted(v["group_sizes"]),
            }
            for k, v in sorted(out.items())
        }
        wire = sum(v["wire_bytes"] for v in by_kind.values())
        inter = int(round(inter_wire))
        return {
            "by_kind": by_kind,
            "scalar_ops": dict(sorted(scalars.items())),
            "payload_bytes": sum(v["payload_bytes"] for v in by_kind.values()),
            "wire_bytes": wire,
            "by_link": {
                "nodes": self.layout.nnodes,
                "ranks_per_node": self.layout.local_world_size,
                "intra_node": {"wire_bytes": wire - inter},
                "inter_node": {"wire_bytes": inter},
            },
        }
