"""``deepspeed.zero3_nvme``: ZeRO-Infinity (Rajbhandari et al. 2021, "ZeRO-Infinity: Breaking the
GPU Memory Wall for Extreme Scale Deep Learning", Sec. 5: infinity offload engine), DeepSpeed
ZeRO-3 with the parameter partitions and the optimizer state (fp32 master, Adam moments, fp32
gradients at the update) on NVMe, moved by DeepSpeed's async I/O op (csrc/aio, libaio).

Configuration as documented (https://www.deepspeed.ai/docs/config-json/, "Parameter offloading",
"Optimizer offloading", "Asynchronous I/O"; https://www.deepspeed.ai/tutorials/zero/ "ZeRO-Infinity")
and as the pinned 0.19.8 parses it (runtime/zero/offload_config.py, runtime/swap_tensor/aio_config.py:
the docs' older ``thread_count`` is ``intra_op_parallelism`` there). Everything else is
``deepspeed.zero3_offload``'s (peers.deepspeed_zero): the client torch AdamW runs on the CPU.

What the case measures beside the usual step record (``strategy_stats``, per rank):

* the disk under ``nvme_path``, once per case before the engine exists (off the timed path):
  ``disk_write_bytes_per_s`` / ``disk_read_bytes_per_s`` of a sequential pass over one file (O_DIRECT
  where the file system takes it, else buffered + fsync, and the page cache dropped with
  posix_fadvise before reading back); every rank probes at once, as the ranks share the disk in training;
* what training moved: ``nvme_read_bytes_per_step`` / ``nvme_write_bytes_per_step`` from the
  process's ``/proc/self/io`` storage counters (DeepSpeed's swappers keep no byte counts; the aio
  threads belong to the process), and the achieved ``nvme_read_bytes_per_s`` /
  ``nvme_write_bytes_per_s`` over the same steps (every step after the first, up to the
  instrumented one), to set beside the disk's;
* ``nvme_resident_bytes``: the swap files of this rank at the end (the state that lives on disk).

``nvme_path`` defaults to a folder of the case inside its launch's scratch folder (the runner's
``.scratch``), or a temporary folder outside the runner; a given ``nvme_path`` gets a per-case
subfolder. Either is deleted when the case closes.

DeepSpeed 0.19.8 defects found on CPU (libaio, gloo, world 1, fp32; 1-layer GPT, seq 16, vocab 512):

* Misaligned gradient reads (silent; the adapter refuses them). With ``offload_optimizer`` on NVMe
  the fp32 gradient of each parameter is written to its own swap file and read back before the
  update into the sub-group's flat gradient buffer at the parameter's offset in the flat partition
  (partitioned_optimizer_swapper._swap_in_pinned_gradients). The op reads with O_DIRECT, which
  needs an aligned destination; DeepSpeed aligns lengths (``_adjust_for_misaligned_lengths``) but
  not offsets. A piece that starts off DeepSpeed's own alignment (AIO_ALIGNED_BYTES x
  intra_op_parallelism: 256 fp32 elements) is not read: the buffer keeps stale values and the
  optimizer steps on them. d_model 520 (the 520-element biases shift every later weight): 7 of the
  8 swapped pieces came back unequal to their files (the one at offset 0 equal), and the losses left
  deepspeed.zero3's at the first update (6.3293 vs 6.3475 at step 2, 6.2513 vs 5.9404 at step 3).
  d_model 512 (every offset a multiple of 256): losses and final parameters equal deepspeed.zero3's
  and deepspeed.zero3_offload's exactly, with the parameters (15 MB) and the optimizer state
  (59 MB) on disk. The optimizer is not involved (the gradient is wrong before it runs): the client
  torch AdamW matches bit for bit where the offsets are aligned. Ranks > 1 shift the offsets too
  (a partition is ceil(numel / world) elements). :func:`misaligned_gradient_swaps` finds the
  pieces from the built engine and the trainer raises before the first step.
  The earlier "lowered MIN_AIO_BYTES" divergence was this defect: the tiny model's 64-element
  biases misalign every later weight once such small tensors are swapped.
* NVMe parameter prefetch of a duplicate (loud): partitioned_param_coordinator's
  ``__prefetch_nvme_param_partitions`` does not drop a parameter listed twice in its window (the
  ordinary prefetch does), so when a window spans the forward's last module and the backward's
  first, the same partition is swapped in twice: ``AssertionError: param N already assigned swap
  buffer id M`` at the second step (seen with 1-3 layers at d_model 512). Models whose output head
  alone exceeds the window (the GPT ladder's 50304-token head) should not reach it; setting
  ``zero.stage3_prefetch_bucket_size`` to 0 turns all stage-3 prefetch (this one included) off.

Parameter swap buffers (``offload_param.buffer_count`` x ``buffer_size``, pinned CPU memory): every
swappable parameter partition lives on NVMe (``max_in_cpu`` 0), and a partition read back holds one
buffer from the pool (partitioned_param_swapper.py:108 the pool, :190 taken at swap-in, :246 returned
only in ``remove_partition_and_release_buffers``) until stage 3 releases the gathered parameter
(partitioned_param_coordinator.py:629 -> partition_parameters.py:1809). Swap-in with no free buffer
is the assertion "Not enough buffers 0 for swapping 1" (partitioned_param_swapper.py:310). What
stage 3 keeps gathered, once the first step has recorded the trace: a module's parameters, plus any
whose next use lies within ``stage3_max_reuse_distance`` elements of the trace
(partitioned_param_coordinator.py:656-662; default 1e9), plus those whose later use the prefetcher
already passed (:650). ``stage3_max_live_parameters`` only caps how much the ordinary prefetch
gathers (:453), never what is kept. The NVMe read-ahead (``__prefetch_nvme_param_partitions``,
:667-690) takes free buffers only (:683), so it cannot exhaust the pool itself. With the reuse
distance at its default, the kept set grows with how many parameters fit in 1e9 elements between a
module's forward and its backward: at gpt-1.3b (50 M elements a block, 103 M the head) the last 8
blocks' 48 swapped weights and the head, past the earlier 35 buffers (2 x 15 parameters + 5): the
crash on 4x H200 at world 1 and 2. On CPU (fp32, d_model 512, 8 blocks, 48 swapped weights, prefetch
off) every swapped weight stayed held from the second step (the first traced one) and 35 buffers
failed the same way; with reuse distance 0 one was held at a time. Counted the same way, gpt-2.7b
keeps about 5 blocks and gpt-6.7b/13b 1-2 (their blocks are larger than the window's share).
The adapter therefore sets ``stage3_max_reuse_distance`` to 0 (``nvme_config``'s ``zero`` keys,
which ``options.zero`` overrides) rather than sizing the pool for the kept set: DeepSpeed documents
the reuse distance as trading memory for traffic ("Smaller values use less memory, but perform
more communication", runtime/zero/config.py:251), here the memory is the pinned pool; buffers
are uniform at the largest partition, so a pool for the kept set would pin about 10 GB per rank at
gpt-1.3b (some 50 buffers of the 103 M-element embedding, bf16), and its size cannot be known
without replaying DeepSpeed's trace. The cost: parameter partitions are read from NVMe in backward
as well as in forward (the upper end of the theory's read range). The pool (``swap_buffer_count``) then
holds two blocks' swappable weights, one computing while the next is read ahead, plus five. The
``matched`` profile already sets the reuse distance to 0 (peers.deepspeed_zero).

If the async I/O op cannot be built on the machine (no libaio headers or library), the runner
skips the case with the builder's own verdict (``peers.deepspeed_aio.aio_unavailable``); scripts/libaio_bundle.sh
carries libaio to a machine without it.
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
import tempfile
import time

import torch

from parabench.families.sharded import DeepSpeedNVMeOptions
from parabench.peers.deepspeed_zero import DeepSpeedTrainer, deepspeed_on_cpu
from parabench.trainer import TrainSpec

AIO_DEFAULTS = {  # the documented defaults, written out so the record shows them
    "block_size": 1048576,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
}


def nvme_config(
    nvme_path: str,
    pin_memory: bool,
    buffer_size: int,
    buffer_count: int = 5,
    offload_param: dict | None = None,
    offload_optimizer: dict | None = None,
    aio: dict | None = None,
) -> dict:
    """The three ZeRO-Infinity sections: ``offload_param`` and ``offload_optimizer`` to
    ``device: nvme`` at ``nvme_path``, and ``aio``; and ``zero``, stage-3 keys that
    peers.deepspeed_zero.ds_config sets unless ``options.zero`` gives them. ``buffer_size``
    (elements) must hold the largest parameter partition (partitioned_param_swapper asserts it).
    ``max_in_cpu`` 0: every parameter partition DeepSpeed deems swappable (at least max(1 MiB,
    block_size) bytes) lives on NVMe. With parameters on NVMe, ``stage3_max_reuse_distance`` 0: a
    parameter's swap buffer returns to the pool after each use (the module docstring). The dicts
    given win key by key."""
    param = {
        "device": "nvme",
        "nvme_path": nvme_path,
        "pin_memory": pin_memory,
        "buffer_count": buffer_count,
        "buffer_size": buffer_size,
        "max_in_cpu": 0,  # documented default 1e9 would keep up to 1e9 elements in CPU memory, not on disk
    }
    optimizer = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": pin_memory, "buffer_count": 4}
    param = {**param, **(offload_param or {})}
    return {
        "offload_param": param,
        "offload_optimizer": {**optimizer, **(offload_optimizer or {})},
        "aio": {**AIO_DEFAULTS, **(aio or {})},
        "zero": {"stage3_max_reuse_distance": 0} if param["device"] == "nvme" else {},
    }


def swap_buffer_elements(model: torch.nn.Module, world: int) -> int:
    """Elements per parameter swap buffer: the largest parameter partition (numel / world, rounded
    up to 1 Mi elements for the aio alignment). DeepSpeed's default (1e8) is too small for gpt-6.7b's
    and gpt-13b's embeddings on one rank (206 M and 258 M elements) and, times the buffer count
    below, needlessly large for small models (35 fp32 buffers of 1e8 elements: 14 GB per rank)."""
    largest = max(math.ceil(p.numel() / world) for p in model.parameters())
    return -(-largest // 2**20) * 2**20


def swappable(numel: int, world: int, itemsize: int, block_size: int = AIO_DEFAULTS["block_size"]) -> bool:
    """Whether DeepSpeed puts a parameter's partition on NVMe: at least max(1 MiB, aio block_size)
    bytes (partitioned_param_swapper.py:100 and :141; partition_parameters.py:1820-1821), smaller
    ones stay in CPU memory and take no swap buffer."""
    return math.ceil(numel / world) * itemsize >= max(2**20, block_size)


def swap_buffer_count(
    model: torch.nn.Module, world: int, itemsize: int, block_size: int = AIO_DEFAULTS["block_size"]
) -> int:
    """Parameter swap buffers: two blocks' swappable weights (a block's modules in flight while the
    NVMe read-ahead fills the rest) plus five (DeepSpeed's default) for the embeddings and head and
    for parameters kept until a use the prefetcher passed. Enough only with
    ``stage3_max_reuse_distance`` 0 (``nvme_config``), which returns each buffer after its
    parameter's use; the reuse distance's default keeps far more swapped in (the module
    docstring). Biases and norms fall under DeepSpeed's swap minimum and are not counted."""
    per_block = max(
        (
            sum(swappable(p.numel(), world, itemsize, block_size) for p in b.parameters())
            for b in getattr(model, "blocks", [])
        ),
        default=0,
    )
    return 2 * per_block + 5


def disk_probe(folder: str, nbytes: int, chunk: int = 8 << 20) -> dict:
    """Sequential write then read of one ``nbytes`` file in ``folder``, in ``chunk`` pieces: bytes/s
    each way. O_DIRECT (page-aligned mmap buffer) where the file system allows it; otherwise buffered
    writes + fsync, and the file's pages dropped (posix_fadvise DONTNEED) before the read. The file
    is removed afterwards."""
    chunk = min(chunk, max(nbytes, mmap.PAGESIZE)) // mmap.PAGESIZE * mmap.PAGESIZE
    count = max(1, nbytes // chunk)
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(min(chunk, 1 << 20)) * (chunk // min(chunk, 1 << 20)))
    path = os.path.join(folder, f".disk-probe-{os.getpid()}")
    method = "O_DIRECT"
    try:
        try:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
            os.write(fd, buf)  # tmpfs and some overlays refuse O_DIRECT here (EINVAL), not at open
            os.lseek(fd, 0, os.SEEK_SET)
        except OSError:
            method = "buffered+fsync+fadvise"
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        t = time.perf_counter()
        for _ in range(count):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t
        os.close(fd)
        flags = os.O_RDONLY | (os.O_DIRECT if method == "O_DIRECT" else 0)
        fd = os.open(path, flags)
        if method != "O_DIRECT":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        for _ in range(count):
            os.readv(fd, [buf])
        read_s = time.perf_counter() - t
        os.close(fd)
    finally:
        buf.close()
        if os.path.exists(path):
            os.unlink(path)
    total = count * chunk
    return {
        "disk_probe_bytes": total,
        "disk_probe_method": method,
        "disk_write_bytes_per_s": total / write_s,
        "disk_read_bytes_per_s": total / read_s,
    }


def io_counters() -> dict[str, int]:
    """The process's storage I/O so far (``/proc/self/io``: read_bytes, write_bytes), all threads."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return {"read_bytes": out.get("read_bytes", 0), "write_bytes": out.get("write_bytes", 0)}


def case_nvme_root(nvme_path: str) -> str:
    """The per-case folder the swap files go to (see the module docstring)."""
    scratch = os.environ.get("PARABENCH_CASE_SCRATCH")
    if scratch and not nvme_path:
        os.makedirs(scratch + ".nvme", exist_ok=True)
        return scratch + ".nvme"
    if nvme_path:
        os.makedirs(nvme_path, exist_ok=True)
        if scratch:
            root = os.path.join(nvme_path, "parabench-" + os.path.basename(scratch))
            os.makedirs(root, exist_ok=True)
            return root
    return tempfile.mkdtemp(prefix="parabench-nvme-", dir=nvme_path or None)


def _rank_files_bytes(root: str, rank: int) -> int:
    """Bytes of the swap files in this rank's folders (DeepSpeed names them ``rank<r>``)."""
    total = 0
    for folder, _, files in os.walk(root):
        if f"rank{rank}" in folder.split(os.sep):
            total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return total


def misaligned_gradient_swaps(engine) -> list[tuple[str, int, int]]:
    """The gradient pieces DeepSpeed would swap and read back to a misaligned address (see the
    module docstring): (parameter name, offset in its sub-group's flat partition, swapped elements)
    for every parameter of an NVMe-swapped optimizer sub-group whose swapped piece (its length
    rounded down to the alignment, if that is at least the swap minimum) starts off DeepSpeed's
    ``numel_alignment``. Empty without optimizer swapping."""
    opt = engine.optimizer
    swapper = getattr(opt, "optimizer_swapper", None)
    if swapper is None:
        return []
    names = {id(p): n for n, p in engine.module.named_parameters()}
    align = swapper.numel_alignment
    out = []
    for i, group in enumerate(opt.fp16_groups):
        if not opt._swappable_optimizer_subgroup(i):
            continue
        for param in group:
            _, offset, numel = opt.grad_position[opt.get_param_id(param)]
            swapped = numel // align * align
            if swapper.is_swappable_tensor(numel=swapped) and offset % align:
                out.append((names.get(id(param), f"ds_id {param.ds_id}"), offset, swapped))
    return out


class MisalignedGradientSwap(RuntimeError):
    """DeepSpeed would read swapped gradients to misaligned addresses (silently wrong updates)."""


def refuse_misaligned(engine) -> None:
    import deepspeed

    bad = misaligned_gradient_swaps(engine)
    if not bad:
        return
    name, offset, swapped = bad[0]
    align = engine.optimizer.optimizer_swapper.numel_alignment
    raise MisalignedGradientSwap(
        f"DeepSpeed {deepspeed.__version__} ZeRO-Infinity would train on wrong gradients: with "
        f"offload_optimizer on NVMe, {len(bad)} swapped gradient piece(s) start at flat-partition offsets "
        f"that are not multiples of its {align}-element aio alignment (first: {name} at offset {offset}, "
        f"{swapped} elements), and its O_DIRECT reads into them do not land (measured on CPU: 7 of 8 "
        "pieces unequal to their swap files; losses 6.2513 vs deepspeed.zero3's 5.9404 at step 3, "
        "d_model 520). Use offload_optimizer device cpu (deepspeed.zero3_offload) or a model and world "
        "size whose per-rank partitions keep the offsets aligned."
    )


class DeepSpeedNVMeTrainer(DeepSpeedTrainer):
    def __init__(self, spec: TrainSpec):
        from parabench.models import build_model

        o = DeepSpeedNVMeOptions.read(spec.options)
        self.nvme_root = case_nvme_root(o.nvme_path)
        try:
            self.disk = disk_probe(self.nvme_root, int(o.disk_probe_mb * 2**20)) if o.disk_probe_mb > 0 else {}
            model = build_model(spec.model, spec.seed, spec.device)
            cfg = nvme_config(
                self.nvme_root,
                pin_memory=spec.device.type == "cuda",
                buffer_size=swap_buffer_elements(model, spec.topology.dp),
                buffer_count=swap_buffer_count(
                    model,
                    spec.topology.dp,
                    spec.param_dtype.itemsize,
                    {**AIO_DEFAULTS, **o.aio}["block_size"],
                ),
                offload_param=o.offload_param,
                offload_optimizer=o.offload_optimizer,
                aio=o.aio,
            )
            self.nvme_sections = cfg
            self._marks: list[tuple[float, dict]] = []  # (time, io counters) at the start of every step
            super().__init__(spec, 3, offload=True, model=_with_checkpointing(model, spec), profile=o.profile, nvme=cfg)
            try:
                refuse_misaligned(self.engine)
            except MisalignedGradientSwap:
                super().close()
                raise
        except BaseException:
            shutil.rmtree(self.nvme_root, ignore_errors=True)
            raise

    def train_step(self, inputs, targets):
        self._marks.append((time.perf_counter(), io_counters()))
        return super().train_step(inputs, targets)

    def strategy_stats(self) -> dict:
        import torch.distributed as dist

        stats = {**super().strategy_stats(), **self.disk, "nvme_sections": self.nvme_sections}
        rank = dist.get_rank() if dist.is_initialized() else 0
        stats["nvme_resident_bytes"] = _rank_files_bytes(self.nvme_root, rank)
        # From the second step's start to the last step's (the instrumented one's) start: every
        # full step after the first (warm-up costs: swap-file creation, first reads).
        if len(self._marks) >= 3:
            (t0, a), (t1, b) = self._marks[1], self._marks[-1]
            steps, seconds = len(self._marks) - 2, t1 - t0
            read, write = b["read_bytes"] - a["read_bytes"], b["write_bytes"] - a["write_bytes"]
            stats.update(
                nvme_steps_measured=steps,
                nvme_read_bytes=read,
                nvme_write_bytes=write,
                nvme_read_bytes_per_step=read // steps,
                nvme_write_bytes_per_step=write // steps,
                nvme_read_bytes_per_s=read / seconds,
                nvme_write_bytes_per_s=write / seconds,
            )
            if self.disk:
                stats["nvme_read_fraction_of_disk"] = (
                    stats["nvme_read_bytes_per_s"] / self.disk["disk_read_bytes_per_s"]
                )
                stats["nvme_write_fraction_of_disk"] = (
                    stats["nvme_write_bytes_per_s"] / self.disk["disk_write_bytes_per_s"]
                )
        return stats

    def full_parameters(self):
        """One parameter gathered at a time: all of them at once would need a swap buffer each
        (partition_parameters.py:1718 swaps the whole list in together), more than the pool."""
        import deepspeed

        out = {}
        for name, p in self.engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                out[name] = p.detach().float().cpu().clone()
        return out

    def close(self):
        try:
            super().close()
        finally:
            shutil.rmtree(self.nvme_root, ignore_errors=True)


def _with_checkpointing(model, spec):
    from parabench.peers.common import checkpoint_blocks

    checkpoint_blocks(model, spec)
    return model


def build_zero3_nvme(spec: TrainSpec) -> DeepSpeedNVMeTrainer:
    deepspeed_on_cpu(spec)
    return DeepSpeedNVMeTrainer(spec)
