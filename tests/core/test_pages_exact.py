"""Exact page ids through the pool, the arena and cross-group eviction (like vLLM's core tests).

Layouts from core_factories: block 4, chunk 192 B = 3 attention pages (64 B) = 2 state
pages (80 B padded to 96 B). Page ids are ``byte_offset // page_bytes``, so attention
chunk c holds pages 3c..3c+2 and state chunk c holds pages 2c, 2c+1.
"""

from __future__ import annotations

from core_factories import (
    attention_model,
    hybrid_model,
    make_layout,
    make_manager,
    page_counts,
    prefill,
    sliding_hybrid_model,
    tokens,
)

from hybridkv.core.allocator import PageAllocator
from hybridkv.core.hashing import BlockHash
from hybridkv.core.ids import NULL_PAGE, PageId, ReqId

ATTN, STATE = 0, 1


def h(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(16, "little"))


def test_free_pages_come_from_the_fullest_chunk_first() -> None:
    mgr = make_manager(attention_model(), num_chunks=3, caching=False)
    for req, n in (("a", 8), ("b", 12)):
        mgr.add_request(ReqId(req), tokens(n))
        assert mgr.allocate(ReqId(req), n) is not None
    assert mgr.block_table(ReqId("a"), ATTN) == [0, 1]
    assert mgr.block_table(ReqId("b"), ATTN) == [2, 3, 4]
    mgr.free(ReqId("a"))  # chunk 0: pages 0, 1 free; chunk 1: page 5 free
    mgr.add_request(ReqId("c"), tokens(12))
    assert mgr.allocate(ReqId("c"), 12) is not None
    assert mgr.block_table(ReqId("c"), ATTN) == [5, 0, 1]  # the fuller chunk 1 first
    mgr.check_integrity()


def test_freed_tail_blocks_are_evicted_first() -> None:
    mgr = make_manager(attention_model(), num_chunks=2)
    mgr.add_request(ReqId("a"), tokens(13))
    prefill(mgr, "a", 13)
    assert mgr.block_table(ReqId("a"), ATTN) == [0, 1, 2, 3]
    mgr.free(ReqId("a"))  # blocks 0-2 are full and cached, block 3 is free
    pool = mgr.allocator.pools[ATTN]
    assert pool.cached_pages_oldest_first() == [2, 1, 0]
    assert mgr.allocator.arena.owner(1) is None  # chunk 1 held only free pages
    mgr.add_request(ReqId("b"), tokens(24, start=1000))
    assert mgr.allocate(ReqId("b"), 24) is not None
    # the free chunk, then evictions: the deepest block of the prefix first
    assert mgr.block_table(ReqId("b"), ATTN) == [3, 4, 5, 2, 1, 0]
    assert mgr.allocator.num_evicted_pages == [3]
    mgr.check_integrity()


def test_chunk_goes_back_to_the_arena_when_all_its_pages_are_free() -> None:
    mgr = make_manager(attention_model(), num_chunks=2, caching=False)
    arena = mgr.allocator.arena
    mgr.add_request(ReqId("a"), tokens(20))
    assert mgr.allocate(ReqId("a"), 20) is not None
    assert [arena.owner(c) for c in range(2)] == [ATTN, ATTN]
    mgr.free(ReqId("a"))
    assert [arena.owner(c) for c in range(2)] == [None, None]
    assert arena.num_free_chunks == 2
    assert mgr.allocator.pools[ATTN].num_owned_chunks == 0
    mgr.check_integrity()


def test_cached_pages_keep_their_chunk_until_evicted() -> None:
    mgr = make_manager(attention_model(), num_chunks=2)
    mgr.add_request(ReqId("a"), tokens(9))
    prefill(mgr, "a", 9)
    mgr.free(ReqId("a"))
    assert mgr.allocator.arena.owner(0) == ATTN  # two cached pages hold chunk 0
    assert page_counts(mgr).cached == (2,)
    mgr.check_integrity()


def test_state_chunk_with_a_snapshot_is_reclaimed_for_attention() -> None:
    alloc = PageAllocator(make_layout(hybrid_model(), num_chunks=2))
    state = alloc.pools[STATE]
    snap = alloc.allocate(STATE)
    assert snap == 0  # chunk 0, first state page
    assert state.cache(snap, h(1), saved_tokens=8)
    state.release(snap, alloc.tick())
    assert [alloc.allocate(ATTN) for _ in range(3)] == [3, 4, 5]  # chunk 1
    alloc.tick()
    assert alloc.allocate(ATTN) == 0  # chunk 0 handed over: the snapshot is gone
    assert state.lookup(h(1)) is None
    assert alloc.arena.owner(0) == ATTN
    assert alloc.num_evicted_pages == [0, 1]
    alloc.check_integrity()


def test_attention_chunk_of_cached_blocks_is_reclaimed_for_a_state() -> None:
    alloc = PageAllocator(make_layout(hybrid_model(), num_chunks=2))
    attn = alloc.pools[ATTN]
    pages = [alloc.allocate(ATTN) for _ in range(3)]
    assert pages == [0, 1, 2]
    for i, page in enumerate(pages):
        assert page is not None
        attn.cache(page, h(i), saved_tokens=4)
        attn.release(page, alloc.tick())
    assert [alloc.allocate(STATE) for _ in range(2)] == [2, 3]  # chunk 1
    alloc.tick()
    assert alloc.allocate(STATE) == 0  # chunk 0, after evicting three attention blocks
    assert attn.num_cached_pages == 0
    assert alloc.num_evicted_pages == [3, 0]
    alloc.check_integrity()


def test_chunk_with_a_referenced_page_is_never_reclaimed() -> None:
    alloc = PageAllocator(make_layout(hybrid_model(), num_chunks=1))
    live = alloc.allocate(STATE)
    snap = alloc.allocate(STATE)
    assert (live, snap) == (0, 1)
    assert snap is not None
    alloc.pools[STATE].cache(snap, h(1), saved_tokens=4)
    alloc.pools[STATE].release(snap, alloc.tick())
    assert alloc.allocate(ATTN) is None  # the live state pins the only chunk
    assert alloc.pools[STATE].lookup(h(1)) == snap
    alloc.check_integrity()


def test_lru_picks_the_older_of_own_page_and_other_chunk() -> None:
    alloc = PageAllocator(make_layout(hybrid_model(), num_chunks=2))
    attn, state = alloc.pools[ATTN], alloc.pools[STATE]
    snap = alloc.allocate(STATE)  # chunk 0
    assert snap == 0
    state.cache(snap, h(100), saved_tokens=8)
    pages = [alloc.allocate(ATTN) for _ in range(3)]  # chunk 1
    assert pages == [3, 4, 5]
    state.release(snap, alloc.tick())  # t=1: the snapshot is the oldest
    for i, page in enumerate(pages[:2]):
        assert page is not None
        attn.cache(page, h(i), saved_tokens=4)
        attn.release(page, alloc.tick())  # t=2, 3
    assert alloc.allocate(ATTN) == 0  # the state chunk (t=1) goes before page 3 (t=2)
    assert alloc.allocate(ATTN) == 1  # then the rest of that chunk
    alloc.check_integrity()


def test_tail_chunk_is_used_by_attention_only() -> None:
    layout = make_layout(hybrid_model(), num_chunks=1, tail_bytes=64)  # one attention page
    assert layout.pages_in_chunk(STATE, 1) == 0
    alloc = PageAllocator(layout)
    assert alloc.allocate(STATE) == 0
    assert alloc.allocate(STATE) == 1
    assert alloc.allocate(STATE) is None  # the tail cannot hold a state
    assert alloc.allocate(ATTN) == 3  # the tail's page: byte offset 192 // 64
    assert alloc.allocate(ATTN) is None
    assert alloc.arena.owner(1) == ATTN
    alloc.check_integrity()


def test_attention_takes_the_tail_before_a_full_chunk() -> None:
    """Regression: attention filled the last full chunk before the tail, so a state that
    came next found only the tail, which cannot hold it; the planner counts the tail as KV."""
    layout = make_layout(hybrid_model(), num_chunks=2, tail_bytes=64)  # one attention page
    alloc = PageAllocator(layout)
    assert alloc.allocate(ATTN) == 6  # the tail's page: byte offset 384 // 64
    assert alloc.allocate(ATTN) == 0  # then the lowest full chunk
    assert alloc.allocate(STATE) == 2  # the other full chunk is still free for a state
    assert alloc.arena.owner(2) == ATTN
    alloc.check_integrity()


def test_sliding_window_blocks_out_of_the_window_become_null() -> None:
    mgr = make_manager(sliding_hybrid_model(window_tokens=8), num_chunks=6)
    mgr.add_request(ReqId("a"), tokens(17))
    prefill(mgr, "a", 17, sampled=500)
    # next query at position 17 sees [10, 17]: blocks 2.. are needed, 0 and 1 are not
    table = mgr.block_table(ReqId("a"), 1)
    assert table[:2] == [NULL_PAGE, NULL_PAGE]
    assert NULL_PAGE not in table[2:]
    assert NULL_PAGE not in mgr.block_table(ReqId("a"), 0)  # full attention keeps all
    mgr.check_integrity()


def test_sliding_window_hit_takes_only_the_window() -> None:
    mgr = make_manager(sliding_hybrid_model(window_tokens=8), num_chunks=6)
    mgr.add_request(ReqId("a"), tokens(17))
    prefill(mgr, "a", 17, sampled=500)
    mgr.free(ReqId("a"))
    mgr.add_request(ReqId("b"), tokens(17))
    hit = mgr.find_hit(ReqId("b"))
    assert hit.num_tokens == 16  # prompt end snapshot of a
    assert mgr.allocate(ReqId("b"), 1, hit) is not None
    table = mgr.block_table(ReqId("b"), 1)
    # a query at 16 sees [9, 16]: blocks 2 and 3 come from the cache, block 4 is new
    assert table[:2] == [NULL_PAGE, NULL_PAGE]
    assert all(PageId(p) != NULL_PAGE for p in table[2:])
    assert len(table) == 5
    mgr.check_integrity()
