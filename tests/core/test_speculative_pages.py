"""Speculative steps in the core: scratch states, rollback by page swap, draft-model groups.

Exact page ids as in test_pages_exact.py (block 4; attention pages 64 B, 3 per chunk;
state pages 96 B, 2 per chunk).
"""

from __future__ import annotations

from core_factories import hybrid_model, make_manager, page_counts, tokens

from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.ids import ReqId
from hybridkv.core.manager import CacheManager, Scratch
from hybridkv.core.planner import max_seq_len, state_pages_per_seq
from hybridkv.core.spec import with_draft

R = ReqId("r")


def decoding(mgr: CacheManager, prompt: list[int], req: ReqId = R) -> int:
    """Prefill ``prompt`` and sample one token: the request is decoding. Returns computed."""
    mgr.add_request(req, prompt)
    hit = mgr.find_hit(req)
    start = hit.num_tokens
    while start < len(prompt):  # chunks end at snapshot positions, as the scheduler cuts them
        end = mgr.next_split(req, start, len(prompt))
        assert mgr.allocate(req, end - start, hit if start == hit.num_tokens else None)
        mgr.commit(req, end, [900] if end == len(prompt) else [])
        start = end
    return len(prompt)


def test_a_speculative_step_takes_a_scratch_state_per_draft_and_keeps_the_accepted_one() -> None:
    mgr = make_manager(num_chunks=6, caching=False)
    computed = decoding(mgr, tokens(5))  # 6 tokens, 5 computed
    live = mgr.live_page(R, 1)
    alloc = mgr.allocate(R, 1 + 3, num_speculative_tokens=3)  # last token + 3 drafts
    assert alloc is not None
    # the step may stop after 6, 7 or 8 tokens (9 is the live page's own end state)
    assert [(s.group_id, s.position) for s in alloc.scratch] == [(1, 6), (1, 7), (1, 8)]
    assert live not in {s.page for s in alloc.scratch}
    assert page_counts(mgr).used[1] == 4
    kept_at_7 = next(s.page for s in alloc.scratch if s.position == 7)
    mgr.commit(R, computed + 2, [1, 2])  # one draft kept, then the correction
    assert mgr.live_page(R, 1) == kept_at_7  # swapped in: no copy
    assert page_counts(mgr).used[1] == 1  # the old live page and the rest are free
    mgr.check_integrity()

    alloc = mgr.allocate(R, 1 + 2, num_speculative_tokens=2)
    assert alloc is not None
    mgr.commit(R, 7 + 3, [3, 4, 5])  # every draft kept and the bonus: the live page stays
    assert mgr.live_page(R, 1) == kept_at_7
    assert page_counts(mgr).used[1] == 1
    mgr.free(R)
    mgr.check_integrity()
    assert page_counts(mgr).used == (0, 0)


def test_scratch_states_are_all_or_nothing_with_the_step() -> None:
    mgr = make_manager(num_chunks=2, caching=False)  # 1 attention chunk, 1 state chunk
    decoding(mgr, tokens(5))
    before = page_counts(mgr)
    assert mgr.allocate(R, 1 + 2, num_speculative_tokens=2) is None  # 2 scratch: 1 page left
    assert page_counts(mgr) == before
    mgr.check_integrity()
    alloc = mgr.allocate(R, 1 + 1, num_speculative_tokens=1)  # one draft fits
    assert alloc is not None and len(alloc.scratch) == 1
    mgr.commit(R, 6, [7])
    mgr.check_integrity()


def test_a_snapshot_past_the_kept_tokens_is_dropped_and_one_before_them_published() -> None:
    mgr = make_manager(num_chunks=6, checkpoint=CheckpointPolicy())
    decoding(mgr, tokens(6))  # 7 tokens, 6 computed; decode snapshots at 8, 12, ...
    alloc = mgr.allocate(R, 1 + 1, num_speculative_tokens=1)  # covers up to 8
    assert alloc is not None and [c.group_id for c in alloc.snapshots] == [1]
    snapshot_page = alloc.snapshots[0].page
    mgr.commit(R, 7, [50])  # the draft at position 7 was rejected: 8 was never reached
    group = mgr.state_groups[1]
    assert 8 not in group.reqs[R].snapshots and group.reqs[R].pending == []
    assert snapshot_page not in group.pool.referenced_pages()
    assert group.pool.lookup(mgr._reqs[R].hashes[1]) is None  # nothing cached at 8
    mgr.check_integrity()
    alloc = mgr.allocate(R, 1 + 1, num_speculative_tokens=1)  # again up to 9: 8 inside
    assert alloc is not None and [s.position for s in alloc.snapshots] == [8]
    mgr.commit(R, 9, [51, 52])  # the draft was kept: 8 is published
    assert group.pool.lookup(mgr._reqs[R].hashes[1]) is not None
    alloc = mgr.allocate(R, 1 + 3, num_speculative_tokens=3)  # covers up to 13: 12 is inside
    assert alloc is not None and [s.position for s in alloc.snapshots] == [12]
    mgr.commit(R, 13, [1, 2, 3, 4])  # 12 was kept: its snapshot (captured in the forward) stays
    assert 12 in group.reqs[R].snapshots or group.reqs[R].parked is not None
    mgr.free(R)
    mgr.check_integrity()


def draft_manager(**options: object) -> CacheManager:
    """Target and draft with equal specs: groups 0, 1 attention; 2, 3 state (1, 3: draft)."""
    return make_manager(with_draft(hybrid_model(), hybrid_model()), num_chunks=8, **options)


def test_draft_groups_stay_apart_take_no_hits_and_publish_nothing() -> None:
    mgr = draft_manager()
    assert [(g.group_id, g.is_draft, g.is_recurrent) for g in mgr.model.groups] == [
        (0, False, False),
        (1, True, False),
        (2, False, True),
        (3, True, True),
    ]
    assert [g.group_id for g in mgr.recurrent] == [2]
    decoding(mgr, tokens(9))
    alloc = mgr.allocate(R, 1 + 3, num_speculative_tokens=3)
    assert alloc is not None
    # the target: the state after each position the step may stop at; the draft: one page
    assert [(s.group_id, s.position) for s in alloc.scratch] == [(2, 10), (2, 11), (2, 12), (3, 10)]
    draft_live = mgr.live_page(R, 3)
    at_10 = next(s.page for s in alloc.scratch if s == Scratch(2, 10, s.page))
    mgr.commit(R, 10, [5])  # no draft kept
    assert mgr.live_page(R, 2) == at_10
    assert mgr.live_page(R, 3) == draft_live  # a draft group never swaps its working page in
    mgr.free(R)
    other = ReqId("o")
    mgr.add_request(other, tokens(9))
    hit = mgr.find_hit(other)
    assert hit.num_tokens == 8  # the target's blocks and snapshot
    alloc = mgr.allocate(other, 1, hit)
    assert alloc is not None
    assert len(alloc.new_pages[1]) == 3  # the draft's blocks 0..2 are its own, none shared
    assert [c.group_id for c in alloc.restores] == [2]  # the draft starts from zeros
    assert mgr.allocator.pools[1].num_cached_pages == 0
    assert mgr.allocator.pools[3].num_cached_pages == 0
    mgr.free(other)
    mgr.check_integrity()


def test_the_fit_check_counts_scratch_states() -> None:
    spec = with_draft(hybrid_model(), hybrid_model())
    assert state_pages_per_seq(spec, 4) == {2: 3 + 4, 3: 2}
    assert state_pages_per_seq(spec, 0) == {2: 3, 3: 1}
    mgr = make_manager(spec, num_chunks=12)
    plain = max_seq_len(mgr.layout, spec, 4, state_pages_per_seq(spec, 0))
    speculative = max_seq_len(mgr.layout, spec, 4, state_pages_per_seq(spec, 4))
    # states: 3 target pages (2 chunks) + 1 draft (1 chunk), or 7 (4 chunks) + 2 (1 chunk);
    # the other 9 or 7 chunks hold blocks of both attention groups, 3 per chunk each
    assert (plain, speculative) == (12 * 4, 9 * 4)
    # the allocator serves it: a sequence of that length speculating 4 drafts, while the
    # target group also holds a snapshot being written and the hit it resumed from
    held = [mgr.allocator.allocate(2) for _ in range(2)]
    mgr.add_request(R, tokens(speculative))
    assert mgr.allocate(R, speculative - 4) is not None
    mgr.commit(R, speculative - 4)
    assert mgr.allocate(R, 4, num_speculative_tokens=4) is not None  # up to max_seq_len
    mgr.commit(R, speculative - 3, [1])
    assert mgr.allocate(R, 5, num_speculative_tokens=4) is None  # 2 tokens past it: no
    mgr.free(R)
    for page in held:
        assert page is not None
        mgr.allocator.pools[2].release(page, mgr.allocator.clock)
    mgr.check_integrity()
