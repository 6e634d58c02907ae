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

Key columns are page-aligned: column ``c`` of a request is position ``base + c``, ``base``
the start of the page holding its first needed key (0 without a sliding window), so the
columns of page ``j`` are slots ``0..B-1`` of the request's ``j``-th needed page and no
column needs a division to find its slot (:class:`KeyGather`).

Padding never reads a slot nobody wrote: a padding key column (before the first needed key,
past the last one, or past the request's last page) re-reads the request's first needed
key, a padding query row repeats its last query row; masks remove the columns and the
padded rows are dropped. A NaN in an unwritten slot would survive masking
(``0 * NaN = NaN`` in the value product, ``NaN + -inf = NaN`` in an additive mask), so this
matters in a NaN-poisoned arena.

Row selections that are one contiguous range of the step are kept as slices (views, and a
copy instead of an index_put to write the output back); the plan is a few dozen tensor ops
on the tests' small steps, where each op's fixed cost is most of its time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from itertools import pairwise

import torch
from torch import Tensor

from hybridkv.ops.host_tensors import long_tensor

Rows = Tensor | slice  # rows of the step: an index tensor, or a slice when contiguous


@dataclass(frozen=True, slots=True)
class KeyGather:
    """Each request's keys as ``Lk`` page-aligned columns (see the module docstring).

    ``pages[r, j]`` is the page of columns ``j*B .. j*B+B-1`` of request ``r`` (slots
    ``0..B-1``); past the request's last needed page it repeats that page. ``valid[r, c]``
    says whether column ``c`` is a key the request needs; the others re-read column
    ``first[r]``, its first needed key. The index tensors a gather needs are derived from
    these once per step and cache layout (:meth:`index`) and shared by the group's layers.
    """

    pages: Tensor  # [n, P] int64
    valid: Tensor  # [n, Lk] bool, Lk <= P * B
    first: Tensor  # [n, 1] int64 column of each request's first needed key
    block_tokens: int
    mask: Tensor | None  # bool, broadcastable to SDPA's [n, heads, Lq, Lk]; None: causal
    _index: dict[tuple[int, tuple[int, ...], int], Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _bias: dict[torch.dtype, Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _causal: dict[tuple[torch.dtype, int], Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def width(self) -> int:
        return int(self.valid.shape[1])

    def index(self, per_page: int, offsets: tuple[int, ...] = (0,), heads: int = 1) -> Tensor:
        """Flat row index of a gather of ``len(offsets)`` tensors at once, cached (every
        layer of the group asks the same).

        The tensors are seen as one of rows (batched._row_view): slot ``b`` of page ``p``
        is row ``p * per_page + b``, or with ``heads`` rows per slot, head ``h`` of it is
        row ``(p * per_page + b) * heads + h``; tensor ``i``'s rows start ``offsets[i]``
        rows in (a layer's K and V in one page). The index is [len(offsets), n, heads, Lk]
        (head-major); padding columns re-read the request's first needed key. Three ops:
        the rows of every page-column from a constant per (offsets, heads, B), then the
        padding replaced."""
        key = (per_page, offsets, heads)
        index = self._index.get(key)
        if index is None:
            n = self.pages.shape[0]
            within = _within_page(offsets, heads, self.block_tokens, self.pages.device)
            pages = self.pages[None, :, None, :, None]  # [1, n, 1, P, 1]
            rows = torch.add(within, pages, alpha=per_page * heads)  # [O, n, H, P, B]
            rows = rows.view(len(offsets), n, heads, -1)[..., : self.width]
            first = rows.gather(3, self.first.view(1, n, 1, 1).expand(len(offsets), n, heads, 1))
            index = torch.where(self.valid[None, :, None, :], rows, first).view(-1)
            self._index[key] = index
        return index

    def pages_slots(self) -> tuple[Tensor, Tensor]:
        """([n, Lk] page, [n, Lk] slot) of each column (the plain indexing path)."""
        rows = self.index(self.block_tokens).view(self.valid.shape)
        return rows // self.block_tokens, rows % self.block_tokens

    def bias(self, dtype: torch.dtype) -> Tensor | None:
        """The mask as an additive one in ``dtype`` (0 where kept, -inf where dropped), as
        SDPA would convert it at every call; None for the causal rule."""
        if self.mask is None:
            return None
        bias = self._bias.get(dtype)
        if bias is None:
            zero = torch.zeros((), dtype=dtype, device=self.mask.device)
            bias = self._bias[dtype] = torch.where(self.mask, zero, float("-inf"))
        return bias

    def causal_bias(self, dtype: torch.dtype, q_len: int) -> Tensor:
        """The causal rule of chunks that start at position 0 as an additive mask [n, 1,
        Lq, Lk] in ``dtype`` (an expanded view of one [Lq, Lk] triangle: query ``t`` keeps
        columns ``0..t``), for attention that takes masks only; built once per step."""
        triangle = self._causal.get((dtype, q_len))
        if triangle is None:
            rows = torch.arange(q_len, device=self.valid.device)[:, None]
            cols = torch.arange(self.width, device=self.valid.device)[None]
            zero = torch.zeros((), dtype=dtype, device=self.valid.device)
            triangle = self._causal[dtype, q_len] = torch.where(cols <= rows, zero, float("-inf"))
        return triangle.expand(self.valid.shape[0], 1, q_len, self.width)


@functools.cache
def _within_page(
    offsets: tuple[int, ...], heads: int, block_tokens: int, device: torch.device
) -> Tensor:
    """[O, 1, H, 1, B]: ``b * heads + h + offsets[o]``, the row of head ``h`` of slot ``b``
    of tensor ``o`` relative to its page's first row (:meth:`KeyGather.index`)."""
    slot = torch.arange(block_tokens, device=device) * heads
    head = torch.arange(heads, device=device)
    offset = torch.tensor(offsets, device=device)
    within = offset[:, None, None] + head[:, None] + slot  # [O, H, B]
    return within[:, None, :, None, :]


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    rows: Rows  # [N] row of each one-token request
    keys: KeyGather  # mask [N, 1, 1, Lk]
    all_rows: bool  # every row of the step is one of these decodes, in order


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    query_rows: Rows  # [R, Lq] row of the step each padded query position reads; a slice
    # when R == 1 (then Lq is the chunk's length and no row is padding)
    out_src: Tensor | None  # [Tp] flat padded position (r * Lq + t) of each real query;
    # None when no query position is padding (every chunk Lq long)
    out_rows: Rows  # [Tp] its row in the step
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
    decode_key_multiple: int = 1,
) -> AttentionPlan:
    """The index tensors of one step for one attention group.

    Args:
        block_table: [R, max_blocks] int64 page ids (-1 where never read).
        starts: R+1 row offsets; seq_lens: R cached lengths after the step.
        positions: [T] absolute position of every row.
        block_tokens: tokens per page; window_tokens: sliding window or None.
        decode_key_multiple: the decodes' key columns rounded up to a multiple of this
            (masked padding), so that successive steps give their matmuls the same shapes
            (see batched.decode_key_multiple).
    """
    device = positions.device
    lens = [b - a for a, b in pairwise(starts)]
    decodes = [r for r, n in enumerate(lens) if n == 1]
    prefills = [r for r, n in enumerate(lens) if n > 1]
    if len(decodes) == len(lens):  # row r is request r
        token_request = torch.arange(len(lens), device=device)
    else:
        token_request = torch.repeat_interleave(long_tensor(lens, device), output_size=starts[-1])
    return AttentionPlan(
        write_pages=block_table[token_request, positions // block_tokens],
        write_slots=positions % block_tokens,
        decode=_decode_batch(
            block_table, starts, seq_lens, decodes, block_tokens, window_tokens, decode_key_multiple
        )
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


def _rows(values: list[int], device: torch.device) -> Rows:
    """``values`` as a slice when they are consecutive, else as an index tensor."""
    if values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return long_tensor(values, device)


def _key_columns(
    block_table: Tensor,
    requests: list[int],
    firsts: list[int],
    seq_lens: list[int],
    block_tokens: int,
    extra: list[int],
    width_multiple: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple[Tensor, ...]]:
    """(pages [n, P], valid [n, Lk], first [n, 1]) of a :class:`KeyGather` of keys
    ``[first, seq_len)`` of each request, column 0 at position ``first // B * B``; the
    column numbers [Lk]; and ``extra``, n values per row, as [n, 1] tensors made in the
    same host-to-device copy. ``Lk`` is rounded up to a multiple of ``width_multiple``
    (the extra columns are padding, not valid)."""
    device = block_table.device
    first_page = [f // block_tokens for f in firsts]
    last_page = [(s - 1) // block_tokens for s in seq_lens]
    last_col = [s - 1 - p * block_tokens for s, p in zip(seq_lens, first_page, strict=True)]
    first_col = [f - p * block_tokens for f, p in zip(firsts, first_page, strict=True)]
    flat = first_page + last_page + first_col + last_col + extra
    bounds = long_tensor(flat, device).view(-1, len(requests), 1).unbind(0)  # [n, 1] each
    windowed = any(firsts)
    width = -(-(max(last_col) + 1) // width_multiple) * width_multiple
    num_pages = max(b - a for a, b in zip(first_page, last_page, strict=True)) + 1
    num_pages = max(num_pages, -(-width // block_tokens))  # the padding columns' pages too
    page = torch.arange(num_pages, device=device)
    if windowed:
        page = page + bounds[0]
    page = torch.minimum(page, bounds[1])  # [n, P]; past its last page: the last
    pages = block_table[_rows(requests, device)].gather(1, page)
    col = torch.arange(width, device=device)
    valid = col <= bounds[3]  # [n, Lk]
    if windowed:
        valid &= col >= bounds[2]
    return pages, valid, bounds[2], col, bounds[4:]


def _first_needed(positions: list[int], window_tokens: int | None) -> list[int]:
    """The first key position each request needs, its first query at ``positions``."""
    if window_tokens is None:
        return [0] * len(positions)
    return [max(0, p - window_tokens + 1) for p in positions]


def _decode_batch(
    block_table: Tensor,
    starts: list[int],
    seq_lens: list[int],
    requests: list[int],
    block_tokens: int,
    window_tokens: int | None,
    key_multiple: int,
) -> DecodeBatch:
    device = block_table.device
    lens = [seq_lens[r] for r in requests]
    firsts = _first_needed([n - 1 for n in lens], window_tokens)  # sees (p - window, p]
    pages, valid, first, _, _ = _key_columns(
        block_table, requests, firsts, lens, block_tokens, [], key_multiple
    )
    mask = valid.view(len(requests), 1, 1, -1)
    rows = [starts[r] for r in requests]
    return DecodeBatch(
        rows=_rows(rows, device),
        keys=KeyGather(pages, valid, first, block_tokens, mask),
        all_rows=len(rows) == starts[-1] == rows[-1] + 1,  # rows 0..T-1
    )


def _prefill_batch(
    block_table: Tensor,
    starts: list[int],
    seq_lens: list[int],
    requests: list[int],
    block_tokens: int,
    window_tokens: int | None,
) -> PrefillBatch:
    device = block_table.device
    q_lens = [starts[r + 1] - starts[r] for r in requests]
    lens = [seq_lens[r] for r in requests]
    computed = [n - q for n, q in zip(lens, q_lens, strict=True)]  # first query's position
    firsts = _first_needed(computed, window_tokens)
    first_rows = [starts[r] for r in requests]
    # the column of each chunk's first query: its position less the request's column 0
    shifts = [c - f // block_tokens * block_tokens for c, f in zip(computed, firsts, strict=True)]
    pages, valid, first, col, (q_last, first_row, shift) = _key_columns(
        block_table,
        requests,
        firsts,
        lens,
        block_tokens,
        [q - 1 for q in q_lens] + first_rows + shifts,
    )
    max_q = max(q_lens)
    t = torch.arange(max_q, device=device)  # [Lq]
    ragged = min(q_lens) < max_q
    q_off = torch.minimum(t, q_last) if ragged else t  # padding repeats the last query
    query_rows: Rows
    out_rows: Rows
    out_src = None
    if len(requests) == 1:
        query_rows = out_rows = slice(first_rows[0], first_rows[0] + max_q)
    else:
        query_rows = first_row + q_off  # [R, Lq]
        if ragged:
            q_valid = (t <= q_last).view(-1)  # [R * Lq]
            out_src = torch.nonzero(q_valid).squeeze(1)
            out_rows = query_rows.view(-1)[q_valid]
        elif requests == list(range(requests[0], requests[0] + len(requests))):
            out_rows = slice(first_rows[0], first_rows[-1] + max_q)
        else:
            out_rows = query_rows.view(-1)
    mask = None
    if any(computed) or (window_tokens is not None and max(lens) > window_tokens):
        # chunks after a cached prefix (or windowed): explicit masks; else SDPA's own
        # causal rule, every chunk starting at position 0
        q_col = (q_off + shift)[:, :, None]  # [R, Lq, 1]
        allowed = col <= q_col  # [R, Lq, Lk]; only valid columns, by construction
        if window_tokens is not None:
            allowed &= col > q_col - window_tokens
        mask = allowed[:, None]
    return PrefillBatch(
        query_rows=query_rows,
        out_src=out_src,
        out_rows=out_rows,
        keys=KeyGather(pages, valid, first, block_tokens, mask),
    )
