"""Random schedules against the cache manager, with every invariant checked after each step.

Requests share prefixes, memory is tight (a handful of chunks), so hits, branch points
(a prefix shared with a cached or running prompt), several snapshots in one chunk,
parked snapshots evicted under pressure, evictions across groups, failed allocations
and preemptions all happen. After every rule
``check_integrity()`` runs; a failed allocation must leave every count as it was; at
the end, with every request freed, no page is referenced.

The machine also plays the runner: it records which prefix every page holds (the
tokens a KV block or a state has seen) when a step computes it, copies states for
restores and snapshots, and checks that every hit hands out pages holding exactly the
request's own prefix, so a wrong page or a KV hit without its state cannot pass.
"""

from __future__ import annotations

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
from hybridkv.core.spec import ModelSpec

PREFIXES = [list(range(100 * k, 100 * k + 16)) for k in range(3)]
MAX_REQUESTS = 4

SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


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

        def _sample(self) -> int:
            self.next_token += 1
            return self.next_token % 7  # few distinct tokens: decodes collide too

        @precondition(lambda self: len(self.prompt_len) < MAX_REQUESTS)
        @rule(
            target=reqs,
            prefix=st.sampled_from(range(len(PREFIXES))),
            shared=st.integers(1, 16),
            suffix=st.lists(st.integers(0, 3), max_size=8),
        )
        def add(self, prefix: int, shared: int, suffix: list[int]) -> ReqId:
            req_id = ReqId(f"r{self.next_id}")
            self.next_id += 1
            prompt = PREFIXES[prefix][:shared] + suffix
            self.mgr.add_request(req_id, prompt)
            self.prompt_len[req_id] = len(prompt)
            return req_id

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

        def _run(
            self, req_id: ReqId, first: bool, computed: int, new_end: int, alloc: Allocation
        ) -> None:
            """Check what a hit handed out, then write what the step computes."""
            mgr, block = self.mgr, self.mgr.block_tokens
            seq = tuple(mgr._reqs[req_id].tokens)
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

        def _token_groups(self) -> list:
            return [g for g in self.mgr.groups if not g.group.is_recurrent]

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

        @invariant()
        def consistent(self) -> None:
            self.mgr.check_integrity()

        def teardown(self) -> None:
            for req_id in list(self.prompt_len):
                self.mgr.free(req_id)
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
# prefill chunks cut at every snapshot (the hybridkv-prompt-end design)
TestHybridSplit = machine(hybrid_model, EvictionPolicy.LRU, SPARSE, split=True).TestCase
for case in (
    TestHybridLru,
    TestHybridCost,
    TestSlidingLru,
    TestSlidingCost,
    TestHybridLegacy,
    TestHybridSparseDecode,
    TestHybridSplit,
):
    case.settings = SETTINGS
del case  # a module-level TestCase would be collected twice
