"""What paged attention needs to know about a step, built once and shared by a group's layers.

Every attention layer of a group has the same block tables, block size and window, so the
index tensors of a step (where each new token's K/V goes, which page slots each request
reads, the masks) are the same for all of them. :func:`build_attention_plan` computes them
once per step and group; each layer then only gathers and attends.

Requests are split in two batches (rows of the step are request-major)::

    decodes   one query each     q [N, Hkv, rep, D]  over keys [N, Hkv, Lk, D], mask [N,1,1,Lk]
    prefills  q_len >= 2         q [R, Hq, Lq, D]    over keys [R, Hkv, Lk, D], mask [R,1,Lq,Lk]
                                 (right-padded to the longest chunk; or no mask, SDPA's own
                                 causal rule, when every chunk starts at position 0)

The prefills are split into a few such batches of similar shapes (:func:`prefill_groups`):
one padded batch of a 554-token chunk beside 31 chunks of 50 tokens, each after a
1500-token cached prefix, would compute 32 x 554 x 1554 scores for 2.1 M real ones (the
W3 workload of issue 13: that step took 2.0 s, more than a 4096-token step).

Padding never reads a slot nobody wrote: a padding key column re-reads the request's first
needed key, a padding query row repeats its last query row; masks remove the columns and
the padded rows are dropped. A NaN in an unwritten slot would survive masking
(``0 * NaN = NaN`` in the value product), so this matters in a NaN-poisoned arena.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class KeyGather:
    """Page slots of each request's keys, padded to ``Lk`` columns, and its mask."""

    pages: Tensor  # [n, Lk] int64
    slots: Tensor  # [n, Lk] int64
    mask: Tensor | None  # bool, broadcastable to SDPA's [n, heads, Lq, Lk]; None: causal


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    rows: Tensor  # [N] int64 row of each one-token request
    keys: KeyGather  # mask [N, 1, 1, Lk]
    bias: Tensor  # [N, 1, 1, Lk] fp32: 0 where the mask keeps a key, -inf where it drops it


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    query_rows: Tensor  # [R, Lq] int64 row of the step each padded query position reads
    out_src: Tensor  # [Tp] int64 flat padded position (r * Lq + t) of each real query
    out_rows: Tensor  # [Tp] int64 its row in the step
    keys: KeyGather  # mask [R, 1, Lq, Lk], or None with is_causal


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """One step of one attention group (block size and window fixed by the group)."""

    write_pages: Tensor  # [T] page of each new token's K/V
    write_slots: Tensor  # [T] its slot in the page
    decode: DecodeBatch | None
    prefills: tuple[PrefillBatch, ...]  # requests of similar shapes batched together


def build_attention_plan(
    block_table: Tensor,
    starts: list[int],
    seq_lens: list[int],
    positions: Tensor,
    block_tokens: int,
    window_tokens: int | None,
) -> AttentionPlan:
    """The index tensors of one step for one attention group.

    Args:
        block_table: [R, max_blocks] int64 page ids (-1 where never read).
        starts: R+1 row offsets; seq_lens: R cached lengths after the step.
        positions: [T] absolute position of every row.
        block_tokens: tokens per page; window_tokens: sliding window or None.
    """
    device = positions.device
    lens = [b - a for a, b in pairwise(starts)]
    token_request = torch.repeat_interleave(
        torch.arange(len(lens), device=device), torch.tensor(lens, device=device)
    )
    write_pages = block_table[token_request, positions // block_tokens]
    decodes = [r for r, n in enumerate(lens) if n == 1]
    prefills = [r for r, n in enumerate(lens) if n > 1]
    return AttentionPlan(
        write_pages=write_pages,
        write_slots=positions % block_tokens,
        decode=_decode_batch(block_table, starts, seq_lens, decodes, block_tokens, window_tokens)
        if decodes
        else None,
        prefills=tuple(
            _prefill_batch(block_table, starts, seq_lens, group, block_tokens, window_tokens)
            for group in prefill_groups([(lens[r], seq_lens[r]) for r in prefills], prefills)
        ),
    )


PADDING_SLACK = 1.5  # a batch may compute this many times its requests' real scores
SMALL_BATCH_SCORES = 1 << 16  # ... or this many scores more (less than a call's fixed cost)


def prefill_groups(shapes: list[tuple[int, int]], requests: list[int]) -> list[list[int]]:
    """Split prefill requests into batches whose padding stays small.

    ``shapes[i]`` is request ``requests[i]``'s (queries, keys). A padded batch computes
    ``n x max_q x max_k`` scores; requests are taken longest chunk first and a batch grows
    while that stays within :data:`PADDING_SLACK` times the real ``sum(q x k)`` (or within
    :data:`SMALL_BATCH_SCORES` of it). Each batch keeps the step's request order.
    """
    order = sorted(range(len(requests)), key=lambda i: (-shapes[i][0], -shapes[i][1]))
    groups: list[list[int]] = []
    members: list[int] = []
    max_q = max_k = real = 0
    for i in order:
        q, k = shapes[i]
        with_it = real + q * k
        padded = (len(members) + 1) * max(max_q, q) * max(max_k, k)
        if members and padded > max(PADDING_SLACK * with_it, with_it + SMALL_BATCH_SCORES):
            groups.append(members)  # i starts the next batch
            members, max_q, max_k, real = [], 0, 0, 0
        members.append(i)
        max_q, max_k, real = max(max_q, q), max(max_k, k), real + q * k
    if members:
        groups.append(members)
    return [[requests[i] for i in sorted(group)] for group in groups]


def _key_columns(
    block_table: Tensor,
    requests: Tensor,
    first: Tensor,
    seq_lens: Tensor,
    block_tokens: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(pages, slots, kv positions, valid) [n, Lk] for keys ``[first, seq_len)`` of each
    request, padding columns pointing at ``first`` (a written slot)."""
    lengths = seq_lens - first  # [n]
    offset = torch.arange(int(lengths.max()), device=first.device)  # [Lk]
    valid = offset[None, :] < lengths[:, None]  # [n, Lk]
    kv_pos = torch.where(valid, first[:, None] + offset[None, :], first[:, None])
    pages = block_table[requests[:, None], kv_pos // block_tokens]
    return pages, kv_pos % block_tokens, kv_pos, valid


def _decode_batch(
    block_table: Tensor,
    starts: list[int],
    seq_lens: list[int],
    requests: list[int],
    block_tokens: int,
    window_tokens: int | None,
) -> DecodeBatch:
    device = block_table.device
    reqs = torch.tensor(requests, device=device)
    lens = torch.tensor([seq_lens[r] for r in requests], device=device)  # [N]
    first = torch.zeros_like(lens)
    if window_tokens is not None:  # the query at p = len - 1 sees keys (p - window, p]
        first = (lens - window_tokens).clamp(min=0)
    pages, slots, _, valid = _key_columns(block_table, reqs, first, lens, block_tokens)
    rows = torch.tensor([starts[r] for r in requests], device=device)
    mask = valid[:, None, None, :]
    bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
    return DecodeBatch(rows=rows, keys=KeyGather(pages, slots, mask), bias=bias)


def _prefill_batch(
    block_table: Tensor,
    starts: list[int],
    seq_lens: list[int],
    requests: list[int],
    block_tokens: int,
    window_tokens: int | None,
) -> PrefillBatch:
    device = block_table.device
    reqs = torch.tensor(requests, device=device)
    q_lens = torch.tensor([starts[r + 1] - starts[r] for r in requests], device=device)  # [R]
    lens = torch.tensor([seq_lens[r] for r in requests], device=device)
    computed = lens - q_lens  # [R] position of each chunk's first query
    max_q = int(q_lens.max())
    t = torch.arange(max_q, device=device)  # [Lq]
    q_valid = t[None, :] < q_lens[:, None]  # [R, Lq]
    q_off = torch.minimum(t[None, :], q_lens[:, None] - 1)  # padding repeats the last query
    first_rows = torch.tensor([starts[r] for r in requests], device=device)
    query_rows = first_rows[:, None] + q_off  # [R, Lq]
    first = torch.zeros_like(lens)
    if window_tokens is not None:
        first = (computed - window_tokens + 1).clamp(min=0)
    pages, slots, kv_pos, k_valid = _key_columns(block_table, reqs, first, lens, block_tokens)
    causal = bool((computed == 0).all()) and (
        window_tokens is None or int(lens.max()) <= window_tokens
    )
    mask = None
    if not causal:  # chunks after a cached prefix (or windowed): explicit masks
        q_pos = computed[:, None] + q_off  # [R, Lq]
        allowed = k_valid[:, None, :] & (kv_pos[:, None, :] <= q_pos[:, :, None])
        if window_tokens is not None:
            allowed &= kv_pos[:, None, :] > q_pos[:, :, None] - window_tokens
        mask = allowed[:, None]  # [R, 1, Lq, Lk]
    return PrefillBatch(
        query_rows=query_rows,
        out_src=torch.nonzero(q_valid.reshape(-1)).squeeze(1),
        out_rows=query_rows[q_valid],
        keys=KeyGather(pages, slots, mask),
    )
