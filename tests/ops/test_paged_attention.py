"""Paged attention == dense causal attention; never reads unwritten slots or -1 pages."""

from __future__ import annotations

import pytest
import torch

from hybridkv.ops.paged_attention import paged_attention, paged_request_attention, store_kv

B, HQ, HKV, D, DV = 4, 6, 2, 8, 5  # GQA 3:1, value dim != key dim


def dense_attention(q, k, v, q_pos, window):
    """q [n, Hq, D], k/v [L, Hkv, *] for positions 0..L-1."""
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * D**-0.5
    k_pos = torch.arange(k.shape[0])
    allowed = k_pos[None] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_batch_matches_dense(window: int | None) -> None:
    """Request 0 prefills 9 tokens from scratch, 1 decodes at 13, 2 continues 6 after 7."""
    gen = torch.Generator().manual_seed(0)
    computed, new = [0, 13, 7], [9, 1, 6]
    total = [c + n for c, n in zip(computed, new, strict=True)]
    kc = torch.full((20, B, HKV, D), float("nan"))
    vc = torch.full((20, B, HKV, DV), float("nan"))
    tables = torch.full((3, 8), -1)
    pages = iter([17, 3, 11, 0, 8, 19, 5, 2, 14, 6, 12, 9])
    full_k = [torch.randn(t, HKV, D, generator=gen) for t in total]
    full_v = [torch.randn(t, HKV, DV, generator=gen) for t in total]
    for r, t in enumerate(total):
        for blk in range(-(-t // B)):
            if window is None or (blk + 1) * B > computed[r] - window:
                tables[r, blk] = next(pages)  # blocks fully outside the window stay -1
        for p in range(computed[r]):  # the cached prefix
            kc[tables[r, p // B], p % B] = full_k[r][p]
            vc[tables[r, p // B], p % B] = full_v[r][p]
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, new, strict=True)])
    token_req = torch.repeat_interleave(torch.arange(3), torch.tensor(new))
    k_new = torch.cat([full_k[r][computed[r] :] for r in range(3)])
    v_new = torch.cat([full_v[r][computed[r] :] for r in range(3)])
    store_kv(k_new, v_new, kc, vc, tables, token_req, positions)
    q = torch.randn(sum(new), HQ, D, generator=gen)
    starts = [0, 9, 10, 16]
    out = paged_attention(q, kc, vc, tables, starts, total, positions, D**-0.5, window)
    assert torch.isfinite(out).all()
    for r in range(3):
        lo, hi = starts[r], starts[r + 1]
        ref = dense_attention(q[lo:hi], full_k[r], full_v[r], positions[lo:hi], window)
        torch.testing.assert_close(out[lo:hi], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_batched_decodes_match_per_request(window: int | None) -> None:
    """Decodes of lengths 1..23 around a prefill chunk: one batched SDPA == the per-request
    path to 1e-5, in a NaN arena with -1 pages outside the window (padding must not leak)."""
    gen = torch.Generator().manual_seed(1)
    computed = [0, 12, 4, 1, 22, 0, 7, 3]  # request 2 prefills; the rest decode
    new = [1, 1, 5, 1, 1, 1, 1, 1]
    total = [c + n for c, n in zip(computed, new, strict=True)]
    kc = torch.full((40, B, HKV, D), float("nan"))
    vc = torch.full((40, B, HKV, DV), float("nan"))
    tables = torch.full((len(total), 8), -1)
    pages = iter(torch.randperm(40, generator=gen).tolist())
    full_k = [torch.randn(t, HKV, D, generator=gen) for t in total]
    full_v = [torch.randn(t, HKV, DV, generator=gen) for t in total]
    for r, t in enumerate(total):
        for blk in range(-(-t // B)):
            if window is None or (blk + 1) * B > computed[r] - window:
                tables[r, blk] = next(pages)
        for p in range(computed[r]):
            kc[tables[r, p // B], p % B] = full_k[r][p]
            vc[tables[r, p // B], p % B] = full_v[r][p]
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, new, strict=True)])
    token_req = torch.repeat_interleave(torch.arange(len(total)), torch.tensor(new))
    k_new = torch.cat([full_k[r][computed[r] :] for r in range(len(total))])
    v_new = torch.cat([full_v[r][computed[r] :] for r in range(len(total))])
    store_kv(k_new, v_new, kc, vc, tables, token_req, positions)
    q = torch.randn(sum(new), HQ, D, generator=gen)
    starts = [0, *torch.tensor(new).cumsum(0).tolist()]
    out = paged_attention(q, kc, vc, tables, starts, total, positions, D**-0.5, window)
    assert torch.isfinite(out).all()
    for r in range(len(total)):
        lo, hi = starts[r], starts[r + 1]
        one = paged_request_attention(
            q[lo:hi], kc, vc, tables[r], total[r], positions[lo:hi], D**-0.5, window
        )
        torch.testing.assert_close(out[lo:hi], one, atol=1e-5, rtol=1e-5)
        ref = dense_attention(q[lo:hi], full_k[r], full_v[r], positions[lo:hi], window)
        torch.testing.assert_close(out[lo:hi], ref, atol=1e-5, rtol=1e-5)
