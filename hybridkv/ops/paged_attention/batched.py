"""Paged attention over a whole step: one batched call for the decodes, one SDPA per prefill batch.

The index tensors come from an :class:`~hybridkv.ops.paged_attention.plan.AttentionPlan`
built once per step and attention group; a layer gathers its K/V pages with them and
attends. Equal to :func:`~hybridkv.ops.paged_attention.naive.paged_attention_reference`
(one request at a time) to float rounding; tests/ops/test_paged_attention.py checks it on
ragged batches in a NaN arena.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridkv.ops.cpu_gemm import native_gemm
from hybridkv.ops.paged_attention.plan import AttentionPlan, DecodeBatch, KeyGather, PrefillBatch
from hybridkv.ops.row_copy import needs_grad, wide_rows
from hybridkv.ops.tensor_memo import TensorMemo
from hybridkv.ops.workspace import WORKSPACE

# attention as two matmuls (_matmul_attention: the decodes and the prefills). Not fp16:
# its unscaled q.k overflows past 65,504 (a NaN row), where SDPA accumulates in fp32
_MATMUL_DTYPES = (torch.bfloat16,)
# the decodes' key columns come in multiples of this (decode_key_multiple)
MATMUL_DECODE_KEY_MULTIPLE = 64


def decode_key_multiple(dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """The multiple the decodes' key columns are padded to for queries of ``dtype`` on
    ``device``.

    The bf16 decode is two matmuls (:func:`_decode`), which oneDNN runs through a
    kernel it generates for each new shape (~250 us each on this machine's CPU, a step's
    first attention layer paying for both, the next ones finding it cached). A decode's
    keys grow by one every step, so with exact widths nearly every step met a new shape:
    64 decodes over 150 keys, one thread, the two matmuls and the softmax 294 us at a
    shape seen before, 1,134 us at a new one. Padded to a multiple of 64 columns, a shape
    repeats for 64 steps; the padding columns are masked (at most 63 more scores a row).
    fp32 and fp16 keep exact widths: their SDPA is ATen's own kernel, and padding would only
    add work; so does bf16 where its matmuls are emulated (:func:`_takes_matmuls`).
    """
    return MATMUL_DECODE_KEY_MULTIPLE if _matmul_dtype(dtype, device) else 1


def _matmul_dtype(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether ``dtype`` attention on ``device`` may take the matmuls: bf16, multiplied
    natively there (:func:`_takes_matmuls`)."""
    return dtype in _MATMUL_DTYPES and native_gemm(dtype, device)


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
    decode = plan.decode
    if decode is not None and decode.all_rows:  # a decode step: its output is the output
        return _decode(query, key_cache, value_cache, decode, scale)
    out = query.new_empty(query.shape[0], query.shape[1], value_cache.shape[-1])
    if decode is not None:
        out[decode.rows] = _decode(query, key_cache, value_cache, decode, scale)
    for prefill in plan.prefills:
        out[prefill.out_rows] = _prefill(query, key_cache, value_cache, prefill, scale)
    return out


def _gather_kv(
    key_cache: Tensor, value_cache: Tensor, keys: KeyGather, dtype: torch.dtype, head_major: bool
) -> tuple[Tensor, Tensor]:
    """K and V of the columns, each [n, Hkv, Lk, d] in ``dtype``: one ``index_select`` for
    both when they are one layer's tensors in the same pages (the arena's layout: one
    storage, equal shapes and strides), else one each. ``head_major``: contiguous, one row
    per (key, head) gathered straight into head-major order (what the decode matmuls read
    without a copy); else transposed views of [n, Lk, Hkv, d]."""
    both = _gather_rows((key_cache, value_cache), keys, dtype, head_major)
    if both is not None:
        return both[0], both[1]
    return _gather(key_cache, keys, dtype, head_major), _gather(
        value_cache, keys, dtype, head_major
    )


def _gather(cache: Tensor, keys: KeyGather, dtype: torch.dtype, head_major: bool = False) -> Tensor:
    """[n, Lk, Hkv, d] -> [n, Hkv, Lk, d] in the query dtype: one ``index_select`` over the
    cache seen as rows (:func:`_row_view`), or advanced indexing when autograd tracks the
    cache (``index_select(out=...)`` does not record a graph) or its layout has no such
    view. ``head_major``: contiguous (see :func:`_gather_kv`)."""
    gathered = _gather_rows((cache,), keys, dtype, head_major)
    if gathered is not None:
        return gathered[0]
    pages, slots = keys.pages_slots()
    out = cache[pages, slots].to(dtype).transpose(1, 2)
    return out.contiguous() if head_major else out


def _gather_rows(
    caches: tuple[Tensor, ...], keys: KeyGather, dtype: torch.dtype, head_major: bool
) -> tuple[Tensor, ...] | None:
    """Each cache's columns ([n, Hkv, Lk, d], see :func:`_gather_kv`) by one
    ``index_select`` over them all seen as rows (:func:`_row_view`), or None when autograd
    tracks one or their layout has no such view."""
    if any(needs_grad(cache) for cache in caches):
        return None
    seen = _row_view(caches, head_major)
    if seen is None:
        return None
    rows, per_page, offsets = seen
    cache = caches[0]
    heads = cache.shape[2]
    index = keys.index(per_page, offsets, heads if head_major else 1)
    gathered = rows.new_empty(index.numel(), *rows.shape[1:])
    torch.index_select(rows, 0, index, out=gathered)
    n, width = keys.valid.shape
    gathered = gathered.view(cache.dtype)  # from 16-byte words
    if head_major:
        return gathered.view(len(caches), n, heads, width, -1).to(dtype).unbind(0)
    gathered = gathered.view(len(caches), n, width, heads, -1).to(dtype)
    return gathered.transpose(2, 3).unbind(0)


RowView = tuple[Tensor, int, tuple[int, ...]]  # rows, slots per page, row offsets

# the layer page views live as long as their engine and every layer gathers from its own
# each step; deriving the view takes ~20 Python-level calls (~5-10 us), the lookup ~1 us.
_ROW_VIEWS: TensorMemo[RowView | None] = TensorMemo()


def _row_view(caches: tuple[Tensor, ...], head_major: bool) -> RowView | None:
    """:func:`_derive_row_view`, remembered per caches (forgotten when one is freed)."""
    return _ROW_VIEWS.get(
        caches,
        lambda: _derive_row_view(caches, head_major),
        (head_major, torch.is_inference_mode_enabled()),
    )


def _derive_row_view(caches: tuple[Tensor, ...], head_major: bool) -> RowView | None:
    """Caches [P, B, Hkv, d] of one storage, dtype, shape and strides seen as one tensor of
    rows: (rows, slots per page, first row of each cache), slot ``b`` of page ``p`` of
    cache ``i`` being row ``p * per_page + b + offsets[i]`` (``head_major``: rows of one
    head, ``(p * per_page + b) * Hkv + h + offsets[i]``). A row whose elements are
    contiguous is one row of a 2-D tensor, of 16-byte words when its bytes, stride and
    offset allow (``index_select`` costs per element: ops/row_copy.py). None when the
    strides do not allow rows (the page stride not a whole number of slot strides, heads
    not packed in a slot for ``head_major``, caches not a whole number of rows apart)."""
    cache = caches[0]
    shape, strides = cache.shape, cache.stride()
    page_stride, slot_stride, head_stride = strides[0], strides[1], strides[2]
    if slot_stride <= 0 or page_stride % slot_stride or shape[0] == 0:
        return None
    if head_major and slot_stride != shape[2] * head_stride:
        return None
    unit = head_stride if head_major else slot_stride
    base = cache.storage_offset()
    if len(caches) > 1:
        elem = cache.element_size()
        storage = cache.data_ptr() - base * elem
        for other in caches[1:]:
            if (
                other.shape != shape
                or other.stride() != strides
                or other.dtype != cache.dtype
                or other.data_ptr() - other.storage_offset() * elem != storage
            ):
                return None
        base = min(other.storage_offset() for other in caches)
    deltas = [other.storage_offset() - base for other in caches]
    if any(delta % unit for delta in deltas):
        return None
    offsets = tuple(delta // unit for delta in deltas)
    per_page = page_stride // slot_stride
    per_slot = slot_stride // unit  # rows per slot
    num_rows = ((shape[0] - 1) * per_page + shape[1]) * per_slot + max(offsets)
    rest = per_page, offsets
    dims = 3 if head_major else 2
    row_shape, row_strides = shape[dims:], strides[dims:]
    if not _contiguous(row_shape, row_strides):
        return cache.as_strided((num_rows, *row_shape), (unit, *row_strides), base), *rest
    rows = cache.as_strided((num_rows, math.prod(row_shape)), (unit, 1), base)
    words = wide_rows(rows)  # None: row bytes, stride or offset not whole 16-byte words
    return (rows if words is None else words), *rest


def _contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _decode(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, batch: DecodeBatch, scale: float
) -> Tensor:
    """[N, Hq, Dv]: the Hq/Hkv query heads of a KV head ride in the query-length axis.

    In bf16 the scores and the weighted sum are two batched matmuls in the query
    dtype around an fp32 softmax (:func:`_matmul_attention`, each request a one-query
    prefill), as transformers' eager attention computes them, over keys gathered
    head-major (:func:`_gather_kv`). SDPA's CPU flash kernel is built for
    long query blocks: on contiguous inputs (64 requests x 192 keys, 8 heads of 64, one
    thread) 789 us against 273 us for the matmuls; 8 x 700: 331 vs 153 us; 64 x 1024: 5.9
    vs 3.0 ms. In the W1 decode step of issue 13 (64 requests, the small Qwen3-Next) the two
    attention layers took 5.3 -> 4.4 ms. fp32 keeps SDPA (its matmul form is not faster), and
    so does fp16 (its unscaled scores would overflow).
    """
    num_kv_heads = key_cache.shape[2]
    q = query if batch.all_rows else query[batch.rows]  # [N, Hq, D]
    num, num_heads, head_dim = q.shape
    if _takes_matmuls(q, key_cache, value_cache):  # a one-query prefill, as matmuls
        k, v = _gather_kv(key_cache, value_cache, batch.keys, q.dtype, head_major=True)
        bias = batch.keys.bias(q.dtype)  # 0 / -inf: exact in bf16, added in fp32
        assert bias is not None  # decodes always have a mask
        out = _matmul_attention(q.view(num, num_heads, 1, head_dim), k, v, bias, scale)
        return out.view(num, num_heads, -1)
    q = q.view(num, num_kv_heads, num_heads // num_kv_heads, head_dim)  # h = g * rep + i
    k, v = _gather_kv(key_cache, value_cache, batch.keys, q.dtype, head_major=False)
    bias = batch.keys.bias(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    return out.reshape(num, num_heads, -1)  # [N, Hkv, rep, Dv] -> [N, Hq, Dv]


def _takes_matmuls(q: Tensor, key_cache: Tensor, value_cache: Tensor) -> bool:
    """Whether attention of ``q`` runs as :func:`_matmul_attention`: bf16 on a device that
    multiplies bf16 natively, and no autograd (its matmuls write into workspace buffers,
    which autograd refuses). Where bf16 matmuls are emulated (a CPU with AVX2 alone,
    :mod:`hybridkv.ops.cpu_gemm`), SDPA's kernel, which computes in fp32 inside, is far
    faster: W1-like run of issue 13 cut to 16 requests, bf16 weights upcast, one thread,
    the attention layers 0.60 s as matmuls against 0.07 s through SDPA."""
    return _matmul_dtype(q.dtype, q.device) and not any(
        needs_grad(x) for x in (q, key_cache, value_cache)
    )


def _prefill(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, batch: PrefillBatch, scale: float
) -> Tensor:
    """[Tp, Hq, Dv] for the prefill rows: in bf16, matmuls (:func:`_matmul_attention`) over
    the batch's mask, or for chunks that all start at position 0 over the causal triangle
    (unless one triangle of queries x keys would pass :data:`MATMUL_SCORES`: a long first
    chunk keeps SDPA's causal kernel, as fast there and with no triangle to hold); else one
    padded SDPA call (GQA by ``enable_gqa``). fp16 keeps SDPA: its unscaled scores would
    overflow past 65,504 where SDPA's stay finite. Autograd (of the query or the cache)
    keeps SDPA too: the matmuls write into workspace buffers."""
    rows = batch.query_rows
    q = query[rows][None] if isinstance(rows, slice) else query[rows]  # [R, Lq, Hq, D]
    q = q.transpose(1, 2)  # [R, Hq, Lq, D]
    q_len = q.shape[2]
    causal = batch.keys.mask is None  # every chunk starts at position 0
    if _takes_matmuls(q, key_cache, value_cache) and (
        not causal or q_len * batch.keys.width <= MATMUL_SCORES
    ):
        k, v = _gather_kv(key_cache, value_cache, batch.keys, q.dtype, head_major=True)
        bias = batch.keys.bias(q.dtype)  # 0 / -inf: exact in bf16, added in fp32
        if bias is None:
            bias = batch.keys.causal_bias(q.dtype, q_len)
        out = _matmul_attention(q, k, v, bias, scale)
    else:
        k, v = _gather_kv(key_cache, value_cache, batch.keys, query.dtype, head_major=False)
        bias = batch.keys.bias(query.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, is_causal=bias is None, scale=scale, enable_gqa=True
        )  # [R, Hq, Lq, Dv]
    flat = out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[-1])  # [R * Lq, Hq, Dv]
    return flat if batch.out_src is None else flat[batch.out_src]


# the most scores (heads x queries x keys) _matmul_attention computes at once
MATMUL_SCORES = 1 << 21


def _matmul_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """Masked bf16 attention as two matmuls around an fp32 softmax, as transformers' eager
    attention computes it: [R, Hq, Lq, Dv]. The decodes (:func:`_decode`, one query a
    request) and the prefill batches (:func:`_prefill`, over their mask or the causal
    triangle) run it.

    SDPA's CPU flash kernel runs far below the matmuls' rate on the engine's shapes, and
    cannot skip masked blocks. The small Qwen3-Next's heads (8 of 64 over 2 KV heads),
    bf16, one thread, fresh inputs, median of 3-5, SDPA -> matmuls a layer: after cached
    prefixes, 31 chunks of 50 tokens after 1,502 (issue 13's W3) 71 -> 34 ms, 8 x 69 after
    ~500 (W2's follow-up turns) 9.4 -> 4.2 ms, 1 x 124 after 288 1.5 -> 0.6 ms, 2,048
    after 4,096 290 -> 131 ms, 512 after 8,192 with 16 heads 208 -> 104 ms; from position
    0 (SDPA's causal kernel, which skips the masked half, against the full square here),
    32 x 128 (W1's prefill) 15.7 -> 6.5 ms, 64 x 64 9.3 -> 3.6 ms, 2 x 1,024 34.8 -> 23.7
    ms, 1 x 2,048 57.5 -> 48.0 ms, 1 x 4,096 206 -> 194 ms. The
    scores live in workspace buffers of at most :data:`MATMUL_SCORES` elements each, filled
    by a group of requests or, for a request with more scores, a block of its queries at a
    time: freshly allocated, their pages cost more to fault in than the softmax over them.
    The softmax is ATen's one-kernel softmax, run in place on the fp32 logits (its kernel
    reads a row before writing it: the same bits as into another buffer, one 8 MB buffer
    less; as four passes of elementwise ops it took 5.1 instead of 4.2 ms at W2's shape,
    42 instead of 34 ms at W3's). Rounding:
    the probabilities are rounded to the query dtype before the second matmul
    (transformers' eager attention does the same), where SDPA keeps them in fp32. Every
    query row's result is the same bits however the rows are grouped.

    q [R, Hq, Lq, D]; k, v [R, Hkv, Lk, D | Dv] contiguous (head-major); bias [R, 1, Lq, Lk]
    additive, 0 or -inf (every query row keeps at least one key), in any float dtype: both
    values are exact in each and are added to the fp32 logits.
    """
    num_reqs, num_heads, q_len, _ = q.shape
    per_query = num_heads * k.shape[2]  # scores of one query position
    block = max(1, min(q_len, MATMUL_SCORES // per_query))  # query positions at once
    group = max(1, MATMUL_SCORES // (per_query * q_len)) if block == q_len else 1
    out = q.new_empty(num_reqs, num_heads, q_len, v.shape[-1])
    for first in range(0, num_reqs, group):
        reqs = slice(first, min(num_reqs, first + group))
        for start in range(0, q_len, block):
            cols = slice(start, min(q_len, start + block))
            _attend(
                q[reqs, :, cols], k[reqs], v[reqs], bias[reqs, :, cols], scale, out[reqs, :, cols]
            )
    return out


def _attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, out: Tensor) -> None:
    """One group of :func:`_matmul_attention` into ``out`` [n, Hq, Lb, Dv]: the Hq/Hkv query
    heads of a KV head ride in the query-length axis of one matmul per KV head."""
    num, num_heads, q_len, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    rows = num_heads // num_kv_heads * q_len  # a KV head's query rows: [rep, Lb] flattened
    shape = (num, num_kv_heads, rows, num_keys)
    scores = WORKSPACE.get("attn.matmul.scores", shape, q.dtype, q.device)
    grouped = q.reshape(num, num_kv_heads, rows, head_dim)  # h = g * rep + i
    torch.matmul(grouped, k.transpose(-1, -2), out=scores)
    logits = WORKSPACE.get("attn.matmul.logits", shape, torch.float32, q.device)
    logits.copy_(scores)
    heads = logits.view(num, num_heads, q_len, num_keys)
    heads.mul_(scale).add_(bias)
    torch.ops.aten._softmax.out(heads, -1, False, out=heads)  # in place: same kernel, bits
    scores.copy_(logits)
    if out.is_contiguous():  # every query of the group: written in place
        torch.matmul(scores, v, out=out.view(num, num_kv_heads, rows, -1))
    else:
        out.copy_(torch.matmul(scores, v).view(num, num_heads, q_len, -1))
