"""Chunks kept for the live states of requests about to be admitted (the live-state reserve).

A state page is a whole chunk in big models, and a chunk comes back from attention only
when none of its pages is referenced. While the scheduler expects admissions
(``CacheManager.expect_admissions``), a token group that needs a page gives up one of
its own cached pages rather than take a chunk the expected live states need
(``PageAllocator.reserve``). The tiny hybrid model: a chunk is 3 attention pages or 2
state pages; snapshots are off here, so the state group holds live states only.
"""

from __future__ import annotations

import pytest
from core_factories import (
    hybrid_model,
    make_layout,
    make_manager,
    page_counts,
    prefill,
    step,
    tokens,
)

from hybridkv.core.allocator import PageAllocator
from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.hashing import BlockHash
from hybridkv.core.ids import ReqId
from hybridkv.core.manager import CacheManager

ATTN, STATE = 0, 1
A, B, W, X = ReqId("a"), ReqId("b"), ReqId("w"), ReqId("x")
NO_SNAPSHOTS = CheckpointPolicy(
    at_prompt_end=False, at_sequence_end=False, at_branch_points=False, prefill_grid_tokens=None
)


def two_running_one_chunk_free(reserve: bool) -> CacheManager:
    """x's two KV blocks cached in chunk 0 beside a's block; b's 3 blocks fill chunk 2;
    a's and b's live states fill chunk 1; chunk 3 is free."""
    mgr = make_manager(num_chunks=4, checkpoint=NO_SNAPSHOTS, reserve=reserve)
    mgr.add_request(X, tokens(8, start=500))
    prefill(mgr, "x", 8)
    mgr.free(X)
    mgr.add_request(A, tokens(4))
    prefill(mgr, "a", 4, sampled=1)
    mgr.add_request(B, tokens(12, start=200))
    prefill(mgr, "b", 12, sampled=2)
    counts = page_counts(mgr)
    assert counts.cached == (2, 0) and counts.free == (0, 0) and counts.free_chunks == 1
    return mgr


@pytest.mark.parametrize(("reserve", "expected"), [(True, 1), (True, 0), (False, 1)])
def test_running_growth_leaves_the_free_chunk_to_an_expected_admission(
    reserve: bool, expected: int
) -> None:
    mgr = two_running_one_chunk_free(reserve)
    mgr.expect_admissions(expected)
    assert step(mgr, "a", 1, [3]) is not None  # a's second block: no free KV page
    mgr.add_request(W, tokens(4, start=300))
    admitted = mgr.allocate(W, 4, mgr.find_hit(W)) is not None
    if reserve and expected:
        # a and then w took x's cached blocks; w's live state took the free chunk
        assert admitted
        assert page_counts(mgr).cached == (0, 0)
    else:
        # a took the free chunk for one page: no chunk is left for w's live state
        assert not admitted
        assert page_counts(mgr).cached == (2, 0)
    mgr.check_integrity()


@pytest.mark.parametrize("expected", [1, 2])
def test_the_reservation_shrinks_as_the_expected_requests_start(expected: int) -> None:
    # chunk 0: x's two cached blocks and a's block; chunk 1: a's live state and a free
    # state page; chunk 2: free. w's live state takes the free state page, its block one
    # of x's (the free chunk is what a second live state would need).
    mgr = make_manager(num_chunks=3, checkpoint=NO_SNAPSHOTS)
    mgr.add_request(X, tokens(8, start=500))
    prefill(mgr, "x", 8)
    mgr.free(X)
    mgr.add_request(A, tokens(4))
    prefill(mgr, "a", 4, sampled=1)
    assert page_counts(mgr).free == (0, 1) and page_counts(mgr).free_chunks == 1
    mgr.expect_admissions(expected)
    mgr.add_request(W, tokens(4, start=300))
    assert mgr.allocate(W, 4, mgr.find_hit(W)) is not None
    assert page_counts(mgr).cached == (1, 0)
    assert step(mgr, "a", 1, [3]) is not None  # a's second block
    if expected == 1:  # w was the one expected: a takes the free chunk
        assert page_counts(mgr).cached == (1, 0) and page_counts(mgr).free_chunks == 0
    else:  # one more is expected: a gives up x's other block, the chunk stays free
        assert page_counts(mgr).cached == (0, 0) and page_counts(mgr).free_chunks == 1
    mgr.check_integrity()


def test_a_group_with_nothing_cached_still_takes_the_chunk() -> None:
    # The reservation never fails an allocation: without a cached page of its own to
    # give up, attention takes the free chunk the live state wanted.
    mgr = make_manager(num_chunks=3, checkpoint=NO_SNAPSHOTS)
    mgr.add_request(A, tokens(4))
    prefill(mgr, "a", 4, sampled=1)
    mgr.add_request(B, tokens(8, start=200))
    prefill(mgr, "b", 8, sampled=2)  # chunk 0: a's and b's blocks; chunk 1: live states
    assert page_counts(mgr).cached == (0, 0)
    mgr.expect_admissions(1)
    assert step(mgr, "a", 1, [3]) is not None
    assert page_counts(mgr).free_chunks == 0
    mgr.check_integrity()


def test_a_chunk_the_reserved_group_cannot_use_is_taken_as_before() -> None:
    # The tail chunk holds attention pages only: taking it costs the live states nothing.
    layout = make_layout(hybrid_model(), num_chunks=2, tail_bytes=128)  # tail: 2 KV pages
    alloc = PageAllocator(layout)
    kv = alloc.pools[ATTN]
    in_tail = [alloc.allocate(ATTN) for _ in range(2)]  # the tail is handed out first
    in_chunk = [alloc.allocate(ATTN) for _ in range(3)]  # then chunk 0
    assert None not in in_tail and None not in in_chunk
    cached = in_chunk[0]
    assert cached is not None and kv.cache(cached, BlockHash(b"kv"), saved_tokens=4)
    kv.release(cached, alloc.tick())
    for page in in_tail:
        assert page is not None
        kv.release(page, alloc.tick())  # unhashed: the tail goes back to the arena
    assert alloc.arena.num_free_chunks == 2  # chunk 1 and the tail
    alloc.reserve({STATE: 1})  # chunk 1 is the one chunk a live state could get
    page = alloc.allocate(ATTN)
    assert page is not None and kv.chunk_of(page) == layout.num_full_chunks  # the tail
    assert kv.lookup(BlockHash(b"kv")) == cached  # nothing was evicted
    alloc.reserve({})
    alloc.check_integrity()


@pytest.mark.parametrize("limit", [None, 0, 1, 2, 99])
def test_free_usable_chunks_are_counted_up_to_the_limit(limit: int | None) -> None:
    """The reserve counts free chunks only as far as it needs (it runs when a group has no
    free page, so counting a large arena each time cost a 64-request engine step ~12%)."""
    mgr = make_manager(num_chunks=6, checkpoint=NO_SNAPSHOTS)
    arena = mgr.allocator.arena
    everything = arena.num_free_usable([ATTN, STATE])
    assert everything == 6
    want = everything if limit is None else min(max(limit, 0), everything)
    assert arena.num_free_usable([ATTN, STATE], limit=limit) == want
