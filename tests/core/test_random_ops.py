"""Random schedules against the cache manager, with every invariant checked after each step.

Requests share prefixes, memory is tight (a handful of chunks), so hits, branch points
(a prefix shared with a cached or running prompt), several snapshots in one chunk,
parked snapshots evicted under pressure, evictions across groups, failed allocations
and preemptions all happen, and so do prefix-cache resets between steps and expected
admissions (token groups then evict their own cached pages to leave chunks to states).
After every rule ``check_integrity()`` runs; a failed allocation must leave every count
as it was; at the end, with every request freed, no page is referenced.

The machine also plays the runner: it records which prefix every page holds (the
tokens a KV block or a state has seen) when a step computes it, copies states for
restores and snapshots, and checks that every hit hands out pages holding exactly the
request's own prefix, so a wrong page or a KV hit without its state cannot pass.

Speculative steps (issue 16) run drafts the step may reject: the machine writes the
draft-extended prefix into the KV pages, the live state, every scratch state (the prefix
up to its position) and the snapshots, keeps a random number of drafts, and checks that
the live state then holds exactly the kept prefix and that nothing computed from a
rejected draft is ever handed out by a hit. With a draft model's groups beside the
target's, those never publish a page nor take a hit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from core_factories import hybrid_model, make_manager, page_counts, sliding_hybrid_model
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.eviction import EvictionPolicy
from hybridkv.core.ids import NULL_PAGE, ReqId
from hybridkv.core.manager import Allocation, CacheManager
from hybridkv.core.spec import ModelSpec, with_draft

PREFIXES = [list(range(100 * k, 100 * k + 16)) for k in range(3)]
MAX_REQUESTS = 4

SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# a prompt: the first ``shared`` tokens of one of PREFIXES, then a suffix of its own
PROMPTS = {
    "prefix": st.sampled_from(range(len(PREFIXES))),
    "shared": st.integers(1, 16),
    "suffix": st.lists(st.integers(0, 3), max_size=8),
}


def machine(
    model: Callable[[], ModelSpec],
    policy: EvictionPolicy,
    checkpoint: CheckpointPolicy,
    split: bool = False,
) -> type[RuleBasedStateMachine]:
    class CacheMachine(RuleBasedStateMachine):
        reqs = Bundle("reqs")

        def __init__(self) -> None:
            super().__init__()
            self.mgr: CacheManager = make_manager(
                model(), num_chunks=6, eviction=policy, checkpoint=checkpoint, split=split
            )
            self.next_id = 0
            self.prompt_len: dict[ReqId, int] = {}
            self.next_token = 10_000
            self.holds: dict[tuple[int, int], tuple[int, ...]] = {}  # (group, page) → prefix
            self.queued: dict[ReqId, list[int]] = {}  # announced, not added (the scheduler's queue)

        def _sample(self) -> int:
            self.next_token += 1
            return self.next_token % 7  # few distinct tokens: decodes collide too

        @precondition(lambda self: len(self.prompt_len) < MAX_REQUESTS)
        @rule(target=reqs, **PROMPTS)
        def add(self, prefix: int, shared: int, suffix: list[int]) -> ReqId:
            req_id = ReqId(f"r{self.next_id}")
            self.next_id += 1
            prompt = PREFIXES[prefix][:shared] + suffix
            self.mgr.add_request(req_id, prompt)
            self.prompt_len[req_id] = len(prompt)
            return req_id

        @rule(**PROMPTS)
        def announce(self, prefix: int, shared: int, suffix: list[int]) -> None:
            """A waiting prompt: what it shares becomes a branch point of later admissions."""
            req_id = ReqId(f"q{self.next_id}")
            self.next_id += 1
            self.queued[req_id] = PREFIXES[prefix][:shared] + suffix
            self.mgr.announce(req_id, self.queued[req_id])

        @precondition(lambda self: self.queued and len(self.prompt_len) < MAX_REQUESTS)
        @rule(target=reqs)
        def admit(self) -> ReqId:
            req_id, prompt = next(iter(self.queued.items()))
            del self.queued[req_id]
            self.mgr.add_request(req_id, prompt)
            self.prompt_len[req_id] = len(prompt)
            return req_id

        @rule(count=st.integers(0, 3))
        def expect(self, count: int) -> None:
            """The scheduler expects admissions: token groups leave chunks to live states."""
            self.mgr.expect_admissions(count)

        @precondition(lambda self: self.queued)
        @rule()
        def withdraw(self) -> None:
            req_id = next(iter(self.queued))
            del self.queued[req_id]
            self.mgr.withdraw(req_id)

        @rule(req_id=reqs, chunk=st.integers(1, 12))
        def step(self, req_id: ReqId, chunk: int) -> None:
            if req_id not in self.prompt_len:
                return
            mgr = self.mgr
            record = mgr._reqs[req_id]
            prompt_len = self.prompt_len[req_id]
            hit = None if record.started else mgr.find_hit(req_id)
            start = hit.num_tokens if hit is not None else mgr.num_computed_tokens(req_id)
            if start < prompt_len:
                end = mgr.next_split(req_id, start, min(prompt_len, start + chunk))
            else:
                end = start + 1  # decode
            before = page_counts(mgr)
            table = [list(mgr.block_table(req_id, g.group_id)) for g in self._token_groups()]
            alloc = mgr.allocate(req_id, end - start, hit)
            if alloc is None:
                assert page_counts(mgr) == before
                assert [mgr.block_table(req_id, g.group_id) for g in self._token_groups()] == (
                    table
                )
                return
            computed = mgr.num_computed_tokens(req_id)
            assert computed <= start
            new_end = computed + (end - start)
            self._run(req_id, hit is not None, computed, new_end, alloc)
            sampled = [self._sample()] if new_end >= prompt_len else []
            mgr.commit(req_id, new_end, sampled)
            self._check_snapshots(req_id)

        @rule(req_id=reqs, num_drafts=st.integers(1, 5), kept=st.integers(0, 5))
        def speculate(self, req_id: ReqId, num_drafts: int, kept: int) -> None:
            """A decode with ``num_drafts`` drafts of which the first ``kept`` are accepted."""
            mgr = self.mgr
            if req_id not in self.prompt_len:
                return
            record = mgr._reqs[req_id]
            for _ in range(4):  # bring the request to decoding (only that speculates)
                if record.started and record.num_computed == len(record.tokens) - 1:
                    break
                self.step(req_id, 12)
            else:
                return
            computed = record.num_computed
            before = page_counts(mgr)
            alloc = mgr.allocate(req_id, 1 + num_drafts, num_speculative_tokens=num_drafts)
            if alloc is None:
                assert page_counts(mgr) == before
                return
            total = computed + 1 + num_drafts
            target_scratch = [s for s in alloc.scratch if s.group_id in self._target_states()]
            assert sorted((s.group_id, s.position) for s in target_scratch) == sorted(
                (g, p) for g in self._target_states() for p in range(computed + 1, total)
            )
            drafts = [self._sample() for _ in range(num_drafts)]
            self._run(req_id, False, computed, total, alloc, drafts)
            kept = min(kept, num_drafts)
            bonus = self._sample()
            while kept < num_drafts and bonus == drafts[kept]:  # a rejected draft differs
                bonus = self._sample()
            mgr.commit(req_id, computed + 1 + kept, [*drafts[:kept], bonus])
            self._check_snapshots(req_id)
            kept_prefix = tuple(record.tokens[: computed + 1 + kept])
            for group in mgr.recurrent:  # the rollback: the live state is the kept prefix
                assert self.holds[group.group_id, mgr.live_page(req_id, group.group_id)] == (
                    kept_prefix
                )

        def _run(
            self,
            req_id: ReqId,
            first: bool,
            computed: int,
            new_end: int,
            alloc: Allocation,
            drafts: list[int] | None = None,
        ) -> None:
            """Check what a hit handed out, then write what the step computes (the sequence
            extended by ``drafts`` in a speculative step)."""
            mgr, block = self.mgr, self.mgr.block_tokens
            seq = tuple(mgr._reqs[req_id].tokens) + tuple(drafts or ())
            if first:
                assert computed % block == 0 and computed < len(seq)
                assert len(alloc.restores) == (len(mgr.recurrent) if computed else 0)
                for g in self._token_groups():
                    for i, page in enumerate(
                        mgr.block_table(req_id, g.group_id)[: computed // block]
                    ):
                        if page != NULL_PAGE:
                            assert self.holds[g.group_id, page] == seq[: (i + 1) * block]
            for copy in alloc.restores:
                assert self.holds[copy.group_id, copy.src_page] == seq[:computed]
                self.holds[copy.group_id, copy.dst_page] = seq[:computed]
            for g in self._token_groups():
                table = mgr.block_table(req_id, g.group_id)
                for i in range(computed // block, -(-new_end // block)):
                    if table[i] != NULL_PAGE:
                        self.holds[g.group_id, table[i]] = seq[: min((i + 1) * block, new_end)]
            for group in mgr.recurrent:
                live = mgr.live_page(req_id, group.group_id)
                assert first or self.holds[group.group_id, live] == seq[:computed]
                self.holds[group.group_id, live] = seq[:new_end]
            if first and mgr._reqs[req_id].branch_tokens:
                event("branch point")
            if len({s.position for s in alloc.snapshots}) > 1:
                event("several snapshots in one chunk")
            for snap in alloc.snapshots:  # the state after exactly snap.position tokens
                assert computed < snap.position <= new_end
                assert snap.page != mgr.live_page(req_id, snap.group_id)
                self.holds[snap.group_id, snap.page] = seq[: snap.position]
            for scratch in alloc.scratch:
                assert scratch.page != mgr.live_page(req_id, scratch.group_id)
                if scratch.group_id in self._target_states():
                    self.holds[scratch.group_id, scratch.page] = seq[: scratch.position]
            if first:  # a draft model's groups never take a hit
                for g, pages in enumerate(alloc.new_pages):
                    if mgr.groups[g].group.is_draft and not mgr.groups[g].group.is_recurrent:
                        assert list(pages) == mgr.block_table(req_id, g)

        def _check_snapshots(self, req_id: ReqId) -> None:
            """Every snapshot the request holds has the state of exactly its own prefix."""
            tokens = tuple(self.mgr._reqs[req_id].tokens)
            for group in self.mgr.recurrent:
                for position, page in group.reqs[req_id].snapshots.items():
                    assert self.holds[group.group_id, page] == tokens[:position]

        def _token_groups(self) -> list:
            """The target's token groups (a draft model's pages are never handed out)."""
            return [g for g in self.mgr.cached_groups if not g.group.is_recurrent]

        def _target_states(self) -> set[int]:
            return {g.group_id for g in self.mgr.recurrent}

        @rule(req_id=consumes(reqs))
        def finish(self, req_id: ReqId) -> None:
            if self.prompt_len.pop(req_id, None) is not None:
                self.mgr.free(req_id)

        @rule(req_id=consumes(reqs), target=reqs)
        def preempt(self, req_id: ReqId) -> ReqId:
            """Free and re-add with everything the request has, as vLLM's recompute does."""
            if self.prompt_len.pop(req_id, None) is None:
                return req_id
            seq = list(self.mgr._reqs[req_id].tokens)
            self.mgr.free(req_id)
            self.mgr.add_request(req_id, seq)
            self.prompt_len[req_id] = len(seq)
            return req_id

        @rule()
        def reset(self) -> None:
            """A prefix-cache reset between steps: nothing cached stays, running requests
            keep exactly their live pages (their states and block tables, same contents)."""
            mgr = self.mgr
            live = {
                req_id: (
                    [list(mgr.block_table(req_id, g.group_id)) for g in self._token_groups()],
                    [g.reqs[req_id].live for g in mgr.recurrent if req_id in g.reqs],
                )
                for req_id in self.prompt_len
            }
            cached = sum(pool.num_cached_pages for pool in mgr.allocator.pools)
            freed = mgr.reset_prefix_cache()
            assert freed >= cached
            for pool in mgr.allocator.pools:
                assert pool.num_cached_pages == 0 and pool._hash == {}
            for group in mgr.recurrent:
                for state in group.reqs.values():
                    assert state.snapshots == {} and state.parked is None
            assert live == {
                req_id: (
                    [list(mgr.block_table(req_id, g.group_id)) for g in self._token_groups()],
                    [g.reqs[req_id].live for g in mgr.recurrent if req_id in g.reqs],
                )
                for req_id in self.prompt_len
            }
            for req_id in self.prompt_len:
                if not mgr._reqs[req_id].started:
                    assert mgr.find_hit(req_id).num_tokens == 0
            event("prefix cache reset")

        @invariant()
        def consistent(self) -> None:
            self.mgr.check_integrity()
            assert set(self.mgr._announced) == set(self.queued)
            reqs = self.mgr._reqs.values()
            pending = Counter(r.pending_branch for r in reqs if r.pending_branch is not None)
            assert pending == self.mgr._pending_branches  # branch points still to compute
            assert all(r.num_computed < r.branch_tokens for r in reqs if r.pending_branch)
            for group in self.mgr.groups:
                if group.group.is_draft:
                    assert group.pool.num_cached_pages == 0, "a draft page was published"

        def teardown(self) -> None:
            for req_id in list(self.prompt_len):
                self.mgr.free(req_id)
            for req_id in self.queued:
                self.mgr.withdraw(req_id)
            assert not self.mgr._queued and not self.mgr._queued_parents
            assert not self.mgr._pending_branches
            self.mgr.check_integrity()
            for pool in self.mgr.allocator.pools:
                assert pool.num_used_pages == 0
                assert pool.referenced_pages() == {}
            assert self.mgr.num_requests == 0

    return CacheMachine


SPARSE = CheckpointPolicy()
DENSE = CheckpointPolicy(interval_tokens=8, retention_interval_tokens=8)

TestHybridLru = machine(hybrid_model, EvictionPolicy.LRU, SPARSE).TestCase
TestHybridCost = machine(hybrid_model, EvictionPolicy.COST, DENSE).TestCase
TestSlidingLru = machine(sliding_hybrid_model, EvictionPolicy.LRU, DENSE).TestCase
TestSlidingCost = machine(sliding_hybrid_model, EvictionPolicy.COST, SPARSE).TestCase
# superseded snapshots held until the request ends, pages never reused (the old policy)
LEGACY = CheckpointPolicy(
    release_superseded=False,
    reuse_superseded_page=False,
    demote_superseded=False,
    release_generated_hit=False,
    release_newest=False,
)
TestHybridLegacy = machine(hybrid_model, EvictionPolicy.LRU, LEGACY).TestCase
# decode snapshots every 2 blocks, with retention keeping every 2nd block of the prompt
SPARSE_DECODE = CheckpointPolicy(decode_interval_tokens=8, retention_interval_tokens=8)
TestHybridSparseDecode = machine(hybrid_model, EvictionPolicy.COST, SPARSE_DECODE).TestCase
# a prefill grid every 6 tokens (floored to block 4: 4, 12, 16, 24, ...), the default
# policy's 4096 scaled to these prompts
GRID = CheckpointPolicy(prefill_grid_tokens=6)
TestHybridGrid = machine(hybrid_model, EvictionPolicy.LRU, GRID).TestCase
# prefill chunks cut at every snapshot (the hybridkv-prompt-end design)
TestHybridSplit = machine(hybrid_model, EvictionPolicy.LRU, SPARSE, split=True).TestCase
# a draft model (same specs as the target, groups of its own) beside the target
TestDraftModel = machine(
    lambda: with_draft(hybrid_model(), hybrid_model()), EvictionPolicy.LRU, DENSE
).TestCase
for case in (
    TestDraftModel,
    TestHybridLru,
    TestHybridCost,
    TestSlidingLru,
    TestSlidingCost,
    TestHybridLegacy,
    TestHybridSparseDecode,
    TestHybridSplit,
    TestHybridGrid,
):
    case.settings = SETTINGS
del case  # a module-level TestCase would be collected twice
