"""Paged attention over a whole step: one batched call for the decodes, one SDPA per prefill batch.

The index tensors come from an :class:`~hybridkv.ops.paged_attention.plan.AttentionPlan`
built once per step and attention group; a layer gathers its K/V pages with them and
attends. Equal to :func:`~hybridkv.ops.paged_attention.naive.paged_attention_reference`
(one request at a time) to float rounding; tests/ops/test_paged_attention.py checks it on
ragged batches in a NaN arena.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridkv.ops.paged_attention.plan import AttentionPlan, DecodeBatch, KeyGather, PrefillBatch
from hybridkv.ops.row_copy import index_select_rows, needs_grad

_MATMUL_DECODE_DTYPES = (torch.bfloat16, torch.float16)  # decodes as two matmuls (_decode)


def store_kv(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, plan: AttentionPlan
) -> None:
    """Write this step's K/V [T, Hkv, D | Dv] into their page slots (``plan.write_*``)."""
    key_cache[plan.write_pages, plan.write_slots] = key.to(key_cache.dtype)
    value_cache[plan.write_pages, plan.write_slots] = value.to(value_cache.dtype)


def paged_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, plan: AttentionPlan, scale: float
) -> Tensor:
    """Causal GQA attention of every row of the step over its request's paged keys.

    Args:
        query: [T, Hq, D], request-major; Hq a multiple of Hkv.
        key_cache / value_cache: [num_pages, B, Hkv, D | Dv], holding this step's K/V.
        plan: the step's plan for this layer's group.
        scale: softmax scale.

    Returns:
        [T, Hq, Dv] in the query dtype.
    """
    out = query.new_empty(query.shape[0], query.shape[1], value_cache.shape[-1])
    if plan.decode is not None:
        out[plan.decode.rows] = _decode(query, key_cache, value_cache, plan.decode, scale)
    for prefill in plan.prefills:
        out[prefill.out_rows] = _prefill(query, key_cache, value_cache, prefill, scale)
    return out


def _gather(cache: Tensor, keys: KeyGather, dtype: torch.dtype) -> Tensor:
    """[n, Lk, Hkv, d] -> [n, Hkv, Lk, d] in the query dtype (advanced indexing when
    autograd tracks the cache: ``index_select(out=...)`` does not record a graph)."""
    slots = None if needs_grad(cache) else _slot_rows(cache)
    if slots is None:
        gathered = cache[keys.pages, keys.slots]
    else:  # one index_select over slot rows: per row, not per element (ops/row_copy.py)
        rows, per_page = slots
        index = (keys.pages * per_page + keys.slots).view(-1)
        gathered = cache.new_empty(index.numel(), *cache.shape[2:])
        index_select_rows(rows, index, gathered)
        gathered = gathered.view(*keys.pages.shape, *cache.shape[2:])
    return gathered.to(dtype).transpose(1, 2)


def _gather_heads(cache: Tensor, keys: KeyGather, dtype: torch.dtype) -> Tensor:
    """[n, Hkv, Lk, d] contiguous, in the query dtype: one row per (key, head) gathered
    straight into head-major order, so the decode matmuls read it without the copy a
    transposed [n, Lk, Hkv, d] gather would need (falls back to :func:`_gather`)."""
    slots = None if needs_grad(cache) else _slot_rows(cache)
    heads, head_stride = cache.shape[2], cache.stride(2)
    if slots is None or cache.stride(1) != heads * head_stride:
        return _gather(cache, keys, dtype).contiguous()
    rows, per_page = slots
    head_rows = cache.as_strided(
        (rows.shape[0] * heads, cache.shape[3]),
        (head_stride, cache.stride(3)),
        cache.storage_offset(),
    )
    slot = keys.pages * per_page + keys.slots  # [n, Lk]
    head = torch.arange(heads, device=slot.device)
    index = (slot[:, None, :] * heads + head[None, :, None]).view(-1)  # [n * Hkv * Lk]
    gathered = cache.new_empty(index.numel(), cache.shape[3])
    index_select_rows(head_rows, index, gathered)
    return gathered.view(slot.shape[0], heads, slot.shape[1], -1).to(dtype)


def _slot_rows(cache: Tensor) -> tuple[Tensor, int] | None:
    """The cache [P, B, Hkv, d] seen as one row per page slot [(P-1)*s + B, Hkv, d] (slot
    ``b`` of page ``p`` is row ``p * s + b``), or None when the page stride is not a
    whole number of slot strides."""
    page_stride, slot_stride = cache.stride(0), cache.stride(1)
    if slot_stride <= 0 or page_stride % slot_stride or cache.shape[0] == 0:
        return None
    per_page = page_stride // slot_stride
    num_rows = (cache.shape[0] - 1) * per_page + cache.shape[1]
    rows = cache.as_strided(
        (num_rows, *cache.shape[2:]), (slot_stride, *cache.stride()[2:]), cache.storage_offset()
    )
    return rows, per_page


def _decode(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, batch: DecodeBatch, scale: float
) -> Tensor:
    """[N, Hq, Dv]: the Hq/Hkv query heads of a KV head ride in the query-length axis.

    In bf16 / fp16 the scores and the weighted sum are two batched matmuls in the query
    dtype around an fp32 softmax, as transformers' eager attention computes them, over
    keys gathered head-major (:func:`_gather_heads`). SDPA's CPU flash kernel is built for
    long query blocks: on contiguous inputs (64 requests x 192 keys, 8 heads of 64, one
    thread) 789 us against 273 us for the matmuls; 8 x 700: 331 vs 153 us; 64 x 1024: 5.9
    vs 3.0 ms. In the W1 decode step of issue 13 (64 requests, the small Qwen3-Next) the two
    attention layers took 5.3 -> 4.4 ms. fp32 keeps SDPA (its matmul form is not faster).
    """
    num_kv_heads = key_cache.shape[2]
    q = query[batch.rows]  # [N, Hq, D]
    num, num_heads, head_dim = q.shape
    q = q.view(num, num_kv_heads, num_heads // num_kv_heads, head_dim)  # h = g * rep + i
    if q.dtype in _MATMUL_DECODE_DTYPES and not needs_grad(q):
        k = _gather_heads(key_cache, batch.keys, query.dtype)  # [N, Hkv, Lk, D]
        v = _gather_heads(value_cache, batch.keys, query.dtype)
        scores = torch.matmul(q, k.transpose(-1, -2)).float()  # [N, Hkv, rep, Lk]
        probs = scores.mul_(scale).add_(batch.bias).softmax(dim=-1).to(q.dtype)
        out = torch.matmul(probs, v)
    else:
        k = _gather(key_cache, batch.keys, query.dtype)
        v = _gather(value_cache, batch.keys, query.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.keys.mask, scale=scale)
    return out.reshape(num, num_heads, -1)  # [N, Hkv, rep, Dv] -> [N, Hq, Dv]


def _prefill(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, batch: PrefillBatch, scale: float
) -> Tensor:
    """[Tp, Hq, Dv] for the prefill rows, one padded SDPA call (GQA by ``enable_gqa``)."""
    q = query[batch.query_rows].transpose(1, 2)  # [R, Lq, Hq, D] -> [R, Hq, Lq, D]
    k = _gather(key_cache, batch.keys, query.dtype)  # [R, Hkv, Lk, D]
    v = _gather(value_cache, batch.keys, query.dtype)
    mask = batch.keys.mask
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )  # [R, Hq, Lq, Dv]
    flat = out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[-1])  # [R * Lq, Hq, Dv]
    return flat[batch.out_src]
