"""Branch points (Marconi's speculative insertion), several snapshots per chunk, parking.

The core's tiny hybrid model at block 4 (tests/core/core_factories.py). A "system prompt"
of 12 tokens (3 blocks) is shared by prompts that continue differently after it.
"""

from __future__ import annotations

import pytest
from core_factories import (
    BLOCK,
    cached_snapshot_positions,
    decode,
    make_manager,
    parked,
    prefill,
    tokens,
)
from hypothesis import given
from hypothesis import strategies as st

import hybridkv.core.hashing as hashing
from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.ids import ReqId

A, B, C, D = ReqId("a"), ReqId("b"), ReqId("c"), ReqId("d")
STATE = 1
SYSTEM = tokens(12, start=1000)


def branch_of(mgr: object, req: ReqId) -> int:
    return mgr._reqs[req].branch_tokens  # type: ignore[attr-defined]


def test_second_request_behind_a_shared_prefix_snapshots_it_and_the_third_hits() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, SYSTEM + tokens(5, start=500))
    prefill(mgr, "a", 17)  # the first: only its prompt end (16) is snapshotted
    assert cached_snapshot_positions(mgr, SYSTEM) == []
    mgr.free(A)
    mgr.add_request(B, SYSTEM + tokens(6, start=600))
    assert mgr.find_hit(B).num_tokens == 0  # the KV is cached, its state is not
    allocs = prefill(mgr, "b", 18)
    assert branch_of(mgr, B) == 12
    assert len(allocs) == 1  # one chunk: the branch and the prompt end inside it
    assert [s.position for s in allocs[0].snapshots] == [12, 16]
    assert cached_snapshot_positions(mgr, SYSTEM) == [12]
    mgr.add_request(C, SYSTEM + tokens(3, start=700))
    assert mgr.find_hit(C).num_tokens == 12  # the third and later hit it
    prefill(mgr, "c", 15)
    assert branch_of(mgr, C) == 0  # its hit reaches the branch: nothing more to take
    mgr.check_integrity()


def test_the_prefill_grid_gives_the_second_request_a_state_near_the_shared_prefix() -> None:
    """issue 12, trace B at 200 blocks: the first request behind an 8192-token system
    prompt had no branch point, so the second found the prompt's KV but no state and
    recomputed all of it (0 hits where vLLM's dense mode had 8160). A grid point every
    6 tokens (floored to block 4: 4, 12, 16) puts one at the shared prefix's end."""
    for grid, expected_hit in ((None, 0), (6, 12)):
        mgr = make_manager(num_chunks=16, checkpoint=CheckpointPolicy(prefill_grid_tokens=grid))
        mgr.add_request(A, SYSTEM + tokens(5, start=500))
        allocs = prefill(mgr, "a", 17)
        taken = [s.position for a in allocs for s in a.snapshots]
        assert taken == ([4, 12, 16] if grid else [16])
        mgr.free(A)
        # superseded grid points stay cached (retention keeps them)
        assert cached_snapshot_positions(mgr, SYSTEM) == ([4, 12] if grid else [])
        mgr.add_request(B, SYSTEM + tokens(6, start=600))
        assert mgr.find_hit(B).num_tokens == expected_hit
        prefill(mgr, "b", 18)
        mgr.free(B)
        mgr.check_integrity()


def test_a_prefill_grid_must_be_positive() -> None:
    with pytest.raises(ValueError, match="prefill_grid_tokens"):
        make_manager(checkpoint=CheckpointPolicy(prefill_grid_tokens=0))


def test_a_prefix_still_being_computed_counts_as_shared() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, SYSTEM + tokens(5, start=500))
    assert mgr.allocate(A, 17, mgr.find_hit(A)) is not None  # running, nothing committed
    mgr.add_request(B, SYSTEM + tokens(6, start=600))
    alloc = mgr.allocate(B, 18, mgr.find_hit(B))
    assert alloc is not None
    assert branch_of(mgr, B) == 12
    assert 12 in [s.position for s in alloc.snapshots]
    mgr.commit(A, 17)
    mgr.commit(B, 18)
    mgr.free(A)
    mgr.free(B)
    assert mgr._inflight == {} and mgr._inflight_parents == {}
    mgr.check_integrity()


def test_the_next_turn_of_a_sequence_is_not_a_branch() -> None:
    """Its shared prefix ends where the previous turn ended: nothing continues past it,
    so even with that turn's snapshot gone, no snapshot is taken there (Marconi: no new
    branch-off node when a sequence extends a leaf)."""
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, tokens(10))
    prefill(mgr, "a", 10, sampled=100)
    decode(mgr, "a", tokens(6, start=101))  # 16 computed
    mgr.free(A)
    pool = mgr.recurrent[0].pool
    for page in pool.cached_pages_oldest_first():
        pool.uncache(page)  # every snapshot evicted, the KV stays
    turn2 = tokens(10) + tokens(7, start=100) + tokens(6, start=900)
    mgr.add_request(B, turn2)
    assert mgr.find_hit(B).num_tokens == 0
    prefill(mgr, "b", len(turn2))
    assert branch_of(mgr, B) == 0
    mgr.check_integrity()


def test_branch_points_can_be_turned_off() -> None:
    mgr = make_manager(num_chunks=16, checkpoint=CheckpointPolicy(at_branch_points=False))
    mgr.add_request(A, SYSTEM + tokens(5, start=500))
    prefill(mgr, "a", 17)
    mgr.free(A)
    mgr.add_request(B, SYSTEM + tokens(6, start=600))
    assert [s.position for s in prefill(mgr, "b", 18)[0].snapshots] == [16]


def test_split_mode_cuts_the_first_chunk_at_the_branch_point() -> None:
    mgr = make_manager(num_chunks=16, split=True)
    mgr.add_request(A, SYSTEM + tokens(5, start=500))
    prefill(mgr, "a", 17)
    mgr.free(A)
    mgr.add_request(B, SYSTEM + tokens(6, start=600))
    assert mgr.next_split(B, 0, 18) == 12  # found before the first allocation
    allocs = prefill(mgr, "b", 18)
    assert [[s.position for s in a.snapshots] for a in allocs] == [[12], [16], []]


def test_a_superseded_branch_keeps_its_place_and_a_prompt_end_is_demoted() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, SYSTEM + tokens(5, start=500))
    prefill(mgr, "a", 17)
    mgr.free(A)
    mgr.add_request(B, SYSTEM + tokens(6, start=600))
    prefill(mgr, "b", 18, sampled=100)
    pool = mgr.recurrent[0].pool
    hashes = mgr._reqs[B].hashes
    branch, prompt_end = pool.lookup(hashes[2]), pool.lookup(hashes[3])
    decode(mgr, "b", tokens(2, start=101))  # 20 computed: a new snapshot supersedes 16
    queue = pool.cached_pages_oldest_first()
    assert queue[0] == prompt_end  # the prompt end goes first
    assert queue.index(branch) > queue.index(prompt_end)
    assert parked(mgr, "b")[0] == 20
    mgr.check_integrity()


def test_a_parked_snapshot_moves_to_the_back_when_its_request_ends() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, tokens(9))
    prefill(mgr, "a", 9, sampled=100)  # parks its prompt end (8)
    page = parked(mgr, "a")[1]
    mgr.add_request(B, tokens(9, start=300))
    prefill(mgr, "b", 9)
    mgr.free(B)  # b's pages are cached after a's parked one
    pool = mgr.recurrent[0].pool
    assert pool.cached_pages_oldest_first()[0] == page
    mgr.free(A)
    assert pool.cached_pages_oldest_first()[-1] == page  # where a's next turn finds it
    mgr.check_integrity()


def test_a_parked_snapshot_evicted_while_running_is_taken_again() -> None:
    mgr = make_manager(num_chunks=16)
    mgr.add_request(A, tokens(6))
    prefill(mgr, "a", 6, sampled=100)
    decode(mgr, "a", tokens(3, start=101))  # newest at 8, parked
    _, page = parked(mgr, "a")
    mgr.recurrent[0].pool.uncache(page)  # what an eviction does to it
    assert parked(mgr, "a") is None
    allocs = decode(mgr, "a", tokens(4, start=104))  # computes 9 .. 12
    assert [s.position for a in allocs for s in a.snapshots] == [12]  # into a fresh page
    assert parked(mgr, "a")[0] == 12
    mgr.free(A)
    assert mgr.allocator.pools[STATE].num_used_pages == 0
    mgr.check_integrity()


POLICIES = [
    CheckpointPolicy(),
    CheckpointPolicy(interval_tokens=2 * BLOCK),
    CheckpointPolicy(decode_interval_tokens=3 * BLOCK, at_prompt_end=False),
    CheckpointPolicy(at_sequence_end=False),
    CheckpointPolicy(prefill_grid_tokens=6),
    CheckpointPolicy(prefill_grid_tokens=2 * BLOCK, at_prompt_end=False),
    CheckpointPolicy(prefill_grid_tokens=BLOCK - 1),  # below the block: every boundary
]


@pytest.mark.parametrize("policy", POLICIES, ids=range(len(POLICIES)))
@given(
    start=st.integers(0, 60),
    length=st.integers(1, 40),
    prompt_len=st.integers(1, 60),
    branch_blocks=st.integers(0, 15),
)
def test_positions_are_the_checkpoints_of_the_range(
    policy: CheckpointPolicy, start: int, length: int, prompt_len: int, branch_blocks: int
) -> None:
    branch = branch_blocks * BLOCK
    end = start + length
    expected = [
        p
        for p in range(start + 1, end + 1)
        if policy.is_checkpoint(p, prompt_len, BLOCK) or (p == branch and p > 0)
    ]
    assert policy.positions(start, end, prompt_len, BLOCK, branch) == expected


def test_an_announced_prompt_makes_the_first_admitted_request_snapshot_its_branch() -> None:
    """Requests arriving together: B waits (announced) while A is admitted, so A already
    snapshots where their prompts branch (12), and B awaits that prefix until A has
    computed it. Announced hashes are reused at admission only for the same tokens."""
    mgr = make_manager(num_chunks=16)
    mgr.announce(B, SYSTEM + tokens(6, start=600))
    mgr.add_request(A, SYSTEM + tokens(5, start=500))
    assert not mgr.awaits_prefix(B)  # nothing started yet
    assert mgr.allocate(A, 8, mgr.find_hit(A)) is not None  # A's first chunk
    mgr.commit(A, 8)  # started, not yet at 12
    assert branch_of(mgr, A) == 12
    assert mgr.awaits_prefix(B)
    assert mgr.allocate(A, 9) is not None
    mgr.commit(A, 17)
    assert not mgr.awaits_prefix(B)  # computed: B now hits instead
    assert 12 in cached_snapshot_positions(mgr, SYSTEM)
    fresh = make_manager(num_chunks=16)
    fresh.add_request(B, SYSTEM + tokens(6, start=600))
    mgr.add_request(B, SYSTEM + tokens(6, start=600))
    assert mgr._reqs[B].hashes == fresh._reqs[B].hashes
    assert mgr.find_hit(B).num_tokens == 12
    mgr.announce(C, tokens(9, start=700))
    mgr.add_request(C, tokens(9, start=800))  # other tokens than announced: hashed afresh
    fresh.add_request(C, tokens(9, start=800))
    assert mgr._reqs[C].hashes == fresh._reqs[C].hashes
    assert not mgr._announced and not mgr._queued


def test_announcing_a_held_request_again_reuses_its_hashes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request announced again before it is freed (its admission failed, or it is
    preempted) lends its block hashes: nothing is hashed again, and the announcement is
    the same as a fresh one (it still makes the prefix shared)."""
    mgr = make_manager(num_chunks=16)
    prompt = SYSTEM + tokens(6, start=600)
    mgr.add_request(A, prompt)
    calls: list[int] = []
    real = hashing.hash_block
    monkeypatch.setattr(hashing, "hash_block", lambda *a: calls.append(1) or real(*a))
    mgr.announce(A, prompt)
    assert calls == []
    mgr.free(A)
    again = mgr.withdraw(A)
    monkeypatch.undo()
    fresh = make_manager(num_chunks=16)
    fresh.announce(A, prompt)
    assert again is not None and again == fresh.withdraw(A)
    mgr.announce(B, prompt)  # a different request id: hashed as usual
    assert mgr.withdraw(B) == again
