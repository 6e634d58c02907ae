"""The second level of the arena: one group's pages inside the chunks it owns.

A page is in exactly one of three states::

    referenced   ref > 0              held by running requests (maybe also hashed)
    cached       ref == 0, hashed     reusable by a prefix hit, evictable, in LRU order
    free         ref == 0, no hash    ready to hand out

New pages come from the chunk with the fewest free pages, so chunks fill up whole and
empty ones go back to the arena for any group to take.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from hybridkv.core.arena import ChunkArena
from hybridkv.core.hashing import BlockHash
from hybridkv.core.ids import PageId


class CachedPage(NamedTuple):
    """A cached page as it was just before an eviction: enough to undo the eviction."""

    page: PageId
    block_hash: BlockHash
    saved_tokens: int
    last_used: int
    queue_seq: int  # its place in the LRU queue


class EvictedChunk(NamedTuple):
    """A chunk as it was just before :meth:`PagePool.evict_chunk`."""

    chunk: int
    free_pages: tuple[PageId, ...]  # its free list, in order
    newest_use: int
    cached: tuple[CachedPage, ...]


class PagePool:
    """Pages of one group: ref counts, the hash → page map and the LRU of cached pages."""

    def __init__(self, group_id: int, arena: ChunkArena) -> None:
        self.group_id = group_id
        self.arena = arena
        layout = arena.layout
        self.page_bytes = layout.pages[group_id].page_bytes
        self._ppc = layout.pages_per_chunk(group_id)
        self._ref: dict[PageId, int] = {}  # every page of every owned chunk
        self._hash: dict[PageId, BlockHash] = {}
        self._by_hash: dict[BlockHash, PageId] = {}
        self.last_used: dict[PageId, int] = {}
        self.saved_tokens: dict[PageId, int] = {}  # prefix tokens a hit on this page saves
        # ref 0 + hashed, oldest first; the value orders the queue when evictions are undone
        self._cached: OrderedDict[PageId, int] = OrderedDict()
        self._queue_seq = 0
        self._front_seq = 0  # decreasing: the queue places of demoted pages
        self._free: dict[int, list[PageId]] = {}  # chunk → free uncached pages
        self._buckets: list[set[int]] = [set() for _ in range(max(self._ppc, 1) + 1)]
        self._referenced: dict[int, int] = {}  # chunk → pages with ref > 0
        self._newest_use: dict[int, int] = {}  # chunk → latest last_used of its pages

    # ------------------------------------------------------------------ queries

    @property
    def num_free_pages(self) -> int:
        return sum(len(v) for v in self._free.values())

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    @property
    def num_used_pages(self) -> int:
        return sum(1 for r in self._ref.values() if r > 0)

    @property
    def num_owned_chunks(self) -> int:
        return len(self._free)

    def ref_count(self, page: PageId) -> int:
        return self._ref[page]

    def referenced_pages(self) -> dict[PageId, int]:
        return {p: r for p, r in self._ref.items() if r > 0}

    def lookup(self, block_hash: BlockHash) -> PageId | None:
        """The page cached under this hash, if any. Read-only."""
        return self._by_hash.get(block_hash)

    def hash_of(self, page: PageId) -> BlockHash | None:
        return self._hash.get(page)

    def chunk_of(self, page: PageId) -> int:
        return page // self._ppc

    def cached_pages_oldest_first(self) -> list[PageId]:
        return list(self._cached)

    def oldest_cached(self, limit: int) -> list[PageId]:
        pages: list[PageId] = []
        for page in self._cached:
            if len(pages) == limit:
                break
            pages.append(page)
        return pages

    def reclaimable_chunks(self) -> list[int]:
        """Owned chunks where no page is referenced: evicting their cached pages frees them."""
        return [c for c, n in self._referenced.items() if n == 0]

    def chunk_newest_use(self, chunk: int) -> int:
        return self._newest_use.get(chunk, 0)

    def chunk_saved_tokens(self, chunk: int) -> int:
        first = chunk * self._ppc
        return sum(self.saved_tokens.get(PageId(p), 0) for p in range(first, first + self._ppc))

    # ------------------------------------------------------------------ mutations

    def add_chunk(self, chunk: int) -> None:
        """Carve a chunk just taken from the arena into free pages."""
        count = self.arena.layout.pages_in_chunk(self.group_id, chunk)
        first = chunk * self._ppc
        pages = [PageId(p) for p in range(first + count - 1, first - 1, -1)]  # pop() → lowest
        self._free[chunk] = pages
        self._buckets[len(pages)].add(chunk)
        self._referenced[chunk] = 0
        for p in pages:
            self._ref[p] = 0

    def pop_free(self, now: int) -> PageId | None:
        """Take a free page from the fullest chunk that has one; it gets ref 1."""
        for count in range(1, len(self._buckets)):
            if self._buckets[count]:
                chunk = min(self._buckets[count])
                page = self._take_free(chunk)
                self._reference(page, now)
                return page
        return None

    def touch(self, page: PageId, now: int) -> None:
        """Take a reference on a hit page (it leaves the eviction queue)."""
        if self._ref[page] == 0:
            self._cached.pop(page, None)
        self._reference(page, now)

    def release(self, page: PageId, now: int, demote: bool = False) -> None:
        """Drop a reference; at zero the page becomes cached (if hashed) or free.

        ``demote``: a cached page goes to the front of the eviction queue, older than
        any page of any group (a superseded snapshot: worth less than anything recent;
        :meth:`demote`).
        """
        ref = self._ref[page] - 1
        assert ref >= 0, f"group {self.group_id}: page {page} released more than taken"
        self._ref[page] = ref
        if ref:
            return
        chunk = self.chunk_of(page)
        self._referenced[chunk] -= 1
        if page in self._hash and demote:
            self._to_front(page)
            return
        self.last_used[page] = now
        self._newest_use[chunk] = max(self._newest_use.get(chunk, 0), now)
        if page in self._hash:
            self._queue_seq += 1
            self._cached[page] = self._queue_seq
        else:
            self._put_free(page)

    def demote(self, page: PageId) -> None:
        """Move a cached page to the front of the eviction queue (evicted next).

        Its last use becomes its (negative) place at the front, older than any real use
        of any group: the allocator compares this group's oldest page with whole chunks
        of other groups by last use, and a demoted page that kept the time of its last
        reference (its snapshot's reservation, usually a step or two ago) looked newer
        than a conversation's KV freed a few steps before. LRU then evicted that KV
        instead of the superseded snapshot (Qwen3.5-27B, ``agentic`` at 64 GiB: the one
        request that lost its hit lost 3,792 tokens so; docs/simulator.md).
        """
        if page in self._cached:
            self._to_front(page)

    def _to_front(self, page: PageId) -> None:
        self._front_seq -= 1
        self._cached[page] = self._front_seq
        self._cached.move_to_end(page, last=False)
        self.last_used[page] = self._front_seq
        self._refresh_newest_use(self.chunk_of(page))

    def _refresh_newest_use(self, chunk: int) -> None:
        """The chunk's newest use over its cached pages (after one of them was demoted).

        Pages in use are left out: the chunk is not reclaimable while they are, and each
        one's release raises the value again. O(pages per chunk); only demotions call it.
        """
        first = chunk * self._ppc
        count = self.arena.layout.pages_in_chunk(self.group_id, chunk)
        self._newest_use[chunk] = max(
            self.last_used[PageId(p)]
            for p in range(first, first + count)
            if PageId(p) in self._cached
        )

    def cache(self, page: PageId, block_hash: BlockHash, saved_tokens: int) -> bool:
        """Register a referenced page under a hash. False if the hash is already cached."""
        if block_hash in self._by_hash or page in self._hash:
            return False
        self._hash[page] = block_hash
        self._by_hash[block_hash] = page
        self.saved_tokens[page] = saved_tokens
        return True

    def uncache(self, page: PageId) -> None:
        """Forget a page's hash (a snapshot that retention drops)."""
        block_hash = self._hash.pop(page, None)
        if block_hash is not None:
            del self._by_hash[block_hash]
        self.saved_tokens.pop(page, None)
        if page in self._cached:
            del self._cached[page]
            self._put_free(page)

    def forget_hashes(self) -> int:
        """Empty the prefix cache of this pool: every cached page becomes free, and pages
        that running requests reference lose their hash (they stay theirs, unreachable by
        any hit). Returns the number of cached pages freed."""
        freed = len(self._cached)
        for page in list(self._hash):
            self.uncache(page)
        return freed

    def reuse_cached(self, page: PageId, now: int) -> PageId:
        """Evict a cached page and hand it out at once (ref 1)."""
        assert self._ref[page] == 0 and page in self._cached
        del self._cached[page]
        del self._by_hash[self._hash.pop(page)]
        self.saved_tokens.pop(page, None)
        self._reference(page, now)
        return page

    def evict_chunk(self, chunk: int) -> EvictedChunk:
        """Evict every cached page of an unreferenced chunk and give it back to the arena.

        Returns what was evicted, for :meth:`restore_chunk`.
        """
        assert self._referenced[chunk] == 0, f"chunk {chunk} still has referenced pages"
        first = chunk * self._ppc
        count = self.arena.layout.pages_in_chunk(self.group_id, chunk)
        record = EvictedChunk(
            chunk=chunk,
            free_pages=tuple(self._free[chunk]),
            newest_use=self._newest_use.get(chunk, 0),
            cached=tuple(
                self.cached_page(PageId(p))
                for p in range(first, first + count)
                if PageId(p) in self._cached
            ),
        )
        for cached in record.cached:
            self.uncache(cached.page)  # puts it on the free list; the last one frees the chunk
        return record

    def cached_page(self, page: PageId) -> CachedPage:
        """The record that :meth:`restore_page` needs to undo evicting this cached page."""
        return CachedPage(
            page=page,
            block_hash=self._hash[page],
            saved_tokens=self.saved_tokens.get(page, 0),
            last_used=self.last_used[page],
            queue_seq=self._cached[page],
        )

    def restore_page(self, cached: CachedPage) -> None:
        """Undo :meth:`reuse_cached` of a page that has been released (is free) again."""
        chunk = self.chunk_of(cached.page)
        if chunk not in self._free:  # the chunk emptied and went back to the arena
            self.arena.take_chunk(self.group_id, chunk)
            self.add_chunk(chunk)
        pages = self._free[chunk]
        self._buckets[len(pages)].discard(chunk)
        pages.remove(cached.page)
        if pages:
            self._buckets[len(pages)].add(chunk)
        self._recache(cached)

    def restore_chunk(self, record: EvictedChunk) -> None:
        """Undo :meth:`evict_chunk` once the chunk is free in the arena again."""
        self.arena.take_chunk(self.group_id, record.chunk)
        self._free[record.chunk] = list(record.free_pages)
        if record.free_pages:
            self._buckets[len(record.free_pages)].add(record.chunk)
        self._referenced[record.chunk] = 0
        self._newest_use[record.chunk] = record.newest_use
        for page in record.free_pages:
            self._ref[page] = 0
        for cached in record.cached:
            self._ref[cached.page] = 0
            self._recache(cached)

    def sort_queue(self) -> None:
        """Put restored pages back in their LRU places (after restore_page/restore_chunk)."""
        self._cached = OrderedDict(sorted(self._cached.items(), key=lambda item: item[1]))

    # ------------------------------------------------------------------ internals

    def _recache(self, cached: CachedPage) -> None:
        page = cached.page
        self._hash[page] = cached.block_hash
        self._by_hash[cached.block_hash] = page
        self.saved_tokens[page] = cached.saved_tokens
        self.last_used[page] = cached.last_used
        self._cached[page] = cached.queue_seq

    def _reference(self, page: PageId, now: int) -> None:
        if self._ref[page] == 0:
            self._referenced[self.chunk_of(page)] += 1
        self._ref[page] += 1
        self.last_used[page] = now

    def _take_free(self, chunk: int) -> PageId:
        pages = self._free[chunk]
        self._buckets[len(pages)].discard(chunk)
        page = pages.pop()
        if pages:
            self._buckets[len(pages)].add(chunk)
        return page

    def _put_free(self, page: PageId) -> None:
        chunk = self.chunk_of(page)
        pages = self._free[chunk]
        self._buckets[len(pages)].discard(chunk)
        pages.append(page)
        self.last_used.pop(page, None)
        if len(pages) == self.arena.layout.pages_in_chunk(self.group_id, chunk):
            self._drop_chunk(chunk)
        else:
            self._buckets[len(pages)].add(chunk)

    def _drop_chunk(self, chunk: int) -> None:
        for page in self._free.pop(chunk):
            del self._ref[page]
        del self._referenced[chunk]
        self._newest_use.pop(chunk, None)
        self.arena.release(chunk)

    def check_integrity(self) -> None:
        """Every invariant of the module docstring, plus chunk bookkeeping."""
        for chunk in self._free:
            assert self.arena.owner(chunk) == self.group_id, f"chunk {chunk} not owned"
        assert len(self._by_hash) == len(self._hash)
        for page, block_hash in self._hash.items():
            assert self._by_hash[block_hash] == page
        referenced: dict[int, int] = dict.fromkeys(self._free, 0)
        free = {p for pages in self._free.values() for p in pages}
        for page, ref in self._ref.items():
            assert ref >= 0
            if ref:
                referenced[self.chunk_of(page)] += 1
                assert page not in self._cached and page not in free
            elif page in self._hash:
                assert page in self._cached, f"page {page}: ref 0 and hashed but not cached"
            else:
                assert page in free, f"page {page}: ref 0, no hash, not free"
        assert referenced == self._referenced
        for count, chunks in enumerate(self._buckets):
            for chunk in chunks:
                assert len(self._free[chunk]) == count
        for chunk, pages in self._free.items():
            full = self.arena.layout.pages_in_chunk(self.group_id, chunk)
            assert len(pages) < full, f"chunk {chunk} is wholly free but still owned"
            assert (chunk in self._buckets[len(pages)]) == (len(pages) > 0)
