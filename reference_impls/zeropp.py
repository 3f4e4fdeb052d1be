"""ZeRO++: ZeRO-3 with quantized weight all-gathers, a secondary weight partition, and quantized
gradient all-to-all.

Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training"
(arXiv:2306.10209). ZeRO-3 moves 3Ψ per step: an all-gather of the weights in forward, another in
backward, and a reduce-scatter of the gradients. ZeRO++ cuts each of the three, and each cut is an
option here, on its own or together, over the ZeRO-3 of ``fsdp.py`` (every unit resharded after
use, the root included). With all three off this class *is* that ZeRO-3: the same collectives on
the same buffers in the same order.

* ``qwz`` (Sec. 3.1, quantized weight communication): before a weight all-gather, the shard is
  quantized **block by block** to int8 with one fp32 scale per block (symmetric: scale =
  max|x| / 127, q = round(x / scale)); the int8 shards and the scales are all-gathered, and every
  rank dequantizes the gathered blocks into the compute-dtype buffer the parameters are views of
  (its own slot too, so every rank computes with the same weights). Blocks bound the error by the
  largest value *of the block* instead of the whole tensor. Bytes on the wire: 1 per element plus
  4 per block, against 2 (bf16) or 4 (fp32).
* ``hpz`` (Sec. 3.2, hierarchical partitioning): after a unit's forward, each rank keeps a
  **secondary** copy of the gathered weights, partitioned within a sub-group of
  ``hpz_group`` ranks standing in for a node (a slice of 1/k of the unit, in the compute dtype,
  k the sub-group size). Backward then all-gathers from the secondary partition inside the
  sub-group only: no weight traffic crosses "nodes" in backward, for b·Ψ/k more memory per rank.
  With k = 1 the secondary copy is the whole unit and backward gathers nothing. The primary fp32
  shard over the whole group stays the master (the optimizer updates it; the next forward
  refreshes the secondary copy from it). With ``qwz`` too, the secondary gather is quantized as
  well (as DeepSpeed does: partition_parameters.py quantizes ``ds_secondary_tensor`` before it).
* ``qgz`` (Sec. 3.3, quantized gradient communication): the gradient reduce-scatter becomes an
  **all-to-all** of quantized chunks. Chunk j of a unit's flat gradient is rank j's shard; each
  chunk is quantized block-wise (int8, or int4 packed two to a byte: ``qgz_bits``), all chunks and
  their scales are exchanged with one all-to-all each, and every rank dequantizes the N chunks it
  received and **sums them in fp32** (a reduce-scatter of quantized data would sum int8 values on
  the wire, which overflow and do not share a scale). The paper sends it in two hops, intra-node
  then inter-node (reducing and requantizing in between) so that the inter-node volume shrinks by
  the node size; within one node, as here, the two hops are one.

Precision, averaging and memory otherwise as in ``fsdp.py``: the loss is scaled by
1/(grad_accum x N), fp32 main-gradient shards, Adam on the fp32 shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference_impls._compat import all_gather_into
from reference_impls.dp_common import free_now
from reference_impls.fsdp import FSDP

# --- block-wise symmetric quantization --------------------------------------------------------


def quantize(rows: torch.Tensor, block: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``rows`` (R, n) in blocks of ``block`` elements (the last one zero-padded):
    int8 codes (R, nb·block), or with ``bits`` 4 uint8 bytes holding two codes each (R, nb·block/2),
    and fp32 scales (R, nb), nb = ceil(n / block). Symmetric: code = round(x / scale) in
    [-qmax, qmax], scale = max|x| / qmax over the block, qmax = 2**(bits-1) - 1."""
    r, n = rows.shape
    nb = -(-n // block)
    x = torch.nn.functional.pad(rows.float(), (0, nb * block - n)).view(r, nb, block)
    qmax = 2 ** (bits - 1) - 1
    scales = x.abs().amax(dim=2) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block: codes 0
    q = torch.round(x / safe.unsqueeze(2)).clamp_(-qmax, qmax).to(torch.int8).view(r, nb * block)
    if bits == 4:  # two codes a byte, offset by 8 into 0..15
        u = (q.to(torch.int16) + 8).view(r, -1, 2)
        q = (u[..., 0] | (u[..., 1] << 4)).to(torch.uint8)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int, bits: int = 8) -> torch.Tensor:
    """fp32 (R, nb·block) from :func:`quantize`'s codes and scales (padding included)."""
    if bits == 4:
        u = q.to(torch.int16)
        q = torch.stack([(u & 15) - 8, (u >> 4) - 8], dim=-1).view(q.shape[0], -1)
    r, nb = scales.shape
    return (q.float().view(r, nb, block) * scales.unsqueeze(2)).view(r, nb * block)


class ZeroPP(FSDP):
    def __init__(
        self,
        model,
        loss_fn,
        blocks,
        group=None,
        *,
        qwz: bool = False,
        hpz_group=None,
        hpz: bool = False,
        qgz: bool = False,
        qgz_bits: int = 4,
        block: int = 2048,
        **fsdp_kwargs,
    ):
        """``hpz``: keep the secondary partition within ``hpz_group`` (None: a sub-group of one rank,
        i.e. each rank keeps the whole unit). ``block``: elements per quantization block."""
        super().__init__(model, loss_fn, blocks, group, reshard_root=True, **fsdp_kwargs)
        assert qgz_bits in (4, 8) and block % 2 == 0
        self.qwz, self.hpz, self.qgz, self.qgz_bits, self.block = qwz, hpz, qgz, qgz_bits, block
        self.hpz_group = hpz_group
        self.hpz_world = dist.get_world_size(hpz_group) if hpz_group is not None else 1
        self.hpz_rank = dist.get_rank(hpz_group) if hpz_group is not None else 0
        for u in self.units:
            u.secondary = None  # hpZ: this rank's slice of the unit as gathered in the last forward
            u.quantized = None  # qwZ: (int8 codes, scales) of an all-gather in flight

    # --- weight all-gathers: primary (forward), secondary (backward under hpZ) -------------------

    def _gather(self, u, backward: bool = False):
        if u.gathered or u.work is not None:
            return
        secondary = backward and self.hpz and u.secondary is not None
        if not self.qwz and not secondary:
            return super()._gather(u)  # ZeRO-3: cast the fp32 shard into the slot, all-gather in place
        u.full.untyped_storage().resize_(u.nbytes)
        if secondary and self.hpz_world == 1:  # the secondary copy is the whole unit: nothing to gather
            u.full.copy_(u.secondary)
            u.work = []
            return
        group, n, rank = (
            (self.hpz_group, self.hpz_world, self.hpz_rank) if secondary else (self.group, self.world, self.rank)
        )
        source = u.secondary if secondary else u.master
        if not self.qwz:  # hpZ alone: the secondary slice, all-gathered in place within the sub-group
            slot = u.full[rank * source.numel() : (rank + 1) * source.numel()]
            slot.copy_(source)
            u.work = [all_gather_into(u.full, slot, group=group, async_op=True)]
            return
        q, scales = quantize(source.view(1, -1), self.block)  # qwZ: int8 codes + fp32 scales per block
        q_all, s_all = q.new_empty(n, q.shape[1]), scales.new_empty(n, scales.shape[1])
        u.work = [
            all_gather_into(q_all, q, group=group, async_op=True),
            all_gather_into(s_all, scales, group=group, async_op=True),
        ]
        u.quantized = (q_all, s_all, source.numel())

    def _wait(self, u, backward: bool = False):
        self._gather(u, backward)
        if u.work is None:
            return
        for w in u.work if isinstance(u.work, list) else [u.work]:
            w.wait()
        if u.quantized is not None:  # dequantize every rank's shard into the gathered buffer
            q_all, s_all, shard = u.quantized
            u.full.view(q_all.shape[0], shard).copy_(dequantize(q_all, s_all, self.block)[:, :shard])
            u.quantized = None
        u.work, u.gathered = None, True

    def _post_forward(self, u, out):
        if self.hpz:  # keep this rank's slice of the gathered unit before it is freed
            k, j = self.hpz_world, self.hpz_rank
            piece = u.full[j * (u.padded // k) : (j + 1) * (u.padded // k)]
            if u.secondary is None:
                u.secondary = torch.empty_like(piece)  # persistent: refreshed by every forward
            u.secondary.copy_(piece)
        super()._post_forward(u, out)

    def _pre_backward(self, u):
        self._wait(u, backward=True)
        nxt = len(self.units) - 1 if u.index == 0 else u.index - 1  # as in FSDP._pre_backward
        if self.prefetch and nxt > 0:
            self._gather(self.units[nxt], backward=True)

    # --- gradients: reduce-scatter, or (qgZ) quantized all-to-all + local fp32 reduction ---------

    def _grad_ready(self, u):
        if not self.qgz:
            return super()._grad_ready(u)
        if u.index > 0:  # as FSDP._grad_ready: a block's buffer at its first gradient, the root's at its last
            self._grad_buffer(u)
        u.ready += 1
        if u.ready < len(u.params):
            return
        u.ready = 0
        self._free(u)
        chunks = self._grad_buffer(u).view(self.world, u.shard_numel)  # row j: rank j's shard
        q, scales = quantize(chunks, self.block, self.qgz_bits)
        q_in, s_in = torch.empty_like(q), torch.empty_like(scales)
        works = [
            dist.all_to_all_single(q_in, q, group=self.group, async_op=True),  # row i now: rank i's chunk
            dist.all_to_all_single(s_in, scales, group=self.group, async_op=True),
        ]
        self._pending.append((works, (q_in, s_in), u))
        while len(self._pending) > self.in_flight:
            self._retire(*self._pending.pop(0))

    def _retire(self, work, out, u):
        if not isinstance(work, list):
            return super()._retire(work, out, u)
        for w in work:
            w.wait()
        for p in u.params:
            p.grad = None
        u.grad_buf = None
        q_in, s_in = out
        reduced = dequantize(q_in, s_in, self.block, self.qgz_bits)[:, : u.shard_numel].sum(dim=0)  # fp32
        free_now(q_in)
        free_now(s_in)
        dst = self._main_shard(u)
        dst.copy_(reduced) if not self._written[u.index] else dst.add_(reduced)
        self._written[u.index] = True

    def state_bytes(self):
        out = super().state_bytes()
        out["params"] += sum(u.secondary.untyped_storage().nbytes() for u in self.units if u.secondary is not None)
        return out
