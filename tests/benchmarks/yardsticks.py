"""A fixed workload that measures how fast this machine is right now, timed between a benchmark's rounds.

Why: the 2-core CI machines switch between two speeds within seconds, without load on them (the
smoke-suite parse took 3.3, 5.4 and 6.5 ms in back-to-back processes on one commit), and
a CPU model unlike the baseline's moves every figure. A yardstick timed in the same seconds as the
benchmark moves with it.

Why this one: it is the interpreter work the harness does (TOML, dataclasses, JSON), from the
standard library only, so a change to parabench cannot move it. Over ten processes on one AMD EPYC
2-core machine, one of them in the slow mode, each benchmark's min over this yardstick's min spread
by 13 % (train step) and 17 % (comm meter), where raw mins spread by 28-44 %. Torch workloads made
worse yardsticks there: a small MLP step with AdamW varied 1.45x between processes by itself.

Change the workload and you must change YARDSTICK too: the gate then compares raw mins against the
old baseline and says so, until `tests/benchmarks/gate.sh --update` records the new one.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib

YARDSTICK = "python-toml-json-1"

_TOML = "\n".join(
    f'[[case]]\nmodel = "m{i}"\nstrategy = "s{i}"\nworld_size = {i % 4 + 1}\n'
    f"options = {{ bucket_mb = {i}, overlap = true }}\nsteps = [1, 2, 3]\n"
    for i in range(40)
)


@dataclasses.dataclass(frozen=True)
class _Row:
    world_size: int
    model: str
    weight: float = 0.0


def yardstick() -> None:
    for case in tomllib.loads(_TOML)["case"]:
        row = dataclasses.replace(_Row(case["world_size"], case["model"]), weight=1.0)
        json.dumps({**case, "row": dataclasses.asdict(row)}, sort_keys=True)
