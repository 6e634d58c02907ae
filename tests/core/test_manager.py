"""CacheManager semantics: hybrid hits, where snapshots are taken and kept, failures."""

from __future__ import annotations

import pytest
from core_factories import (
    BLOCK,
    attention_model,
    cached_snapshot_positions,
    decode,
    make_manager,
    page_counts,
    parked,
    prefill,
    snapshot_positions,
    tokens,
)

from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.ids import ReqId
from hybridkv.core.manager import Snapshot, StateCopy

A, B, C = ReqId("a"), ReqId("b"), ReqId("c")
ATTN, STATE = 0, 1
# the policy before superseded snapshots were released (kept as an option)
LEGACY = CheckpointPolicy(
    release_superseded=False,
    reuse_superseded_page=False,
    demote_superseded=False,
    release_generated_hit=False,
    release_newest=False,
)


@pytest.mark.parametrize(
    ("prompt_len", "prompt_end"), [(5, 4), (8, 4), (9, 8), (12, 8), (13, 12), (17, 16)]
)
def test_prompt_end_snapshot_at_floor_of_prompt_minus_one(prompt_len: int, prompt_end: int) -> None:
    mgr = make_manager(num_chunks=8)
    mgr.add_request(A, tokens(prompt_len))
    assert mgr.next_split(A, 0, prompt_len) == prompt_len  # the snapshot is inside the chunk
    allocs = prefill(mgr, "a", prompt_len)
    assert len(allocs) == 1
    snapshot_page = allocs[0].snapshots[0].page
    assert allocs[0].snapshots[0] == Snapshot(STATE, prompt_end, snapshot_page)
    assert prompt_end in cached_snapshot_positions(mgr, tokens(prompt_len))
    mgr.free(A)
    mgr.add_request(B, tokens(prompt_len))  # the same prompt again
    assert mgr.find_hit(B).num_tokens == prompt_end


@pytest.mark.parametrize("prompt_len", [5, 9, 13])
def test_split_mode_cuts_the_prefill_at_the_prompt_end(prompt_len: int) -> None:
    """``split_prefill_at_snapshots``: the snapshot is the state at a chunk's end."""
    mgr = make_manager(num_chunks=8, split=True)
    mgr.add_request(A, tokens(prompt_len))
    prompt_end = (prompt_len - 1) // BLOCK * BLOCK
    assert mgr.next_split(A, 0, prompt_len) == prompt_end
    allocs = prefill(mgr, "a", prompt_len)
    assert [a.num_computed_tokens for a in allocs] == [0, prompt_end]
    assert [[s.position for s in a.snapshots] for a in allocs] == [[prompt_end], []]


def test_no_kv_hit_without_its_state() -> None:
    policy = CheckpointPolicy(at_prompt_end=False, at_sequence_end=False)
    mgr = make_manager(num_chunks=8, checkpoint=policy)
    mgr.add_request(A, tokens(20))
    allocs = prefill(mgr, "a", 20)
    assert all(a.snapshots == () for a in allocs)
    mgr.free(A)
    assert mgr.allocator.pools[ATTN].num_cached_pages == 5  # every block of a is cached
    mgr.add_request(B, tokens(30))
    assert mgr.find_hit(B).num_tokens == 0  # but no snapshot to resume the state from


def test_hit_is_the_snapshot_not_the_longest_kv_prefix() -> None:
    mgr = make_manager(num_chunks=8)
    mgr.add_request(A, tokens(20))
    prefill(mgr, "a", 20)  # snapshots at 16 (prompt end) and 20 (the whole prompt)
    assert cached_snapshot_positions(mgr, tokens(20)) == [16, 20]
    assert snapshot_positions(mgr, "a") == []  # 16 was released to the cache ...
    assert parked(mgr, "a") is not None and parked(mgr, "a")[0] == 20  # ... and 20 parked
    mgr.free(A)
    mgr.add_request(B, tokens(18) + tokens(12, start=900))  # shares 18 tokens with a
    assert mgr.find_hit(B).num_tokens == 16  # KV covers 16 too; the next snapshot is 20
    mgr.add_request(C, tokens(20) + tokens(12, start=900))
    assert mgr.find_hit(C).num_tokens == 20


def test_hit_restores_the_snapshot_into_a_fresh_live_page() -> None:
    mgr = make_manager(num_chunks=8)
    mgr.add_request(A, tokens(13))
    prefill(mgr, "a", 13)
    newest = parked(mgr, "a")
    assert newest is not None and newest[0] == 12
    snapshot = newest[1]
    mgr.free(A)
    mgr.add_request(B, tokens(13))
    hit = mgr.find_hit(B)
    assert hit.num_tokens == 12
    alloc = mgr.allocate(B, 1, hit)
    assert alloc is not None
    live = mgr.live_page(B, STATE)
    assert live != snapshot
    assert alloc.restores == (StateCopy(STATE, snapshot, live),)
    assert mgr.num_computed_tokens(B) == 12
    assert mgr.num_cached_tokens(B) == 12
    assert len(alloc.new_pages[ATTN]) == 1  # block 3 is recomputed, blocks 0-2 are shared
    assert mgr.stats.hit_tokens == 12
    mgr.check_integrity()


def test_decode_keeps_only_the_latest_boundary_snapshot_and_the_prompt_end() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, tokens(6))
    prefill(mgr, "a", 6, sampled=100)
    assert parked(mgr, "a")[0] == 4  # the request holds none: its newest is parked
    decode(mgr, "a", tokens(2, start=101))  # computes positions 6 and 7
    assert parked(mgr, "a")[0] == 8
    decode(mgr, "a", tokens(20, start=103))  # up to 28 tokens computed
    assert mgr.num_computed_tokens(A) == 28
    assert parked(mgr, "a")[0] == 28
    assert snapshot_positions(mgr, "a") == []
    seq = tokens(6) + tokens(23, start=100)
    assert cached_snapshot_positions(mgr, seq) == [4, 28]  # dropped ones left the cache


def test_legacy_policy_holds_superseded_snapshots_until_the_request_ends() -> None:
    mgr = make_manager(num_chunks=16, checkpoint=LEGACY)
    mgr.add_request(A, tokens(6))
    prefill(mgr, "a", 6, sampled=100)
    decode(mgr, "a", tokens(22, start=101))  # up to 28 tokens computed
    assert snapshot_positions(mgr, "a") == [4, 28]
    seq = tokens(6) + tokens(23, start=100)
    assert cached_snapshot_positions(mgr, seq) == [4, 28]


def test_retention_interval_keeps_sparse_snapshots() -> None:
    policy = CheckpointPolicy(retention_interval_tokens=4 * BLOCK)
    mgr = make_manager(num_chunks=16, checkpoint=policy)
    mgr.add_request(A, tokens(6))
    prefill(mgr, "a", 6, sampled=100)
    decode(mgr, "a", tokens(35, start=101))  # 40 tokens computed
    seq = tokens(6) + tokens(36, start=100)
    assert cached_snapshot_positions(mgr, seq) == [4, 16, 32, 40]
    assert snapshot_positions(mgr, "a") == []  # 4, 16, 32 are cached, not held
    assert parked(mgr, "a")[0] == 40


def test_interval_checkpoints_are_taken_inside_one_chunk() -> None:
    policy = CheckpointPolicy(interval_tokens=2 * BLOCK)
    mgr = make_manager(num_chunks=16, checkpoint=policy)
    mgr.add_request(A, tokens(30))
    allocs = prefill(mgr, "a", 30)
    assert len(allocs) == 1
    assert [s.position for s in allocs[0].snapshots] == [8, 16, 24, 28]
    assert len({s.page for s in allocs[0].snapshots}) == 4
    assert cached_snapshot_positions(mgr, tokens(30)) == [8, 16, 24, 28]
    assert parked(mgr, "a")[0] == 28


def test_interval_checkpoints_split_prefill_chunks_in_split_mode() -> None:
    policy = CheckpointPolicy(interval_tokens=2 * BLOCK)
    mgr = make_manager(num_chunks=16, checkpoint=policy, split=True)
    mgr.add_request(A, tokens(30))
    assert mgr.next_split(A, 0, 30) == 8
    assert mgr.next_split(A, 8, 30) == 16
    assert mgr.next_split(A, 16, 20) == 20  # no checkpoint strictly inside
    assert mgr.next_split(A, 24, 30) == 28  # the prompt end
    assert mgr.next_split(A, 28, 30) == 30
    allocs = prefill(mgr, "a", 30)
    assert [len(a.snapshots) for a in allocs] == [1, 1, 1, 1, 0]
    assert cached_snapshot_positions(mgr, tokens(30)) == [8, 16, 24, 28]
    assert parked(mgr, "a")[0] == 28


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no_caching"])
def test_next_split_without_recurrent_groups_or_caching_is_the_chunk(caching: bool) -> None:
    mgr = make_manager(attention_model(), num_chunks=16, caching=caching, split=True)
    mgr.add_request(A, tokens(30))
    assert mgr.next_split(A, 0, 30) == 30
    mgr = make_manager(num_chunks=16, caching=False, split=True)
    mgr.add_request(A, tokens(30))
    assert mgr.next_split(A, 0, 30) == 30


def test_second_turn_resumes_at_the_last_boundary_of_the_first() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, tokens(9))
    prefill(mgr, "a", 9, sampled=100)
    decode(mgr, "a", tokens(9, start=101))  # 18 computed, 19 tokens (last one unseen)
    turn1 = tokens(9) + tokens(10, start=100)
    mgr.free(A)
    mgr.add_request(B, [*turn1, 7, 7, 7, 7, 7])
    assert mgr.find_hit(B).num_tokens == 16  # the last block boundary turn 1 computed
    prefill(mgr, "b", len(turn1) + 5)
    mgr.check_integrity()


def test_allocation_failure_returns_none_and_changes_nothing() -> None:
    mgr = make_manager(num_chunks=3)
    mgr.add_request(A, tokens(13))
    prefill(mgr, "a", 13)
    mgr.free(A)
    mgr.add_request(B, tokens(60, start=1000))
    before = page_counts(mgr)
    queues = [p.cached_pages_oldest_first() for p in mgr.allocator.pools]
    assert mgr.allocate(B, 40, mgr.find_hit(B)) is None  # evicts a's pages, then fails
    mgr.check_integrity()
    assert page_counts(mgr) == before
    assert [p.cached_pages_oldest_first() for p in mgr.allocator.pools] == queues
    assert mgr.allocator.num_evicted_pages == [0, 0]
    assert mgr.num_computed_tokens(B) == 0
    mgr.add_request(C, tokens(13))
    assert mgr.find_hit(C).num_tokens == 12  # a's prefix survived the failed attempt


def test_failed_decode_growth_keeps_the_running_request() -> None:
    mgr = make_manager(attention_model(), num_chunks=1)
    mgr.add_request(A, tokens(11))
    prefill(mgr, "a", 11, sampled=100)
    table = list(mgr.block_table(A, ATTN))
    before = page_counts(mgr)
    assert mgr.allocate(A, 8) is None
    assert mgr.block_table(A, ATTN) == table
    assert page_counts(mgr) == before
    mgr.check_integrity()


def test_failed_hit_allocation_keeps_the_hit_cached() -> None:
    mgr = make_manager(attention_model(), num_chunks=2)
    mgr.add_request(A, tokens(13))
    prefill(mgr, "a", 13)
    mgr.free(A)
    mgr.add_request(B, tokens(12) + tokens(40, start=500))
    hit = mgr.find_hit(B)
    assert hit.num_tokens == 12
    before = page_counts(mgr)
    assert mgr.allocate(B, 40, hit) is None
    assert page_counts(mgr) == before
    assert mgr.find_hit(B).num_tokens == 12
    mgr.check_integrity()


def test_caching_off_gives_no_hits_and_no_snapshots() -> None:
    mgr = make_manager(num_chunks=8, caching=False)
    mgr.add_request(A, tokens(20))
    allocs = prefill(mgr, "a", 20)
    assert all(a.snapshots == () for a in allocs)
    mgr.free(A)
    assert page_counts(mgr).cached == (0, 0)
    assert page_counts(mgr).used == (0, 0)
    mgr.add_request(B, tokens(20))
    assert mgr.find_hit(B).num_tokens == 0


def test_duplicate_prefix_from_two_concurrent_requests() -> None:
    mgr = make_manager(num_chunks=12)
    for req in (A, B):
        mgr.add_request(req, tokens(13))
        assert mgr.allocate(req, 12, mgr.find_hit(req)) is not None  # both before any commit
    for req in (A, B):
        mgr.commit(req, 12)
        mgr.check_integrity()
    assert mgr.allocator.pools[ATTN].num_cached_pages == 0  # all still referenced
    assert parked(mgr, "a") is not None  # a published first
    assert mgr.recurrent[0].reqs[B].parked is None  # b's copy went back
    mgr.free(A)
    mgr.free(B)
    assert page_counts(mgr).cached == (3, 1)
    assert page_counts(mgr).used == (0, 0)
    mgr.add_request(C, tokens(13))
    assert mgr.find_hit(C).num_tokens == 12
    mgr.check_integrity()


def test_add_request_twice_is_an_error() -> None:
    mgr = make_manager()
    mgr.add_request(A, tokens(4))
    with pytest.raises(ValueError, match="already"):
        mgr.add_request(A, tokens(4))


def test_checkpoint_intervals_must_be_block_multiples() -> None:
    with pytest.raises(ValueError, match="multiple of the block size"):
        make_manager(checkpoint=CheckpointPolicy(interval_tokens=BLOCK + 1))


def test_preempted_request_resumes_from_its_own_snapshot() -> None:
    mgr = make_manager(num_chunks=12)
    mgr.add_request(A, tokens(9))
    prefill(mgr, "a", 9, sampled=100)
    decode(mgr, "a", tokens(4, start=101))  # 12 computed: a boundary snapshot at 12
    mgr.free(A)  # preempted: resumes with everything it has as the prompt
    mgr.add_request(A, tokens(9) + tokens(5, start=100))
    assert mgr.find_hit(A).num_tokens == 12


def test_failed_allocation_puts_back_what_it_evicted_across_groups() -> None:
    mgr = make_manager(num_chunks=4)
    mgr.add_request(A, tokens(9))
    prefill(mgr, "a", 9)
    mgr.free(A)
    # chunk 0: attention pages 0, 1 cached; chunk 1: state page 3 (a's snapshot) cached
    assert [mgr.allocator.arena.owner(c) for c in range(4)] == [ATTN, STATE, None, None]
    before = page_counts(mgr)
    queues = [p.cached_pages_oldest_first() for p in mgr.allocator.pools]
    mgr.add_request(B, tokens(41, start=1000))
    # attention takes the free page, both free chunks, evicts pages 1 and 0 and then the
    # snapshot's chunk; the live state finds nothing left
    assert mgr.allocate(B, 40, mgr.find_hit(B)) is None
    mgr.check_integrity()
    assert page_counts(mgr) == before
    assert [p.cached_pages_oldest_first() for p in mgr.allocator.pools] == queues
    assert [mgr.allocator.arena.owner(c) for c in range(4)] == [ATTN, STATE, None, None]
    mgr.add_request(C, tokens(9))
    assert mgr.find_hit(C).num_tokens == 8


def test_hybrid_misses_count_cached_kv_without_a_state_snapshot() -> None:
    """Prompt tokens whose KV every attention group held, lost for want of a snapshot."""
    policy = CheckpointPolicy(at_prompt_end=False, at_sequence_end=False)
    mgr = make_manager(num_chunks=8, checkpoint=policy)
    mgr.add_request(A, tokens(20))
    prefill(mgr, "a", 20)
    mgr.free(A)
    mgr.add_request(B, tokens(30))  # its first 20 tokens' KV is cached, no state is
    prefill(mgr, "b", 30)
    usage = mgr.usage()
    assert (usage.prefix_query_tokens, usage.prefix_hit_tokens) == (50, 0)
    assert usage.prefix_hybrid_miss_tokens == 20


def test_no_hybrid_miss_when_the_snapshot_covers_the_kv_hit() -> None:
    mgr = make_manager(num_chunks=8)
    mgr.add_request(A, tokens(20))
    prefill(mgr, "a", 20)  # snapshots at 16 and 20
    mgr.free(A)
    mgr.add_request(B, tokens(18) + tokens(12, start=900))  # KV 16, snapshot 16
    prefill(mgr, "b", 30)
    mgr.free(B)
    mgr.add_request(C, tokens(24))  # KV 20 (a's blocks), snapshot at 20
    prefill(mgr, "c", 24)
    usage = mgr.usage()
    assert usage.prefix_hit_tokens == 16 + 20
    assert usage.prefix_hybrid_miss_tokens == 0


def test_reset_prefix_cache_frees_every_cached_page_and_nothing_hits() -> None:
    mgr = make_manager(num_chunks=8)
    mgr.add_request(A, tokens(20))
    prefill(mgr, "a", 20)
    decode(mgr, "a", [1, 2, 3])
    mgr.free(A)
    cached = page_counts(mgr).cached
    assert cached[ATTN] > 0 and cached[STATE] > 0
    assert mgr.reset_prefix_cache() == sum(cached)
    mgr.check_integrity()
    assert page_counts(mgr) == (
        (0, 0),
        (0, 0),
        (0, 0),
        (0, 0),
        8,
    )  # every chunk back in the arena
    mgr.add_request(B, tokens(20))
    assert mgr.find_hit(B).num_tokens == 0
    assert mgr.reset_prefix_cache() == 0  # idempotent


def test_reset_prefix_cache_keeps_running_requests_live_pages_only() -> None:
    """A running request keeps its block table and live state; its snapshots go;
    its later steps publish its blocks again, so its next turn hits once more."""
    mgr = make_manager(num_chunks=8)
    mgr.add_request(A, tokens(20))
    prefill(mgr, "a", 20)
    table, live = list(mgr.block_table(A, ATTN)), mgr.live_page(A, STATE)
    assert parked(mgr, "a") is not None  # its prompt-end snapshot, released to the cache
    mgr.reset_prefix_cache()
    mgr.check_integrity()
    assert mgr.block_table(A, ATTN) == table and mgr.live_page(A, STATE) == live
    assert snapshot_positions(mgr, "a") == [] and parked(mgr, "a") is None
    counts = page_counts(mgr)
    assert counts.cached == (0, 0) and counts.used == (len(table), 1)  # all free or live
    mgr.add_request(B, tokens(20))
    assert mgr.find_hit(B).num_tokens == 0
    decode(mgr, "a", [1, 2, 3, 4])  # 24 computed: a snapshot at the block boundary 24
    seq = list(mgr._reqs[A].tokens)
    mgr.free(A)
    mgr.check_integrity()
    mgr.add_request(C, [*seq, 7, 8])
    assert mgr.find_hit(C).num_tokens == 24
