"""CacheManager: the one façade the scheduler (engine or simulator) talks to.

Per request and per step::

    add_request(req, prompt)          hashes the prompt's full blocks
    hit = find_hit(req)               read-only: the longest hybrid prefix hit
    alloc = allocate(req, n, hit)     pages for n more tokens, restore copies, a page for
                                      every snapshot due in the chunk (its position), and
                                      scratch states when the last s of them are drafts
    ... the runner restores, runs the model, which writes the snapshots and scratches ...
    commit(req, num_computed, new)    keep the state at num_computed (a rejected draft's is
                                      dropped), publish full blocks and snapshots, retention
    free(req)                         at finish or preemption; hashed pages stay cached
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from hybridkv.core.allocator import PageAllocator
from hybridkv.core.arena import static_split
from hybridkv.core.config import CacheConfig
from hybridkv.core.coordinator import longest_hybrid_hit
from hybridkv.core.groups.attention import AttentionGroup
from hybridkv.core.groups.base import CachedRequest, GroupManager
from hybridkv.core.groups.recurrent import RecurrentGroup
from hybridkv.core.groups.sliding import SlidingWindowGroup
from hybridkv.core.hashing import BlockHash, extend_block_hashes, root_hash
from hybridkv.core.ids import PageId, ReqId
from hybridkv.core.layout import ArenaLayout, build_layout
from hybridkv.core.spec import (
    AttentionSpec,
    GroupSpec,
    ModelSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    Spec,
)

__all__ = [
    "Allocation",
    "CacheConfig",
    "CacheManager",
    "CacheUsage",
    "GroupUsage",
    "Hit",
    "Scratch",
    "Snapshot",
    "StateCopy",
]

# The table: one manager class per spec kind. Token groups keep block tables, state
# groups keep live states and snapshots; the façade reaches each through its own table.
TOKEN_MANAGER_FOR: dict[type[Spec], type[AttentionGroup]] = {
    AttentionSpec: AttentionGroup,
    SlidingWindowSpec: SlidingWindowGroup,
}
STATE_MANAGER_FOR: dict[type[Spec], type[RecurrentGroup]] = {
    RecurrentStateSpec: RecurrentGroup,
}


_Key = TypeVar("_Key", bound=Hashable)


class Hit(NamedTuple):
    num_tokens: int  # reusable prefix, aligned for every group (0: no hit)


class StateCopy(NamedTuple):
    """A whole state page copied before the forward (a hit's snapshot into the live page)."""

    group_id: int
    src_page: PageId
    dst_page: PageId


class Snapshot(NamedTuple):
    """The state of ``group_id`` after exactly ``position`` tokens of the request, to be
    written into ``page`` during the step (the chunk covers ``position``)."""

    group_id: int
    position: int
    page: PageId


class Scratch(NamedTuple):
    """A speculative step's state page: the state of ``group_id`` after exactly
    ``position`` tokens is written into ``page`` during the forward (a draft group's one
    page is its working state from ``position`` on)."""

    group_id: int
    position: int
    page: PageId


class Allocation(NamedTuple):
    new_pages: tuple[tuple[PageId, ...], ...]  # new_pages[g]: pages group g added
    restores: tuple[StateCopy, ...]  # snapshot → live, before the forward
    snapshots: tuple[Snapshot, ...]  # states inside (or at the end of) this step's chunk
    num_computed_tokens: int  # tokens in the cache before this step (the hit, at admission)
    num_cached_tokens: int  # prompt tokens the first admission found cached
    scratch: tuple[Scratch, ...] = ()  # speculative steps only


class GroupUsage(NamedTuple):
    """One group's pages right now."""

    group_id: int
    kind: str
    num_layers: int
    page_bytes: int
    pages_used: int  # referenced by running requests
    pages_cached: int  # reusable by a hit, evictable
    pages_free: int  # in the group's chunks, holding nothing
    chunks: int  # chunks the group owns
    pages_evicted: int  # since start


class CacheUsage(NamedTuple):
    """What the cache holds and has done: the one read the engine and simulator make."""

    groups: tuple[GroupUsage, ...]
    state_pages_used: int  # live states and held snapshots, all recurrent groups
    snapshots_taken: int  # per recurrent group (all take them together)
    snapshots_dropped: int  # superseded snapshots retention let go
    pages_evicted: int
    free_chunks: int
    num_requests: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hybrid_miss_tokens: int  # KV cached past the hit, but no state to resume there


@dataclass(slots=True)
class CacheStats:
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of which served from the cache
    # Hybrid misses: prompt tokens past the hit whose KV every attention group still held,
    # lost because no recurrent state snapshot sat at or after them. The metric users asked
    # vLLM and SGLang for: it says whether denser snapshots (checkpoint_interval) would pay.
    hybrid_miss_tokens: int = 0


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
        self.token_groups: dict[int, AttentionGroup] = {}
        self.state_groups: dict[int, RecurrentGroup] = {}
        self.groups: list[GroupManager] = [self._make_group(g) for g in model.groups]
        # the target's groups: prefix hits, published blocks, snapshots (a draft model's
        # groups only ever hold the running requests' own pages)
        self.cached_groups = [g for g in self.groups if not g.group.is_draft]
        self.recurrent = [g for g in self.state_groups.values() if not g.group.is_draft]
        self._root = root_hash(model.name, model.model_type, model.dtype, config.cache_salt)
        self._reqs: dict[ReqId, CachedRequest] = {}
        # prompt blocks of started requests: a prefix being computed counts as shared
        # before it is cached (branch points, CheckpointPolicy.at_branch_points)
        self._inflight: Counter[BlockHash] = Counter()
        self._inflight_parents: Counter[BlockHash] = Counter()  # ... with a next block there
        # prompt blocks of waiting requests the scheduler announced: a prefix they share
        # with a request being admitted is a branch point too (announce, awaits_prefix)
        self._announced: dict[ReqId, tuple[list[int], list[BlockHash]]] = {}  # tokens, hashes
        self._queued: Counter[BlockHash] = Counter()
        self._queued_parents: Counter[BlockHash] = Counter()
        # branch points started requests are still computing: (blocks, hash of the last)
        self._pending_branches: Counter[tuple[int, BlockHash]] = Counter()
        self._expected_admissions = 0  # expect_admissions, less the requests started since
        self.stats = CacheStats()

    def _make_group(self, group: GroupSpec) -> GroupManager:
        kind = type(group.spec)
        if kind in STATE_MANAGER_FOR:
            state = STATE_MANAGER_FOR[kind](group, self.allocator, self.config)
            self.state_groups[group.group_id] = state
            return state
        tokens = TOKEN_MANAGER_FOR[kind](group, self.allocator, self.config)
        self.token_groups[group.group_id] = tokens
        return tokens

    # ------------------------------------------------------------------ requests

    def announce(self, req_id: ReqId, prompt_token_ids: Sequence[int]) -> None:
        """A request waits for admission with this prompt (until :meth:`add_request` or
        :meth:`withdraw`).

        What waits counts as shared when a request is admitted: 32 requests behind one
        1500-token prefix arrive together, and the first one admitted snapshots where
        they branch off it, so the others can resume there (:meth:`awaits_prefix`).
        A request the cache still holds with the same tokens (announced again before it
        is freed: preempted, or its admission failed for lack of room) lends its block
        hashes, so a prompt that keeps failing admission is not hashed again every step.
        """
        if not (self.config.enable_prefix_caching and self.recurrent):
            return
        self.withdraw(req_id)
        tokens = list(prompt_token_ids)
        held = self._reqs.get(req_id)
        hashes = list(held.hashes) if held is not None and held.tokens == tokens else []
        extend_block_hashes(hashes, self._root, tokens, self.block_tokens)
        self._announced[req_id] = (tokens, hashes)
        self._queued.update(hashes)
        self._queued_parents.update(hashes[:-1])

    def withdraw(self, req_id: ReqId) -> tuple[list[int], list[BlockHash]] | None:
        """The announced request is admitted or gone: its (tokens, block hashes), if any."""
        announced = self._announced.pop(req_id, None)
        if announced is not None:
            _forget(self._queued, announced[1])
            _forget(self._queued_parents, announced[1][:-1])
        return announced

    def awaits_prefix(self, req_id: ReqId) -> bool:
        """Whether the announced request should wait: a started request is computing a
        prefix of its prompt and will snapshot where that prefix ends (its branch point),
        so admitting this one a step or two later turns the prefix into a hit instead of
        computing it twice.

        One comparison per pending branch point (a few at most): block hashes chain, so
        equal hashes of the branch's last block mean the whole prefix is equal. Cheap with
        thousands of long prompts waiting.
        """
        announced = self._announced.get(req_id)
        if announced is None:
            return False
        hashes = announced[1]
        return any(
            blocks <= len(hashes) and hashes[blocks - 1] == last
            for blocks, last in self._pending_branches
        )

    def expect_admissions(self, num_requests: int) -> None:
        """Up to ``num_requests`` waiting requests may be admitted before the next call
        (the scheduler says so at the start of every step: waiting ones, up to the free
        seats). Each needs a live page per state group, and a state page of a big model
        is a whole chunk: until they start, token groups that need a page give up one of
        their own cached pages rather than take a chunk those live states will need
        (:meth:`PageAllocator.reserve`; ``CacheConfig.reserve_live_states``). Each
        request's first allocation takes one off the count.
        """
        self._expected_admissions = max(0, num_requests)
        self._reserve_live_states()

    def _reserve_live_states(self) -> None:
        if not self.config.reserve_live_states:
            return
        count = self._expected_admissions
        self.allocator.reserve(dict.fromkeys(self.state_groups, count))

    def add_request(self, req_id: ReqId, prompt_token_ids: Sequence[int]) -> None:
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} is already in the cache")
        announced = self.withdraw(req_id)
        req = CachedRequest(tokens=list(prompt_token_ids), prompt_len=len(prompt_token_ids))
        if announced is not None and announced[0] == req.tokens:  # hashed when announced
            req.hashes.extend(announced[1])
        extend_block_hashes(req.hashes, self._root, req.tokens, self.block_tokens)
        self._reqs[req_id] = req

    def find_hit(self, req_id: ReqId) -> Hit:
        """Longest prefix every group can resume from; the last token is always recomputed."""
        if not self.config.enable_prefix_caching:
            return Hit(0)
        req = self._reqs[req_id]
        return Hit(longest_hybrid_hit(self.cached_groups, req.hashes, len(req.tokens) - 1))

    def next_split(self, req_id: ReqId, start: int, end: int) -> int:
        """Where a chunk [start, end) must end: ``end``, unless the cache splits prefills
        at snapshots (``CacheConfig.split_prefill_at_snapshots``), then the first
        snapshot position inside it.

        Before a request's first allocation, ``start`` is its hit and the branch point
        is found as :meth:`allocate` will find it.
        """
        if not (
            self.config.split_prefill_at_snapshots
            and self.config.enable_prefix_caching
            and self.recurrent
        ):
            return end
        req = self._reqs[req_id]
        branch = req.branch_tokens if req.started else self._branch_point(req, start)
        positions = self.config.checkpoint.positions(
            start, end - 1, req.prompt_len, self.block_tokens, branch
        )
        return positions[0] if positions else end

    def burst_end(self, req_id: ReqId, start: int, end: int) -> int:
        """Where a decode burst of a running request from ``start`` ends: ``end``, or just
        before the first snapshot position past ``start + 1`` inside it.

        A burst keeps at least its first token (the state after ``start + 1`` tokens)
        and the rest only up to a stop it cannot see coming. Reserving a later position
        may take the page of the request's parked snapshot (``reuse_superseded_page``),
        which a stop short of that position would then lose with the new one; ending
        the burst before it makes that position the next round's first token instead.
        """
        if not (self.config.enable_prefix_caching and self.recurrent):
            return end
        positions = self._snapshot_positions(self._reqs[req_id], start + 1, end)
        return positions[0] - 1 if positions else end

    def allocate(
        self,
        req_id: ReqId,
        num_new_tokens: int,
        hit: Hit | None = None,
        *,
        num_speculative_tokens: int = 0,
    ) -> Allocation | None:
        """Pages for ``num_new_tokens`` more tokens; None (and no change) if they do not fit.

        The first call of a request takes the hit found by :meth:`find_hit` and returns
        the restore copies that put the snapshot's state into a fresh live page.
        ``num_speculative_tokens``: the last s of the new tokens are drafts the step may
        reject; every recurrent group then also takes a scratch page for the state after
        each position the step may stop at (``Allocation.scratch``), all or nothing with
        the rest, and :meth:`commit` keeps the one the step stopped at.
        """
        req = self._reqs[req_id]
        self.allocator.tick()
        first = not req.started
        if first:
            # Re-check: pages seen by find_hit may have been evicted since.
            wanted = hit.num_tokens if hit else 0
            req.num_computed = (
                longest_hybrid_hit(self.cached_groups, req.hashes, wanted) if wanted else 0
            )
            for group in self.groups:
                taken = 0 if group.group.is_draft else req.num_computed
                group.take_hit(req_id, req.hashes, taken)
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
        scratch = self._reserve_scratch(req_id, total, num_speculative_tokens)
        if scratch is None:
            self._undo(req_id, first, new_pages)
            self.allocator.rollback()
            return None
        self.allocator.end()
        computed = req.num_computed
        if first:
            self._start(req)
        restores = self._restores(req_id, req.num_cached_tokens) if first else ()
        return Allocation(
            tuple(new_pages),
            restores,
            self._reserve_snapshots(req_id, req, computed, total),
            num_computed_tokens=computed,
            num_cached_tokens=req.num_cached_tokens,
            scratch=scratch,
        )

    def _reserve_scratch(
        self, req_id: ReqId, total: int, num_speculative: int
    ) -> tuple[Scratch, ...] | None:
        """Scratch states of a speculative step, for every recurrent group or none.

        The step covers tokens up to ``total``, the last ``s`` drafts: it keeps
        ``total - s + a`` of them for some ``a`` in ``[0, s]``, and for ``a < s`` the state
        after the last kept token is one the forward passes through. So a target group
        takes one page per position ``total - s .. total - 1`` (s pages: vLLM's
        ``num_speculative_blocks``); a draft group one working page.
        """
        if num_speculative <= 0:
            return ()
        taken: list[Scratch] = []
        first_kept = total - num_speculative
        for group in self.state_groups.values():
            positions = [first_kept] if group.group.is_draft else list(range(first_kept, total))
            pages = group.reserve_scratch(req_id, positions)
            if pages is None:
                for g in self.state_groups.values():
                    g.cancel_scratch(req_id)
                return None
            taken += [
                Scratch(group.group_id, p, page) for p, page in zip(positions, pages, strict=True)
            ]
        return tuple(taken)

    def _start(self, req: CachedRequest) -> None:
        req.started = True
        if self._expected_admissions:
            self._expected_admissions -= 1
            self._reserve_live_states()
        req.num_cached_tokens = req.num_computed
        self.stats.query_tokens += req.prompt_len
        self.stats.hit_tokens += req.num_computed
        if self.config.enable_prefix_caching and self.recurrent and self.token_groups:
            kv_only = longest_hybrid_hit(
                list(self.token_groups.values()), req.hashes, len(req.tokens) - 1
            )
            self.stats.hybrid_miss_tokens += max(0, kv_only - req.num_computed)
        if self.config.enable_prefix_caching and self.recurrent:
            req.branch_tokens = self._branch_point(req, req.num_computed)
            if req.branch_tokens > req.num_computed:
                blocks = req.branch_tokens // self.block_tokens
                req.pending_branch = (blocks, req.hashes[blocks - 1])
                self._pending_branches[req.pending_branch] += 1
            prompt_blocks = req.hashes[: req.prompt_len // self.block_tokens]
            self._inflight.update(prompt_blocks)
            self._inflight_parents.update(prompt_blocks[:-1])
            req.num_inflight_blocks = len(prompt_blocks)

    def _branch_point(self, req: CachedRequest, hit_tokens: int) -> int:
        """Where the prompt's shared prefix branches off, if the hit does not reach it (else 0).

        Marconi's speculative insertion (MLSys'25, §4.2) at block granularity: the
        prompt's blocks are shared up to L (each cached in a token group, or in the prompt
        of a started request: a prefix being computed counts before it is cached, or of a
        waiting one: a prefix about to be computed counts too), and another sequence
        continues past L with a different block. L is then a node where
        sequences branch (a system prompt, a tool list, few-shot examples), and its state
        is worth a snapshot. When nothing continues past L, the prompt merely extends a
        sequence that ended there (the next turn of a chat whose snapshot was evicted):
        no branch, no snapshot. Capped at the prompt end: the last prompt token is always
        recomputed. Read-only.
        """
        if not self.config.checkpoint.at_branch_points:
            return 0
        limit = min(len(req.hashes), (req.prompt_len - 1) // self.block_tokens)
        num_blocks = hit_tokens // self.block_tokens
        while num_blocks < limit and self._is_shared(req.hashes[num_blocks]):
            num_blocks += 1
        shared = num_blocks * self.block_tokens
        if shared <= hit_tokens or not self._continues(req.hashes[num_blocks - 1]):
            return 0
        return shared

    def _is_shared(self, block_hash: BlockHash) -> bool:
        if block_hash in self._inflight or block_hash in self._queued:
            return True
        return any(g.pool.lookup(block_hash) is not None for g in self.token_groups.values())

    def _continues(self, block_hash: BlockHash) -> bool:
        """Some started prompt or cached sequence has a block after this one."""
        if block_hash in self._inflight_parents or block_hash in self._queued_parents:
            return True
        return any(g.has_cached_child(block_hash) for g in self.token_groups.values())

    def _stop(self, req: CachedRequest) -> None:
        """Take the request's prompt blocks out of the in-flight sets."""
        blocks = req.hashes[: req.num_inflight_blocks]
        _forget(self._inflight, blocks)
        _forget(self._inflight_parents, blocks[:-1])
        req.num_inflight_blocks = 0
        self._branch_reached(req)

    def _branch_reached(self, req: CachedRequest) -> None:
        """The request's branch point is computed (or it stopped): nobody waits for it."""
        if req.pending_branch is not None:
            _forget(self._pending_branches, [req.pending_branch])
            req.pending_branch = None

    def _undo(self, req_id: ReqId, first: bool, new_pages: list[tuple[PageId, ...]]) -> None:
        if first:  # nothing else is held yet: drop the hit refs and the new pages
            for group in self.groups:
                group.free(req_id)
            self._reqs[req_id].num_computed = 0
            return
        for group, pages in zip(self.groups, new_pages, strict=False):
            group.undo(req_id, pages)

    def _restores(self, req_id: ReqId, hit_tokens: int) -> tuple[StateCopy, ...]:
        if hit_tokens == 0:
            return ()
        return tuple(
            StateCopy(g.group_id, g.reqs[req_id].snapshots[hit_tokens], g.live_page(req_id))
            for g in self.recurrent
        )

    def _snapshot_positions(self, req: CachedRequest, start: int, end: int) -> list[int]:
        return self.config.checkpoint.positions(
            start, end, req.prompt_len, self.block_tokens, req.branch_tokens
        )

    def _reserve_snapshots(
        self, req_id: ReqId, req: CachedRequest, start: int, total: int
    ) -> tuple[Snapshot, ...]:
        """A page per recurrent group for every snapshot position in ``(start, total]``.

        All groups or none for a position (a partial snapshot is useless); the first
        position that does not fit ends the reservations (snapshots are optional, never
        a reason to fail the allocation). When prefills are split at snapshots, only the
        chunk's end can be one.
        """
        if not (self.config.enable_prefix_caching and self.recurrent):
            return ()
        positions = self._snapshot_positions(req, start, total)
        if self.config.split_prefill_at_snapshots:
            positions = [p for p in positions if p == total]
        policy = self.config.checkpoint
        reusable = None
        if policy.reuse_superseded_page:

            def reusable(position: int) -> bool:
                return not policy.keep(
                    position, req.prompt_len, self.block_tokens, req.branch_tokens
                )

        snapshots: list[Snapshot] = []
        for position in positions:
            taken = self._reserve_position(req_id, position, reusable, position > req.prompt_len)
            if taken is None:
                break
            snapshots += taken
        return tuple(snapshots)

    def _reserve_position(
        self,
        req_id: ReqId,
        position: int,
        reusable: Callable[[int], bool] | None,
        generated: bool,
    ) -> list[Snapshot] | None:
        taken: list[Snapshot] = []
        self.allocator.begin()
        for group in self.recurrent:
            page = group.reserve_snapshot(req_id, position, reusable, generated)
            if page is None:
                for g in self.recurrent:
                    g.cancel_snapshot(req_id, position)
                self.allocator.rollback()
                return None
            taken.append(Snapshot(group.group_id, position, page))
        self.allocator.end()
        return taken

    def commit(self, req_id: ReqId, num_computed: int, new_token_ids: Sequence[int] = ()) -> None:
        """Record a finished step: ``num_computed`` tokens are in the cache now.

        ``new_token_ids`` are tokens appended to the sequence (sampled ones), hashed so
        that decode blocks and sequence-end snapshots become reusable too. After a
        speculative step ``num_computed`` may be short of what was allocated (drafts were
        rejected): the live states become the scratch states at ``num_computed``, and the
        KV written past it is never published (its pages are rewritten by later steps).
        """
        req = self._reqs[req_id]
        req.tokens.extend(new_token_ids)
        req.num_computed = num_computed
        if req.pending_branch is not None and num_computed >= req.branch_tokens:
            self._branch_reached(req)
        for state in self.state_groups.values():
            state.settle(req_id, num_computed)
        if not self.config.enable_prefix_caching:
            return
        extend_block_hashes(req.hashes, self._root, req.tokens, self.block_tokens)
        for group in self.cached_groups:
            group.cache(req_id, req)

    def free(self, req_id: ReqId) -> None:
        """Release a finished or preempted request. Its hashed pages stay in the cache."""
        self.allocator.tick()
        for group in self.groups:
            group.free(req_id)
        req = self._reqs.pop(req_id, None)
        if req is not None:
            self._stop(req)

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache (vLLM's ``reset_prefix_cache``), between two steps.

        Afterwards no prompt hits anything cached before: every cached page (KV block or
        state snapshot) is free, and the pages running requests hold are theirs alone,
        unhashed. Running requests are unaffected: their live states and block tables
        stay, and their next commits publish their blocks (and later snapshots) again.
        Counters (queries, hits, evictions) keep counting: they are totals since start.

        Returns:
            the number of cached pages freed, over all groups.
        """
        for group in self.groups:
            group.forget_published()
        return sum(pool.forget_hashes() for pool in self.allocator.pools)

    # ------------------------------------------------------------------ queries

    def num_cached_tokens(self, req_id: ReqId) -> int:
        return self._reqs[req_id].num_cached_tokens

    def num_computed_tokens(self, req_id: ReqId) -> int:
        return self._reqs[req_id].num_computed

    def block_table(self, req_id: ReqId, group_id: int) -> list[PageId]:
        return self.token_groups[group_id].tables.get(req_id, [])

    def live_page(self, req_id: ReqId, group_id: int) -> PageId:
        return self.state_groups[group_id].live_page(req_id)

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    def usage(self) -> CacheUsage:
        """Pages per group, snapshot and eviction counts, prefix-cache totals. Read-only."""
        pools = self.allocator.pools
        groups = tuple(
            GroupUsage(
                group_id=g.group_id,
                kind=g.group.spec.label,
                num_layers=g.group.num_layers,
                page_bytes=g.pool.page_bytes,
                pages_used=g.pool.num_used_pages,
                pages_cached=g.pool.num_cached_pages,
                pages_free=g.pool.num_free_pages,
                chunks=g.pool.num_owned_chunks,
                pages_evicted=self.allocator.num_evicted_pages[g.group_id],
            )
            for g in self.groups
        )
        first_state = self.recurrent[0] if self.recurrent else None  # all snapshot together
        return CacheUsage(
            groups=groups,
            state_pages_used=sum(pools[g].num_used_pages for g in self.state_groups),
            snapshots_taken=first_state.num_snapshots_taken if first_state else 0,
            snapshots_dropped=first_state.num_snapshots_dropped if first_state else 0,
            pages_evicted=sum(self.allocator.num_evicted_pages),
            free_chunks=self.allocator.arena.num_free_chunks,
            num_requests=len(self._reqs),
            prefix_query_tokens=self.stats.query_tokens,
            prefix_hit_tokens=self.stats.hit_tokens,
            prefix_hybrid_miss_tokens=self.stats.hybrid_miss_tokens,
        )

    def check_integrity(self) -> None:
        """Every pool, chunk and request record agrees; call after any operation in tests."""
        self.allocator.check_integrity()
        for group in self.groups:
            group.check_integrity()


def _forget(counts: Counter[_Key], keys: Sequence[_Key]) -> None:
    """Take one count of each key away, dropping the ones that reach zero."""
    for key in keys:
        count = counts[key] - 1
        if count > 0:
            counts[key] = count
        else:
            del counts[key]
