"""The shared half of the peer-fidelity scripts: the GPT they train, its data, their flags, and the
measurement. Standalone on purpose: it imports torch and the standard library only, never
parabench, so each script shows what a user of the library would write from its documentation.

The model reproduces ``parabench/models.py`` layer for layer and name for name (the parameter
names, shapes, order and GPT-2 initialisation), and the data its Markov-chain batches, so a script
and its parabench adapter start from the same weights and see the same tokens: their losses agree
as far as the library's arithmetic allows (tests/test_fidelity.py compares the parameter count).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# --- the model: a GPT-2/3 decoder, parabench's block layouts --------------------------------------


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.head_dim = d // n_head
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, s, _ = x.shape
        # heads from the local width: a tensor-parallel shard has fewer of them
        q, k, v = (lin(x).view(b, s, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class FusedAttention(nn.Module):
    """GPT-2 / nanoGPT / Megatron-LM's layout: one qkv linear (d -> 3d, with a bias) split into
    q, k and v after the matmul (``--layout fused``)."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.head_dim = d // n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, layout: str = "separate"):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = FusedAttention(d, n_head) if layout == "fused" else Attention(d, n_head)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, n_layer: int, n_head: int, d_model: int, vocab: int, seq_len: int, layout: str = "separate"):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, layout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_gpt(args, device) -> GPT:
    """fp32 parameters on ``device``, GPT-2 initialisation (N(0, 0.02), residual projections
    scaled by 1/sqrt(2L)) drawn in parameter order from one seeded generator on the device."""
    with torch.device("meta"):
        model = GPT(args.n_layer, args.n_head, args.d_model, args.vocab, args.seq_len, args.layout)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    resid_std = 0.02 / math.sqrt(2 * args.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen, device=device).mul_(std))
    return model


# --- the data: token[t+1] = token[t] + offset, offsets drawn from a skewed set -------------------

OFFSETS = (1, 2, 3, 5, 8, 13)
PROBS = (0.5, 0.2, 0.12, 0.08, 0.06, 0.04)


def global_batch(step: int, batch_size: int, args):
    gen = torch.Generator(device="cpu").manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, args.vocab, (batch_size, 1), generator=gen)
    choice = torch.multinomial(torch.tensor(PROBS), batch_size * args.seq_len, replacement=True, generator=gen)
    offsets = torch.tensor(OFFSETS)[choice].view(batch_size, args.seq_len)
    stream = torch.cat([starts, starts + offsets.cumsum(dim=1)], dim=1) % args.vocab
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def local_batches(args, dp_rank: int, dp: int, device):
    """This rank's micro-batch of every step's global batch (``micro_batch * dp`` sequences)."""
    lo = dp_rank * args.micro_batch
    out = []
    for step in range(args.warmup + args.steps):
        x, y = global_batch(step, args.micro_batch * dp, args)
        out.append((x[lo : lo + args.micro_batch].to(device), y[lo : lo + args.micro_batch].to(device)))
    return out


# --- the bf16-master recipe: 16-bit parameters, fp32 master weights and AdamW states --------------


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _local_grad(p):
    """The local part of ``p.grad`` in ``p``'s own layout: DTensor may leave a gradient in another
    placement than its parameter (a vocabulary-sharded embedding gets a replicated one)."""
    g = p.grad
    if hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return _local(g)


class MasterWeightAdamW:
    """AdamW on fp32 master copies of 16-bit parameters (Micikevicius et al. 2018, "Mixed
    Precision Training"; DeepSpeed's and Megatron's bf16 recipe): gradients are copied up to fp32,
    the fused (CUDA) or foreach AdamW updates the masters, and the masters are copied back down.
    It works on each parameter's local tensor (a DTensor's shard), so one kernel call covers
    every parameter whatever its placement."""

    def __init__(self, params, fused: bool, **hyper):
        self.params = [p for p in params if p.requires_grad]
        self.master = [_local(p).detach().float().clone() for p in self.params]
        self.grads = [torch.zeros_like(m) for m in self.master]
        for m, g in zip(self.master, self.grads):
            m.grad = g
        impl = {"fused": True} if fused else {"foreach": True}
        self.inner = torch.optim.AdamW(self.master, **hyper, **impl)

    @torch.no_grad()
    def step(self):
        torch._foreach_copy_(self.grads, [_local_grad(p) for p in self.params])
        self.inner.step()
        torch._foreach_copy_([_local(p) for p in self.params], self.master)

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None


# --- flags, process group, measurement ------------------------------------------------------------


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument(
        "--layout",
        choices=("separate", "fused"),
        default="separate",
        help="attention projections: separate q, k, v linears, or one fused qkv linear (GPT-2 / nanoGPT)",
    )
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when present")
    ap.add_argument("--out", help="write the JSON result here (rank 0); it is printed either way")
    return ap


# AdamW with every hyperparameter explicit (library defaults differ, weight decay above all).
def adamw_hyper(args) -> dict:
    return {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def init(args, backend_timeout_s: float = 600.0) -> torch.device:
    """torchrun's environment: NCCL on cuda:LOCAL_RANK (``--device cuda``, or auto with a GPU
    present), else gloo on the CPU."""
    import datetime

    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=backend_timeout_s), device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=backend_timeout_s))
    return device


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # Linux: resets ru_maxrss's high-water mark (proc(5), /proc/pid/clear_refs)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def _peak(device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _host_times() -> dict:
    """This thread's and process's CPU seconds, the host's busy seconds (/proc/stat) and the wall
    clock: read on either side of the timed steps, as parabench's worker does, so a slow or
    scattered launch of the script can be told from a busy host."""
    thread = resource.getrusage(resource.RUSAGE_THREAD)
    process = resource.getrusage(resource.RUSAGE_SELF)
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(ticks[:3]) + sum(ticks[5:8])) / tick
        # the hypervisor's: time this VM's CPUs waited for the physical ones (absent on old kernels)
        steal = ticks[7] / tick if len(ticks) > 7 else None
    except (OSError, ValueError):
        busy = steal = None
    threads = {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
        except OSError:
            continue
        fields = tail.split()
        threads[tid] = (names.get(int(tid)) or head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / tick)
    return {
        "threads": threads,
        "wall": time.perf_counter(),
        "thread": thread.ru_utime + thread.ru_stime,
        "process": process.ru_utime + process.ru_stime,
        "busy": busy,
        "steal": steal,
        "involuntary": thread.ru_nivcsw,
    }


def _host_use(before: dict, after: dict) -> dict:
    wall = after["wall"] - before["wall"]
    mine = after["process"] - before["process"]
    other = None if before["busy"] is None else max(0.0, after["busy"] - before["busy"] - mine) / wall
    threads = sorted(
        (
            {"thread": name, "cpu_share": round((cpu - before["threads"].get(tid, (name, 0.0))[1]) / wall, 4)}
            for tid, (name, cpu) in after["threads"].items()
        ),
        key=lambda r: -r["cpu_share"],
    )
    return {
        "threads": [r for r in threads[:6] if r["cpu_share"] > 0],
        "thread_cpu_share": (after["thread"] - before["thread"]) / wall,
        "process_cpu_share": mine / wall,
        "other_cpu_share": other,
        "steal_cpu_share": None if before["steal"] is None else max(0.0, after["steal"] - before["steal"]) / wall,
        "involuntary_switches": after["involuntary"] - before["involuntary"],
        "load_average": list(os.getloadavg()),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "boot_id": _boot_id(),
    }


def _boot_id() -> str | None:
    """The kernel's boot id: equal on both sides only when script and adapter ran on one machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _dispatch_us(device, ops: int = 200, repeats: int = 5) -> float:
    """The host's median time to issue one tiny op on ``device``, in µs: the same probe parabench's
    worker takes before the warm-up and after the timed steps, so a launch's speed can be set
    beside its host's on both sides."""
    x = torch.zeros(1, device=device)
    x.add_(1.0)
    _sync(device)
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(ops):
            x.add_(1.0)
        rounds.append((time.perf_counter() - t0) / ops)
        _sync(device)
    return statistics.median(rounds) * 1e6


class StepClock:
    """Per-step durations that do not stall the device, as parabench's worker takes them: a CUDA
    event recorded after each step and read once at the end (the host clock on a CPU, where a step
    ends when its call returns). No synchronisation between steps: a library that keeps the device
    fed while the host runs ahead is timed as it would run in training (a sync after every step
    would stall its host each step). The marks add up to the window's device time; what the median
    step leaves out shows in the window's wall clock (``measure``)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def durations_s(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


TIMING_METHOD = (
    "step: CUDA events after each step, no per-step sync, read at the end (host clock on CPU); "
    "tokens/s from the slowest rank's median step; window: wall clock from one device sync before "
    "the first timed step to one after the last, the slowest rank's"
)


def measure(args, device, step, batches, tokens_per_step: int, library: dict) -> dict | None:
    """Run ``warmup`` untimed and ``steps`` timed calls of ``step(x, y) -> loss``; return (rank 0)
    the result, else None. The same method as parabench's worker, so that script and adapter are
    timed alike (``TIMING_METHOD``):

    - per step, a ``StepClock`` mark after each step, no synchronisation between steps; a step's
      time is the slowest rank's, and tokens/s per device uses the median step;
    - the timed window: the wall clock from one device sync before the first timed step to one
      after the last (the slowest rank's), giving ``window_tokens_per_s_per_device``. The step
      durations add up to about the window; their median leaves out the slow steps (a host stall,
      a garbage collection, a library's periodic sync), which the window keeps.

    Peak memory is the largest rank's over the timed steps. A step's loss is the mean over the
    ranks that return one (``step`` may return None: a pipeline's ranks without its last stage)."""
    losses = []
    dispatch_before = _dispatch_us(device)
    for x, y in batches[: args.warmup]:
        losses.append(step(x, y))
    _sync(device)
    dist.barrier()
    _reset_peak(device)
    clock = StepClock(device)
    host_before = _host_times()
    _sync(device)
    window_start = time.perf_counter()
    clock.mark()
    for x, y in batches[args.warmup :]:
        losses.append(step(x, y))
        clock.mark()
    host_after = _host_times()  # the host's own work over the steps, before the wait for the device
    _sync(device)
    window_s = time.perf_counter() - window_start
    times = clock.durations_s()
    host = _host_use(host_before, host_after)
    host["dispatch_us"] = {"before": dispatch_before, "after": _dispatch_us(device)}
    peak = _peak(device)
    mine = {
        "times": times,
        "window_s": window_s,
        "peak": peak,
        "losses": [None if l is None else float(_local(l)) for l in losses],
        "host": host,
    }
    world = dist.get_world_size()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    steps = [max(ts) for ts in zip(*(r["times"] for r in everyone))]
    median = statistics.median(steps)
    window = max(r["window_s"] for r in everyone)
    losses = [statistics.fmean(v for v in vals if v is not None) for vals in zip(*(r["losses"] for r in everyone))]
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
    config = {**vars(args), "world_size": world, "device": device.type}
    config.update({k: v for k, v in library.items() if k != "choices"})
    return {
        "tokens_per_s_per_device": tokens_per_step / median / world,
        "step_time_s_median": median,
        "step_times_s": steps,
        "timed_window_s": window,
        "window_tokens_per_s_per_device": tokens_per_step * len(steps) / window / world,
        "timing": TIMING_METHOD,
        "peak_memory_bytes": max(r["peak"] for r in everyone),
        "peak_memory_source": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "ru_maxrss",
        "final_loss": losses[-1],
        "losses": losses,
        "tokens_per_step": tokens_per_step,
        "host_per_rank": [r["host"] for r in everyone],
        "config": config,
        # where the script follows its library's recipe and parabench's adapter does not (the
        # script's ``library["choices"]``): an adapter that differs can still be fast, but then
        # the ratio is between two recipes, and the report says which
        "choices": library.get("choices") or {},
        "versions": versions,
    }


def finish(args, result: dict | None) -> None:
    """Rank 0 prints the result and writes it to ``--out``; every rank leaves the process group.

    Called after ``main`` has returned, with the library's objects gone: DDP's reducer, an FSDP or
    DeepSpeed engine or a device mesh each hold the process group, and one left alive keeps it past
    ``destroy_process_group`` until the interpreter tears down, where gloo's threads end the process
    with SIGABRT ("terminate called without an active exception"; pytorch/pytorch#179291)."""
    gc.collect()  # the objects' reference cycles (modules and their hooks) hold the group too
    if result is not None:
        text = json.dumps(result, indent=1, default=str)
        print(text, flush=True)
        if args.out:
            tmp = f"{args.out}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, args.out)
    dist.barrier()
    dist.destroy_process_group()
