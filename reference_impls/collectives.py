"""Collective algorithms written on point-to-point send/recv only, to be read and measured.

Every function works in place (or into a given output) on a contiguous tensor, reduces with SUM,
and runs on any number of ranks, powers of two or not. The only communication used is
``isend``/``irecv`` posted together through ``batch_isend_irecv`` (:func:`_exchange`), then waited
for, so each "step" below is one round of simultaneous sends and receives.

Cost model (Hockney, as in the papers): a message of ``N`` bytes costs ``α + Nβ``, reducing it
costs ``Nγ``; ``p`` is the number of ranks.

* parameter server (root 0): 2 steps; the root receives (p-1)N and sends (p-1)N bytes,
  every other rank sends N.
* binary tree, reduce then broadcast: 2·⌊log2 p⌋ steps of the whole vector; an inner node
  sends up to 3N.
* ring, reduce-scatter then all-gather: 2(p-1) steps of N/p; 2(p-1)/p · N sent per rank,
  the lower bound.
* recursive halving then doubling: 2·log2 p' steps (p' the largest power of two ≤ p), plus 2
  full-vector steps when p is not a power of two; 2(p'-1)/p' · N sent per rank (+N for the
  ranks folded in).

References
----------
* R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication Operations
  in MPICH", IJHPCA 19(1), 2005 — recursive halving/doubling (Rabenseifner's
  all-reduce, with the fold of the extra ranks for non-powers of two), the ring all-gather and
  the α-β-γ cost model used above.
* P. Patarasuk, X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 69(2), 2009 — the ring all-reduce (reduce-scatter ring followed by an
  all-gather ring) reaches the lower bound 2(p-1)/p · N on bytes per rank.

``group``: every function takes an optional process group. Peers are computed as ranks *within*
the group and translated with ``dist.get_global_rank`` for the point-to-point calls, which
address ranks globally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "ps_allreduce",
    "ring_allreduce",
    "recursive_halving_doubling_allreduce",
    "tree_allreduce",
    "ring_allgather",
    "ring_reduce_scatter",
    "node_groups",
    "hierarchical_allreduce",
]


# --------------------------------------------------------------------------- helpers


def _rank_and_size(group) -> tuple[int, int]:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group")
    return rank, size


def _global(group, rank: int) -> int:
    """Group rank → global rank (what send/recv address)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _exchange(sends, recvs, group) -> None:
    """Post ``sends`` [(tensor, peer)] and ``recvs`` [(tensor, peer)] at once and wait for all.

    Peers are group ranks. Posting both sides together is what lets two neighbours swap data
    without deadlock (each would otherwise block in ``send`` waiting for the other's ``recv``).
    Empty tensors are skipped: both ends compute the same sizes, so they skip the same messages.
    """
    ops = [dist.P2POp(dist.isend, t, _global(group, peer), group) for t, peer in sends if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, _global(group, peer), group) for t, peer in recvs if t.numel()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("collectives here work in place on contiguous tensors")
    return tensor.view(-1)


def _bounds(numel: int, parts: int) -> list[int]:
    """Offsets of ``parts`` nearly equal chunks (the first ``numel % parts`` one element longer).

    Uneven split rather than padding: no extra copy, and chunks may be empty when
    ``numel < parts`` (those messages are simply not sent)."""
    base, extra = divmod(numel, parts)
    offsets = [0]
    for i in range(parts):
        offsets.append(offsets[-1] + base + (1 if i < extra else 0))
    return offsets


# --------------------------------------------------------------------------- all-reduce


def ps_allreduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Parameter server: every rank sends its whole tensor to rank 0, which sums and sends back.

    The naive baseline. Two steps, but the root receives (p-1)N bytes and sends (p-1)N bytes
    through one link, so its time grows linearly with p while the ring's stays flat.
    """
    rank, n = _rank_and_size(group)
    flat = _flat(tensor)
    if n == 1:
        return tensor
    if rank == 0:
        incoming = [torch.empty_like(flat) for _ in range(n - 1)]
        _exchange([], [(buf, peer) for peer, buf in enumerate(incoming, start=1)], group)
        for buf in incoming:
            flat.add_(buf)
        _exchange([(flat, peer) for peer in range(1, n)], [], group)
    else:
        _exchange([(flat, 0)], [], group)
        _exchange([], [(flat, 0)], group)
    return tensor


def ring_allreduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Ring all-reduce (Patarasuk & Yuan 2009): a reduce-scatter ring, then an all-gather ring.

    The tensor is cut into p chunks (uneven split, see :func:`_bounds`). Each rank only ever
    talks to its right neighbour (send) and its left neighbour (receive).

    * Reduce-scatter, steps s = 0..p-2: rank r sends chunk (r - s) and receives chunk
      (r - s - 1), adding it to its own copy. A chunk gains one contribution per hop, so after
      p-1 hops rank r holds the complete sum of chunk (r + 1).
    * All-gather, steps s = 0..p-2: rank r forwards the complete chunk (r + 1 - s) and receives
      the complete chunk (r - s) into place.

    Each rank sends 2(p-1) messages of N/p: 2(p-1)/p · N bytes, the lower bound for all-reduce,
    at the price of 2(p-1) latencies (bad for small messages, where the tree or recursive
    doubling wins).
    """
    rank, n = _rank_and_size(group)
    flat = _flat(tensor)
    if n == 1:
        return tensor
    off = _bounds(flat.numel(), n)

    def chunk(i: int) -> torch.Tensor:
        i %= n
        return flat[off[i] : off[i + 1]]

    left, right = (rank - 1) % n, (rank + 1) % n
    scratch = torch.empty(off[1] - off[0], dtype=flat.dtype, device=flat.device)  # chunk 0 is the largest
    for s in range(n - 1):  # reduce-scatter
        mine = chunk(rank - s - 1)
        incoming = scratch[: mine.numel()]
        _exchange([(chunk(rank - s), right)], [(incoming, left)], group)
        mine.add_(incoming)
    for s in range(n - 1):  # all-gather: rank r starts with the complete chunk r + 1
        _exchange([(chunk(rank + 1 - s), right)], [(chunk(rank - s), left)], group)
    return tensor


def recursive_halving_doubling_allreduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Rabenseifner's all-reduce (Thakur, Rabenseifner & Gropp 2005, the all-reduce section).

    1. *Fold* (only when p is not a power of two): with p' the largest power of two ≤ p and
       r = p - p', the first 2r ranks pair up; each even rank sends its whole vector to the odd
       rank above it and sits out. p' ranks remain, renumbered 0..p'-1.
    2. *Reduce-scatter by recursive halving*: in the step at distance d = p'/2, p'/4, ..., 1
       each rank swaps half of its current range with the partner ``newrank XOR d``, keeps the
       half that its bit ``d`` selects and adds the partner's copy of it. After log2 p' steps
       rank k holds the complete sum of chunk k (1/p' of the vector).
    3. *All-gather by recursive doubling*: the same pairs in reverse order (d = 1, 2, ...)
       swap the complete blocks they own, which double each step.
    4. *Unfold*: each odd rank of the first 2r sends the result back to its even partner.

    Bytes per rank 2(p'-1)/p' · N like the ring, but only 2·log2 p' latencies; the fold costs
    two extra full-vector steps for the ranks involved.
    """
    rank, n = _rank_and_size(group)
    flat = _flat(tensor)
    if n == 1:
        return tensor
    pof2 = 1 << (n.bit_length() - 1)
    rem = n - pof2

    # 1. fold the extra ranks into their partners
    if rank < 2 * rem:
        if rank % 2 == 0:
            _exchange([(flat, rank + 1)], [], group)
            newrank = -1
        else:
            incoming = torch.empty_like(flat)
            _exchange([], [(incoming, rank - 1)], group)
            flat.add_(incoming)
            newrank = rank // 2
    else:
        newrank = rank - rem

    def real(k: int) -> int:
        """Group rank of the rank renumbered ``k`` among the p' that take part."""
        return 2 * k + 1 if k < rem else k + rem

    if newrank >= 0:
        off = _bounds(flat.numel(), pof2)

        def blocks(lo: int, hi: int) -> torch.Tensor:  # chunks lo..hi-1, contiguous
            return flat[off[lo] : off[hi]]

        # 2. reduce-scatter by recursive halving
        scratch = torch.empty(off[pof2 // 2], dtype=flat.dtype, device=flat.device)  # largest half
        lo, hi, d = 0, pof2, pof2 // 2
        while d:
            partner, mid = newrank ^ d, (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if newrank & d else ((lo, mid), (mid, hi))
            mine = blocks(*keep)
            incoming = scratch[: mine.numel()]
            _exchange([(blocks(*give), real(partner))], [(incoming, real(partner))], group)
            mine.add_(incoming)
            lo, hi = keep
            d //= 2
        # now lo == newrank: this rank owns the complete chunk newrank
        # 3. all-gather by recursive doubling
        d = 1
        while d < pof2:
            partner = newrank ^ d
            my_lo, their_lo = newrank // d * d, partner // d * d
            _exchange(
                [(blocks(my_lo, my_lo + d), real(partner))], [(blocks(their_lo, their_lo + d), real(partner))], group
            )
            d *= 2

    # 4. unfold: give the folded ranks the result
    if rank < 2 * rem:
        if rank % 2 == 1:
            _exchange([(flat, rank - 1)], [], group)
        else:
            _exchange([], [(flat, rank + 1)], group)
    return tensor


def tree_allreduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Binary-tree reduce to rank 0, then binary-tree broadcast back (heap numbering).

    Rank r's children are 2r+1 and 2r+2, its parent (r-1)//2. Reduce: receive both children's
    (partial) sums at once, add, send the result up. Broadcast: receive from the parent, send to
    the children. 2·⌊log2 p⌋ steps of the *whole* vector, so the latency term is
    logarithmic but the bandwidth term is ~2·log2(p)·N instead of the ring's 2N: good for small
    messages, poor for large ones. Production trees (MPICH's binomial trees, NCCL's double binary
    tree) pipeline the vector in segments to recover the bandwidth; this one does not, to stay
    readable.
    """
    rank, n = _rank_and_size(group)
    flat = _flat(tensor)
    if n == 1:
        return tensor
    parent = (rank - 1) // 2
    children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < n]
    incoming = [torch.empty_like(flat) for _ in children]
    _exchange([], list(zip(incoming, children)), group)  # reduce: children first
    for buf in incoming:
        flat.add_(buf)
    if rank:
        _exchange([(flat, parent)], [], group)
        _exchange([], [(flat, parent)], group)  # broadcast: wait for the total from above
    _exchange([(flat, c) for c in children], [], group)
    return tensor


# --------------------------------------------------------------------------- all-gather, reduce-scatter


def ring_allgather(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """Ring all-gather (Thakur et al. 2005) of equal shards: ``output`` = cat of inputs.

    ``output`` has p × ``input.numel()`` elements; rank r's input lands at shard r. In step s
    rank r forwards shard (r - s) to its right neighbour and receives shard (r - s - 1) from its
    left one, straight into place. p-1 steps, (p-1)/p of the output sent per rank (optimal).
    """
    rank, n = _rank_and_size(group)
    out, inp = _flat(output), _flat(input)
    size = inp.numel()
    if out.numel() != n * size:
        raise ValueError(f"output has {out.numel()} elements, expected {n} x {size}")

    def shard(i: int) -> torch.Tensor:
        i %= n
        return out[i * size : (i + 1) * size]

    if shard(rank).data_ptr() != inp.data_ptr():
        shard(rank).copy_(inp)
    left, right = (rank - 1) % n, (rank + 1) % n
    for s in range(n - 1):
        _exchange([(shard(rank - s), right)], [(shard(rank - s - 1), left)], group)
    return output


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """Ring reduce-scatter of equal shards: ``output`` on rank r = Σ over ranks of input shard r.

    ``input`` (left untouched) has p × ``output.numel()`` elements. A running partial sum travels
    around the ring: in step s rank r sends its partial sum of shard (r - s - 1) to the right,
    receives the left neighbour's partial sum of shard (r - s - 2) and adds its own input shard.
    The shard numbering is offset by one from :func:`ring_allreduce` so that the last sum to
    arrive at rank r is shard r, as ``reduce_scatter_tensor`` defines it. p-1 steps,
    (p-1)/p of the input sent per rank (optimal).
    """
    rank, n = _rank_and_size(group)
    out, inp = _flat(output), _flat(input)
    size = out.numel()
    if inp.numel() != n * size:
        raise ValueError(f"input has {inp.numel()} elements, expected {n} x {size}")

    def shard(i: int) -> torch.Tensor:
        i %= n
        return inp[i * size : (i + 1) * size]

    if n == 1:
        out.copy_(inp)
        return output
    left, right = (rank - 1) % n, (rank + 1) % n
    incoming, partial = torch.empty_like(out), torch.empty_like(out)
    send = shard(rank - 1)
    for s in range(n - 1):
        _exchange([(send, right)], [(incoming, left)], group)
        dst = out if s == n - 2 else partial  # the send has completed: partial may be overwritten
        torch.add(shard(rank - s - 2), incoming, out=dst)
        send = dst
    return output


# --------------------------------------------------------------------------- hierarchical all-reduce


def node_groups(nnodes: int, ranks_per_node: int):
    """(this rank's intra-node group, its inter-node group) for nodes of ``ranks_per_node``
    consecutive ranks (torchrun's layout: LOCAL_WORLD_SIZE, GROUP_RANK). The inter-node group joins
    the ranks with the same local rank, one per node. Every rank creates every group, in the same
    order, as ``new_group`` requires."""
    world = nnodes * ranks_per_node
    if dist.get_world_size() != world:
        raise ValueError(f"{nnodes} nodes x {ranks_per_node} ranks is not the world of {dist.get_world_size()}")
    rank = dist.get_rank()
    intra = inter = None
    for node in range(nnodes):
        group = dist.new_group(list(range(node * ranks_per_node, (node + 1) * ranks_per_node)))
        if rank // ranks_per_node == node:
            intra = group
    for local in range(ranks_per_node):
        group = dist.new_group(list(range(local, world, ranks_per_node)))
        if rank % ranks_per_node == local:
            inter = group
    return intra, inter


def hierarchical_allreduce(tensor: torch.Tensor, intra_group, inter_group) -> torch.Tensor:
    """All-reduce in three rings: reduce-scatter inside the node, all-reduce of each shard across
    the nodes (between the ranks holding the same shard), all-gather inside the node.

    With m ranks per node and k nodes, a rank sends 2(m-1)/m · N inside its node (the same as a
    flat ring) and 2(k-1)/k · N/m across nodes: the slow link carries 1/m of what it carries in a
    flat ring over n = mk ranks, where a node's last rank sends its whole 2(n-1)/n · N across.
    The tensor is padded to a multiple of m for equal shards (the padding is sent, as in NCCL's
    and Horovod's hierarchical forms)."""
    flat = _flat(tensor)
    m = dist.get_world_size(intra_group)
    size = -(-flat.numel() // m)
    padded = flat.new_zeros(size * m)
    padded[: flat.numel()].copy_(flat)
    shard = flat.new_empty(size)
    ring_reduce_scatter(shard, padded, intra_group)
    ring_allreduce(shard, inter_group)
    ring_allgather(padded, shard, intra_group)
    flat.copy_(padded[: flat.numel()])
    return tensor
