"""ZeRO-Offload: ZeRO-2 with the optimizer on the CPU (Ren et al. 2021, "ZeRO-Offload: Democratizing
Billion-Scale Model Training", Sec. 4).

The device keeps what forward and backward need: the compute-dtype parameters and, while backward
runs, the gradient buckets. Everything the optimizer touches moves to the CPU: the fp32 master
shard, Adam's two moments, and the update itself (the paper's "offload strategy": the
O(Ψ)-compute, O(Ψ)-memory update goes to the CPU, the O(Ψ·tokens) forward/backward stays on the
device). Per step:

1. backward: gradient buckets are **reduce-scattered on the device** into the fp32 main-gradient
   shard this rank owns, as in ZeRO-2 (``zero.py``);
2. fp16: the loss scaler unscales and checks that shard *on the device* (the inf flag is
   all-reduced there, which NCCL can do and a CPU tensor could not);
3. the shard is **copied to CPU memory** (pinned on GPUs, so the copy is a DMA);
4. **AdamW runs on the CPU** over the fp32 master shard (torch's multi-tensor kernel; the paper
   uses a SIMD CPU-Adam);
5. the updated master shard is **copied back** into the device's compute-dtype parameter buffer
   and the parameters are all-gathered, as in ZeRO-2.

Device-resident model state per rank: bΨp parameters + 4Ψp/N fp32 main-gradient shard; the CPU
holds 4Ψp/N master + 8Ψp/N Adam (+ a 4Ψp/N gradient copy). On a CPU-only machine the "device" is
the CPU already: the copies are memcpys within the same memory and the measurement shows only
their cost. The paper overlaps the copies with backward and the next forward (and delays the
parameter update by one step, DPU); this reference does them in sequence, which is simpler to read.
"""

from __future__ import annotations

import torch

from reference_impls._compat import all_gather_into
from reference_impls.dp_common import adamw, optimizer_state_bytes, tensor_bytes
from reference_impls.zero import ZeRO


class ZeROOffload(ZeRO):
    def __init__(
        self,
        model,
        loss_fn,
        group=None,
        *,
        grad_accum=1,
        compute_dtype=torch.float32,
        bucket_mb=25.0,
        adam: dict,
        grad_scaler=None,
    ):
        super().__init__(
            model,
            loss_fn,
            group,
            stage=2,
            grad_accum=grad_accum,
            compute_dtype=compute_dtype,
            bucket_mb=bucket_mb,
            adam=adam,
            grad_scaler=grad_scaler,
        )
        self.pinned = self.flat_param.device.type == "cuda"
        sizes = [m.numel() for m in self.master]
        cpu_master = torch.cat([m.detach().float().cpu() for m in self.master])
        cpu_grad = torch.zeros_like(cpu_master)
        if self.pinned:
            cpu_master, cpu_grad = cpu_master.pin_memory(), cpu_grad.pin_memory()
        self.cpu_master_flat, self.cpu_grad = cpu_master, cpu_grad
        self.cpu_master = list(cpu_master.split(sizes))
        for m, g in zip(self.cpu_master, cpu_grad.split(sizes)):
            m.grad = g
        # Nothing of the optimizer stays on the device: drop ZeRO's device master and its AdamW.
        self.master_flat, self.master = None, None
        self.optimizer = adamw(self.cpu_master, **adam)

    def _step(self):
        if self.measure_state:
            self._grad_bytes = tensor_bytes([self.main_grad])  # device-resident gradient state
        applied = True
        if self.grad_scaler is not None:  # on the device, before the copy
            applied = self.grad_scaler.unscale_and_check([self.main_grad], self.group)
            self.grad_scaler.update(applied)
        if applied:
            self.cpu_grad.copy_(self.main_grad)  # device -> CPU (blocking: the CPU reads it next)
            self.optimizer.step()  # AdamW on the CPU
        works = []
        for b, master in zip(self.buckets, self.cpu_master):
            mine = self._mine(self.flat_param, b)
            mine.copy_(master)  # CPU -> device, cast to the compute dtype
            works.append(
                all_gather_into(self.flat_param[b.offset : b.offset + b.numel], mine, group=self.group, async_op=True)
            )
        for w in works:
            w.wait()

    def state_bytes(self):
        """Device-resident model state (the point of offloading); the CPU side is ``cpu_state_bytes``."""
        return {"params": tensor_bytes([self.flat_param]), "grads": self._grad_bytes, "optimizer": 0}

    def cpu_state_bytes(self) -> dict:
        return {
            "master": tensor_bytes([self.cpu_master_flat]),
            "grads": tensor_bytes([self.cpu_grad]),
            "optimizer": optimizer_state_bytes(self.optimizer),
        }

    def full_parameters(self):
        device = self.flat_param.device
        self.master = [m.to(device) for m in self.cpu_master]
        try:
            return super().full_parameters()
        finally:
            self.master = None
