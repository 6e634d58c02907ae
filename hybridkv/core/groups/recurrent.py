"""Recurrent state: one live page per request, plus snapshots at block-aligned positions.

A snapshot at position L is a copy of the live state after exactly L tokens, cached
under the hash of the block that ends at L (the same chain hash the attention groups
use, in this group's own pool). A request resumes only at an exact snapshot: the
state has no per-token history to cut back to.

Life of a snapshot::

    reserve_snapshot   page taken before the step (may fail: snapshots are optional)
    (runner copies live -> page after the forward)
    cache              page published under hash[L / block - 1], held by the request
    retention          superseded snapshots the policy does not keep are dropped at once
    free               the request's reference goes; the page stays cached (LRU)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hybridkv.core.groups.base import GroupManager, ReqId
from hybridkv.core.hashing import BlockHash
from hybridkv.core.pool import PageId


@dataclass(slots=True)
class _ReqState:
    live: PageId | None = None
    snapshots: dict[int, PageId] = field(default_factory=dict)  # position → page
    created: set[int] = field(default_factory=set)  # positions this request snapshotted
    pending: tuple[int, PageId] | None = None  # (position, page) to publish after the step


class RecurrentGroup(GroupManager):
    """Live states and snapshots of one recurrent group. Caching off: live pages only."""

    def __init__(self, *args: object, caching: bool = True, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.caching = caching
        self.reqs: dict[ReqId, _ReqState] = {}
        self.num_snapshots_taken = 0
        self.num_snapshots_dropped = 0

    def longest_hit(self, hashes: Sequence[BlockHash], max_tokens: int) -> int:
        if not self.caching:
            return 0
        for num_blocks in range(min(len(hashes), max_tokens // self.block_tokens), 0, -1):
            if self.pool.lookup(hashes[num_blocks - 1]) is not None:
                return num_blocks * self.block_tokens
        return 0

    def snapshot_at(self, hashes: Sequence[BlockHash], num_tokens: int) -> PageId | None:
        if num_tokens == 0:
            return None
        return self.pool.lookup(hashes[num_tokens // self.block_tokens - 1])

    def take_hit(self, req_id: ReqId, hashes: Sequence[BlockHash], num_tokens: int) -> None:
        state = self.reqs.setdefault(req_id, _ReqState())
        page = self.snapshot_at(hashes, num_tokens)
        if page is not None:
            self.pool.touch(page, self.allocator.clock)
            state.snapshots[num_tokens] = page

    def allocate(self, req_id: ReqId, num_total_tokens: int) -> list[PageId] | None:
        state = self.reqs.setdefault(req_id, _ReqState())
        if state.live is not None:
            return []
        pages = self._allocate_pages(1)
        if pages is not None:
            state.live = pages[0]
        return pages

    def live_page(self, req_id: ReqId) -> PageId:
        live = self.reqs[req_id].live
        assert live is not None, f"request {req_id} has no live state"
        return live

    def reserve_snapshot(self, req_id: ReqId, position: int) -> PageId | None:
        """A page for the snapshot the runner takes after this step, or None if none fits."""
        state = self.reqs[req_id]
        if state.pending is not None or position in state.snapshots:
            return None
        pages = self._allocate_pages(1)
        if pages is None:
            return None
        state.pending = (position, pages[0])
        return pages[0]

    def cancel_snapshot(self, req_id: ReqId) -> None:
        state = self.reqs[req_id]
        if state.pending is not None:
            self.pool.release(state.pending[1], self.allocator.clock)
            state.pending = None

    def cache(self, req_id: ReqId, hashes: Sequence[BlockHash], num_computed: int) -> None:
        state = self.reqs[req_id]
        if state.pending is None or state.pending[0] > num_computed:
            return
        position, page = state.pending
        state.pending = None
        block_hash = hashes[position // self.block_tokens - 1]
        if self.pool.cache(page, block_hash, saved_tokens=position):
            state.snapshots[position] = page
            state.created.add(position)
            self.num_snapshots_taken += 1
        else:  # another request published the same prefix first
            self.pool.release(page, self.allocator.clock)

    def apply_retention(self, req_id: ReqId, keep: Callable[[int], bool]) -> None:
        """Drop this request's superseded snapshots that ``keep`` rejects (the newest stays)."""
        state = self.reqs[req_id]
        if len(state.created) < 2:
            return
        newest = max(state.created)
        for position in sorted(state.created):
            if position == newest or keep(position):
                continue
            page = state.snapshots.pop(position)
            state.created.discard(position)
            if self.pool.ref_count(page) == 1:  # nobody else resumed from it
                self.pool.uncache(page)
            self.pool.release(page, self.allocator.clock)
            self.num_snapshots_dropped += 1

    def free(self, req_id: ReqId) -> None:
        state = self.reqs.pop(req_id, None)
        if state is None:
            return
        clock = self.allocator.clock
        if state.pending is not None:
            self.pool.release(state.pending[1], clock)
        for position in sorted(state.snapshots):  # deeper snapshots end newer in the LRU
            self.pool.release(state.snapshots[position], clock)
        if state.live is not None:
            self.pool.release(state.live, clock)

    def check_integrity(self) -> None:
        held: dict[PageId, int] = {}
        for state in self.reqs.values():
            pages = list(state.snapshots.values())
            pages += [p for p in (state.live,) if p is not None]
            pages += [state.pending[1]] if state.pending else []
            for page in pages:
                held[page] = held.get(page, 0) + 1
            assert state.created <= set(state.snapshots)
        assert held == self.pool.referenced_pages(), "request states disagree with ref counts"
