"""The contract every per-kind group manager keeps, and the request record they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridkv.core.allocator import PageAllocator
from hybridkv.core.config import CacheConfig
from hybridkv.core.hashing import BlockHash
from hybridkv.core.ids import PageId, ReqId
from hybridkv.core.pool import PagePool
from hybridkv.core.spec import GroupSpec


@dataclass(slots=True)
class CachedRequest:
    """What the cache knows of one request: its tokens, their block hashes, its progress.

    Owned by the :class:`~hybridkv.core.manager.CacheManager`; group managers read it.
    """

    tokens: list[int]
    prompt_len: int
    hashes: list[BlockHash] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0
    started: bool = False
    # where the prompt's shared prefix ends, when no snapshot covered it at admission
    # (0: none); a snapshot is taken there during the prefill (CheckpointPolicy)
    branch_tokens: int = 0
    num_inflight_blocks: int = 0  # prompt blocks counted in the manager's in-flight set
    # (blocks, hash of the last) of the branch point while it is still to be computed,
    # as registered in the manager's pending branches (waiting requests resume there)
    pending_branch: tuple[int, BlockHash] | None = None


class GroupManager(ABC):
    """One layer group's view of every request: which pages it holds and what is cached.

    Every kind is built the same way, from the group's spec, the shared allocator and the
    cache's config, so the façade can make them from its table alone.
    """

    def __init__(self, group: GroupSpec, allocator: PageAllocator, config: CacheConfig) -> None:
        self.group = group
        self.group_id = group.group_id
        self.allocator = allocator
        self.config = config
        self.block_tokens = config.block_tokens

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
    def undo(self, req_id: ReqId, pages: Sequence[PageId]) -> None:
        """Give back ``pages``, the ones :meth:`allocate` just added for the request.

        Mutates: the request's record and the pages' ref counts. Used when a later group
        of the same allocation does not fit (all groups or none).
        """

    @abstractmethod
    def cache(self, req_id: ReqId, req: CachedRequest) -> None:
        """Publish what the step computed (full blocks, snapshots) in the prefix cache.

        ``req.num_computed`` tokens are in the pages now. Each kind also does its own
        follow-up here: snapshot retention, releasing blocks that left a window.
        """

    @abstractmethod
    def free(self, req_id: ReqId) -> None:
        """Drop every reference of the request; hashed pages stay cached."""

    @abstractmethod
    def forget_published(self) -> None:
        """Before the pool forgets every hash (a prefix-cache reset, between steps): drop
        what the request records say about published pages, so that running requests
        go on as if nothing had been cached, publishing their blocks anew."""

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
