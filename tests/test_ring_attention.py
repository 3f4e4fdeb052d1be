"""Ring attention on its own (``reference_impls.context_parallel.ring_attention``): the fused block
kernels return what the written-out block computes; one block pair's backward given the *final*
output and lse is that pair's exact share of the gradients; the ring's output and q/k/v
gradients equal ``F.scaled_dot_product_attention(is_causal=True)`` over the whole sequence for
both splits at 2 and 4 ranks; autograd keeps only q, k, v, the output and its lse. CPU, gloo.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parabench.distributed import run_on_gloo
from reference_impls.context_parallel import block_attention_reference, block_backward, block_forward, merge_partials

RTOL = ATOL = 1e-5


def _close(got, want, rtol=RTOL, atol=ATOL) -> bool:
    return torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("diagonal", [False, True])
def test_block_forward_matches_the_written_out_block(diagonal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    out, lse = block_forward(q, k, v, diagonal, scale=8**-0.5)
    want_out, want_lse = block_attention_reference(q, k, v, diagonal, scale=8**-0.5)
    assert lse.shape == (2, 3, 16) and lse.dtype == torch.float32
    assert _close(out, want_out) and _close(lse, want_lse)


def test_block_backward_with_final_out_and_lse_gives_exact_shares():
    """Keys in two blocks, the second on the queries' own positions: the merged forward equals
    causal SDPA over both, and the two blocks' backward calls (each given the merged out and lse)
    sum to SDPA's gradients."""
    torch.manual_seed(1)
    n, d, scale = 16, 8, 8**-0.5
    q = torch.randn(1, 2, n, d)
    k, v = torch.randn(1, 2, 2 * n, d), torch.randn(1, 2, 2 * n, d)
    dout = torch.randn(1, 2, n, d)
    k_past, k_here, v_past, v_here = k[..., :n, :], k[..., n:, :], v[..., :n, :], v[..., n:, :]

    out, lse = merge_partials(
        *block_forward(q, k_past, v_past, False, scale), *block_forward(q, k_here, v_here, True, scale)
    )
    dq_past, dk_past, dv_past = block_backward(dout, q, k_past, v_past, out, lse, False, scale)
    dq_here, dk_here, dv_here = block_backward(dout, q, k_here, v_here, out, lse, True, scale)

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    # queries at positions n..2n-1 of a 2n-long sequence: causal mask aligned bottom-right
    mask = torch.ones(n, 2 * n, dtype=torch.bool).tril(diagonal=n)
    want = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask)
    want.backward(dout)
    assert _close(out, want.detach())
    assert _close(dq_past + dq_here, qr.grad)
    assert _close(torch.cat([dk_past, dk_here], -2), kr.grad) and _close(torch.cat([dv_past, dv_here], -2), vr.grad)


def _ring_vs_sdpa(shapes: dict) -> dict:
    """On every rank: ring attention of this rank's positions against causal SDPA over the whole
    sequence (computed on every rank from the same seed), for both splits, fp32 and bf16; and
    the bytes autograd saves."""
    import torch.distributed as dist

    from reference_impls.context_parallel import positions_of, ring_attention

    group = dist.new_group(list(range(dist.get_world_size())))
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    b, a, s, d = shapes["b"], shapes["a"], shapes["s"], shapes["d"]
    out = {}
    for split in ("zigzag", "contiguous"):
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(0)
            full = [torch.randn(b, a, s, d, generator=gen).to(dtype).requires_grad_() for _ in range(3)]
            dout = torch.randn(b, a, s, d, generator=gen).to(dtype)
            want = F.scaled_dot_product_attention(*full, is_causal=True)
            want.backward(dout)
            mine = positions_of(rank, cp, s, split)
            q, k, v = (t.detach()[:, :, mine].clone().requires_grad_() for t in full)
            saved: dict[int, int] = {}

            def pack(t):
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                got = ring_attention(q, k, v, group, split)
            got.backward(dout[:, :, mine])
            broken = ring_attention(q.detach(), k.detach(), v.detach(), group, split, lse_correction=False)
            out[(split, str(dtype))] = {
                "out": (got.detach(), want.detach()[:, :, mine]),
                "grads": [(x.grad, t.grad[:, :, mine]) for x, t in zip((q, k, v), full)],
                "dtypes": [t.dtype for t in (got, q.grad, k.grad, v.grad)],
                "saved_bytes": sum(saved.values()),
                "broken_max_err": (broken - want.detach()[:, :, mine]).abs().max().item(),
            }
    return out


SHAPES = {"b": 2, "a": 3, "s": 64, "d": 16}


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def ring_runs(request):
    return request.param, run_on_gloo(_ring_vs_sdpa, request.param, SHAPES)


@pytest.mark.parametrize("split", ["zigzag", "contiguous"])
def test_ring_matches_full_sequence_sdpa_fp32(ring_runs, split):
    world, per_rank = ring_runs
    for rank, res in enumerate(per_rank):
        r = res[(split, "torch.float32")]
        assert _close(*r["out"]), (world, rank)
        for name, (got, want) in zip("qkv", r["grads"]):
            assert _close(got, want), (world, rank, name, (got - want).abs().max().item())


@pytest.mark.parametrize("split", ["zigzag", "contiguous"])
def test_ring_stays_in_bf16_and_close_to_sdpa(ring_runs, split):
    """Under bf16 inputs the output and gradients come back in bf16 (partials merged in fp32);
    they differ from bf16 SDPA by bf16 rounding only."""
    _, per_rank = ring_runs
    for res in per_rank:
        r = res[(split, "torch.bfloat16")]
        assert r["dtypes"] == [torch.bfloat16] * 4
        assert _close(*r["out"], rtol=2e-2, atol=2e-2)
        for got, want in r["grads"]:
            assert _close(got, want, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("split", ["zigzag", "contiguous"])
def test_saved_for_backward_is_q_k_v_out_and_lse_only(ring_runs, split):
    """Nothing quadratic in the sequence and nothing of the visited blocks: q, k, v and the output
    (b·a·n·d each, input dtype) and the fp32 lse (b·a·n)."""
    world, per_rank = ring_runs
    b, a, s, d = SHAPES["b"], SHAPES["a"], SHAPES["s"], SHAPES["d"]
    n = s // world
    for res in per_rank:
        for dtype, size in (("torch.float32", 4), ("torch.bfloat16", 2)):
            assert res[(split, dtype)]["saved_bytes"] == 4 * b * a * n * d * size + b * a * n * 4


def test_broken_variant_is_wrong(ring_runs):
    _, per_rank = ring_runs
    assert all(res[("zigzag", "torch.float32")]["broken_max_err"] > 1e-2 for res in per_rank)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("split", ["zigzag", "contiguous"])
def test_fused_calls_cover_exactly_the_causal_pairs(cp, split):
    """Every kernel call is a rectangle of chunk pairs, together exactly the pairs causal attention
    needs, each once; zig-zag needs 3 calls for its own block (two causal diagonals and one full
    pair) and 1 for every other block, where pair by pair it would need 2."""
    from reference_impls.context_parallel import chunk_pairs, chunks_of, fused_pairs

    for rank in range(cp):
        mine = chunks_of(rank, cp, split)
        for src in range(cp):
            theirs = chunks_of(src, cp, split)
            calls = fused_pairs(mine, theirs)
            covered = [
                (qi, ki, diagonal) for a, b, ka, kb, diagonal, n in calls for qi in range(a, b) for ki in range(ka, kb)
            ]
            assert sorted(covered) == sorted(chunk_pairs(mine, theirs))
            assert all(n == (b - a) * (kb - ka) and (not diagonal or n == 1) for a, b, ka, kb, diagonal, n in calls)
            if split == "zigzag":
                assert len(calls) == (3 if src == rank else 1)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("split", ["zigzag", "contiguous"])
def test_no_computed_pair_has_a_fully_masked_row(cp, split):
    """Causal ring attention never computes a query row that sees no key: a key chunk wholly in a
    query chunk's future is skipped, and a diagonal pair's row sees at least its own position."""
    from reference_impls.context_parallel import chunk_pairs, chunks_of

    for rank in range(cp):
        mine = chunks_of(rank, cp, split)
        for src in range(cp):
            theirs = chunks_of(src, cp, split)
            for qi, ki, diagonal in chunk_pairs(mine, theirs):
                assert theirs[ki] < mine[qi] or (diagonal and theirs[ki] == mine[qi])


def test_merge_keeps_fully_masked_rows_exact_and_finite():
    """Rows with no visible key (out 0, lse -inf) in one partial take the other partial exactly; in
    both, they stay 0 and -inf instead of NaN; against attention over the concatenated keys."""
    from reference_impls.context_parallel import merge_partials

    torch.manual_seed(0)
    q, k1, k2, v1, v2 = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(5))
    m1 = torch.ones(6, 6, dtype=torch.bool)
    m2 = torch.ones(6, 6, dtype=torch.bool)
    m1[0] = m1[3] = False  # rows 0 and 3 see nothing of block 1
    m2[3] = m2[5] = False  # rows 3 and 5 see nothing of block 2; row 3 sees no key at all

    def partial(k, v, mask):
        s = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(lse == float("-inf"), 0.0, lse).unsqueeze(-1))
        return p @ v, lse

    out, lse = merge_partials(*partial(k1, v1, m1), *partial(k2, v2, m2))
    assert torch.isfinite(out).all() and torch.equal(out[..., 3, :], torch.zeros_like(out[..., 3, :]))
    assert (lse[..., 3] == float("-inf")).all()
    full_mask = torch.cat([m1, m2], dim=1)
    s = (q @ torch.cat([k1, k2], dim=-2).transpose(-1, -2)).masked_fill(~full_mask, float("-inf"))
    want = torch.softmax(s, dim=-1) @ torch.cat([v1, v2], dim=-2)
    rows = [0, 1, 2, 4, 5]
    torch.testing.assert_close(out[..., rows, :], want[..., rows, :], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[..., rows], torch.logsumexp(s, dim=-1)[..., rows], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[..., 0, :], partial(k2, v2, m2)[0][..., 0, :], rtol=0, atol=0)
