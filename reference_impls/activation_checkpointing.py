"""Activation checkpointing per transformer block (Chen et al. 2016, "Training Deep Nets with
Sublinear Memory Cost"; Korthikanti et al. 2022 call it full recomputation).

Each block keeps only its input in forward; backward runs the block's forward once more to rebuild
the activations it needs (``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``).
Memory for activations drops from O(L) blocks' worth to one block plus L block inputs; compute rises
by one extra forward of the blocks (2·N_blocks + 4·L·s·d FLOPs per token, see
``parabench.models.HFU_CONVENTION``).

How it is applied matters for sharded strategies. The block's *forward* is replaced (its instance
attribute), not the module wrapped: the module's ``__call__`` and its hooks then stay *outside* the
checkpointed region. A reference FSDP unit gathers its parameters in a forward pre-hook and frees
them in a forward post-hook; inside the region those hooks would run again during recomputation and
the post-hook would free the storage backward is about to read. Outside it, the unit's pre-backward
hook (on the block's output) gathers the parameters before autograd reaches the block, which is
when the recomputation happens. FSDP2 (``fully_shard``) and DeepSpeed ZeRO-3 hook the module the
same way, and parameter names are unchanged, so every strategy can use this one function.
"""

from __future__ import annotations

from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(blocks) -> None:
    """Make every module in ``blocks`` recompute its forward in backward (in place, names unchanged)."""
    for block in blocks:
        inner = block.forward

        def forward(x, inner=inner):
            return checkpoint(inner, x, use_reentrant=False)

        block.forward = forward
