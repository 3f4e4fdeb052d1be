"""What is live at the memory peak of one training step, by category, on any device.

The allocator's peak (``torch.cuda.max_memory_allocated``, or ``ru_maxrss`` on a CPU) says how high
a step went, not what was there. :class:`MemoryBreakdown` is a ``TorchDispatchMode`` that follows
every tensor *storage* the step creates (each storage counted once, however many views point
into it) plus every storage alive when it starts, keeps a running sum of live bytes, and at each
new high-water mark records what is live, by category:

* ``parameters``: storages of the model's parameters as they are at that moment (gathered
  ZeRO-3/FSDP units included, the local shard of a DTensor, DeepSpeed's ``ds_tensor``), and
  trainer buffers whose name says parameter (``flat_param``, ``lp_flat``, ``*_groups_flat``);
* ``optimizer``: optimizer state tensors and optimizer parameters that are not model parameters
  (fp32 master copies), and trainer buffers named ``master``/``fp32``;
* ``gradients``: ``.grad`` of model and optimizer parameters, and trainer buffers whose name says
  gradient (``flat_grad``, ``main_grad``, staging buckets, in-flight reduce-scatters, DeepSpeed's
  ``ipg`` buckets and ``averaged_gradients``);
* ``communication``: storages a collective read or wrote that are none of the above (receive
  buffers of a collective);
* ``activations``: everything else created with autograd recording, outside backward (what
  forward saves for backward, logits, loss);
* ``temporaries``: everything else created in backward or under ``no_grad`` (gradient
  temporaries before accumulation, optimizer scratch);
* ``other``: storages alive before the step that nothing above names (the step's inputs, and
  tensors first seen as an op's argument).

The result also gives ``peak_by_phase``: the same snapshot at the high-water mark of each phase
(``forward``: from a module's forward on; ``backward``: inside autograd's engine; ``step``: after a
backward until the next forward, i.e. the reduction's tail and the optimizer update), since the phase
that holds the step's peak can differ by device (on a CPU, foreach AdamW's scratch copies of the
moments; on CUDA the fused kernel makes none).

Categories are tested in that order, so a gradient bucket that a collective also touches counts
as a gradient. The trainer's buffers are found by walking its attributes (and those of
DeepSpeed's engine and optimizer) and reading the attribute names: a heuristic, documented so
that the numbers can be read, and exact for the reference implementations.

Limits. Storages allocated behind the dispatcher (inside a communication backend, the caching
allocator's rounding and fragmentation, the CUDA context) are not seen, so the peak here is at
most the allocator's. A storage shrunk with ``untyped_storage().resize_()`` (FSDP's reshard) is
noticed at the next op that touches it, at once for parameter storages (watched every op), and
before any new high-water mark is recorded. A storage first seen inside a collective's ``wait()``
belongs to the backend (gloo finishes some collectives there on copies of its own) and is not counted.
Python overhead is large (every op of the step): use it on an untimed step only.
"""

from __future__ import annotations

import gc
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

_Work = getattr(getattr(torch._C, "_distributed_c10d", None), "Work", None)

CATEGORIES = ("parameters", "optimizer", "gradients", "communication", "activations", "temporaries", "other")
_COMM_NAMESPACES = ("c10d", "_c10d_functional")
_WALK_MODULES = ("reference_impls", "parabench", "deepspeed")
_GRAD_WORDS = ("grad", "staging", "pending", "ipg", "inflight", "in_flight")
_OPT_WORDS = ("master", "fp32", "optimizer_state", "exp_avg", "single_partition")
_PARAM_WORDS = ("param", "flat", "full", "shard", "bit16", "fp16")


def _plain(t):
    """The plain tensors holding ``t``'s data (a DTensor's local shard, ...)."""
    if not isinstance(t, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _plain(getattr(t, n))]
    return [t]


def _leaves(x, out):
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _leaves(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _leaves(y, out)
    return out


class _Storage:
    __slots__ = ("ref", "nbytes", "created", "op", "comm")

    def __init__(self, ref, nbytes, created, op):
        self.ref, self.nbytes, self.created, self.op, self.comm = ref, nbytes, created, op, False


class MemoryBreakdown(TorchDispatchMode):
    """``with MemoryBreakdown(trainer) as mb: trainer.train_step(x, y)``; then ``mb.result()``."""

    def __init__(self, trainer, device: torch.device | None = None, top: int = 12, inputs=()):
        super().__init__()
        self.trainer, self.top, self.inputs = trainer, top, list(inputs)
        self.models, self.optimizers = [], []
        self._find_roots(trainer)
        if device is None:
            p = next((q for m in self.models for q in m.parameters()), None)
            device = _plain(p)[0].device if p is not None else torch.device("cpu")
        self.device = torch.device(device)
        self._live: dict[int, _Storage] = {}
        self.current = self.peak = self.baseline = 0
        self._watch: dict[int, _Storage] = {}
        self.n_ops, self._peak_info = 0, None
        # Phase of the op being run: "forward" from any module's forward (a global pre-hook: so the
        # gathers in a unit's pre-forward hook are forward too), "backward" inside autograd's engine,
        # "step" for what runs after a backward outside it (reduction tail, optimizer update).
        self._phase, self._module_hook = "forward", None
        # The same snapshot at each phase's own high-water mark: the step's peak can sit in a phase that
        # differs by device (CPU's foreach AdamW makes scratch copies of its moments, CUDA's fused one not).
        self._phase_peak: dict[str, int] = {}
        self._phase_info: dict[str, dict] = {}
        self._in_wait, self._work_wait = 0, None

    # --- what the trainer holds --------------------------------------------------------------

    def _find_roots(self, obj, depth=0, seen=None):
        seen = set() if seen is None else seen
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module) and not type(obj).__module__.startswith(_WALK_MODULES):
            self.models.append(obj)
            return
        if isinstance(obj, torch.optim.Optimizer):
            self.optimizers.append(obj)
        if isinstance(obj, (list, tuple)):
            for x in obj:
                self._find_roots(x, depth + 1, seen)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(_WALK_MODULES):
            if isinstance(obj, torch.nn.Module):  # DeepSpeed's engine: its wrapped module
                self.models += [m for m in obj.children() if not type(m).__module__.startswith(_WALK_MODULES)]
            for v in vars(obj).values():
                self._find_roots(v, depth + 1, seen)

    def _named_buffers(self):
        """(attribute path, tensor) for every tensor reachable from the trainer's own attributes."""
        out = []
        # A method, not a nested function: a recursive closure refers to itself through its cell, a
        # cycle that would keep ``out`` (and every buffer named in it, e.g. gradient buckets the trainer
        # has since dropped) alive until the next garbage collection, inflating the rest of the step.
        self._walk(self.trainer, "trainer", 0, out, set())
        return out

    def _walk(self, x, path, depth, out, seen):
        if isinstance(x, torch.Tensor):
            out.append((path, x))
            if x.grad is not None:
                out.append((path + ".grad", x.grad))
            return
        if depth > 5 or id(x) in seen or isinstance(x, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(x))
        if isinstance(x, (list, tuple, set)):
            for y in x:
                self._walk(y, path, depth + 1, out, seen)
        elif isinstance(x, dict):
            for k, y in x.items():
                self._walk(y, f"{path}.{k}" if isinstance(k, str) else path, depth + 1, out, seen)
        elif isinstance(x, torch.nn.Module) or isinstance(x, torch.optim.Optimizer):
            if type(x).__module__.startswith(_WALK_MODULES) and not isinstance(x, torch.nn.Module):
                for k, y in vars(x).items():
                    if k not in ("state", "param_groups"):
                        self._walk(y, f"{path}.{k}", depth + 1, out, seen)
            elif isinstance(x, torch.nn.Module) and type(x).__module__.startswith(_WALK_MODULES):
                for k, y in vars(x).items():
                    if not k.startswith("_"):
                        self._walk(y, f"{path}.{k}", depth + 1, out, seen)
        elif hasattr(x, "__dict__") and type(x).__module__.startswith(_WALK_MODULES):
            for k, y in vars(x).items():
                self._walk(y, f"{path}.{k}", depth + 1, out, seen)

    def _key(self, t):
        try:
            return t.untyped_storage()._cdata
        except Exception:  # meta/fake tensors, or no storage
            return None

    def _classify_known(self, tensors: list | None = None) -> dict[int, str]:
        """storage key -> category, for what the trainer holds right now (``tensors`` collects them)."""
        cat: dict[int, str] = {}

        def put(t, c):
            for p in _plain(t):
                if p.device != self.device:
                    continue
                k = self._key(p)
                if k is not None and k not in cat:
                    cat[k] = c
                    if tensors is not None:
                        tensors.append(p)

        model_params = []
        for m in self.models:
            for p in m.parameters():
                model_params.append(p)
                put(p, "parameters")
                ds = getattr(p, "ds_tensor", None)
                if ds is not None:
                    put(ds, "parameters")
            for b in m.buffers():
                put(b, "parameters")
            for mod in m.modules():  # FSDP2: the unsharded parameters it gathers into
                get_state = getattr(mod, "_get_fsdp_state", None)
                if get_state is None:
                    continue
                try:
                    group = get_state()._fsdp_param_group
                    for fp in group.fsdp_params if group is not None else []:
                        for name in ("_unsharded_param", "_sharded_param_data"):
                            t = getattr(fp, name, None)
                            if isinstance(t, torch.Tensor):
                                put(t, "parameters")
                        for t in getattr(fp, "all_gather_outputs", []) or []:
                            put(t, "parameters")
                except Exception:
                    pass
        model_ids = {id(p) for p in model_params}
        for opt in self.optimizers:
            for s in opt.state.values():
                for v in s.values():
                    if isinstance(v, torch.Tensor):  # step counters included
                        put(v, "optimizer")
            for g in opt.param_groups:
                for p in g["params"]:
                    if id(p) not in model_ids:
                        put(p, "optimizer")
        for p in model_params:
            if p.grad is not None:
                put(p.grad, "gradients")
        for opt in self.optimizers:
            for g in opt.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        put(p.grad, "gradients")
        for path, t in self._named_buffers():
            name = path.lower()
            if any(w in name for w in _GRAD_WORDS):
                put(t, "gradients")
            elif any(w in name for w in _OPT_WORDS):
                put(t, "optimizer")
            elif any(w in name for w in _PARAM_WORDS):
                put(t, "parameters")
        return cat

    # --- accounting ---------------------------------------------------------------------------

    def _on_free(self, key):
        def cb(_ref):
            s = self._live.pop(key, None)
            if s is not None:
                self.current -= s.nbytes
            self._watch.pop(key, None)

        return cb

    def _track(self, t, created: str, op: str):
        if not isinstance(t, torch.Tensor) or t.device != self.device or is_traceable_wrapper_subclass(t):
            return None
        try:
            st = t.untyped_storage()
        except Exception:
            return None
        key = st._cdata
        s = self._live.get(key)
        if s is None and self._in_wait:
            return None  # a backend's own buffer, first seen inside a collective's wait()
        if s is None:
            s = _Storage(weakref.ref(st, self._on_free(key)), st.nbytes(), created, op)
            self._live[key] = s
            self.current += s.nbytes
        elif s.nbytes != st.nbytes():  # grown or shrunk behind the dispatcher (storage resize_)
            self.current += st.nbytes() - s.nbytes
            s.nbytes = st.nbytes()
            self._watch[key] = s
        return s

    def _refresh(self, storages):
        """Re-read the sizes of ``storages``: one resized behind the dispatcher (FSDP's reshard, or a buffer
        freed with ``untyped_storage().resize_(0)`` while a collective's work handle still refers to it)."""
        for s in list(storages):
            st = s.ref()
            if st is not None and st.nbytes() != s.nbytes:
                self.current += st.nbytes() - s.nbytes
                s.nbytes = st.nbytes()

    def __enter__(self):
        # What the trainer holds before the step (model state, its buffers) and the step's inputs. Other
        # tensors of the process (an earlier case's leftovers) are counted only if the step touches them.
        gc.collect()
        tensors = list(self.inputs)
        self._classify_known(tensors)
        for t in tensors:
            for p in _plain(t):
                self._track(p, "before", "")
        del tensors
        for m in self.models:  # parameter storages are resized by FSDP-style resharding: watch them
            for p in m.parameters():
                for q in _plain(p):
                    s = self._track(q, "before", "")
                    if s is not None:
                        self._watch[q.untyped_storage()._cdata] = s
        self.baseline = self.peak = self.current
        self._peak_info = None
        self._phase_peak, self._phase_info = {}, {}
        self._phase = "forward"
        self._module_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._enter_forward)
        self._patch_work_wait()
        return super().__enter__()

    def __exit__(self, *exc):
        if self._module_hook is not None:
            self._module_hook.remove()
            self._module_hook = None
        if self._work_wait is not None:
            _Work.wait, self._work_wait = self._work_wait, None
        return super().__exit__(*exc)

    def _patch_work_wait(self):
        """Mark the time spent in a collective's ``wait()``: a backend can finish its work there through
        the dispatcher on a buffer of its own (gloo's reduce-scatter slices its reduced copy of the
        input), which its worker thread frees whenever it gets round to it. Such a storage was
        allocated behind the dispatcher and is not counted, as NCCL's are not."""
        if _Work is None:
            return
        self._work_wait = wait = _Work.wait

        def counted_wait(work, *args, **kwargs):
            self._in_wait += 1
            try:
                return wait(work, *args, **kwargs)
            finally:
                self._in_wait -= 1

        _Work.wait = counted_wait

    def _enter_forward(self, module, args):
        self._phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(t) for t in _leaves((args, kwargs), [])):
            return NotImplemented  # let DTensor & co. decompose into plain tensors first
        out = func(*args, **kwargs)
        self.n_ops += 1
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward:
            self._phase = "backward"
        elif self._phase == "backward":
            self._phase = "step"
        created = "backward" if in_backward else ("forward" if torch.is_grad_enabled() else "no_grad")
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        comm = func.namespace in _COMM_NAMESPACES
        for t in _leaves(out, []):
            s = self._track(t, created, name)
            if s is not None and comm:
                s.comm = True
        for t in _leaves((args, kwargs), []):
            s = self._track(t, "unseen", name)
            if s is not None and comm:
                s.comm = True
        self._refresh(self._watch.values())
        phase = self._phase
        if self.current > self._phase_peak.get(phase, self.baseline):
            self._refresh(self._live.values())  # a candidate high-water mark: count what resize_ freed since
        if self.current > self._phase_peak.get(phase, self.baseline):
            self._phase_peak[phase] = self.current  # what the next snapshot of this phase must exceed
            info = self._snapshot(name, phase)
            # Report what the snapshot holds (taking it can release a few storages the op left behind).
            info["peak_bytes"] = self.current
            self._phase_info[phase] = info
            if self.current > self.peak:
                self.peak = self.current
                self._peak_info = info
        return out

    def _snapshot(self, op, phase):
        known = self._classify_known()
        by_cat = defaultdict(int)
        items = []
        for key, s in self._live.items():
            c = known.get(key)
            if c is None:
                if s.comm:
                    c = "communication"
                elif s.created == "forward":
                    c = "activations"
                elif s.created in ("backward", "no_grad"):
                    c = "temporaries"
                else:
                    c = "other"
            by_cat[c] += s.nbytes
            items.append((s.nbytes, c, s.op, s.created))
        items.sort(reverse=True)
        return {
            "op_index": self.n_ops,
            "op": op,
            "phase": phase,
            "by_category": {c: int(by_cat.get(c, 0)) for c in CATEGORIES},
            "largest": [{"bytes": int(b), "category": c, "op": o, "created": w} for b, c, o, w in items[: self.top]],
        }

    def result(self) -> dict:
        info = self._peak_info or {
            "op_index": 0,
            "op": None,
            "phase": None,
            "by_category": {c: 0 for c in CATEGORIES},
            "largest": [],
        }
        if self._peak_info is None:  # the step never went above where it started
            known = self._classify_known()
            info["by_category"] = {c: 0 for c in CATEGORIES}
            for key, s in self._live.items():
                info["by_category"][known.get(key, "other")] += s.nbytes
        info = {k: v for k, v in info.items() if k != "peak_bytes"}
        by_phase = {
            ph: {
                "peak_bytes": int(i["peak_bytes"]),
                "op_index": i["op_index"],
                "op": i["op"],
                "by_category": i["by_category"],
            }
            for ph, i in self._phase_info.items()
        }
        return {
            "peak_bytes": int(self.peak),
            "baseline_bytes": int(self.baseline),
            "end_bytes": int(self.current),
            "n_ops": self.n_ops,
            "device": str(self.device),
            "peak_total_bytes": int(sum(info["by_category"].values())),
            **info,
            "peak_by_phase": by_phase,
        }


def measure_step(trainer, inputs, targets) -> tuple[object, dict]:
    """Run one ``train_step`` under :class:`MemoryBreakdown`; return (loss, breakdown dict)."""
    if inputs.device.type == "cuda":
        torch.cuda.synchronize(inputs.device)
    mb = MemoryBreakdown(trainer, device=inputs.device, inputs=(inputs, targets))
    with mb:
        loss = trainer.train_step(inputs, targets)
    if inputs.device.type == "cuda":
        torch.cuda.synchronize(inputs.device)
    return loss, mb.result()
