"""Runs a DeepSpeed fidelity script on CPUs without building DeepSpeed's shared-memory all-reduce op.

``python -m parabench.fidelity.deepspeed_cpu SCRIPT ARGS...`` (what ``parabench fidelity`` launches
under torchrun for a DeepSpeed script on a CPU device). DeepSpeed's CPU accelerator JIT-compiles
``deepspeed_shm_comm`` when its communication backend starts (``deepspeed/comm/torch.py``
``build_shm_op``; 30-220 s on a 2-core machine, in every fresh environment). The op serves only
DeepSpeed inference's ``inference_all_reduce``: training's collectives go to gloo with or without
it, so skipping it changes nothing measured. The DeepSpeed adapters skip it the same way
(``parabench.peers.deepspeed_zero.deepspeed_on_cpu``), so both sides start alike; the script itself
stays what a user of the library would write.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # by module path: ``deepspeed.comm`` has an attribute ``torch`` (the torch package itself)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    script = sys.argv.pop(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
