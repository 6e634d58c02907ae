"""Paged attention: causal GQA over K/V pages addressed by a block table.

Contract: :func:`store_kv` writes a step's K/V first, then :func:`paged_attention` reads
exactly positions ``[0, seq_len)`` (or the sliding window) of each request. Both take an
:class:`AttentionPlan`, the step's index tensors for one attention group, built once by
:func:`build_attention_plan` and shared by the group's layers. The engine's path is
:mod:`.batched` (one batched call for the decodes — two matmuls in bf16/fp16, SDPA in fp32 —
and one SDPA call per batch of similar prefill chunks, per layer);
:mod:`.naive` is its per-request specification. A flash/flex kernel would be dispatched
here behind the same calls.
"""

from __future__ import annotations

from hybridkv.ops.paged_attention.batched import decode_key_multiple, paged_attention, store_kv
from hybridkv.ops.paged_attention.naive import (
    gather_kv,
    paged_attention_reference,
    paged_request_attention,
    store_kv_reference,
)
from hybridkv.ops.paged_attention.plan import AttentionPlan, build_attention_plan

__all__ = [
    "AttentionPlan",
    "build_attention_plan",
    "decode_key_multiple",
    "gather_kv",
    "paged_attention",
    "paged_attention_reference",
    "paged_request_attention",
    "store_kv",
    "store_kv_reference",
]
