"""Paged attention: causal GQA over K/V pages addressed by a block table.

Contract: :func:`store_kv` writes a step's K/V first, then :func:`paged_attention` reads
exactly positions ``[0, seq_len)`` (or the sliding window) of each request. Decodes run
batched (:func:`paged_decode_attention`), prefill chunks one by one
(:func:`paged_request_attention`). No fast path
is installed on CPU; a flash/flex kernel would be dispatched here behind the same call.
"""

from __future__ import annotations

from hybridkv.ops.paged_attention.naive import (
    gather_kv,
    paged_attention,
    paged_decode_attention,
    paged_request_attention,
    store_kv,
)

__all__ = [
    "gather_kv",
    "paged_attention",
    "paged_decode_attention",
    "paged_request_attention",
    "store_kv",
]
