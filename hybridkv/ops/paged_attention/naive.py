"""Reference paged attention: gather each request's valid keys, then dense SDPA.

Only positions ``[first_needed, seq_len)`` of a request are gathered, so the unwritten
slots of its last page, pages outside a sliding window (-1 in the block table) and pages
of other groups that share the arena bytes are never read.

Decodes (one query token each) run together: one padded gather over the block tables and
one SDPA call per layer, instead of one per request (the per-request loop was ~40% of
engine time at 64 running requests). Padding slots re-read a valid position of the same
request rather than an unwritten one, because masking alone cannot hide a NaN in the
arena (``0 * NaN = NaN`` in the value matmul). Prefill chunks keep the per-request path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def store_kv(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    token_request: Tensor,
    positions: Tensor,
) -> None:
    """Write this step's K/V into the pages: position p -> page table[r, p // B], slot p % B.

    Args:
        key: [T, Hkv, D]; value: [T, Hkv, Dv].
        key_cache: [num_pages, B, Hkv, D]; value_cache: [num_pages, B, Hkv, Dv] (written).
        block_table: [R, max_blocks] page ids of this group.
        token_request: [T] request of each row; positions: [T] absolute positions.
    """
    block_tokens = key_cache.shape[1]
    pages = block_table[token_request, positions // block_tokens]  # [T]
    slots = positions % block_tokens  # [T]
    key_cache[pages, slots] = key.to(key_cache.dtype)
    value_cache[pages, slots] = value.to(value_cache.dtype)


def gather_kv(
    key_cache: Tensor, value_cache: Tensor, table_row: Tensor, start: int, end: int
) -> tuple[Tensor, Tensor]:
    """K/V of positions [start, end) of one request: ([L, Hkv, D], [L, Hkv, Dv])."""
    block_tokens = key_cache.shape[1]
    kv_pos = torch.arange(start, end, device=table_row.device)  # [L]
    pages = table_row[kv_pos // block_tokens]  # [L]
    slots = kv_pos % block_tokens
    return key_cache[pages, slots], value_cache[pages, slots]


def paged_decode_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    requests: Tensor,
    seq_lens: Tensor,
    positions: Tensor,
    scale: float,
    window_tokens: int | None = None,
) -> Tensor:
    """Attention of N one-token queries at once over their paged keys, one SDPA call.

    Each query's keys ``[first, seq_len)`` are gathered into a padded [N, Hkv, Lmax, D]
    batch; a padding column points at the query's own ``first`` position (always written),
    so every gathered value is finite and the boolean mask removes it exactly. The Hq/Hkv
    query heads that share a KV head ride in SDPA's query-length axis ([N, Hkv, rep, D]),
    so GQA needs neither a K/V repeat nor ``enable_gqa``.

    Args:
        query: [N, Hq, D], one row per decode; Hq a multiple of Hkv.
        key_cache / value_cache: [num_pages, B, Hkv, D | Dv], already holding this step's K/V.
        block_table: [R, max_blocks] page ids; ``requests`` [N] picks each query's row.
        seq_lens: [N] cached lengths after this step; positions: [N] query positions.
        scale: softmax scale.
        window_tokens: sliding window; a query at p sees keys in (p - window, p].

    Returns:
        [N, Hq, Dv] in the query dtype.
    """
    num_queries, num_heads, head_dim = query.shape
    num_kv_heads, block_tokens = key_cache.shape[2], key_cache.shape[1]
    first = (
        torch.zeros_like(seq_lens)
        if window_tokens is None
        else (positions - window_tokens + 1).clamp(min=0)
    )
    lengths = seq_lens - first  # [N] keys each query may read
    max_len = int(lengths.max())
    offset = torch.arange(max_len, device=query.device)  # [L]
    kv_pos = first[:, None] + offset[None, :]  # [N, L]
    valid = offset[None, :] < lengths[:, None]
    allowed = valid & (kv_pos <= positions[:, None])
    if window_tokens is not None:
        allowed &= kv_pos > positions[:, None] - window_tokens
    kv_pos = torch.where(valid, kv_pos, first[:, None])  # padding re-reads a written slot
    pages = block_table[requests[:, None], kv_pos // block_tokens]  # [N, L]
    slots = kv_pos % block_tokens
    k = key_cache[pages, slots].to(query.dtype).transpose(1, 2)  # [N, Hkv, L, D]
    v = value_cache[pages, slots].to(query.dtype).transpose(1, 2)  # [N, Hkv, L, Dv]
    rep = num_heads // num_kv_heads
    q = query.reshape(num_queries, num_kv_heads, rep, head_dim)  # heads h = g * rep + i
    mask = allowed[:, None, None, :]  # [N, 1, 1, L]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [N, Hkv, rep, Dv]
    return out.reshape(num_queries, num_heads, -1)


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    starts: list[int],
    seq_lens: list[int],
    positions: Tensor,
    scale: float,
    window_tokens: int | None = None,
) -> Tensor:
    """Causal GQA attention of every request's new tokens over its paged keys.

    One-token requests (decodes) go through :func:`paged_decode_attention` together;
    longer chunks run one by one.

    Args:
        query: [T, Hq, D], request-major; Hq a multiple of Hkv.
        key_cache / value_cache: [num_pages, B, Hkv, D | Dv], already holding this step's K/V.
        block_table: [R, max_blocks] page ids.
        starts: R+1 row offsets; seq_lens: R cached lengths after this step.
        positions: [T] absolute query positions (a query sees keys at positions <= its own).
        scale: softmax scale.
        window_tokens: sliding window; a query at p sees keys in (p - window, p].

    Returns:
        [T, Hq, Dv] in the query dtype.
    """
    out = query.new_empty(query.shape[0], query.shape[1], value_cache.shape[-1])
    decodes = [r for r in range(len(seq_lens)) if starts[r + 1] - starts[r] == 1]
    if decodes:
        rows = torch.tensor([starts[r] for r in decodes], device=query.device)
        out[rows] = paged_decode_attention(
            query[rows],
            key_cache,
            value_cache,
            block_table,
            torch.tensor(decodes, device=query.device),
            torch.tensor([seq_lens[r] for r in decodes], device=query.device),
            positions[rows],
            scale,
            window_tokens,
        )
    for r, seq_len in enumerate(seq_lens):
        lo, hi = starts[r], starts[r + 1]
        if hi - lo < 2:
            continue
        out[lo:hi] = paged_request_attention(
            query[lo:hi],
            key_cache,
            value_cache,
            block_table[r],
            seq_len,
            positions[lo:hi],
            scale,
            window_tokens,
        )
    return out


def paged_request_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    table_row: Tensor,
    seq_len: int,
    q_pos: Tensor,
    scale: float,
    window_tokens: int | None,
) -> Tensor:
    """One request's queries [n, Hq, D] over its keys: gather the needed span, dense SDPA."""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    first = 0 if window_tokens is None else max(0, int(q_pos.min()) - window_tokens + 1)
    k, v = gather_kv(key_cache, value_cache, table_row, first, seq_len)  # [L, Hkv, D]
    k_pos = torch.arange(first, seq_len, device=query.device)  # [L]
    allowed = k_pos[None, :] <= q_pos[:, None]  # [n, L]
    if window_tokens is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window_tokens
    rep = num_heads // num_kv_heads
    k = k.to(query.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = v.to(query.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, L, Dv]
    q = query.transpose(0, 1)  # [Hq, n, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)  # [Hq, n, Dv]
    return o.transpose(0, 1)
