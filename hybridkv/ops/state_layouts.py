"""Index layouts that batch a step's ragged requests for the recurrent ops.

Built once per step and group (:class:`~hybridkv.ops.paged_state.StateBatch` caches them),
on the host from the step's :class:`StepRows`, then moved to the device: the ops run on
these tensors, with no Python loop per request.

``ChunkLayout`` (chunked forms: delta rule, SSD). Every multi-token request is cut into
chunks of ``chunk_tokens`` rows (the last one zero-padded) and the chunks are stacked
chunk-index-major, requests sorted by chunk count, so chunk ``i`` of every request still
running is one contiguous slice and their states are a prefix of the state batch::

    requests (sorted)  A: 3 chunks   B: 2 chunks   C: 1 chunk
    chunk ids          step 0: A0 B0 C0 | step 1: A1 B1 | step 2: A2
    states             step 0: S[:3]    | step 1: S[:2] | step 2: S[:1]

The requests of a step are split into blocks of a few hundred padded rows, each with its
own layout: one pass over a whole step's chunk tensors (16 MB each for 64 x 128 GDN rows)
streamed through memory and ran no faster than the per-request loop it replaced, while a
block's tensors stay in cache. ``TokenLayout`` (token loops: Mamba1) is the same with one
token per step. ``ConvBlock`` (causal conv) interleaves each request's carried inputs with
its rows in one axis.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch
from torch import Tensor

from hybridkv.ops.host_tensors import bool_tensor, long_matrix, long_tensor

PAD_MULTIPLE = 16  # chunk lengths are multiples of this (or the op's own maximum)
FUSED_PAD_ELEMENTS = 1 << 16  # ChunkLayout.pad_heads_first pads all tensors at once up to this


@dataclass(frozen=True, eq=False)
class StepRows:
    """What the layouts are built from: a step's row offsets, live pages, initial-state
    flags and captures, on the host (request ``r`` owns rows ``starts[r]..starts[r+1]``)."""

    starts: list[int]
    pages: Tensor  # [R] live state page of each request, on the ops' device
    has_initial_state: list[bool]
    captures: list[tuple[int, int, int]]  # (request, offset of the row in it, capture page)

    @property
    def lens(self) -> list[int]:
        return [b - a for a, b in itertools.pairwise(self.starts)]

    @property
    def num_tokens(self) -> int:
        return self.starts[-1]

    def interior_captures(self) -> list[tuple[int, int, int]]:
        """The captures before their request's last row (the others copy its final page)."""
        lens = self.lens
        return [(r, pos, page) for r, pos, page in self.captures if pos != lens[r] - 1]


class StepCaptures(NamedTuple):
    """Interior captures falling in one step of a chunk or token loop."""

    index: Tensor  # [c] position among the requests running at this step
    offset: Tensor  # [c] row within the chunk (always 0 for token loops)
    pages: Tensor  # [c] capture pages
    # every one is after its chunk's last row: the states the step carries to the next
    # chunk, copied instead of computed (a prefill that starts at a cache block boundary,
    # in chunks of a block, has all its snapshots there)
    at_chunk_end: bool = False


def choose_chunk_tokens(lens: list[int], max_chunk_tokens: int) -> int:
    """Chunk length for a step: the op's chunk, shortened when every request is shorter.

    A short chunk (a speculative window, a prompt tail) then pads to the next multiple of
    16 rather than to the op's full chunk; longer requests keep the op's chunk length.
    """
    longest = -(-max(lens) // PAD_MULTIPLE) * PAD_MULTIPLE
    return min(max_chunk_tokens, longest)


@dataclass(frozen=True, eq=False)
class ChunkLayout:
    """Multi-token requests in zero-padded chunks, stacked chunk-index-major (see module)."""

    chunk_tokens: int
    num_chunks: int
    rows: Tensor  # [Tp] the requests' rows of the flat token axis, in order
    slots: Tensor  # [Tp] slot of each row in the padded axis [num_chunks * chunk_tokens]
    steps: list[tuple[int, int]]  # step i: (first chunk id, number of requests running)
    pages: Tensor  # [Rp] live state page of each request, sorted
    fresh: Tensor | None  # [Rp] bool, sorted; None when every request carries a state
    captures: list[StepCaptures | None]  # per step

    @cached_property
    def strict_upper(self) -> Tensor:
        """[C, C] bool, True above the diagonal: the in-chunk entries a row never reads."""
        size = self.chunk_tokens
        return torch.ones(size, size, dtype=torch.bool, device=self.rows.device).triu(1)

    @cached_property
    def _chunk_and_offset(self) -> tuple[Tensor, Tensor]:
        """(chunk id, row within the chunk) of every padded slot: the same for every tensor
        a layer pads and every layer of the step."""
        return self.slots // self.chunk_tokens, self.slots % self.chunk_tokens

    @cached_property
    def chunk_ids(self) -> Tensor:
        """[num_chunks] the chunks' numbers (the packaged operands read their count from it:
        :mod:`hybridkv.ops.gated_delta_rule.packaged_chunks`)."""
        return torch.arange(self.num_chunks, device=self.rows.device)

    def pad_heads_first(self, xs: Sequence[Tensor]) -> list[Tensor]:
        """Each of ``xs`` (rows [T, H, ...], one dtype) as [num_chunks, H, chunk_tokens, ...],
        zeros between.

        Small steps (at most :data:`FUSED_PAD_ELEMENTS` padded values in all) pad every
        tensor with one gather and one scatter: a short prefill's chunk pads five GDN
        tensors, and five gathers and scatters of their own cost more than its matmuls
        (one 28-token prefill: ~55 us less per GDN layer under the profiler). Larger ones
        pad each tensor on its own: the shared path copies every value twice more (the
        concatenation, the final transposing copy), which long prefills would feel.
        """
        elements = sum(math.prod(x.shape[1:]) for x in xs) * self.rows.numel()
        if elements > FUSED_PAD_ELEMENTS:
            return [self._pad_one(x) for x in xs]
        return pad_together(xs, self.slots, self.num_chunks, self.chunk_tokens, self.rows)

    def _pad_one(self, x: Tensor) -> Tensor:
        out = x.new_zeros(self.num_chunks, x.shape[1], self.chunk_tokens, *x.shape[2:])
        chunk, pos = self._chunk_and_offset
        out[chunk, :, pos] = x.index_select(0, self.rows)
        return out

    def unpad(self, y: Tensor) -> Tensor:
        """[num_chunks * chunk_tokens, ...] -> [Tp, ...], one row per entry of ``rows``."""
        return y.index_select(0, self.slots)


def pad_together(
    xs: Sequence[Tensor],
    slots: Tensor,
    num_chunks: int,
    chunk_tokens: int,
    rows: Tensor | None = None,
) -> list[Tensor]:
    """Each of ``xs`` (rows [T, H, ...], one dtype) as [num_chunks, H, chunk_tokens, ...],
    zeros between: row ``i`` (of ``rows``, when given: picked first, one gather for all)
    at ``slots[i]`` of the padded axis, every tensor in one scatter
    (:meth:`ChunkLayout.pad_heads_first`; the packaged chunk operands run it too, on rows
    they picked and prepared themselves)."""
    flat = torch.cat([x.reshape(x.shape[0], -1) for x in xs], dim=1)  # [T, F]
    padded = flat.new_zeros(num_chunks * chunk_tokens, flat.shape[1])
    padded.index_copy_(0, slots, flat if rows is None else flat.index_select(0, rows))
    padded = padded.view(num_chunks, chunk_tokens, -1)
    out: list[Tensor] = []
    at = 0
    for x in xs:
        width = math.prod(x.shape[1:])
        part = padded[:, :, at : at + width].unflatten(2, x.shape[1:])  # [N, C, H, ...]
        out.append(part.movedim(1, 2).contiguous())  # [N, H, C, ...]
        at += width
    return out


def _step_captures(
    hits: list[tuple[int, int, int, int]],
    num_steps: int,
    device: torch.device,
    last_offset: int | None = None,
) -> list[StepCaptures | None]:
    """(step, index, offset, page) hits grouped by step, as tensors; ``last_offset``: the
    offset of a chunk's last row (None: token loops, no such distinction)."""
    per_step: list[list[tuple[int, int, int]]] = [[] for _ in range(num_steps)]
    for step, index, offset, page in hits:
        per_step[step].append((index, offset, page))
    return [
        StepCaptures(
            *(long_tensor(col, device) for col in zip(*items, strict=True)),
            at_chunk_end=last_offset is not None and all(o == last_offset for _, o, _ in items),
        )
        if items
        else None
        for items in per_step
    ]


def build_chunk_layouts(
    states: StepRows, reqs: list[int], max_chunk_tokens: int, block_tokens: int
) -> list[ChunkLayout]:
    """Requests ``reqs`` (each with two or more rows) in blocks of about ``block_tokens``
    padded rows, requests of similar chunk counts together; one layout per block."""
    lens = [states.lens[r] for r in reqs]
    size = choose_chunk_tokens(lens, max_chunk_tokens)
    num_chunks = [-(-n // size) for n in lens]
    order = sorted(range(len(reqs)), key=lambda i: -num_chunks[i])
    blocks: list[list[int]] = [[]]
    block_chunks = 0
    for i in order:
        if blocks[-1] and (block_chunks + num_chunks[i]) * size > block_tokens:
            blocks.append([])
            block_chunks = 0
        blocks[-1].append(reqs[i])
        block_chunks += num_chunks[i]
    captures: dict[int, list[tuple[int, int]]] = {}
    for r, pos, page in states.interior_captures():
        captures.setdefault(r, []).append((pos, page))
    return [_block_layout(states, block, max_chunk_tokens, captures) for block in blocks]


def _runs(
    lengths: list[int], row_starts: list[int], slot_starts: list[int], device: torch.device
) -> tuple[Tensor, Tensor]:
    """(rows, slots) [T] of consecutive runs: run ``i`` is ``lengths[i]`` rows from
    ``row_starts[i]``, placed at slots from ``slot_starts[i]``.

    Built from the runs (a request's chunks: a few per request) with four tensor ops, where
    deriving them per row took about twenty: on a step with one short prefill beside
    decodes, the layouts cost more than the chunk's arithmetic.
    """
    bases: list[list[int]] = [[], []]
    done = 0
    for length, row, slot in zip(lengths, row_starts, slot_starts, strict=True):
        bases[0].append(row - done)
        bases[1].append(slot - done)
        done += length
    counts = long_tensor(lengths, device)
    index = torch.repeat_interleave(long_matrix(bases, len(lengths), device), counts, dim=1)
    index += torch.arange(done, device=device)
    return index[0], index[1]


def _block_layout(
    states: StepRows,
    reqs: list[int],
    max_chunk_tokens: int,
    captures: dict[int, list[tuple[int, int]]],
) -> ChunkLayout:
    """The layout of one block of requests, its chunk length fitted to its own requests."""
    device = states.pages.device
    lens = [states.lens[r] for r in reqs]
    size = choose_chunk_tokens(lens, max_chunk_tokens)
    num_chunks = [-(-n // size) for n in lens]
    order = sorted(range(len(reqs)), key=lambda i: -num_chunks[i])  # stable: ties keep order
    rank = [0] * len(reqs)
    for position, i in enumerate(order):
        rank[i] = position
    running = [0] * num_chunks[order[0]]  # requests with more than c chunks, per step c
    for count in num_chunks:
        for step in range(count):
            running[step] += 1
    offsets = [0]
    for count in running[:-1]:
        offsets.append(offsets[-1] + count)

    lengths, row_starts, slot_starts = [], [], []
    for i, r in enumerate(reqs):
        for c in range(num_chunks[i]):
            lengths.append(min(size, lens[i] - c * size))
            row_starts.append(states.starts[r] + c * size)
            slot_starts.append((offsets[c] + rank[i]) * size)
    rows, slots = _runs(lengths, row_starts, slot_starts, device)
    hits = [
        (pos // size, rank[i], pos % size, page)
        for i, r in enumerate(reqs)
        for pos, page in captures.get(r, [])
    ]
    fresh = [not states.has_initial_state[reqs[i]] for i in order]
    return ChunkLayout(
        chunk_tokens=size,
        num_chunks=sum(num_chunks),
        rows=rows,
        slots=slots,
        steps=list(zip(offsets, running, strict=True)),
        pages=states.pages[long_tensor([reqs[i] for i in order], device)],
        fresh=bool_tensor(fresh, device) if any(fresh) else None,
        captures=_step_captures(hits, len(running), device, last_offset=size - 1),
    )


@dataclass(frozen=True, eq=False)
class TokenLayout:
    """A block of requests, position-major: step ``t`` runs token ``t`` of each request
    longer than ``t``, requests sorted by length so that they are a prefix of the block."""

    rows: Tensor  # [max_len, Rb] row of token t of sorted request s; row 0 past its end
    running: list[int]  # requests running at each step
    slots: Tensor  # [Tb] flat index into [max_len * Rb] of each real (step, request)
    slot_rows: Tensor  # [Tb] the row of each of those
    pages: Tensor  # [Rb] live pages, sorted
    fresh: Tensor | None  # [Rb] bool, sorted; None when every request carries a state
    captures: list[StepCaptures | None]  # per step


def build_token_layouts(states: StepRows, block_requests: int) -> list[TokenLayout]:
    """Every request of a step, longest first, in blocks of ``block_requests``."""
    order = sorted(range(len(states.lens)), key=lambda r: -states.lens[r])
    captures: dict[int, list[tuple[int, int]]] = {}
    for r, pos, page in states.interior_captures():
        captures.setdefault(r, []).append((pos, page))
    return [
        _token_block(states, order[i : i + block_requests], captures)
        for i in range(0, len(order), block_requests)
    ]


def _token_block(
    states: StepRows, reqs: list[int], captures: dict[int, list[tuple[int, int]]]
) -> TokenLayout:
    """The layout of requests ``reqs``, given longest first."""
    device = states.pages.device
    lens = long_tensor(states.lens[r] for r in reqs)
    running = (lens[None, :] > torch.arange(int(lens[0]))[:, None]).sum(1).tolist()
    steps = torch.arange(len(running))[:, None]  # [L, 1]
    first = long_tensor(states.starts[r] for r in reqs)  # [Rb]
    real = steps < lens  # [L, Rb]
    rows = torch.where(real, first + steps, 0)  # padding reads row 0 and is never used
    hits = [(pos, s, 0, page) for s, r in enumerate(reqs) for pos, page in captures.get(r, [])]
    fresh = [not states.has_initial_state[r] for r in reqs]
    return TokenLayout(
        rows=rows.to(device),
        running=running,
        slots=real.flatten().nonzero()[:, 0].to(device),
        slot_rows=rows[real].to(device),
        pages=states.pages[long_tensor(reqs, device)],
        fresh=bool_tensor(fresh, device) if any(fresh) else None,
        captures=_step_captures(hits, len(running), device),
    )


@dataclass(frozen=True, eq=False)
class ConvBlock:
    """Consecutive requests of a step in one axis holding, per request, its K-1 carried
    inputs then its rows::

        ext = [ state_r (K-1) | rows of request r | state_r+1 (K-1) | rows of r+1 | ... ]

    so the conv window of every row is the K ext rows ending at it, and every state (final
    or captured) is the K-1 ext rows ending at its row. Index tensors are block-relative.
    """

    reqs: slice  # the block's requests
    rows: slice  # their rows of the flat token axis
    ext_tokens: int
    x_rows: Tensor  # [Tb] ext row of each row
    state_rows: Tensor  # [Rb * (K-1)] ext rows of the carried states, request-major
    final_rows: Tensor  # [Rb * (K-1)] ext rows of the final states
    capture_rows: Tensor | None  # [Sb * (K-1)] ext rows of the captured states
    capture_pages: Tensor | None  # [Sb]

    @cached_property
    def ext_ids(self) -> Tensor:
        """[ext_tokens] the axis' rows (the packaged conv reads its length from it:
        :mod:`hybridkv.ops.causal_conv1d.packaged`)."""
        return torch.arange(self.ext_tokens, device=self.x_rows.device)


def build_conv_blocks(
    states: StepRows, kernel: int, block_tokens: int, multi_token_only: bool = False
) -> list[ConvBlock]:
    """Consecutive requests in blocks of about ``block_tokens`` ext rows; with
    ``multi_token_only``, the one-token requests (decodes) are left out (a block never
    spans one: its requests stay consecutive)."""
    keep = kernel - 1
    bounds: list[tuple[int, int]] = []  # [lo, hi) of each block
    lo, size = None, 0
    for r, n in enumerate(states.lens):
        if multi_token_only and n == 1:
            if lo is not None:
                bounds.append((lo, r))
            lo, size = None, 0
            continue
        if lo is not None and size and size + n + keep > block_tokens:
            bounds.append((lo, r))
            lo, size = None, 0
        if lo is None:
            lo = r
        size += n + keep
    if lo is not None:
        bounds.append((lo, len(states.lens)))
    blocks = []
    for lo, hi in bounds:
        wanted = [
            (states.starts[r] + pos, page) for r, pos, page in states.captures if lo <= r < hi
        ]
        blocks.append(_conv_block(states, keep, lo, hi, wanted))
    return blocks


def _conv_block(
    states: StepRows, keep: int, lo: int, hi: int, captures: list[tuple[int, int]]
) -> ConvBlock:
    device = states.pages.device
    first_row = states.starts[lo]
    lens = states.lens[lo:hi]
    # request j of the block: its carried inputs at ext rows first_j .. first_j + K-2, its
    # rows right after; first_j = (its first row - first_row) + j * (K-1)
    firsts = [states.starts[lo + j] - first_row + j * keep for j in range(hi - lo)]
    x_rows, _ = _runs(lens, [f + keep for f in firsts], [0] * len(lens), device)
    ends = [f + keep + n for f, n in zip(firsts, lens, strict=True)]  # past each last row
    capture_rows = capture_pages = None
    if captures:
        wanted = []  # ext row of each captured row
        for row, _ in captures:
            j = bisect.bisect_right(states.starts, row, lo, hi) - 1 - lo
            wanted.append(row - states.starts[lo + j] + firsts[j] + keep)
        capture_rows = long_tensor((w - keep + 1 + t for w in wanted for t in range(keep)), device)
        capture_pages = long_tensor((page for _, page in captures), device)
    return ConvBlock(
        reqs=slice(lo, hi),
        rows=slice(first_row, states.starts[hi]),
        ext_tokens=sum(lens) + (hi - lo) * keep,
        x_rows=x_rows,
        state_rows=long_tensor((f + t for f in firsts for t in range(keep)), device),
        final_rows=long_tensor((e - keep + t for e in ends for t in range(keep)), device),
        capture_rows=capture_rows,
        capture_pages=capture_pages,
    )
