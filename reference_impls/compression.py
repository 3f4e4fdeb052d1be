"""Communication-reducing data parallelism: compressed gradient buckets, and local SGD.

Plain DDP (``data_parallel.DDP``) all-reduces every fp32 gradient bucket: 4Ψ payload bytes per step.
The methods below move fewer bytes and pay for it in optimisation quality; parabench records both
(bytes per step from the comm meter, losses per step) so the trade-off can be read off the results.

Compressed DDP. :class:`CompressedDDP` is the reference DDP with one method replaced: ``_launch``,
which the gradient hooks call as soon as a bucket is complete, hands the bucket to a *compressor*
instead of calling ``all_reduce``. The compressor starts its collective(s) asynchronously and
returns a work object whose ``wait()`` (called by ``DDP.train_step`` before the update) finishes
the exchange and leaves the *averaged, decompressed* gradient in the bucket. Bucketing, overlap
with backward, no_sync during accumulation and the optimizer are untouched.

Gradient scaling: the reference DDP multiplies the loss by 1/N, so each rank's bucket holds
``g_i / N`` and the *sum* over ranks of what each rank contributes is the mean gradient. Every
compressor below keeps that convention: it compresses ``g_i / N`` and sums the decompressed
contributions.

* :class:`FP16Compressor` — half-precision on the wire: cast the bucket to fp16, all-reduce, cast
  back (torch's ``default_hooks.fp16_compress_hook``). 2 bytes per element instead of 4, no state.
* :class:`OneBitCompressor` — 1-bit SGD (Seide et al. 2014, "1-Bit Stochastic Gradient Descent and
  its Application to Data-Parallel Distributed Training of Speech DNNs") in the scaled-sign form
  of EF-SignSGD (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD and other Gradient
  Compression Schemes", Alg. 1; Bernstein et al. 2018 "signSGD"): each tensor is sent as its
  signs, 8 per byte, and one fp32 scale ``||p||_1 / d``; what compression dropped is kept in a
  residual and added to the next step's gradient (error feedback). Ranks all-gather the packed
  signs + scales (a sum of signs is not a sign, so all-reduce cannot be used) and every rank
  decompresses and adds up the N contributions locally.
* :class:`TopKCompressor` — sparsification (Aji & Heafield 2017, "Sparse Communication for
  Distributed Gradient Descent"; Lin et al. 2018, "Deep Gradient Compression"): only the k largest
  |p| of each bucket are sent, as (value fp32, index int32) pairs, with the rest accumulated in a
  residual. Index sets differ between ranks, so again all-gather, then scatter-add locally.
* :class:`PowerSGDCompressor` — low-rank compression (Vogels et al. 2019, "PowerSGD: Practical
  Low-Rank Gradient Compression for Distributed Optimization", Alg. 1): for each 2-D gradient M
  (n x m) and rank r: P = M Q, all-reduce P, orthogonalise P, Q = Mᵀ P, all-reduce Q, M ≈ P Qᵀ;
  one power iteration per step, Q warm-started from the previous step, error feedback. Because
  the compression is linear in M, all-reduce works. 1-D tensors (biases, LayerNorms) are
  all-reduced uncompressed.

Local SGD. :class:`LocalSGD` (Stich 2019, "Local SGD Converges Fast and Communicates Little"; Lin
et al. 2020, "Don't Use Large Mini-Batches, Use Local SGD"): no gradient communication at all;
every rank steps on its own micro-batches, and every ``sync_every`` (H) steps the parameters — and,
by default, the optimizer states — are averaged with all-reduce: on average 4Ψ/H (+ the states)
bytes per step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from reference_impls._compat import all_gather_into
from reference_impls.data_parallel import DDP, _FlatReplica
from reference_impls.dp_common import tensor_bytes


class _Then:
    """A started collective plus what to do once it has finished (``wait`` runs both)."""

    def __init__(self, works, finish):
        self.works, self.finish = works, finish

    def wait(self):
        for w in self.works:
            w.wait()
        self.finish()


def _segments(bucket) -> list[int]:
    """Element counts of the bucket's tensors in flat order (+ the padding, if any, as one more)."""
    sizes = [p.numel() for p in bucket.params]
    return sizes + ([bucket.numel - bucket.used] if bucket.numel > bucket.used else [])


class Compressor:
    """Per-bucket communication of a :class:`CompressedDDP`.

    ``launch(bucket, grad, group)`` starts the exchange of ``grad`` (this rank's bucket, ``g_i/N``)
    and returns a work; after ``work.wait()`` ``grad`` holds the sum over ranks of the decompressed
    contributions. ``state_bytes()`` is what the compressor keeps between steps (residuals, Q).
    """

    def __init__(self, error_feedback: bool = True):
        self.error_feedback = error_feedback
        self.residual: dict[int, torch.Tensor] = {}  # bucket index -> fp32 error-feedback memory

    def _with_error(self, bucket, grad) -> torch.Tensor:
        """p = g + e (fp32): the gradient plus what earlier compressions left out."""
        p = grad.float().clone()
        if self.error_feedback and bucket.index in self.residual:
            p += self.residual[bucket.index]
        return p

    def _remember(self, bucket, p: torch.Tensor, sent: torch.Tensor) -> None:
        """e = p - C(p): what this rank's compressed message left out, sent along next step."""
        if self.error_feedback:
            self.residual[bucket.index] = p - sent

    def launch(self, bucket, grad, group):
        raise NotImplementedError

    def state_bytes(self) -> int:
        return tensor_bytes(self.residual.values())


class FP16Compressor(Compressor):
    """Cast to fp16, all-reduce, cast back. Gradients already carry the 1/N factor, as in torch's
    fp16_compress_hook (which divides before the all-reduce) — it keeps the sum in fp16's range."""

    def __init__(self):
        super().__init__(error_feedback=False)

    def launch(self, bucket, grad, group):
        wire = grad.to(torch.float16)
        work = dist.all_reduce(wire, group=group, async_op=True)
        return _Then([work], lambda: grad.copy_(wire))


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """Booleans -> uint8, 8 per byte, first element in the most significant bit (zero-padded)."""
    pad = (-positive.numel()) % 8
    bits = torch.cat([positive, positive.new_zeros(pad)]).view(-1, 8).to(torch.uint8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=bits.device)
    return (bits * weights).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 -> +1.0 / -1.0 (fp32) for the first ``n`` elements."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.view(-1)[:n].float() * 2 - 1


class OneBitCompressor(Compressor):
    """Scaled sign with error feedback; all-gather of [scales (fp32 bytes) | packed signs]."""

    def compress(self, p: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-tensor scales ||p_j||_1 / d_j, packed signs). A zero counts as positive; error
        feedback carries the difference."""
        scales = torch.stack([seg.abs().mean() for seg in p.split(sizes)])
        return scales, pack_signs(p >= 0)

    def decompress(self, scales: torch.Tensor, packed: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        signs = unpack_signs(packed, sum(sizes))
        return signs * torch.repeat_interleave(scales, torch.tensor(sizes, device=scales.device))

    def launch(self, bucket, grad, group):
        world = dist.get_world_size(group)
        sizes = _segments(bucket)
        p = self._with_error(bucket, grad)
        scales, packed = self.compress(p, sizes)
        self._remember(bucket, p, self.decompress(scales, packed, sizes))
        message = torch.cat([scales.view(torch.uint8), packed])  # one uint8 message per rank
        gathered = torch.empty(world * message.numel(), dtype=torch.uint8, device=grad.device)
        work = all_gather_into(gathered, message, group=group, async_op=True)

        def finish():
            total = torch.zeros_like(p)
            for m in gathered.view(world, -1):
                s = m[: 4 * len(sizes)].clone().view(torch.float32)
                total += self.decompress(s, m[4 * len(sizes) :], sizes)
            grad.copy_(total)

        return _Then([work], finish)


class TopKCompressor(Compressor):
    """Top-k of |g + e| per bucket, k = ceil(ratio x numel); all-gather values and int32 indices."""

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True):
        super().__init__(error_feedback)
        if not 0 < ratio <= 1:
            raise ValueError(f"topk ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio

    def k(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel))

    def launch(self, bucket, grad, group):
        world = dist.get_world_size(group)
        p = self._with_error(bucket, grad)
        idx = p.abs().topk(self.k(p.numel()), sorted=False).indices
        values = p[idx]
        self._remember(bucket, p, torch.zeros_like(p).index_put_((idx,), values))
        all_values = torch.empty(world * values.numel(), dtype=values.dtype, device=grad.device)
        all_idx = torch.empty(world * idx.numel(), dtype=torch.int32, device=grad.device)
        works = [
            all_gather_into(all_values, values, group=group, async_op=True),
            all_gather_into(all_idx, idx.to(torch.int32), group=group, async_op=True),
        ]

        def finish():
            total = torch.zeros_like(p).index_add_(0, all_idx.long(), all_values)  # duplicates add up
            grad.copy_(total)

        return _Then(works, finish)


class PowerSGDCompressor(Compressor):
    """Rank-r PowerSGD per 2-D tensor, one power iteration per step, warm start, error feedback.

    Error feedback follows torch's powerSGD_hook: e_i = p_i - (decompressed sum)/N over the whole
    bucket, so the uncompressed 1-D tensors leave e_i = p_i - mean(p), which sums to zero over
    ranks (the mean is unaffected)."""

    def __init__(self, rank: int = 2, error_feedback: bool = True, seed: int = 0):
        super().__init__(error_feedback)
        self.rank, self.seed = rank, seed
        self.q: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, tensor) -> Q (m x r), warm start

    def _q(self, key, m: int, r: int, device) -> torch.Tensor:
        if key not in self.q:  # the same random Q on every rank (same seed), as torch does
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + key[0] * 1009 + key[1])
            self.q[key] = torch.randn(m, r, generator=g).to(device)
        return self.q[key]

    def launch(self, bucket, grad, group):
        world = dist.get_world_size(group)
        p = self._with_error(bucket, grad)
        mats, vec_slices, start = [], [], 0
        for j, (size, param) in enumerate(zip(_segments(bucket), bucket.params + [None])):
            view = p[start : start + size]
            if param is not None and param.dim() == 2:
                n, m = param.shape
                mats.append((j, view.view(n, m), min(self.rank, n, m)))
            else:
                vec_slices.append((start, size))
            start += size
        works = []
        if vec_slices:  # 1-D tensors (and padding): all-reduced as they are, started first
            flat_vec = torch.cat([p[a : a + s] for a, s in vec_slices])
            works.append(dist.all_reduce(flat_vec, group=group, async_op=True))
        qs = [self._q((bucket.index, j), M.shape[1], r, p.device) for j, M, r in mats]
        ps_flat = torch.cat([(M @ Q).reshape(-1) for (_, M, _), Q in zip(mats, qs)]) if mats else None
        if mats:
            works.append(dist.all_reduce(ps_flat, group=group, async_op=True))  # P = Σ_i M_i Q

        def finish():
            out = torch.empty_like(p)
            if vec_slices:
                at = 0
                for a, s in vec_slices:
                    out[a : a + s] = flat_vec[at : at + s]
                    at += s
            if mats:
                ps, at = [], 0
                for _, M, r in mats:
                    n = M.shape[0]
                    ps.append(torch.linalg.qr(ps_flat[at : at + n * r].view(n, r)).Q)  # orthogonalise P
                    at += n * r
                qs_flat = torch.cat([(M.t() @ P).reshape(-1) for (_, M, _), P in zip(mats, ps)])
                dist.all_reduce(qs_flat, group=group)  # Q = Σ_i M_iᵀ P
                at = 0
                for (j, M, r), P in zip(mats, ps):
                    m = M.shape[1]
                    Q = qs_flat[at : at + m * r].view(m, r)
                    at += m * r
                    self.q[(bucket.index, j)] = Q / world  # warm start (torch keeps the mean Q too)
                    s0 = sum(_segments(bucket)[:j])
                    out[s0 : s0 + M.numel()] = (P @ Q.t()).reshape(-1)  # P Pᵀ Σ_i M_i
            self._remember(bucket, p, out / world)
            grad.copy_(out)

        return _Then(works, finish)

    def state_bytes(self) -> int:
        return super().state_bytes() + tensor_bytes(self.q.values())


class CompressedDDP(DDP):
    """The reference DDP whose per-bucket all-reduce is replaced by ``compressor``'s exchange."""

    def __init__(self, model, loss_fn, group=None, *, compressor: Compressor, **kwargs):
        super().__init__(model, loss_fn, group, **kwargs)
        self.compressor = compressor

    def _launch(self, bucket):
        grad = self.flat_grad[bucket.offset : bucket.offset + bucket.numel]
        self._works.append(self.compressor.launch(bucket, grad, self.group))

    def state_bytes(self):
        out = super().state_bytes()
        out["grads"] += self.compressor.state_bytes()  # residuals (and PowerSGD's Q) are gradient state
        return out


class LocalSGD(_FlatReplica):
    """Every rank steps alone on its local gradient; every ``sync_every`` steps an average.

    Averaged at a sync: the fp32 parameters (the master), and with ``average_optimizer_state`` the
    optimizer's state tensors too (AdamW: both moments; SGD: the momentum buffer); one all-reduce
    each, pre-divided by N (gloo has no AVG). ``optimizer``: ``"adamw"`` (the benchmark's optimizer,
    so loss curves compare with ref.ddp) or ``"sgd"`` (momentum ``momentum``, L2 weight decay).
    With SGD (+ momentum) and ``sync_every=1`` the result is DDP with the same SGD exactly: the
    update is linear in the gradient, so averaging parameters after the step equals stepping on
    the averaged gradient. With AdamW it is not (m/√v is not linear in g), whatever H.
    """

    def __init__(
        self,
        model,
        loss_fn,
        group=None,
        *,
        grad_accum=1,
        compute_dtype=torch.float32,
        adam: dict,
        sync_every: int = 4,
        average_optimizer_state: bool = True,
        optimizer: str = "adamw",
        momentum: float = 0.9,
    ):
        super().__init__(model, loss_fn, group, grad_accum, compute_dtype, float("inf"), adam, None)
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.sync_every, self.average_optimizer_state = sync_every, average_optimizer_state
        if optimizer == "adamw":
            from reference_impls.dp_common import adamw

            self.optimizer = adamw([self.master], **adam)
        elif optimizer == "sgd":
            self.optimizer = torch.optim.SGD(
                [self.master], lr=adam["lr"], momentum=momentum, weight_decay=adam["weight_decay"]
            )
        else:
            raise ValueError(f"local SGD optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
        self.steps_done = 0
        self.last_step_synced = False

    def _loss_multiplier(self) -> float:
        return 1.0 / self.grad_accum  # this rank's own mean gradient: nothing is summed over ranks

    def train_step(self, inputs, targets):
        loss = self._forward_backward(inputs, targets)
        self._update(self.flat_grad if self.flat_grad.dtype == torch.float32 else self.flat_grad.float())
        self.steps_done += 1
        self.last_step_synced = self.steps_done % self.sync_every == 0
        if self.last_step_synced:
            self.average()
        return loss

    def average(self):
        tensors = [self.master]
        if self.average_optimizer_state:
            tensors += [
                v
                for s in self.optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            ]
        for t in tensors:
            t.div_(self.world)
            dist.all_reduce(t, group=self.group)
        if self.master is not self.flat_param:
            self.flat_param.copy_(self.master)

    def full_parameters(self):
        """This rank's parameters (they differ between ranks except right after a sync)."""
        return self._full_parameters_from(self.master)

    def close(self):
        pass
