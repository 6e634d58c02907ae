"""Pages on demand for every group from one arena, evicting across groups when needed.

Order of preference for a page of group ``g``::

    1. a free page in a chunk g already owns (fullest chunk first)
    2. a free chunk from the arena
    3. eviction: g's own cached page, or a whole reclaimable chunk of another group,
       whichever the eviction policy values least

Step 3 is what lets snapshots give way to attention KV and back: the SGLang unified
pool once evicted only its own side and reported "cannot alloc" with memory to spare
(SGLang PR #34441).

Step 3 has a catch: a state page fills a whole chunk, and a chunk comes back from the
attention groups only when none of its pages is referenced. KV pages of the running
requests end up spread over most chunks (a hit pins its pages where they were written;
a freed page is reused wherever it is), so a chunk attention takes from the arena, or
from a state's cached snapshot, is rarely given back while requests run. With requests
waiting for admission, :meth:`PageAllocator.reserve` names the state pages their live
states will need, and until then a group outside the reservation that has cached pages
of its own evicts one of them (step 3 within the group) rather than take a chunk the
reservation needs (steps 2 and 3 across groups). Without it the running requests' KV
took the live-state chunk every finishing request gave back, and the waiting ones were
admitted only as fast as whole chunks drained (Qwen3.5-27B ``agentic`` at 4 GiB: 7
requests running on average when an admission failed, 11 with ``static-split``'s fixed
pools; docs/simulator.md).

A request's pages are taken one by one, so the last one may not fit after earlier ones
evicted cached prefixes. Between :meth:`PageAllocator.begin` and ``end`` evictions are
journaled, and :meth:`PageAllocator.rollback` puts them back: a failed allocation
leaves the cache as it found it (vLLM checks the free count first for the same reason).
"""

from __future__ import annotations

from collections.abc import Mapping

from hybridkv.core.arena import ChunkArena
from hybridkv.core.eviction import Candidate, EvictionPolicy, pick_victim
from hybridkv.core.ids import PageId
from hybridkv.core.layout import ArenaLayout
from hybridkv.core.pool import CachedPage, EvictedChunk, PagePool

EVICTION_WINDOW = 16  # oldest cached pages per group considered by the cost policy


class PageAllocator:
    """The arena's chunks and one :class:`PagePool` per group, behind one clock."""

    def __init__(
        self,
        layout: ArenaLayout,
        policy: EvictionPolicy = EvictionPolicy.LRU,
        alpha: float = 1.0,
        partition: Mapping[int, range] | None = None,
    ) -> None:
        self.layout = layout
        self.arena = ChunkArena(layout, partition)
        self.pools = [PagePool(p.group_id, self.arena) for p in layout.pages]
        self.policy = policy
        self.alpha = alpha
        self.clock = 0
        self.num_evicted_pages = [0] * len(self.pools)
        self._journal: list[tuple[int, CachedPage | EvictedChunk]] | None = None
        self._reserved: dict[int, int] = {}  # group → pages it will soon need (reserve)

    def tick(self) -> int:
        """Advance logical time (once per scheduler step)."""
        self.clock += 1
        return self.clock

    def reserve(self, pages: Mapping[int, int]) -> None:
        """Pages each group will soon need (until the next call): the live states of the
        requests about to be admitted. Other groups then leave the chunks these pages
        need, making room among their own cached pages instead (module docstring)."""
        self._reserved = {g: n for g, n in pages.items() if n > 0}

    def allocate(self, group_id: int) -> PageId | None:
        """One page for ``group_id`` with ref 1, or None when nothing can be freed."""
        pool = self.pools[group_id]
        page = pool.pop_free(self.clock)
        if page is not None:
            return page
        if self._holds_back(group_id):
            return self._evict_for(group_id, own_only=True)
        chunk = self.arena.take(group_id)
        if chunk is not None:
            pool.add_chunk(chunk)
            return pool.pop_free(self.clock)
        return self._evict_for(group_id)

    def _holds_back(self, group_id: int) -> bool:
        """Whether the group should evict one of its own cached pages rather than take a
        chunk: it is outside the reservation, has a cached page to give up, and the chunks
        the reserved pages can come from are no more than they need.

        Counted in chunks: the free ones any reserved group can use, plus per reserved
        group its free and cached pages (whole chunks' worth), plus every other group's
        reclaimable chunks; needed: the reserved pages, whole chunks per group. A chunk
        the reserved groups could not use anyway (the tail, another partition) is taken
        as before, and a group with nothing cached takes what it needs: the reservation
        never fails an allocation.
        """
        if not self._reserved or group_id in self._reserved:
            return False
        if not self.pools[group_id].num_cached_pages:
            return False
        reserved = self._reserved
        needed = 0
        supply = 0
        for g, wanted in reserved.items():
            pool = self.pools[g]
            per_chunk = self.layout.pages_per_chunk(g)
            needed += -(-wanted // per_chunk)
            supply += (pool.num_free_pages + pool.num_cached_pages) // per_chunk
        # counted until the supply covers the need: with plenty free (the common case)
        # this stops after a few chunks instead of visiting the whole arena per call
        supply += self.arena.num_free_usable(reserved, limit=needed - supply + 1)
        for pool in self.pools:
            if supply > needed:
                return False
            if pool.group_id not in reserved:
                supply += sum(
                    1
                    for c in pool.reclaimable_chunks()
                    if any(self.arena.usable(g, c) for g in reserved)
                )
        if supply > needed:
            return False
        chunk = self.arena.peek(group_id)
        return chunk is None or any(self.arena.usable(g, chunk) for g in reserved)

    def _candidates(self, group_id: int, own_only: bool = False) -> list[Candidate]:
        own = self.pools[group_id]
        window = 1 if self.policy is EvictionPolicy.LRU else EVICTION_WINDOW
        found = [
            Candidate(
                group_id=group_id,
                last_used=own.last_used[p],
                saved_tokens=own.saved_tokens.get(p, 0),
                num_bytes=own.page_bytes,
                page=p,
            )
            for p in own.oldest_cached(window)
        ]
        for other in self.pools:
            if other.group_id == group_id or own_only:
                continue
            chunks = [c for c in other.reclaimable_chunks() if self._fits(group_id, c)]
            if not chunks:
                continue
            chunk = min(chunks, key=lambda c: (other.chunk_newest_use(c), c))
            found.append(
                Candidate(
                    group_id=other.group_id,
                    last_used=other.chunk_newest_use(chunk),
                    saved_tokens=other.chunk_saved_tokens(chunk),
                    num_bytes=self.layout.chunk_bytes,
                    chunk=chunk,
                )
            )
        return found

    def _fits(self, group_id: int, chunk: int) -> bool:
        return self.arena.usable(group_id, chunk)

    def _evict_for(self, group_id: int, own_only: bool = False) -> PageId | None:
        victim = pick_victim(self._candidates(group_id, own_only), self.policy, self.alpha)
        if victim is None:
            return None
        if victim.page is not None:
            pool = self.pools[group_id]
            if self._journal is not None:
                self._journal.append((group_id, pool.cached_page(PageId(victim.page))))
            self.num_evicted_pages[group_id] += 1
            return pool.reuse_cached(PageId(victim.page), self.clock)
        assert victim.chunk is not None
        record = self.pools[victim.group_id].evict_chunk(victim.chunk)
        if self._journal is not None:
            self._journal.append((victim.group_id, record))
        self.num_evicted_pages[victim.group_id] += len(record.cached)
        return self.allocate(group_id)

    def begin(self) -> None:
        """Start journaling evictions: the pages about to be taken may not all fit."""
        self._journal = []

    def end(self) -> None:
        """Keep the evictions since :meth:`begin`."""
        self._journal = None

    def rollback(self) -> None:
        """Undo the evictions since :meth:`begin`.

        Every page allocated since :meth:`begin` must have been released first, so that
        each evicted page (or chunk) is free again and can be cached as it was.
        """
        journal, self._journal = self._journal or [], None
        for group_id, record in reversed(journal):
            pool = self.pools[group_id]
            if isinstance(record, EvictedChunk):
                pool.restore_chunk(record)
                self.num_evicted_pages[group_id] -= len(record.cached)
            else:
                pool.restore_page(record)
                self.num_evicted_pages[group_id] -= 1
        for group_id in {group_id for group_id, _ in journal}:
            self.pools[group_id].sort_queue()

    def check_integrity(self) -> None:
        self.arena.check_integrity()
        owned = 0
        for pool in self.pools:
            pool.check_integrity()
            owned += pool.num_owned_chunks
        assert owned + self.arena.num_free_chunks == self.arena.num_chunks
