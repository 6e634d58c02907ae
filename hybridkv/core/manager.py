"""CacheManager: the one façade the scheduler (engine or simulator) talks to.

Per request and per step::

    add_request(req, prompt)          hashes the prompt's full blocks
    hit = find_hit(req)               read-only: the longest hybrid prefix hit
    alloc = allocate(req, n, hit)     pages for n more tokens (+ snapshot/restore copies)
    ... the runner restores, runs the model, takes snapshots ...
    commit(req, num_computed, new)    publish full blocks and snapshots, apply retention
    free(req)                         at finish or preemption; hashed pages stay cached
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from hybridkv.core.allocator import PageAllocator
from hybridkv.core.arena import static_split
from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.coordinator import longest_hybrid_hit
from hybridkv.core.eviction import EvictionPolicy
from hybridkv.core.groups.attention import AttentionGroup
from hybridkv.core.groups.base import GroupManager, ReqId
from hybridkv.core.groups.recurrent import RecurrentGroup
from hybridkv.core.groups.sliding import SlidingWindowGroup
from hybridkv.core.hashing import BlockHash, extend_block_hashes, root_hash
from hybridkv.core.layout import ArenaLayout, build_layout
from hybridkv.core.pool import PageId
from hybridkv.core.spec import (
    AttentionSpec,
    GroupSpec,
    ModelSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    Spec,
)

MANAGER_FOR: dict[type[Spec], type[GroupManager]] = {
    AttentionSpec: AttentionGroup,
    SlidingWindowSpec: SlidingWindowGroup,
    RecurrentStateSpec: RecurrentGroup,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheConfig:
    """How the cache is sized and what it keeps."""

    memory_bytes: int
    block_tokens: int = 16
    enable_prefix_caching: bool = True
    checkpoint: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    eviction: EvictionPolicy = EvictionPolicy.LRU
    eviction_alpha: float = 1.0
    cache_salt: str = ""  # anything else that changes what a cached page means
    # None: memory flows between groups. A fraction: recurrent groups are pinned to that
    # share of the chunks and attention to the rest (emulates SGLang's static split).
    state_memory_fraction: float | None = None


class Hit(NamedTuple):
    num_tokens: int  # reusable prefix, aligned for every group (0: no hit)


class StateCopy(NamedTuple):
    group_id: int
    src_page: PageId
    dst_page: PageId


class Allocation(NamedTuple):
    new_pages: tuple[tuple[PageId, ...], ...]  # new_pages[g]: pages group g added
    restores: tuple[StateCopy, ...]  # snapshot → live, before the forward
    snapshots: tuple[StateCopy, ...]  # live → snapshot, after the forward


@dataclass(slots=True)
class _Request:
    tokens: list[int]
    prompt_len: int
    hashes: list[BlockHash] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0
    started: bool = False


@dataclass(slots=True)
class CacheStats:
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of which served from the cache


class CacheManager:
    """Prefix-cached paged memory for every layer group of one model."""

    def __init__(
        self, model: ModelSpec, config: CacheConfig, layout: ArenaLayout | None = None
    ) -> None:
        config.checkpoint.validate(config.block_tokens)
        self.model = model
        self.config = config
        self.block_tokens = config.block_tokens
        self.layout = layout or build_layout(model.groups, config.block_tokens, config.memory_bytes)
        partition = None
        if config.state_memory_fraction is not None:
            recurrent_ids = {g.group_id for g in model.groups if g.is_recurrent}
            partition = static_split(self.layout, recurrent_ids, config.state_memory_fraction)
        self.allocator = PageAllocator(
            self.layout, config.eviction, config.eviction_alpha, partition
        )
        self.groups: list[GroupManager] = [self._make_group(g) for g in model.groups]
        self.recurrent = [g for g in self.groups if isinstance(g, RecurrentGroup)]
        self._root = root_hash(model.name, model.model_type, model.dtype, config.cache_salt)
        self._reqs: dict[ReqId, _Request] = {}
        self.stats = CacheStats()

    def _make_group(self, group: GroupSpec) -> GroupManager:
        cls = MANAGER_FOR[type(group.spec)]
        if cls is RecurrentGroup:
            return RecurrentGroup(
                group, self.allocator, self.block_tokens, caching=self.config.enable_prefix_caching
            )
        return cls(group, self.allocator, self.block_tokens)

    # ------------------------------------------------------------------ requests

    def add_request(self, req_id: ReqId, prompt_token_ids: Sequence[int]) -> None:
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} is already in the cache")
        req = _Request(tokens=list(prompt_token_ids), prompt_len=len(prompt_token_ids))
        extend_block_hashes(req.hashes, self._root, req.tokens, self.block_tokens)
        self._reqs[req_id] = req

    def find_hit(self, req_id: ReqId) -> Hit:
        """Longest prefix every group can resume from; the last token is always recomputed."""
        if not self.config.enable_prefix_caching:
            return Hit(0)
        req = self._reqs[req_id]
        return Hit(longest_hybrid_hit(self.groups, req.hashes, len(req.tokens) - 1))

    def next_split(self, req_id: ReqId, start: int, end: int) -> int:
        """Where a prefill chunk [start, end) must end so the state is snapshotted there."""
        if not (self.config.enable_prefix_caching and self.recurrent):
            return end
        req = self._reqs[req_id]
        stop = self.config.checkpoint.next_prefill_checkpoint(
            start, end, req.prompt_len, self.block_tokens
        )
        return end if stop is None else stop

    def allocate(
        self, req_id: ReqId, num_new_tokens: int, hit: Hit | None = None
    ) -> Allocation | None:
        """Pages for ``num_new_tokens`` more tokens; None (and no change) if they do not fit.

        The first call of a request takes the hit found by :meth:`find_hit` and returns
        the restore copies that put the snapshot's state into a fresh live page.
        """
        req = self._reqs[req_id]
        self.allocator.tick()
        first = not req.started
        if first:
            # Re-check: pages seen by find_hit may have been evicted since.
            wanted = hit.num_tokens if hit else 0
            req.num_computed = longest_hybrid_hit(self.groups, req.hashes, wanted) if wanted else 0
            for group in self.groups:
                group.take_hit(req_id, req.hashes, req.num_computed)
        total = req.num_computed + num_new_tokens
        new_pages: list[tuple[PageId, ...]] = []
        self.allocator.begin()
        for group in self.groups:
            pages = group.allocate(req_id, total)
            if pages is None:
                self._undo(req_id, first, new_pages)
                self.allocator.rollback()
                return None
            new_pages.append(tuple(pages))
        self.allocator.end()
        if first:
            self._start(req_id, req)
        restores = self._restores(req_id, req.num_cached_tokens) if first else ()
        return Allocation(tuple(new_pages), restores, self._reserve_snapshots(req_id, req, total))

    def _start(self, req_id: ReqId, req: _Request) -> None:
        req.started = True
        req.num_cached_tokens = req.num_computed
        self.stats.query_tokens += req.prompt_len
        self.stats.hit_tokens += req.num_computed

    def _undo(self, req_id: ReqId, first: bool, new_pages: list[tuple[PageId, ...]]) -> None:
        if first:  # nothing else is held yet: drop the hit refs and the new pages
            for group in self.groups:
                group.free(req_id)
            self._reqs[req_id].num_computed = 0
            return
        for group, pages in zip(self.groups, new_pages, strict=False):
            if isinstance(group, AttentionGroup) and pages:
                del group.tables[req_id][-len(pages) :]
            for page in pages:
                group.pool.release(page, self.allocator.clock)

    def _restores(self, req_id: ReqId, hit_tokens: int) -> tuple[StateCopy, ...]:
        if hit_tokens == 0:
            return ()
        return tuple(
            StateCopy(g.group_id, g.reqs[req_id].snapshots[hit_tokens], g.live_page(req_id))
            for g in self.recurrent
        )

    def _reserve_snapshots(self, req_id: ReqId, req: _Request, total: int) -> tuple[StateCopy, ...]:
        policy = self.config.checkpoint
        if not (self.config.enable_prefix_caching and self.recurrent):
            return ()
        if not policy.is_checkpoint(total, req.prompt_len, self.block_tokens):
            return ()
        copies: list[StateCopy] = []
        reusable = None
        if policy.reuse_superseded_page:

            def reusable(position: int) -> bool:
                return not policy.keep(position, req.prompt_len, self.block_tokens)

        self.allocator.begin()
        for group in self.recurrent:
            page = group.reserve_snapshot(req_id, total, reusable, total > req.prompt_len)
            if page is None:  # all groups or none: a partial snapshot is useless
                for g in self.recurrent:
                    g.cancel_snapshot(req_id)
                self.allocator.rollback()
                return ()
            copies.append(StateCopy(group.group_id, group.live_page(req_id), page))
        self.allocator.end()
        return tuple(copies)

    def commit(self, req_id: ReqId, num_computed: int, new_token_ids: Sequence[int] = ()) -> None:
        """Record a finished step: ``num_computed`` tokens are in the cache now.

        ``new_token_ids`` are tokens appended to the sequence (sampled ones), hashed so
        that decode blocks and sequence-end snapshots become reusable too.
        """
        req = self._reqs[req_id]
        req.tokens.extend(new_token_ids)
        req.num_computed = num_computed
        if not self.config.enable_prefix_caching:
            return
        extend_block_hashes(req.hashes, self._root, req.tokens, self.block_tokens)
        policy = self.config.checkpoint

        def keep(position: int) -> bool:
            return policy.keep(position, req.prompt_len, self.block_tokens)

        for group in self.groups:
            group.cache(req_id, req.hashes, num_computed)
            if isinstance(group, RecurrentGroup):
                group.apply_retention(
                    req_id,
                    keep,
                    policy.release_superseded,
                    policy.demote_superseded,
                    policy.release_generated_hit,
                )
            elif isinstance(group, SlidingWindowGroup):
                group.remove_skipped(req_id, num_computed)

    def free(self, req_id: ReqId) -> None:
        """Release a finished or preempted request. Its hashed pages stay in the cache."""
        self.allocator.tick()
        for group in self.groups:
            group.free(req_id)
        self._reqs.pop(req_id, None)

    # ------------------------------------------------------------------ queries

    def num_cached_tokens(self, req_id: ReqId) -> int:
        return self._reqs[req_id].num_cached_tokens

    def num_computed_tokens(self, req_id: ReqId) -> int:
        return self._reqs[req_id].num_computed

    def block_table(self, req_id: ReqId, group_id: int) -> list[PageId]:
        group = self.groups[group_id]
        assert isinstance(group, AttentionGroup)
        return group.tables.get(req_id, [])

    def live_page(self, req_id: ReqId, group_id: int) -> PageId:
        group = self.groups[group_id]
        assert isinstance(group, RecurrentGroup)
        return group.live_page(req_id)

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    def check_integrity(self) -> None:
        """Every pool, chunk and request record agrees; call after any operation in tests."""
        self.allocator.check_integrity()
        for group in self.groups:
            group.check_integrity()
