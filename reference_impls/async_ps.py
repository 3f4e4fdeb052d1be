"""An asynchronous parameter server with bounded staleness: workers push gradients and pull parameters
without a barrier.

The synchronous parameter server (``data_parallel.ParameterServer``) makes every worker wait for the
update its gradient went into before it computes the next one: a barrier per step, paced by the slowest
worker. Here a worker pushes its gradient and starts on the next batch at once, with whatever parameters
it has received so far, so its gradient may have been computed on parameters that are ``τ`` updates old.

Consistency model: bounded delay (Li et al. 2014, "Scaling Distributed Machine Learning with the
Parameter Server", Sec. 3 "Flexible Consistency", Fig. 5: sequential = delay 0, eventual = delay ∞,
bounded delay τ in between; Ho et al. 2013, "More Effective Distributed ML via a Stale Synchronous
Parallel Parameter Server", the same bound as a clock). Update ``c`` (``W_c -> W_{c+1}``) averages
one gradient per rank, each computed on parameters ``W_u`` with

    c - max_staleness <= u <= c                  (staleness τ = c - u, the bound ``max_staleness``)

so a worker blocks only when the newest parameters it holds are more than ``max_staleness`` versions
behind the batch it is about to compute. ``max_staleness = 0`` is the synchronous server, bit for bit
(every gradient of update ``c`` is computed on ``W_c``). The seeds contrast the two: bulk synchronous
parallel "has to halt and wait for others", asynchronous parallel "can lead to stale weights and thus
lower the statistical learning efficiency" (seed 003_e2e346ed8bfc8aec.txt, "Data Parallelism").

Wire protocol (gloo or NCCL point-to-point, server = group rank 0, which trains its own slice too):

* worker -> server, per step: its gradient (tag ``TAG_GRAD``, ``bΨ``) and the version ``u`` it was
  computed on (tag ``TAG_VERSION``, one int64), with a blocking ``send``: it returns once the transport
  has the bytes, and the worker never waits for the update its gradient goes into;
* server -> worker, per update: the new parameters (tag ``TAG_PARAMS``, ``bΨ``), ``isend`` from a
  snapshot that stays alive until every worker has it. A worker keeps one ``irecv`` posted for the next
  version and applies arrived versions between steps, never while it computes.

Each push yields exactly one version, so a worker knows how many versions are still owed to it and posts
no receive that could stay unmatched; ``drain()`` (called by ``full_parameters`` and ``close``) waits for
them, after which every rank holds the final parameters.

Measured: the staleness of every gradient the server averaged (its histogram, the server's own always 0),
in :meth:`staleness_stats`. Where the server is the slowest rank (it trains a slice and serves every worker)
the workers run ahead until the bound stops them, so most of their gradients are exactly ``max_staleness``
old (results/studies/async-training-cpu).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from reference_impls.data_parallel import _FlatReplica
from reference_impls.dp_common import adamw, tensor_bytes

TAG_GRAD, TAG_VERSION, TAG_PARAMS = 11, 12, 13


class AsyncParameterServer(_FlatReplica):
    """Bounded-delay parameter server; ``max_staleness`` is the bound τ (0: the synchronous server)."""

    def __init__(
        self,
        model,
        loss_fn,
        group=None,
        *,
        max_staleness: int = 1,
        grad_accum=1,
        compute_dtype=torch.float32,
        adam: dict,
        grad_scaler=None,
    ):
        if grad_scaler is not None:
            raise ValueError("the asynchronous parameter server has no loss scaling: train it in fp32 or bf16")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, not {max_staleness}")
        super().__init__(model, loss_fn, group, grad_accum, compute_dtype, float("inf"), adam, None)
        self.max_staleness = int(max_staleness)
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.server, self.workers = ranks[0], ranks[1:]
        self.is_server = dist.get_rank() == self.server
        self.version = 0  # updates reflected in flat_param
        self.step_index = 0  # the clock c of the next gradient this rank computes
        self.staleness = Counter()  # server: τ of every gradient averaged; worker: of its own pushes
        if self.is_server:
            self.optimizer = adamw([self.master], **adam)
            self.recv_buf = torch.empty_like(self.flat_grad)
            self._sends: list[tuple[list, torch.Tensor]] = []  # (works, snapshot) per version in flight
        else:
            self.optimizer = None
            self.master = self.flat_param
            self.recv_buf = torch.empty_like(self.flat_param)
            self._pending = None  # the posted irecv of the next version
            self._owed = 0  # versions the server will still send this worker

    # --- worker side ---------------------------------------------------------------------------

    def _post(self):
        if self._pending is None and self._owed > 0:
            self._pending = dist.irecv(self.recv_buf, src=self.server, group=self.group, tag=TAG_PARAMS)

    def _apply_received(self):
        self._pending.wait()
        self._pending = None
        self._owed -= 1
        self.flat_param.copy_(self.recv_buf)
        self.version += 1
        self._post()

    def _catch_up(self, need: int):
        """Apply every version that has arrived, then block until at least version ``need`` is here."""
        while self._pending is not None and self._pending.is_completed():
            self._apply_received()
        while self.version < need:
            self._apply_received()

    def drain(self):
        """Receive every version still owed (worker) or finish every send (server)."""
        if self.is_server:
            for works, _ in self._sends:
                for w in works:
                    w.wait()
            self._sends = []
        else:
            while self._owed:
                self._apply_received()

    # --- the step ------------------------------------------------------------------------------

    def train_step(self, inputs, targets):
        c = self.step_index
        if not self.is_server:
            self._catch_up(c - self.max_staleness)
        loss = self._forward_backward(inputs, targets)
        if self.is_server:
            self._serve(c)
        else:
            self.staleness[c - self.version] += 1
            dist.send(self.flat_grad, dst=self.server, group=self.group, tag=TAG_GRAD)
            version = torch.tensor([self.version], dtype=torch.int64, device=self.flat_grad.device)
            dist.send(version, dst=self.server, group=self.group, tag=TAG_VERSION)
            if self.measure_state:
                self._grad_bytes = tensor_bytes([self.flat_grad])
            self.flat_grad.zero_()
            self._owed += 1
            self._post()
        self.step_index += 1
        return loss

    def _serve(self, c: int):
        """Update ``c``: the server's own gradient (on ``W_c``) plus one from each worker, then send ``W_{c+1}``."""
        main_grad = self.flat_grad if self.flat_grad.dtype == torch.float32 else self.flat_grad.float()
        self.staleness[0] += 1
        version = torch.zeros(1, dtype=torch.int64, device=self.flat_grad.device)
        for w in self.workers:  # update c needs every rank's gradient c; whichever arrives first waits
            dist.recv(self.recv_buf, src=w, group=self.group, tag=TAG_GRAD)
            dist.recv(version, src=w, group=self.group, tag=TAG_VERSION)
            tau = c - int(version)
            if not 0 <= tau <= self.max_staleness:
                raise RuntimeError(f"rank {w} pushed a gradient of version {int(version)} to update {c}")
            self.staleness[tau] += 1
            main_grad.add_(self.recv_buf)
        self.master.grad = main_grad
        if self.measure_state:
            self._grad_bytes = tensor_bytes({id(t): t for t in (self.flat_grad, main_grad, self.recv_buf)}.values())
        self.optimizer.step()
        self.master.grad = None
        if self.master is not self.flat_param:
            self.flat_param.copy_(self.master)
        self.flat_grad.zero_()
        self.version += 1
        self._sends = [(ws, s) for ws, s in self._sends if not all(w.is_completed() for w in ws)]
        snapshot = self.flat_param.clone()  # the next update overwrites flat_param before the sends finish
        works = [dist.isend(snapshot, dst=w, group=self.group, tag=TAG_PARAMS) for w in self.workers]
        self._sends.append((works, snapshot))

    # --- measurements --------------------------------------------------------------------------

    def staleness_stats(self) -> dict:
        """The staleness histogram (server: every gradient averaged; worker: its own pushes)."""
        n = sum(self.staleness.values())
        return {
            "max_staleness_bound": self.max_staleness,
            "staleness_counts": {str(k): v for k, v in sorted(self.staleness.items())},
            "staleness_max": max(self.staleness) if n else None,
            "staleness_mean": sum(k * v for k, v in self.staleness.items()) / n if n else None,
            "gradients_counted": n,
            "role": "server" if self.is_server else "worker",
        }

    def state_bytes(self) -> dict:
        if self.is_server:
            out = super().state_bytes()
            out["params"] += tensor_bytes(s for _, s in self._sends)  # snapshots still in flight
            return out
        return {"params": tensor_bytes([self.flat_param, self.recv_buf]), "grads": self._grad_bytes, "optimizer": 0}

    def full_parameters(self):
        self.drain()
        return self._full_parameters_from(self.master if self.is_server else self.flat_param)

    def close(self):
        self.drain()
