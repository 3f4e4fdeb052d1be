"""Replay a pipeline schedule with measured op times and free communication (pure; no torch).

The uniform bubble (p−1)/(m+p−1) (and its interleaved and zero-bubble forms) assumes every stage
takes the same time per op and that a message arrives the moment it is sent. A real pipeline
breaks both: the first stage also embeds, the last also runs the head and the loss, and every hop
costs a send, a receive and their launches. This module separates the two. It takes each stage's
recorded op order and each op's own measured duration (``record.per_rank[i].pipeline``: ``order``
and ``timeline``), lets every op start as soon as its stage is free and its inputs exist, with
messages taking no time, and reports each stage's idle share of the simulated step:

* F(c, i) waits for F(c−1, i): the previous virtual stage's forward of micro-batch i;
* B(c, i) waits for B(c+1, i) (the gradient from downstream) and for F(c, i);
* W(c, i) (zero-bubble weight gradient) waits for B(c, i);

where ``c`` is the virtual stage: the stage itself for GPipe, 1F1B and ZB-H1, the global chunk
(``F3c5``: chunk 5) for interleaved 1F1B, whose chunk c+1 lives on the next rank. A stage's bubble
is ``1 − busy / step`` with ``step`` the simulated makespan, the definition behind
(p−1)/(m+p−1) (Narayanan et al. 2021, Sec. 2.2) and the simulations in ``tests/test_pp_*.py``.

Run with the measured times, the simulation gives the bubble the schedule and the unequal stages
imply; run with every op of a kind set to its mean over all stages, it gives the equal-stage
bubble (the theory, at the measured F:B:W ratio). The measured bubble minus the first is what
neither explains: point-to-point transfers, launches and host gaps between ops.

Two checks on the order alone go with it: the peak of (chunk, micro-batch) activations each stage
holds (``simulate``'s ``peak_live``), and ``check_untagged_channels``, whether the order still
pairs every send with its receive where messages between two stages match in posting order
without tags (as NCCL's send/recv do).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class Op:
    """One unit of a stage's schedule: ``kind`` F, B or W on micro-batch ``micro`` of virtual stage
    ``chunk``, taking ``duration_s``."""

    kind: str
    micro: int
    chunk: int
    duration_s: float


def _dependencies(op: Op, last_chunk: int) -> list[tuple[str, int, int]]:
    if op.kind == "F":
        return [("F", op.chunk - 1, op.micro)] if op.chunk > 0 else []
    if op.kind == "B":
        own = [("F", op.chunk, op.micro)]
        return own + ([("B", op.chunk + 1, op.micro)] if op.chunk < last_chunk else [])
    if op.kind == "W":
        return [("B", op.chunk, op.micro)]
    raise ValueError(f"unknown op kind {op.kind!r}; valid: {', '.join(KINDS)}")


def _peak_live(ops: list[Op], present: set[tuple[str, int, int]]) -> int:
    """Most (chunk, micro-batch) activations alive at once on a stage running ``ops`` in order:
    from its F until its W where the schedule has one, else until its B."""
    live = peak = 0
    for op in ops:
        if op.kind == "F":
            live += 1
            peak = max(peak, live)
        elif op.kind == ("W" if ("W", op.chunk, op.micro) in present else "B"):
            live -= 1
    return peak


def _present(stage_ops: list[list[Op]], last_chunk: int) -> set[tuple[str, int, int]]:
    """Every op's (kind, chunk, micro); ValueError where an op depends on one no stage runs."""
    present = {(op.kind, op.chunk, op.micro) for ops in stage_ops for op in ops}
    for ops in stage_ops:
        for op in ops:
            missing = [d for d in _dependencies(op, last_chunk) if d not in present]
            if missing:
                raise ValueError(f"{op.kind}{op.micro}c{op.chunk} depends on {missing[0]}, which no stage runs")
    return present


def simulate(stage_ops: list[list[Op]]) -> dict:
    """Run each stage's ops in its order, each as soon as its stage is free and its dependencies
    are done, messages free. Returns ``step_s`` (the makespan), per stage ``busy_s``, ``end_s``,
    ``bubble`` (1 − busy/step) and ``peak_live`` (``_peak_live``), and ``bubble_mean`` over stages.
    A schedule in which some op waits for one that never runs, or for one queued behind itself,
    raises ValueError."""
    if not stage_ops or not all(stage_ops):
        raise ValueError("every stage needs at least one op")
    last_chunk = max(op.chunk for ops in stage_ops for op in ops)
    present = _present(stage_ops, last_chunk)
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * len(stage_ops)
    free = [0.0] * len(stage_ops)
    while any(pos[s] < len(ops) for s, ops in enumerate(stage_ops)):
        progressed = False
        for s, ops in enumerate(stage_ops):
            while pos[s] < len(ops):
                op = ops[pos[s]]
                deps = _dependencies(op, last_chunk)
                if any(d not in done for d in deps):
                    break
                start = max([free[s], *(done[d] for d in deps)])
                free[s] = done[op.kind, op.chunk, op.micro] = start + op.duration_s
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"stage {s}: {ops[pos[s]].kind}{ops[pos[s]].micro}c{ops[pos[s]].chunk}"
                for s, ops in enumerate(stage_ops)
                if pos[s] < len(ops)
            )
            raise ValueError(f"the schedule deadlocks ({stuck})")
    step = max(free)
    busy = [sum(op.duration_s for op in ops) for ops in stage_ops]
    bubbles = [1 - b / step if step > 0 else 0.0 for b in busy]
    return {
        "step_s": step,
        "busy_s": busy,
        "end_s": free,
        "bubble": bubbles,
        "bubble_mean": sum(bubbles) / len(bubbles),
        "peak_live": [_peak_live(ops, present) for ops in stage_ops],
    }


def check_untagged_channels(stage_ops: list[list[Op]]) -> None:
    """Raise ValueError unless, between every two stages, the messages one sends (an op's output
    that an op of the other stage depends on, sent when the op runs) come in the order the other
    receives them (when the op that needs one runs). Without tags the k-th receive takes the k-th
    send, so any other order hands an op another op's tensor, or leaves a message untaken."""
    last_chunk = max(op.chunk for ops in stage_ops for op in ops)
    _present(stage_ops, last_chunk)
    stage_of = {(op.kind, op.chunk, op.micro): s for s, ops in enumerate(stage_ops) for op in ops}
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    readers: dict[tuple[str, int, int], list[int]] = {}
    for s, ops in enumerate(stage_ops):
        for op in ops:
            for dep in _dependencies(op, last_chunk):
                src = stage_of[dep]
                if src != s:
                    received.setdefault((src, s), []).append(dep)
                    if s not in readers.setdefault(dep, []):
                        readers[dep].append(s)
    for s, ops in enumerate(stage_ops):
        for op in ops:
            for dst in readers.get((op.kind, op.chunk, op.micro), []):
                sent.setdefault((s, dst), []).append((op.kind, op.chunk, op.micro))
    for channel in sorted(set(sent) | set(received), key=str):
        out, into = sent.get(channel, []), received.get(channel, [])
        if out != into:
            n = next((k for k, (a, b) in enumerate(zip(out, into)) if a != b), min(len(out), len(into)))
            where = f"stage {channel[0]} -> stage {channel[1]}, message {n}"
            if n >= len(into):
                raise ValueError(f"{where}: {out[n]} is sent but never received")
            got = out[n] if n < len(out) else "nothing (never sent)"
            raise ValueError(f"{where}: the receive for {into[n]} takes {got}")


def equalized(stage_ops: list[list[Op]]) -> list[list[Op]]:
    """The same schedule with every op of a kind lasting that kind's mean over all stages (and
    chunks): equal stages, the measured F:B:W ratio kept."""
    by_kind: dict[str, list[float]] = {}
    for ops in stage_ops:
        for op in ops:
            by_kind.setdefault(op.kind, []).append(op.duration_s)
    mean = {k: sum(v) / len(v) for k, v in by_kind.items()}
    return [[replace(op, duration_s=mean[op.kind]) for op in ops] for ops in stage_ops]


def _parse_label(label: str, stage: int) -> tuple[str, int, int]:
    """``F3`` (stage's own chunk) or ``B2c5`` (interleaved: global chunk 5) as (kind, micro, chunk)."""
    kind, rest = label[0], label[1:]
    micro, _, chunk = rest.partition("c")
    return kind, int(micro), int(chunk) if chunk else stage


def ops_from_stats(stages: list[dict]) -> list[list[Op]]:
    """Each stage's ops, in its recorded ``order``, with durations from its ``timeline`` entries
    ``[kind, micro, start_s, end_s(, chunk)]`` ('wait' entries skipped). ``stages`` are the per-rank
    pipeline statistics in stage order. Raises ValueError where an op of the order has no timed
    entry."""
    out = []
    for s, p in enumerate(stages):
        stage = p.get("stage", s)
        timed: dict[tuple[str, int, int], float] = {}
        for entry in p.get("timeline") or []:
            kind = entry[0]
            if kind not in KINDS:
                continue
            chunk = int(entry[4]) if len(entry) > 4 else stage
            timed[kind, int(entry[1]), chunk] = float(entry[3]) - float(entry[2])
        ops = []
        for label in p.get("order") or []:
            kind, micro, chunk = _parse_label(label, stage)
            if (kind, micro, chunk) not in timed:
                raise ValueError(f"stage {stage}: {label} is in the order but not in the timeline")
            ops.append(Op(kind, micro, chunk, timed[kind, micro, chunk]))
        out.append(ops)
    return out


def replay(stages: list[dict]) -> dict | None:
    """The bubble a pipeline case's own schedule implies, from its per-stage statistics (stage
    order): ``simulated`` with the measured op times and ``equal`` with each kind's mean, each
    ``{bubble_mean, bubble, step_s}``. None where a stage recorded no timeline (DeepSpeed's
    pipeline engine, or a stage count that does not match ``stages``)."""
    if not stages or any(not p.get("timeline") or not p.get("order") for p in stages):
        return None
    n = stages[0].get("stages")
    if isinstance(n, int) and len(stages) != n:
        return None
    ops = ops_from_stats(sorted(stages, key=lambda p: p.get("stage", 0)))
    keep = ("bubble_mean", "bubble", "step_s")
    return {
        "simulated": {k: v for k, v in simulate(ops).items() if k in keep},
        "equal": {k: v for k, v in simulate(equalized(ops)).items() if k in keep},
    }
