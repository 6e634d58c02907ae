"""The contract every per-kind group manager keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NewType

from hybridkv.core.allocator import PageAllocator
from hybridkv.core.hashing import BlockHash
from hybridkv.core.pool import PageId, PagePool
from hybridkv.core.spec import GroupSpec

ReqId = NewType("ReqId", str)


class GroupManager(ABC):
    """One layer group's view of every request: which pages it holds and what is cached."""

    def __init__(self, group: GroupSpec, allocator: PageAllocator, block_tokens: int) -> None:
        self.group = group
        self.group_id = group.group_id
        self.allocator = allocator
        self.block_tokens = block_tokens

    @property
    def pool(self) -> PagePool:
        return self.allocator.pools[self.group_id]

    @abstractmethod
    def longest_hit(self, hashes: Sequence[BlockHash], max_tokens: int) -> int:
        """Largest block-aligned prefix length <= max_tokens this group can resume from.

        Read-only: touches no ref count. A recurrent group can resume only at a snapshot,
        so its answer may be shorter than an attention group's; the coordinator repeats
        until every group accepts the same length.
        """

    @abstractmethod
    def take_hit(self, req_id: ReqId, hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Take a reference on every page of a hit of ``num_tokens`` (already checked)."""

    @abstractmethod
    def allocate(self, req_id: ReqId, num_total_tokens: int) -> list[PageId] | None:
        """Grow the request to cover ``num_total_tokens``; returns the new pages.

        None when memory is out; then nothing was taken.
        """

    @abstractmethod
    def cache(self, req_id: ReqId, hashes: Sequence[BlockHash], num_computed: int) -> None:
        """Publish what the step computed (full blocks, snapshots) in the prefix cache."""

    @abstractmethod
    def free(self, req_id: ReqId) -> None:
        """Drop every reference of the request; hashed pages stay cached."""

    def _allocate_pages(self, count: int) -> list[PageId] | None:
        pages: list[PageId] = []
        for _ in range(count):
            page = self.allocator.allocate(self.group_id)
            if page is None:
                for p in reversed(pages):
                    self.pool.release(p, self.allocator.clock)
                return None
            pages.append(page)
        return pages

    @abstractmethod
    def check_integrity(self) -> None:
        """Per-request bookkeeping agrees with the pool's ref counts."""
