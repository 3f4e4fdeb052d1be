"""Pipeline stages balanced by cost, in plain Python: how many transformer blocks each stage gets
when the first stage also runs the token and position embeddings and the last the final LayerNorm,
the output head and the loss.

An equal split leaves the last stage the slowest, and a pipeline runs at the pace of its slowest
stage: at gpt-1.3b on 4 stages the last stage's step ran 35-45 % longer than the others'
(docs/results.md). Megatron-LM moves blocks off the end stages by hand
(``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``); DeepSpeed's
``PipelineModule(partition_method="parameters")`` balances parameter counts, in which the head
(V x d weights) weighs about two gpt-1.3b blocks. Here the weights are forward FLOPs per token,
as the PaLM paper counts them (appendix B) but with causal attention's halving:

* a block: ``2 (4 + 2 r) d^2`` for its matmuls (q, k, v and the output projection, 4 d^2; the MLP's
  two matmuls of ratio ``r``, 2 r d^2), plus ``2 s d`` for the scores and the weighted values, each
  ``s d / 2`` multiply-adds a token on average under the causal mask;
* the head: ``2 d V``; the embedding lookup: none.

Backward costs twice the forward for every matmul, so balancing the forward balances F + B. The
loss's softmax over V and the embedding's gradient are memory-bound and not counted, which the split
answers by filling the middle stages first. Checked against the stage times of
``results/studies/plan-retest-pipelines-h100x4/20261127-161154`` (gpt-1.3b, 4 stages, 8
micro-batches, three splits): a block cost 21 ms of a stage's step, and over a middle stage the head's
stage ran 2.4 blocks longer (FLOPs: 1.9) and the embedding's 0.5 (FLOPs: 0). On those costs this
file's split, [6, 7, 7, 4], is the best of every split, its largest stage 6 % below that of the
hand-made [7, 7, 6, 4] the study ran (``tests/test_pp_split.py``).

``balance_counts`` is the split itself, for any per-stage extra: the planner passes its calibrated
costs (``parabench.plan.terms.pipeline.balanced_stage_layers``), option ``stage_layers =
"balanced"`` these FLOPs (``flop_balanced_layers``). Every pipeline that takes ``stage_layers``
(the references, torch.distributed.pipelining's and DeepSpeed's) then cuts the same stages.
"""

from __future__ import annotations

BALANCED = "balanced"  # option stage_layers = "balanced": the FLOP-balanced split of this file


def balance_counts(n_items: int, extras: list[float]) -> list[int]:
    """Items (identical blocks of cost 1) per stage that minimise the largest stage's cost, where
    stage ``i`` also carries ``extras[i]`` (in blocks). Each stage gets one block, then the rest go
    one at a time to the stage whose cost grows to the least: exact for a min-max of equal
    increments (it ends at the largest of the ``n_items`` smallest reachable costs). Ties go to the
    earlier stage, so equal extras give ``partition_layers``' equal split, the first stages taking
    the remainder."""
    if n_items < len(extras):
        raise ValueError(f"{len(extras)} stages for {n_items} blocks")
    counts = [1] * len(extras)
    for _ in range(n_items - len(extras)):
        # rounded, so float noise in the extras cannot break a tie
        grown = [round(n + 1 + e, 9) for n, e in zip(counts, extras)]
        counts[grown.index(min(grown))] += 1
    return counts


def block_flops_per_token(d_model: int, seq_len: int, mlp_ratio: int = 4) -> float:
    """Forward FLOPs of one dense block per token (module docstring)."""
    return 2 * (4 + 2 * mlp_ratio) * d_model**2 + 2 * seq_len * d_model


def head_flops_per_token(d_model: int, vocab_size: int) -> float:
    """Forward FLOPs of the output head per token."""
    return 2 * d_model * vocab_size


def flop_stage_imbalance(
    stage_layers: list[int], d_model: int, seq_len: int, vocab_size: int, mlp_ratio: int = 4
) -> float:
    """The largest stage's forward FLOPs over the mean stage's, for blocks per stage ``stage_layers``
    and the head on the last stage: the analytic value beside a record's measured
    ``pipeline_stage_imbalance``."""
    head = head_flops_per_token(d_model, vocab_size) / block_flops_per_token(d_model, seq_len, mlp_ratio)
    costs = [*stage_layers[:-1], stage_layers[-1] + head]
    return max(costs) * len(costs) / sum(costs)


def flop_balanced_layers(
    n_layers: int, n_stages: int, d_model: int, seq_len: int, vocab_size: int, mlp_ratio: int = 4
) -> list[int]:
    """Blocks per stage that even the stages' forward FLOPs, the head counted on the last stage.
    The end stages also run work the FLOPs miss (the embedding's gradient, the softmax), so of the
    splits with the smallest largest stage this takes the one that fills the middle stages up to it
    and leaves the rest to the two ends, balanced between them."""
    extras = [0.0] * n_stages
    extras[-1] = head_flops_per_token(d_model, vocab_size) / block_flops_per_token(d_model, seq_len, mlp_ratio)
    split = balance_counts(n_layers, extras)
    if n_stages <= 2:
        return split
    largest = max(n + e for n, e in zip(split, extras))
    middle = [int(largest + 1e-9)] * (n_stages - 2)  # a middle stage carries blocks only
    if n_layers - sum(middle) < 2:  # the middle would take the ends' blocks
        return split
    first, last = balance_counts(n_layers - sum(middle), [extras[0], extras[-1]])
    return [first, *middle, last]
