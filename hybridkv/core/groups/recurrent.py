"""Recurrent state: one live page per request, plus snapshots at block-aligned positions.

A snapshot at position L is a copy of the live state after exactly L tokens, cached
under the hash of the block that ends at L (the same chain hash the attention groups
use, in this group's own pool). A request resumes only at an exact snapshot: the
state has no per-token history to cut back to.

Life of a snapshot::

    reserve_snapshot   page taken before the step (may fail: snapshots are optional);
                       with ``reuse``, the page of the request's newest snapshot when
                       retention would drop that one anyway (rewritten in place); a step
                       may reserve several positions (each block boundary due in its chunk)
    (the runner has the state after exactly L tokens written into the page during the
     forward, or copies the live page after it when L is the chunk's end)
    cache              page published under hash[L / block - 1], held by the request
    retention          superseded snapshots the policy does not keep are dropped at once;
                       kept ones are released to the cache (``release``) or stay held
    free               the request's reference goes; the page stays cached (LRU)

Why a request holds only its newest snapshot (``release``): a state page is as big as
thousands of tokens of KV, and a pinned page can never be evicted. Holding the prompt
end and the hit snapshot until the request ends made a decoding request pin ~2.7 state
pages (docs/simulator.md); released, they stay hits for other requests and give way
under pressure like any cached page.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hybridkv.core.allocator import PageAllocator
from hybridkv.core.config import CacheConfig
from hybridkv.core.groups.base import CachedRequest, GroupManager
from hybridkv.core.hashing import BlockHash
from hybridkv.core.ids import PageId, ReqId
from hybridkv.core.spec import GroupSpec


@dataclass(slots=True)
class _Pending:
    """A snapshot reserved for this step, published by the next :meth:`RecurrentGroup.cache`."""

    position: int
    page: PageId
    generated: bool  # covers sampled tokens
    recycled: tuple[int, BlockHash] | None = None  # the snapshot whose page this reuses
    was_parked: bool = False  # the recycled snapshot was parked, not held


@dataclass(frozen=True, slots=True)
class _Parked:
    """The request's newest snapshot, released to the cache while the request runs."""

    position: int
    page: PageId
    block_hash: BlockHash


@dataclass(slots=True)
class _ReqState:
    live: PageId | None = None
    snapshots: dict[int, PageId] = field(default_factory=dict)  # position → page
    created: set[int] = field(default_factory=set)  # positions this request snapshotted
    pending: list[_Pending] = field(default_factory=list)  # ascending positions
    parked: _Parked | None = None  # its newest snapshot, not held (release_newest)
    scratch: dict[int, PageId] = field(default_factory=dict)  # position → page, one step


class RecurrentGroup(GroupManager):
    """Live states and snapshots of one recurrent group. Caching off: live pages only."""

    def __init__(self, group: GroupSpec, allocator: PageAllocator, config: CacheConfig) -> None:
        super().__init__(group, allocator, config)
        self.caching = config.enable_prefix_caching and not group.is_draft
        self.policy = config.checkpoint
        self.reqs: dict[ReqId, _ReqState] = {}
        self.num_snapshots_taken = 0
        # snapshot page → its hash, for snapshots that cover sampled tokens (a page that
        # was evicted and reused since no longer matches its entry)
        self._generated: dict[PageId, BlockHash] = {}
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

    def is_generated(self, page: PageId) -> bool:
        """Whether this cached snapshot covers tokens its creator sampled (a turn's end)."""
        block_hash = self._generated.get(page)
        return block_hash is not None and block_hash == self.pool.hash_of(page)

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

    def undo(self, req_id: ReqId, pages: Sequence[PageId]) -> None:
        state = self.reqs[req_id]
        for page in pages:
            if page == state.live:
                state.live = None
            self.pool.release(page, self.allocator.clock)

    def live_page(self, req_id: ReqId) -> PageId:
        live = self.reqs[req_id].live
        assert live is not None, f"request {req_id} has no live state"
        return live

    def reserve_snapshot(
        self,
        req_id: ReqId,
        position: int,
        reusable: Callable[[int], bool] | None = None,
        generated: bool = False,
    ) -> PageId | None:
        """A page for the state after ``position`` tokens in this step, or None if none fits.

        ``reusable(q)``: the request's newest snapshot at q may be overwritten, because
        retention drops it once a newer one exists. Its page is then taken back (its hash
        forgotten at once: from now on it may hold the new state) instead of a new page,
        so a decode boundary costs a copy but no allocation and no eviction. Only the
        first reservation of a step may reuse a page.
        """
        state = self.reqs[req_id]
        if position in state.snapshots or any(p.position == position for p in state.pending):
            return None
        if reusable is not None and not state.pending:
            page = self._reuse_newest(state, position, reusable, generated)
            if page is not None:
                return page
        pages = self._allocate_pages(1)
        if pages is None:
            return None
        state.pending.append(_Pending(position, pages[0], generated))
        return pages[0]

    def _reuse_newest(
        self, state: _ReqState, position: int, reusable: Callable[[int], bool], generated: bool
    ) -> PageId | None:
        """Take back the page of the request's newest snapshot for ``position`` (its hash
        is forgotten), if retention drops that snapshot anyway and nobody resumed from it."""
        parked = state.parked if self._is_parked(state) else None
        previous = max(state.created, default=None)
        if parked is not None:
            if not (
                parked.position < position
                and reusable(parked.position)
                and self.pool.ref_count(parked.page) == 0
            ):
                return None
            page, previous = parked.page, parked.position
            self.pool.touch(page, self.allocator.clock)
            state.parked = None
        elif (
            previous is not None
            and previous < position
            and reusable(previous)
            and self.pool.ref_count(state.snapshots[previous]) == 1  # nobody resumed from it
        ):
            page = state.snapshots.pop(previous)
            state.created.discard(previous)
        else:
            return None
        block_hash = self.pool.hash_of(page)
        assert block_hash is not None
        self.pool.uncache(page)
        recycled = (previous, block_hash)
        state.pending.append(_Pending(position, page, generated, recycled, parked is not None))
        self.num_snapshots_dropped += 1
        return page

    def _is_parked(self, state: _ReqState) -> bool:
        """The parked snapshot is still cached under its hash (not evicted since)."""
        parked = state.parked
        return parked is not None and self.pool.hash_of(parked.page) == parked.block_hash

    def reserve_scratch(self, req_id: ReqId, positions: Sequence[int]) -> list[PageId] | None:
        """Pages for a speculative step: each receives the state after ``positions[i]``
        tokens during the forward; None (nothing taken) if they do not all fit.

        Held until the step's :meth:`settle`. A draft group asks for one page, the draft's
        working state while it proposes (its own live state stays at its last real token).
        """
        state = self.reqs[req_id]
        assert not state.scratch, f"request {req_id} already holds scratch states"
        pages = self._allocate_pages(len(positions))
        if pages is not None:
            state.scratch = dict(zip(positions, pages, strict=True))
        return pages

    def cancel_scratch(self, req_id: ReqId) -> None:
        """Give the scratch pages back (the allocation they belonged to failed)."""
        state = self.reqs[req_id]
        for page in state.scratch.values():
            self.pool.release(page, self.allocator.clock)
        state.scratch = {}

    def settle(self, req_id: ReqId, num_computed: int) -> None:
        """End a step whose tokens were kept up to ``num_computed``: the live state becomes
        the state after exactly that many tokens, every scratch page goes back.

        After a speculative step that kept fewer tokens than it computed, the state after
        the last kept token is in the scratch page of that position: the page ids swap
        (the old live page, holding the state after a rejected token, is released), so a
        rollback costs no copy. A snapshot reserved past ``num_computed`` holds a rejected
        position's state: it is dropped (a reused page's old snapshot is gone already).
        A draft group's scratch is only ever its working page: never swapped in.
        """
        state = self.reqs.get(req_id)
        if state is None:
            return
        clock = self.allocator.clock
        accepted = None if self.group.is_draft else state.scratch.pop(num_computed, None)
        if accepted is not None:
            assert state.live is not None
            self.pool.release(state.live, clock)
            state.live = accepted
        for page in state.scratch.values():
            self.pool.release(page, clock)
        state.scratch = {}
        for pending in [p for p in state.pending if p.position > num_computed]:
            self.pool.release(pending.page, clock)  # unhashed (a reused page too): free
            state.pending.remove(pending)

    def cancel_snapshot(self, req_id: ReqId, position: int) -> None:
        """Undo :meth:`reserve_snapshot` at ``position`` (no copy has run): a reused page
        is re-cached."""
        state = self.reqs[req_id]
        found = [p for p in state.pending if p.position == position]
        if not found:
            return
        pending = found[0]
        state.pending.remove(pending)
        if pending.recycled is not None:
            previous, block_hash = pending.recycled
            cached = self.pool.cache(pending.page, block_hash, saved_tokens=previous)
            assert cached, "the hash of a reused snapshot cannot be taken while it is pending"
            self.num_snapshots_dropped -= 1
            if pending.was_parked:  # parked again at its recency, as park_newest does
                self.pool.release(pending.page, self.allocator.clock)
                state.parked = _Parked(previous, pending.page, block_hash)
                return
            state.snapshots[previous] = pending.page
            state.created.add(previous)
            return
        self.pool.release(pending.page, self.allocator.clock)

    def cache(self, req_id: ReqId, req: CachedRequest) -> None:
        """Publish the snapshots the step took, then apply retention."""
        self._publish_pending(req_id, req.hashes, req.num_computed)
        policy, block_tokens = self.policy, self.block_tokens

        def keep(position: int) -> bool:
            return policy.keep(position, req.prompt_len, block_tokens, req.branch_tokens)

        self.apply_retention(
            req_id,
            keep,
            policy.release_superseded,
            policy.demote_superseded,
            policy.release_generated_hit,
            shared=req.branch_tokens,
        )
        if policy.release_newest:
            self.park_newest(req_id)

    def park_newest(self, req_id: ReqId) -> None:
        """Release the request's newest snapshot to the cache ("park" it) at its recency.

        A running request then pins only its live state: under pressure its newest
        snapshot can be evicted like any cached page (LRU; it is refreshed at every
        boundary, when its page is rewritten in place if it is still cached), where a
        held one would have kept a new request out or pushed a finished request's turn
        end out of the cache. :meth:`free` moves it to the back of the queue, where the
        request's next turn finds it.
        """
        state = self.reqs[req_id]
        if not state.created:
            return
        position = max(state.created)
        page = state.snapshots.pop(position)
        state.created.discard(position)
        block_hash = self.pool.hash_of(page)
        assert block_hash is not None
        self.pool.release(page, self.allocator.clock)
        state.parked = _Parked(position, page, block_hash)

    def _publish_pending(
        self, req_id: ReqId, hashes: Sequence[BlockHash], num_computed: int
    ) -> None:
        state = self.reqs[req_id]
        due = [p for p in state.pending if p.position <= num_computed]
        state.pending = [p for p in state.pending if p.position > num_computed]
        for pending in due:
            position, page = pending.position, pending.page
            block_hash = hashes[position // self.block_tokens - 1]
            if self.pool.cache(page, block_hash, saved_tokens=position):
                state.snapshots[position] = page
                state.created.add(position)
                self.num_snapshots_taken += 1
                if pending.generated:
                    self._generated[page] = block_hash
                else:
                    self._generated.pop(page, None)
            else:  # another request published the same prefix first
                self.pool.release(page, self.allocator.clock)

    def apply_retention(
        self,
        req_id: ReqId,
        keep: Callable[[int], bool],
        release: bool = False,
        demote: bool = False,
        release_generated_hit: bool = False,
        shared: int = 0,
    ) -> None:
        """Drop this request's superseded snapshots that ``keep`` rejects (the newest stays).

        ``release``: superseded snapshots that ``keep`` accepts are released to the cache
        rather than held until :meth:`free`; with ``demote`` they go to the front of the
        eviction queue unless another request holds them too.
        ``release_generated_hit``: the snapshot the request resumed from is released and
        demoted once its restore has run (this commit follows it) if it covers sampled
        tokens: the end of a previous turn, which only this conversation continues and
        which this request now supersedes. A hit on a prompt snapshot is held until the
        request ends: prompt snapshots are the ones shared (system prompts), and running
        requests that hold one keep it from being evicted between their arrivals.
        ``shared``: the request's branch point; released there, it is never demoted (other
        requests are expected to resume from it).
        """
        state = self.reqs[req_id]
        clock = self.allocator.clock
        if release_generated_hit:
            for position in [p for p in state.snapshots if p not in state.created]:
                page = state.snapshots[position]
                if self.is_generated(page):
                    del state.snapshots[position]
                    self.pool.release(page, clock, demote and self.pool.ref_count(page) == 1)
        if state.parked is not None and state.created:
            self._supersede_parked(state, keep, demote, shared)
        if len(state.created) < 2:
            return
        newest = max(state.created)
        for position in sorted(state.created):
            if position == newest:
                continue
            if keep(position):
                if release:
                    page = state.snapshots.pop(position)
                    state.created.discard(position)
                    front = demote and position != shared and self.pool.ref_count(page) == 1
                    self.pool.release(page, clock, front)
                continue
            page = state.snapshots.pop(position)
            state.created.discard(position)
            if self.pool.ref_count(page) == 1:  # nobody else resumed from it
                self.pool.uncache(page)
            self.pool.release(page, clock)
            self.num_snapshots_dropped += 1

    def _supersede_parked(
        self, state: _ReqState, keep: Callable[[int], bool], demote: bool, shared: int
    ) -> None:
        """A newer snapshot exists: the parked one stays cached if ``keep`` accepts it
        (at the front of the queue with ``demote``, unless it is the branch point ``shared``),
        else it is dropped."""
        parked, state.parked = state.parked, None
        assert parked is not None
        if self.pool.hash_of(parked.page) != parked.block_hash:
            return  # evicted since
        if self.pool.ref_count(parked.page):
            return  # another request resumed from it: it decides
        if keep(parked.position):
            if demote and parked.position != shared:
                self.pool.demote(parked.page)
            return
        self.pool.uncache(parked.page)
        self.num_snapshots_dropped += 1

    def forget_published(self) -> None:
        """Every request lets go of its snapshots (the hit it resumed from, the ones it
        took, the parked one): only live states stay held. Its later snapshots are taken
        as the policy says, from its current position on."""
        assert all(not s.pending and not s.scratch for s in self.reqs.values()), (
            "a prefix-cache reset must run between steps"
        )
        clock = self.allocator.clock
        for state in self.reqs.values():
            for page in state.snapshots.values():
                self.pool.release(page, clock)
            state.snapshots.clear()
            state.created.clear()
            state.parked = None
        self._generated.clear()

    def free(self, req_id: ReqId) -> None:
        state = self.reqs.pop(req_id, None)
        if state is None:
            return
        clock = self.allocator.clock
        parked = state.parked if self._is_parked(state) else None
        if parked is not None and self.pool.ref_count(parked.page) == 0:
            self.pool.touch(parked.page, clock)  # to the back: the next turn's start
            self.pool.release(parked.page, clock)
        for pending in state.pending:
            self.pool.release(pending.page, clock)
        for page in state.scratch.values():
            self.pool.release(page, clock)
        for position in sorted(state.snapshots):  # deeper snapshots end newer in the LRU
            self.pool.release(state.snapshots[position], clock)
        if state.live is not None:
            self.pool.release(state.live, clock)

    def check_integrity(self) -> None:
        held: dict[PageId, int] = {}
        for state in self.reqs.values():
            pages = list(state.snapshots.values())
            pages += [p for p in (state.live,) if p is not None]
            pages += [p.page for p in state.pending]
            pages += list(state.scratch.values())
            for page in pages:
                held[page] = held.get(page, 0) + 1
            assert state.created <= set(state.snapshots)
        assert held == self.pool.referenced_pages(), "request states disagree with ref counts"
