"""Pages on demand for every group from one arena, evicting across groups when needed.

Order of preference for a page of group ``g``::

    1. a free page in a chunk g already owns (fullest chunk first)
    2. a free chunk from the arena
    3. eviction: g's own cached page, or a whole reclaimable chunk of another group,
       whichever the eviction policy values least

Step 3 is what lets snapshots give way to attention KV and back: the SGLang unified
pool once evicted only its own side and reported "cannot alloc" with memory to spare
(SGLang PR #34441).

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

    def tick(self) -> int:
        """Advance logical time (once per scheduler step)."""
        self.clock += 1
        return self.clock

    def allocate(self, group_id: int) -> PageId | None:
        """One page for ``group_id`` with ref 1, or None when nothing can be freed."""
        pool = self.pools[group_id]
        page = pool.pop_free(self.clock)
        if page is not None:
            return page
        chunk = self.arena.take(group_id)
        if chunk is not None:
            pool.add_chunk(chunk)
            return pool.pop_free(self.clock)
        return self._evict_for(group_id)

    def _candidates(self, group_id: int) -> list[Candidate]:
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
            if other.group_id == group_id:
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

    def _evict_for(self, group_id: int) -> PageId | None:
        victim = pick_victim(self._candidates(group_id), self.policy, self.alpha)
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
