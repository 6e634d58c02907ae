"""Reference paged attention: each request alone, its valid keys gathered, dense SDPA.

Only positions ``[first_needed, seq_len)`` of a request are gathered, so the unwritten
slots of its last page, pages outside a sliding window (-1 in the block table) and pages
of other groups that share the arena bytes are never read. The engine runs the batched
form (:mod:`.batched`, one SDPA call per layer for the decodes and one for the prefills);
this is its specification.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def store_kv_reference(
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


def paged_attention_reference(
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
    """Causal GQA attention of every request's new tokens over its paged keys, one by one.

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
    for r, seq_len in enumerate(seq_lens):
        lo, hi = starts[r], starts[r + 1]
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
