"""What every recurrent op needs to know about a step: rows, state pages, wanted captures.

A step's rows are request-major (request ``r`` owns rows ``starts[r]..starts[r+1]``) and
its state lives in page ``pages[r]`` of each layer's view of the group. :class:`StateBatch`
holds that for one recurrent group and derives, once per step, the index tensors the ops
run on (decode rows, chunk layouts, conv windows); every layer of the group reuses them.

State capture (issues 12 and 16): a :class:`StateCaptures` asks for the state *after* given
rows, written into given pages of the same view during the same op call. A capture at a
request's last row is its final state; anywhere else the op computes the state inside its
chunk. The destination pages must not be any request's live page in the step.

Math runs in fp32; states move between the pages (any float dtype) and fp32 once on the
way in and once on the way out, through :data:`~hybridkv.ops.workspace.WORKSPACE` buffers.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from functools import cached_property
from typing import NamedTuple

import torch
from torch import Tensor

from hybridkv.ops.host_tensors import bool_tensor, long_tensor
from hybridkv.ops.row_copy import index_copy_rows, index_select_rows
from hybridkv.ops.state_layouts import (
    ChunkLayout,
    ConvBlock,
    StepRows,
    TokenLayout,
    build_chunk_layouts,
    build_conv_blocks,
    build_token_layouts,
)
from hybridkv.ops.workspace import WORKSPACE


class StateCaptures(NamedTuple):
    """States wanted inside a step: after row ``rows[i]``, into page ``pages[i]``."""

    rows: Tensor  # [S] int64, rows of the step's flat token axis
    pages: Tensor  # [S] int64, destination pages in the same layer view (not live pages)


class DecodeRows(NamedTuple):
    """The one-token requests of a step (decodes): they run the one-step form together."""

    rows: Tensor  # [B] int64 row of each
    pages: Tensor  # [B] int64 live state page of each
    fresh: Tensor | None  # [B] bool, True: start from zeros; None when every one carries a state


class StateBatch:
    """One step's requests on their state pages, for one recurrent group.

    Args:
        starts: R+1 row offsets, request-major.
        pages: [R] int64 live state page of each request.
        has_initial_state: per request; False starts from zeros (its page holds garbage
            and is overwritten).
        captures: states to write during the step, or None.
    """

    def __init__(
        self,
        starts: list[int],
        pages: Tensor,
        has_initial_state: list[bool],
        captures: StateCaptures | None = None,
    ) -> None:
        self.starts = starts
        self.pages = pages
        self.has_initial_state = has_initial_state
        self.captures = captures
        self._chunk_layouts: dict[tuple[int, int], list[ChunkLayout]] = {}
        self._conv_blocks: dict[tuple[int, int, bool], list[ConvBlock]] = {}
        self._token_layouts: dict[int, list[TokenLayout]] = {}
        if captures is not None:
            self._check_captures()

    @property
    def num_tokens(self) -> int:
        return self.starts[-1]

    @cached_property
    def lens(self) -> list[int]:
        return [b - a for a, b in zip(self.starts[:-1], self.starts[1:], strict=True)]

    @cached_property
    def step(self) -> StepRows:
        """The host facts the layouts are built from (captures as request and offset)."""
        rows: list[int] = []
        pages: list[int] = []
        if self.captures is not None:
            rows = [int(x) for x in self.captures.rows.tolist()]
            pages = [int(x) for x in self.captures.pages.tolist()]
        reqs = [bisect.bisect_right(self.starts, row) - 1 for row in rows]
        captures = [
            (r, row - self.starts[r], page) for r, row, page in zip(reqs, rows, pages, strict=True)
        ]
        return StepRows(self.starts, self.pages, self.has_initial_state, captures)

    def _check_captures(self) -> None:
        assert self.captures is not None
        rows, pages = self.captures.rows.tolist(), self.captures.pages.tolist()
        if len(rows) != len(pages):
            raise ValueError(f"{len(rows)} capture rows but {len(pages)} capture pages")
        if any(not 0 <= row < self.num_tokens for row in rows):
            raise ValueError(f"capture rows {rows} outside the step's {self.num_tokens} rows")
        if len(set(pages)) != len(pages):
            raise ValueError(f"capture pages {pages} repeat a page")
        if set(pages) & set(self.pages.tolist()):
            raise ValueError("a capture page is a live state page of the same step")

    @cached_property
    def fresh(self) -> Tensor | None:
        """[R] bool, True where a request starts from zeros; None when none does."""
        if all(self.has_initial_state):
            return None
        return bool_tensor((not f for f in self.has_initial_state), self.pages.device)

    @cached_property
    def decodes(self) -> DecodeRows | None:
        """The one-token requests, None when there are none."""
        singles = [r for r, n in enumerate(self.lens) if n == 1]
        if not singles:
            return None
        device = self.pages.device
        fresh = [not self.has_initial_state[r] for r in singles]
        return DecodeRows(
            rows=long_tensor((self.starts[r] for r in singles), device),
            pages=self.pages[long_tensor(singles, device)],
            fresh=bool_tensor(fresh, device) if any(fresh) else None,
        )

    @cached_property
    def final_captures(self) -> tuple[Tensor, Tensor] | None:
        """(live pages, capture pages) of the captures at a request's last row."""
        lens = self.lens
        hits = [(r, page) for r, pos, page in self.step.captures if pos == lens[r] - 1]
        if not hits:
            return None
        device = self.pages.device
        src = self.pages[long_tensor((r for r, _ in hits), device)]
        return src, long_tensor((page for _, page in hits), device)

    def interior_captures(self) -> list[tuple[int, int, int]]:
        """(request, offset of the row in the request's rows, capture page) of the captures
        before a request's last row, in the order given."""
        return self.step.interior_captures()

    def chunks(self, max_chunk_tokens: int, block_tokens: int) -> list[ChunkLayout]:
        """The multi-token requests cut into chunks, in blocks of about ``block_tokens``
        padded rows (empty when there are none); cached per arguments."""
        key = (max_chunk_tokens, block_tokens)
        if key not in self._chunk_layouts:
            multi = [r for r, n in enumerate(self.lens) if n > 1]
            self._chunk_layouts[key] = (
                build_chunk_layouts(self.step, multi, max_chunk_tokens, block_tokens)
                if multi
                else []
            )
        return self._chunk_layouts[key]

    def tokens(self, block_requests: int) -> list[TokenLayout]:
        """Every request, position-major, in blocks of ``block_requests`` (the token loop
        of scans without a chunked form); cached per block size."""
        if block_requests not in self._token_layouts:
            self._token_layouts[block_requests] = build_token_layouts(self.step, block_requests)
        return self._token_layouts[block_requests]

    def conv(
        self, kernel: int, block_tokens: int, multi_token_only: bool = False
    ) -> list[ConvBlock]:
        """Consecutive requests in blocks for a width-``kernel`` causal conv (the decodes
        left out with ``multi_token_only``); cached."""
        key = (kernel, block_tokens, multi_token_only)
        if key not in self._conv_blocks:
            self._conv_blocks[key] = build_conv_blocks(
                self.step, kernel, block_tokens, multi_token_only
            )
        return self._conv_blocks[key]

    def copy_final_captures(self, view: Tensor) -> None:
        """Captures at a request's last row: copy its final state page (after the op wrote it)."""
        if self.final_captures is not None:
            src, dst = self.final_captures
            index_copy_rows(view, dst, view.index_select(0, src))


def read_states(view: Tensor, pages: Tensor, fresh: Tensor | None, name: str) -> Tensor:
    """fp32 copy of ``view[pages]`` in workspace buffer ``name``; ``fresh`` rows zeroed.

    Zeroing uses masked_fill, never a product, so NaN garbage in a fresh page stays out.
    """
    shape = (pages.numel(), *view.shape[1:])
    states = WORKSPACE.get(name, shape, torch.float32, view.device)
    if view.dtype == torch.float32:
        index_select_rows(view, pages, states)
    else:
        raw = WORKSPACE.get(name + ".page", shape, view.dtype, view.device)
        index_select_rows(view, pages, raw)
        states.copy_(raw)
    if fresh is not None:
        states.masked_fill_(fresh.view(-1, *[1] * (states.dim() - 1)), 0.0)
    return states


def write_states(view: Tensor, pages: Tensor, states: Tensor, name: str) -> None:
    """``view[pages] = states``, cast to the page dtype through workspace buffer ``name``."""
    if view.dtype != states.dtype:
        raw = WORKSPACE.get(name + ".page", tuple(states.shape), view.dtype, view.device)
        raw.copy_(states)
        states = raw
    index_copy_rows(view, pages, states)


# (rows of one request, its fp32 initial state or None for zeros) -> (y, final state)
ScanFn = Callable[[slice, Tensor | None], tuple[Tensor, Tensor]]


def needs_grad(*tensors: Tensor | None) -> bool:
    """True when autograd records this call (training through the serving layers)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def scan_each_request(out: Tensor, view: Tensor, states: StateBatch, scan: ScanFn) -> Tensor:
    """The differentiable path: each request alone through the op's reference ``scan``,
    its final state written to its page; fills and returns ``out``.

    The varlen paths update states in place in workspace buffers, which autograd cannot
    follow; the demo model trains through the serving layers (``demo_model.train``), so an
    op whose inputs require grad runs this instead. Captures are an inference feature.
    """
    if states.captures is not None:
        raise NotImplementedError("state captures are not differentiable")
    for r, page in enumerate(states.pages.tolist()):
        rows = slice(states.starts[r], states.starts[r + 1])
        initial = view[page].float() if states.has_initial_state[r] else None
        out[rows], final = scan(rows, initial)
        view[page] = final.to(view.dtype)
    return out
