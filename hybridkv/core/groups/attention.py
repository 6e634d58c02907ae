"""Full attention: one page per ``block_tokens`` tokens; a hit is the longest chain.

The group also remembers, for every cached page, the hash of the block before it (its
parent), so :meth:`AttentionGroup.has_cached_child` can tell whether some cached
sequence continues past a prefix: that is what makes the prefix's end a branch point
rather than the end of one sequence (docs/architecture.md §3). The index is keyed by
page, so it never outgrows the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.core.allocator import PageAllocator
from hybridkv.core.config import CacheConfig
from hybridkv.core.groups.base import CachedRequest, GroupManager
from hybridkv.core.hashing import BlockHash
from hybridkv.core.ids import NULL_PAGE, PageId, ReqId
from hybridkv.core.spec import GroupSpec


class AttentionGroup(GroupManager):
    """Block tables of every request for one full-attention group."""

    def __init__(self, group: GroupSpec, allocator: PageAllocator, config: CacheConfig) -> None:
        super().__init__(group, allocator, config)
        self.tables: dict[ReqId, list[PageId]] = {}
        self._num_cached_blocks: dict[ReqId, int] = {}
        self._parent: dict[PageId, BlockHash] = {}  # cached page → hash of the block before
        self._children: dict[BlockHash, set[PageId]] = {}  # the reverse (may hold stale pages)

    def longest_hit(self, hashes: Sequence[BlockHash], max_tokens: int) -> int:
        num_blocks = 0
        limit = min(len(hashes), max_tokens // self.block_tokens)
        while num_blocks < limit and self.pool.lookup(hashes[num_blocks]) is not None:
            num_blocks += 1  # hashes chain, so the first miss ends the prefix
        return num_blocks * self.block_tokens

    def take_hit(self, req_id: ReqId, hashes: Sequence[BlockHash], num_tokens: int) -> None:
        table = self.tables.setdefault(req_id, [])
        assert not table, f"request {req_id} already holds pages"
        for block_hash in hashes[: num_tokens // self.block_tokens]:
            page = self.pool.lookup(block_hash)
            assert page is not None, "hit pages must be checked before they are taken"
            self.pool.touch(page, self.allocator.clock)
            table.append(page)
        self._num_cached_blocks[req_id] = len(table)

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def allocate(self, req_id: ReqId, num_total_tokens: int) -> list[PageId] | None:
        table = self.tables.setdefault(req_id, [])
        self._num_cached_blocks.setdefault(req_id, 0)
        pages = self._allocate_pages(max(0, self.num_blocks(num_total_tokens) - len(table)))
        if pages is not None:
            table.extend(pages)
        return pages

    def undo(self, req_id: ReqId, pages: Sequence[PageId]) -> None:
        if pages:
            del self.tables[req_id][-len(pages) :]
        for page in pages:
            self.pool.release(page, self.allocator.clock)

    def cache(self, req_id: ReqId, req: CachedRequest) -> None:
        table, hashes = self.tables[req_id], req.hashes
        num_full = min(req.num_computed // self.block_tokens, len(hashes), len(table))
        for i in range(self._num_cached_blocks[req_id], num_full):
            if table[i] == NULL_PAGE:
                continue
            if self.pool.cache(table[i], hashes[i], saved_tokens=self.block_tokens) and i:
                self._link(table[i], hashes[i - 1])
        self._num_cached_blocks[req_id] = max(self._num_cached_blocks[req_id], num_full)

    def _link(self, page: PageId, parent: BlockHash) -> None:
        old = self._parent.get(page)
        if old is not None:
            siblings = self._children[old]
            siblings.discard(page)
            if not siblings:
                del self._children[old]
        self._parent[page] = parent
        self._children.setdefault(parent, set()).add(page)

    def has_cached_child(self, parent: BlockHash) -> bool:
        """Whether a block whose parent is ``parent`` is cached. Read-only."""
        return any(
            self.pool.hash_of(page) is not None and self._parent[page] == parent
            for page in self._children.get(parent, ())
        )

    def forget_published(self) -> None:
        """The running requests' full blocks are published again by their next commit."""
        for req_id in self._num_cached_blocks:
            self._num_cached_blocks[req_id] = 0
        self._parent.clear()
        self._children.clear()

    def free(self, req_id: ReqId) -> None:
        # Tail first: the LRU queue then evicts a prefix's deepest blocks before its root.
        for page in reversed(self.tables.pop(req_id, [])):
            if page != NULL_PAGE:
                self.pool.release(page, self.allocator.clock)
        self._num_cached_blocks.pop(req_id, None)

    def check_integrity(self) -> None:
        held: dict[PageId, int] = {}
        for table in self.tables.values():
            for page in table:
                if page != NULL_PAGE:
                    held[page] = held.get(page, 0) + 1
        assert held == self.pool.referenced_pages(), "block tables disagree with ref counts"
