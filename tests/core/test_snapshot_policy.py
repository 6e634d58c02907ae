"""What a request holds of its snapshots, and what the cache keeps of them (CheckpointPolicy).

The default policy: a request holds its live state only; its newest snapshot is parked
(released to the cache at its recency, moved to the back when the request ends);
superseded snapshots that retention keeps are released to the cache (ref 0, hits for
other requests, evictable) at the front of the eviction queue; a decode boundary
rewrites the newest snapshot's page in place when retention would drop it anyway;
the snapshot a request resumed from is released after its restore if it covers
sampled tokens (a previous turn's end) and held to the end if it is a prompt snapshot.
"""

from __future__ import annotations

from core_factories import (
    cached_snapshot_positions,
    decode,
    make_manager,
    parked,
    prefill,
    snapshot_positions,
    step,
    tokens,
)

from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.hashing import BlockHash
from hybridkv.core.ids import ReqId
from hybridkv.core.manager import CacheManager

A, B, C, K, K2 = ReqId("a"), ReqId("b"), ReqId("c"), ReqId("k"), ReqId("k2")
ATTN, STATE = 0, 1


def held_state_pages(mgr: CacheManager, req: ReqId) -> int:
    """State pages the request references: its live page, snapshots and a pending one."""
    state = mgr.recurrent[0].reqs[req]
    return len(state.snapshots) + (state.live is not None) + len(state.pending)


def test_superseded_snapshot_is_released_but_stays_a_hit() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, tokens(20))
    prefill(mgr, "a", 20)  # prompt end 16, then 20
    state_pool = mgr.allocator.pools[STATE]
    page16 = state_pool.lookup(mgr._reqs[A].hashes[3])
    assert page16 is not None
    assert snapshot_positions(mgr, "a") == []
    assert parked(mgr, "a")[0] == 20
    assert state_pool.ref_count(page16) == 0  # nobody pins it ...
    assert page16 in state_pool.cached_pages_oldest_first()  # ... it is evictable
    mgr.add_request(B, tokens(18) + tokens(6, start=900))
    assert mgr.find_hit(B).num_tokens == 16  # ... and a hit while a still runs
    prefill(mgr, "b", 24)
    mgr.check_integrity()


def test_released_superseded_snapshot_is_evicted_before_newer_cached_pages() -> None:
    mgr = make_manager(num_chunks=4)
    mgr.add_request(C, tokens(5, start=500))
    prefill(mgr, "c", 5)  # c's prompt end (4) is cached when c ends
    mgr.free(C)
    state_pool = mgr.allocator.pools[STATE]
    c_page = state_pool.cached_pages_oldest_first()[0]
    mgr.add_request(A, tokens(8))
    prefill(mgr, "a", 8)  # prompt end 4, then 8: 4 is superseded after c's release
    a4 = state_pool.lookup(mgr._reqs[A].hashes[0])
    assert a4 is not None
    a8 = parked(mgr, "a")[1]
    assert state_pool.cached_pages_oldest_first() == [a4, c_page, a8]  # 4 demoted to the front
    mgr.add_request(B, tokens(4, start=900))
    assert mgr.allocate(B, 3, mgr.find_hit(B)) is not None  # needs a live state page
    assert cached_snapshot_positions(mgr, tokens(8)) == [8]  # a's 4 went first
    assert cached_snapshot_positions(mgr, tokens(5, start=500)) == [4]  # c's survived
    mgr.check_integrity()


def test_demoted_snapshot_goes_before_another_groups_older_chunk() -> None:
    # k's KV fills attention chunk 0 and is freed; later a's prompt end (4) is superseded
    # and demoted. b's live state then needs a page with no chunk free: the candidates are
    # the demoted snapshot and k's whole KV chunk, which was used before the snapshot's
    # reservation. Demoted means older than anything: the snapshot goes, k's prefix stays.
    # (Before, the snapshot kept the time of its reservation, and LRU took k's KV.)
    mgr = make_manager(num_chunks=4)
    k_prompt = tokens(13, start=700)
    mgr.add_request(K, k_prompt)
    prefill(mgr, "k", 13)
    mgr.free(K)
    for _ in range(5):
        mgr.allocator.tick()
    mgr.add_request(A, tokens(8))
    prefill(mgr, "a", 8)
    assert cached_snapshot_positions(mgr, tokens(8)) == [4, 8]
    assert mgr.allocator.arena.num_free_chunks == 0
    mgr.add_request(B, tokens(4, start=900))
    assert mgr.allocate(B, 3, mgr.find_hit(B)) is not None
    assert cached_snapshot_positions(mgr, tokens(8)) == [8]  # the demoted 4 went
    mgr.add_request(K2, [*k_prompt, 1, 2, 3])
    assert mgr.find_hit(K2).num_tokens == 12  # k's KV and its prompt-end snapshot stayed
    mgr.check_integrity()


def test_a_chunk_of_demoted_snapshots_is_older_than_any_used_page() -> None:
    # The other direction: attention needs a page, and the state chunk whose pages are
    # all demoted snapshots (released after the attention page was) goes first.
    mgr = make_manager(num_chunks=2)
    alloc = mgr.allocator
    kv, states = alloc.pools[ATTN], alloc.pools[STATE]
    attn_pages = [alloc.allocate(ATTN) for _ in range(3)]  # chunk 0
    for i, page in enumerate(attn_pages):
        assert page is not None and kv.cache(page, BlockHash(b"kv%d" % i), saved_tokens=4)
        kv.release(page, alloc.tick())
    state_pages = [alloc.allocate(STATE) for _ in range(2)]  # chunk 1
    for i, page in enumerate(state_pages):
        assert page is not None and states.cache(page, BlockHash(b"state%d" % i), saved_tokens=4)
        states.release(page, alloc.tick(), demote=True)
    state_chunk = states.chunk_of(state_pages[0])
    assert states.chunk_newest_use(state_chunk) < min(kv.last_used[p] for p in attn_pages)
    page = alloc.allocate(ATTN)
    assert page is not None and kv.chunk_of(page) == state_chunk  # the snapshots' chunk
    assert all(kv.lookup(BlockHash(b"kv%d" % i)) is not None for i in range(3))
    assert all(states.lookup(BlockHash(b"state%d" % i)) is None for i in range(2))
    alloc.check_integrity()


def test_decode_boundary_rewrites_the_newest_snapshot_page_in_place() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, tokens(6))
    prefill(mgr, "a", 6, sampled=100)
    first = step(mgr, "a", 2, [101])  # computes 6, 7: snapshot at 8 (new page)
    assert first is not None and len(first.snapshots) == 1
    page8 = first.snapshots[0].page
    for i in range(4):  # computes 8 .. 11
        alloc = step(mgr, "a", 1, [102 + i])
        assert alloc is not None
        assert held_state_pages(mgr, A) == 1  # live only: the newest is parked
    assert alloc.snapshots[0].page == page8  # the boundary at 12 reused 8's page
    assert alloc.new_pages[STATE] == ()
    seq = tokens(6) + tokens(8, start=100)
    assert cached_snapshot_positions(mgr, seq) == [4, 12]  # 8's hash is gone with it
    assert parked(mgr, "a") == (12, page8)


def test_a_snapshot_another_request_resumed_from_is_not_rewritten() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, tokens(6))
    prefill(mgr, "a", 6, sampled=100)
    decode(mgr, "a", tokens(3, start=101))  # 8 computed: a's newest snapshot is at 8
    position, page8 = parked(mgr, "a")
    assert position == 8
    mgr.add_request(B, tokens(6) + tokens(4, start=100))
    hit = mgr.find_hit(B)
    assert hit.num_tokens == 8
    assert mgr.allocate(B, 2, hit) is not None  # b holds 8 until its restore has run
    alloc = decode(mgr, "a", tokens(3, start=104))[-1]  # computes 9 .. 11: snapshot at 12
    assert alloc.snapshots[0].page != page8
    mgr.commit(B, 10)
    assert mgr.allocator.pools[STATE].ref_count(page8) == 0  # cached, not lost
    seq = tokens(6) + tokens(7, start=100)
    assert 8 in cached_snapshot_positions(mgr, seq)
    mgr.check_integrity()


def test_cancelled_reuse_puts_the_snapshot_back() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, tokens(6))
    prefill(mgr, "a", 6, sampled=100)
    decode(mgr, "a", tokens(3, start=101))  # newest snapshot at 8
    group = mgr.recurrent[0]
    position, page8 = parked(mgr, "a")
    assert position == 8
    assert group.reserve_snapshot(A, 12, lambda position: True) == page8
    assert cached_snapshot_positions(mgr, tokens(6) + tokens(3, start=100)) == [4]
    assert parked(mgr, "a") is None
    group.cancel_snapshot(A, 12)  # what _reserve_snapshots does when another group fails
    assert parked(mgr, "a") == (8, page8)
    assert cached_snapshot_positions(mgr, tokens(6) + tokens(3, start=100)) == [4, 8]
    # parked again at its recency, as park_newest parks it: not demoted to the front,
    # where it would be older than any page of any group and evicted first
    assert mgr.allocator.pools[STATE].cached_pages_oldest_first()[-1] == page8
    mgr.check_integrity()


def test_generated_hit_is_released_after_the_restore() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, tokens(6))
    prefill(mgr, "a", 6, sampled=100)
    decode(mgr, "a", tokens(7, start=101))  # 12 computed: snapshot at 12 covers samples
    mgr.free(A)
    turn2 = tokens(6) + tokens(7, start=100) + tokens(5, start=900)
    mgr.add_request(B, turn2)
    hit = mgr.find_hit(B)
    assert hit.num_tokens == 12
    assert mgr.allocate(B, 4, hit) is not None
    page12 = mgr.recurrent[0].reqs[B].snapshots[12]
    assert mgr.allocator.pools[STATE].ref_count(page12) == 1  # until the restore ran
    mgr.commit(B, 16)
    assert 12 not in snapshot_positions(mgr, "b")
    assert mgr.allocator.pools[STATE].ref_count(page12) == 0
    assert mgr.allocator.pools[STATE].cached_pages_oldest_first()[0] == page12  # demoted
    assert held_state_pages(mgr, B) == 1  # live; its own snapshot at 16 is parked
    assert parked(mgr, "b")[0] == 16
    mgr.check_integrity()


def test_prompt_hit_is_held_until_the_request_ends() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, tokens(13))
    prefill(mgr, "a", 13)  # prompt end 12: prompt tokens only (a shared system prompt)
    mgr.free(A)
    mgr.add_request(B, tokens(13) + tokens(8, start=900))
    prefill(mgr, "b", 21, sampled=5)
    assert 12 in snapshot_positions(mgr, "b")  # still held: running requests protect it
    mgr.free(B)
    assert mgr.allocator.pools[STATE].num_used_pages == 0
    mgr.check_integrity()


def test_decode_interval_snapshots_only_on_its_grid() -> None:
    policy = CheckpointPolicy(decode_interval_tokens=2 * 4)
    mgr = make_manager(num_chunks=16, checkpoint=policy)
    mgr.add_request(A, tokens(6))
    prefill(mgr, "a", 6, sampled=100)
    allocs = decode(mgr, "a", tokens(22, start=101))  # computes 6 .. 27
    taken = [6 + i + 1 for i, a in enumerate(allocs) if a.snapshots]
    assert taken == [8, 16, 24]
    assert parked(mgr, "a")[0] == 24
