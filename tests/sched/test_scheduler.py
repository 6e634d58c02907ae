"""The scheduler on its own: a small CacheManager, no model, every decision checked.

The manager is the core tests' tiny hybrid model (tests/core/core_factories.py): block 4,
one attention group (3 pages of 4 tokens per chunk) and one state group (2 live states per
chunk). Each test drives ``schedule`` / ``advance`` by hand the way the engine's step does.
"""

from __future__ import annotations

import pytest

from hybridkv.core.checkpoint import CheckpointPolicy
from hybridkv.core.ids import ReqId
from hybridkv.core.manager import CacheManager
from hybridkv.sched.request import Sequence, SequenceStatus
from hybridkv.sched.sampling_params import SamplingParams
from hybridkv.sched.scheduler import Scheduler, SchedulerOutput
from tests.core.core_factories import make_manager, tokens

SAMPLED = 900  # the token every test "samples"


def seq(name: str, prompt_len: int, *, request_id: str | None = None, index: int = 0) -> Sequence:
    return Sequence(
        seq_id=ReqId(name),
        request_id=request_id or name,
        index=index,
        prompt_token_ids=tokens(prompt_len, start=100 * (ord(name[0]) - ord("a"))),
        params=SamplingParams(max_tokens=64),
    )


def scheduler(
    mgr: CacheManager, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 64
) -> Scheduler:
    return Scheduler(mgr, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)


def run_step(sched: Scheduler) -> SchedulerOutput:
    """Schedule one step and record it as the engine does (every sampling chunk samples)."""
    out = sched.schedule()
    for chunk in out.chunks:
        if chunk.samples:
            chunk.seq.output_token_ids.append(SAMPLED)
        sched.advance(chunk)
    return out


def work(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks]


def test_waiting_sequences_are_admitted_first_come_first_served() -> None:
    mgr = make_manager(num_chunks=8, caching=False)
    sched = scheduler(mgr, max_num_seqs=2)
    for s in (seq("a", 5), seq("b", 6), seq("c", 1)):
        sched.add(s)
    out = run_step(sched)
    assert work(out) == [("a", 0, 5), ("b", 0, 6)]  # c is short, but came last
    assert [s.seq_id for s in sched.waiting] == ["c"]
    mgr.check_integrity()


def test_admission_stops_at_the_first_sequence_that_does_not_fit() -> None:
    """FCFS: a short sequence behind a long one waits, so the long one is never starved."""
    mgr = make_manager(num_chunks=3, caching=False)  # 1 state chunk + 6 attention pages
    sched = scheduler(mgr)
    sched.add(seq("a", 16))  # 4 pages
    assert work(run_step(sched)) == [("a", 0, 16)]
    sched.add(seq("b", 12))  # 3 pages: does not fit beside a's 5
    sched.add(seq("c", 2))  # 1 page: would fit
    assert work(run_step(sched)) == [("a", 16, 1)]  # a's 5th page leaves b no room
    assert [s.seq_id for s in sched.waiting] == ["b", "c"]
    mgr.check_integrity()


def test_the_token_budget_splits_a_prefill_and_running_sequences_go_first() -> None:
    mgr = make_manager(num_chunks=8, caching=False)
    sched = scheduler(mgr, max_num_batched_tokens=10)
    sched.add(seq("a", 8))
    sched.add(seq("b", 8))
    assert work(run_step(sched)) == [("a", 0, 8), ("b", 0, 2)]  # b's prefill is cut
    assert work(run_step(sched)) == [("a", 8, 1), ("b", 2, 6)]  # decode first, then the rest
    assert sched.running[1].num_outputs == 1  # b sampled once its prompt was done
    mgr.check_integrity()


def test_the_newest_running_sequence_is_preempted_when_memory_runs_out() -> None:
    mgr = make_manager(num_chunks=3, caching=False)  # 1 state chunk + 6 attention pages
    sched = scheduler(mgr)
    sched.add(seq("a", 11))
    sched.add(seq("b", 11))
    run_step(sched)  # 3 + 3 pages: every attention page is taken
    assert work(run_step(sched)) == [("a", 11, 1), ("b", 11, 1)]  # 12 tokens still fit
    out = run_step(sched)  # a needs a 4th page: b, the newest, goes
    assert [s.seq_id for s in out.preempted] == ["b"]
    assert work(out) == [("a", 12, 1)]
    b = sched.waiting[0]
    assert (b.seq_id, b.status, b.num_computed) == ("b", SequenceStatus.WAITING, 0)
    assert b.output_token_ids == [SAMPLED, SAMPLED]  # recomputed later, outputs kept
    assert sched.num_preemptions == 1
    mgr.check_integrity()


def test_a_sequence_preempts_itself_when_it_is_the_newest() -> None:
    mgr = make_manager(num_chunks=2, caching=False)  # 1 state chunk + 3 attention pages
    sched = scheduler(mgr)
    sched.add(seq("a", 12))
    run_step(sched)
    out = run_step(sched)  # a alone needs a 4th page: nothing else to take it from
    assert [s.seq_id for s in out.preempted] == ["a"]
    assert out.chunks == []
    mgr.check_integrity()


def test_a_sequence_that_cannot_fit_even_alone_is_rejected() -> None:
    mgr = make_manager(num_chunks=2, caching=False)  # 3 attention pages: 12 tokens
    sched = scheduler(mgr)
    big = seq("a", 20)
    sched.add(big)
    sched.add(seq("b", 3))
    out = run_step(sched)
    assert out.rejected == [big]
    assert (big.status, big.finish_reason) == (SequenceStatus.FINISHED, "abort")
    assert work(out) == []  # b waits for the next step: admission stopped at a
    assert work(run_step(sched)) == [("b", 0, 3)]
    mgr.check_integrity()


def test_a_sibling_waits_for_the_first_completion_then_resumes_from_its_prompt() -> None:
    """n > 1: the second completion is admitted once the first has computed the prompt, and
    its prompt (but the last token) is then a prefix hit, so the prompt is computed once."""
    mgr = make_manager(num_chunks=8)
    sched = scheduler(mgr, max_num_batched_tokens=5)
    first, second = (seq(f"{i}", 10, request_id="r", index=i) for i in range(2))
    first.prompt_token_ids = second.prompt_token_ids = tokens(10)
    sched.add(first)
    sched.add(second)
    assert work(run_step(sched)) == [("0", 0, 5)]  # cut at the budget; the sibling waits
    while first.num_computed < 10:  # the first finishes its prompt; the sibling still waits
        assert [s.seq_id for s in sched.waiting] == ["1"]
        run_step(sched)
    out = run_step(sched)
    admitted = [c for c in out.chunks if c.seq is second]
    assert [(c.start, c.num_tokens) for c in admitted] == [(8, 2)]  # resumed at block 8
    assert second.num_cached_tokens == 8
    mgr.check_integrity()


def test_a_fresh_prompt_samples_in_its_first_step_with_caching_on_as_off() -> None:
    """Snapshots are taken inside the forward: no chunk is cut for them (issue 12)."""
    outs = {}
    for caching in (True, False):
        mgr = make_manager(num_chunks=8, caching=caching)
        sched = scheduler(mgr)
        sched.add(seq("a", 13))
        outs[caching] = run_step(sched)
        assert work(outs[caching]) == [("a", 0, 13)]
        assert outs[caching].chunks[0].samples
        assert sched.running[0].num_outputs == 1
        mgr.check_integrity()
    snapshots = outs[True].chunks[0].allocation.snapshots
    assert [s.position for s in snapshots] == [12]  # the prompt end, inside the chunk
    assert outs[False].chunks[0].allocation.snapshots == ()


def test_the_second_request_behind_a_shared_prefix_takes_its_branch_point_in_one_step() -> None:
    mgr = make_manager(num_chunks=16)
    sched = scheduler(mgr)
    system = tokens(12, start=1000)
    a, b, c = seq("a", 5), seq("b", 6), seq("c", 3)
    for s in (a, b, c):
        s.prompt_token_ids = system + s.prompt_token_ids
    sched.add(a)
    run_step(sched)
    sched.add(b)  # a is decoding: its prompt is cached, its state at 12 is not
    out = run_step(sched)
    [b_chunk] = [ch for ch in out.chunks if ch.seq is b]
    assert (b_chunk.start, b_chunk.num_tokens, b_chunk.samples) == (0, 18, True)
    assert [s.position for s in b_chunk.allocation.snapshots] == [12, 16]
    sched.add(c)
    out = run_step(sched)
    [c_chunk] = [ch for ch in out.chunks if ch.seq is c]
    assert (c_chunk.start, c.num_cached_tokens) == (12, 12)  # the third hits it
    mgr.check_integrity()


def test_split_mode_takes_one_more_step_to_the_first_token() -> None:
    """``split_prefill_at_snapshots`` (the engine before in-forward captures): the prompt
    end cuts the prefill, so the first token comes a step later."""
    mgr = make_manager(num_chunks=8, split=True)
    sched = scheduler(mgr)
    sched.add(seq("a", 13))
    out = run_step(sched)
    assert work(out) == [("a", 0, 12)] and not out.chunks[0].samples
    assert work(run_step(sched)) == [("a", 12, 1)]
    assert sched.running[0].num_outputs == 1
    mgr.check_integrity()


def test_finish_frees_the_pages_of_running_and_forgets_waiting_sequences() -> None:
    mgr = make_manager(num_chunks=8, caching=False)
    sched = scheduler(mgr, max_num_seqs=1)
    a, b = seq("a", 5), seq("b", 5)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(a, "stop")
    sched.finish(b, "abort")
    assert sched.num_unfinished == 0
    assert mgr.num_requests == 0
    assert (a.finish_reason, b.finish_reason) == ("stop", "abort")
    mgr.check_integrity()


def speculate(s: Sequence, drafts: list[int]) -> None:
    """What the engine does before scheduling: ask for drafts (filled after scheduling)."""
    s.num_draft_tokens = len(drafts)
    s.draft_token_ids = list(drafts)


def test_a_decoding_sequence_verifies_its_drafts_in_one_chunk() -> None:
    mgr = make_manager(num_chunks=8, caching=False)
    sched = scheduler(mgr)
    a = seq("a", 5)
    sched.add(a)
    run_step(sched)  # prefill, one token sampled: 6 tokens, 5 computed
    speculate(a, [1, 2, 3])
    out = sched.schedule()
    [chunk] = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.num_draft_tokens) == (5, 4, 3)
    assert chunk.token_ids == [SAMPLED, 1, 2, 3]
    assert [s.position for s in chunk.allocation.scratch] == [6, 7, 8]
    a.output_token_ids += [1, 7]  # the first draft kept, then a correction
    sched.advance(chunk)
    assert (a.num_computed, a.num_tokens, a.num_draft_tokens, a.draft_token_ids) == (7, 8, 0, [])
    assert mgr.num_computed_tokens(a.seq_id) == 7
    assert mgr._reqs[a.seq_id].tokens == a.all_token_ids
    mgr.check_integrity()


def test_drafts_count_against_the_budget_and_never_go_to_a_prefill() -> None:
    mgr = make_manager(num_chunks=8, caching=False)
    sched = scheduler(mgr, max_num_batched_tokens=3)
    a, b = seq("a", 2), seq("b", 6)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    speculate(a, [1, 2, 3, 4])
    speculate(b, [1, 2])  # b is not decoding yet: its drafts are ignored
    out = sched.schedule()
    assert [(c.seq.seq_id, c.num_tokens, c.num_draft_tokens) for c in out.chunks] == [
        ("a", 3, 2)  # 1 + 2 drafts fill the budget; b waits
    ]


def test_speculation_that_does_not_fit_decodes_plainly_and_preempts_nobody() -> None:
    mgr = make_manager(num_chunks=2, caching=False)  # 1 state chunk: 2 state pages
    sched = scheduler(mgr)
    a = seq("a", 5)
    sched.add(a)
    run_step(sched)
    speculate(a, [1, 2])  # two scratch states: only one page is left
    out = sched.schedule()
    assert [(c.num_tokens, c.num_draft_tokens) for c in out.chunks] == [(1, 0)]
    assert out.preempted == []
    mgr.check_integrity()


def shared_prefix_requests(count: int, prefix_len: int, tail_len: int) -> list[Sequence]:
    """``count`` requests: one prefix, then a tail of their own."""
    prefix = tokens(prefix_len, start=500)
    made = []
    for i in range(count):
        s = seq(chr(ord("a") + i), prefix_len + tail_len)
        s.prompt_token_ids = prefix + tokens(tail_len, start=1000 + 100 * i)
        made.append(s)
    return made


def test_requests_arriving_behind_one_prefix_compute_it_once() -> None:
    """Issue 13's W3 in small: four requests behind a 10-token prefix arrive together. The
    first one admitted snapshots where they branch off it (block 8: the waiting prompts
    count as shared); the others wait while it computes that prefix, then resume there."""
    mgr = make_manager(num_chunks=16)
    sched = scheduler(mgr, max_num_batched_tokens=64)
    requests = shared_prefix_requests(4, 10, 3)
    for s in requests:
        sched.add(s)
    out = run_step(sched)
    assert work(out) == [("a", 0, 13)]  # the budget had room for all four: they wait
    assert [s.position for s in out.chunks[0].allocation.snapshots] == [8, 12]
    out = run_step(sched)
    assert work(out) == [("a", 13, 1), ("b", 8, 5), ("c", 8, 5), ("d", 8, 5)]
    assert [s.num_cached_tokens for s in requests] == [0, 8, 8, 8]
    mgr.check_integrity()


def test_without_a_shared_prefix_nothing_waits() -> None:
    mgr = make_manager(num_chunks=16)
    sched = scheduler(mgr, max_num_batched_tokens=64)
    for i, s in enumerate(shared_prefix_requests(3, 0, 9)):
        s.prompt_token_ids = tokens(9, start=2000 + 100 * i)
        sched.add(s)
    assert work(run_step(sched)) == [("a", 0, 9), ("b", 0, 9), ("c", 0, 9)]
    mgr.check_integrity()


def test_a_waiting_request_stops_waiting_when_the_prefix_computer_is_preempted() -> None:
    """The prefix being computed is the only reason to wait: once its computer is gone
    (preempted, aborted), the waiting request is admitted and computes it itself, and every
    announcement is withdrawn when the requests end."""
    mgr = make_manager(num_chunks=16)
    sched = scheduler(mgr, max_num_batched_tokens=6)
    first, second = shared_prefix_requests(2, 10, 3)
    sched.add(first)
    sched.add(second)
    assert work(run_step(sched)) == [("a", 0, 6)]  # a chunk of the prefix; b waits
    assert mgr.awaits_prefix(second.seq_id)
    sched.finish(first, "abort")
    assert not mgr.awaits_prefix(second.seq_id)
    assert work(run_step(sched)) == [("b", 0, 6)]
    sched.finish(second, "abort")
    assert not mgr._announced and not mgr._queued and not mgr._queued_parents
    mgr.check_integrity()


def test_requests_behind_a_waiting_one_are_admitted_meanwhile() -> None:
    """A request waiting for its prefix is passed over, not a barrier: an unrelated one
    behind it is admitted in the same step, then the waiting one resumes at block 8."""
    mgr = make_manager(num_chunks=16)
    sched = scheduler(mgr, max_num_batched_tokens=64)
    first, second = shared_prefix_requests(2, 10, 3)
    other = seq("c", 3)
    other.prompt_token_ids = tokens(3, start=3000)
    for s in (first, second, other):
        sched.add(s)
    assert work(run_step(sched)) == [("a", 0, 13), ("c", 0, 3)]
    assert [s.seq_id for s in sched.waiting] == ["b"]
    assert work(run_step(sched)) == [("a", 13, 1), ("c", 3, 1), ("b", 8, 5)]
    mgr.check_integrity()


@pytest.mark.parametrize("reserve", [True, False])
def test_running_growth_leaves_a_waiting_sequences_live_state_its_chunk(reserve: bool) -> None:
    """The scheduler tells the manager how many waiting sequences it may admit, so a
    running sequence's new block comes from its own group's cached blocks, not from the
    chunk the waiting one's live state needs (CacheManager.expect_admissions)."""
    no_snapshots = CheckpointPolicy(
        at_prompt_end=False, at_sequence_end=False, at_branch_points=False, prefill_grid_tokens=None
    )
    mgr = make_manager(num_chunks=4, checkpoint=no_snapshots, reserve=reserve)
    sched = scheduler(mgr)
    x = seq("x", 8)
    sched.add(x)
    run_step(sched)
    sched.finish(x, "stop")  # its two blocks stay cached in chunk 0
    sched.add(seq("a", 4))  # a's block beside them; a's and b's live states: chunk 1
    sched.add(seq("b", 11))  # chunk 2
    assert work(run_step(sched)) == [("a", 0, 4), ("b", 0, 11)]
    assert mgr.allocator.arena.num_free_chunks == 1
    sched.add(seq("w", 4))
    out = run_step(sched)  # a's decode needs a second block
    if reserve:
        assert work(out) == [("a", 4, 1), ("b", 11, 1), ("w", 0, 4)]
    else:  # a's block took the free chunk
        assert work(out) == [("a", 4, 1), ("b", 11, 1)]
        assert [s.seq_id for s in sched.waiting] == ["w"]
    mgr.check_integrity()


def test_the_manager_expects_the_waiting_sequences_up_to_the_free_seats() -> None:
    mgr = make_manager(num_chunks=8, caching=False)
    expected: list[int] = []
    expect = mgr.expect_admissions

    def spy(num_requests: int) -> None:
        expected.append(num_requests)
        expect(num_requests)

    mgr.expect_admissions = spy  # type: ignore[method-assign]
    sched = scheduler(mgr, max_num_seqs=2)
    for s in (seq("a", 5), seq("b", 6), seq("c", 1)):
        sched.add(s)
    run_step(sched)  # 3 waiting, 2 seats
    run_step(sched)  # 1 waiting, no seat
    assert expected == [2, 0]


def burst(s: Sequence, num_tokens: int) -> None:
    """What the engine does before scheduling a burst round (hybridkv.engine.decode_burst)."""
    s.num_burst_tokens = num_tokens


def test_a_burst_takes_the_pages_of_its_positions_and_counts_one_token() -> None:
    """Each burst counts one token against the budget. A burst ends before a snapshot
    position past its first token (b: 12, block 4); one at its first token stays (a: 8)."""
    mgr = make_manager(num_chunks=16)
    sched = scheduler(mgr)
    a, b = seq("a", 7), seq("b", 8)
    for s in (a, b):
        sched.add(s)
    run_step(sched)  # prefilled, one token sampled each
    burst(a, 3)
    burst(b, 3)
    sched.max_num_batched_tokens = 2
    out = sched.schedule()  # a budget of 2 tokens: one per burst
    assert [(c.seq.seq_id, c.start, c.num_tokens, c.num_burst_tokens) for c in out.chunks] == [
        ("a", 7, 4, 3),
        ("b", 8, 3, 2),  # positions 8, 9, 10: the state after 12 is the next round's first
    ]
    chunk = out.chunks[0]
    assert (chunk.known_end, chunk.token_ids) == (8, [SAMPLED])
    assert [s.position for s in chunk.allocation.snapshots] == [8]
    assert len(mgr.block_table(a.seq_id, 0)) == 3  # 11 positions at 4 tokens a page
    for c in out.chunks:
        c.seq.output_token_ids += [1] * c.num_tokens
        sched.advance(c)
    assert (a.num_computed, a.num_tokens, a.num_burst_tokens) == (11, 12, 0)
    assert (b.num_computed, b.num_tokens) == (11, 12)
    assert mgr.num_computed_tokens(a.seq_id) == 11
    assert mgr._reqs[a.seq_id].tokens == a.all_token_ids
    mgr.check_integrity()


def test_a_burst_round_admits_nobody_and_the_next_round_does() -> None:
    mgr = make_manager(num_chunks=16)
    sched = scheduler(mgr)
    a, c = seq("a", 7), seq("c", 3)
    sched.add(a)
    run_step(sched)
    sched.add(c)  # a preempted sequence, say: the engine bursts only with nobody waiting
    burst(a, 2)
    out = sched.schedule()
    assert [(x.seq.seq_id, x.num_tokens) for x in out.chunks] == [("a", 3)]
    assert list(sched.waiting) == [c]
    a.output_token_ids += [1, 2, 3]
    sched.advance(out.chunks[0])
    assert work(run_step(sched)) == [("a", 10, 1), ("c", 0, 3)]


def test_a_stop_inside_a_burst_keeps_the_last_snapshot_of_its_sequence() -> None:
    """Regression: a burst from 9 reserved the snapshot at 12, taking the page of the
    request's parked snapshot at 8 (one per request is kept while it decodes); a stop
    before 12 then dropped both, and the next turn found 8 tokens less. Now the burst
    ends before 12, and the snapshot at 8 is there for the next turn."""
    mgr = make_manager(num_chunks=16)
    sched = scheduler(mgr)
    a = seq("a", 5)
    sched.add(a)
    for _ in range(4):  # the prompt, then one-token steps to 9 tokens computed
        run_step(sched)
    assert a.num_computed == 8
    run_step(sched)
    burst(a, 5)  # positions 9..14 would reach 12
    [chunk] = sched.schedule().chunks
    assert (chunk.start, chunk.num_tokens, chunk.allocation.snapshots) == (9, 2, ())
    a.output_token_ids += [1]  # a stop at the burst's first token
    sched.advance(chunk)
    sched.finish(a, "stop")
    again = seq("a2", 14)
    again.prompt_token_ids = [*a.all_token_ids, 7, 7, 7]
    sched.add(again)
    [resumed] = sched.schedule().chunks
    assert resumed.start == 8  # its snapshot at 8
    mgr.check_integrity()


def test_a_burst_that_does_not_fit_decodes_plainly_and_preempts_nobody() -> None:
    mgr = make_manager(num_chunks=3, caching=False)
    sched = scheduler(mgr)
    a, b = seq("a", 7), seq("b", 7)
    for s in (a, b):
        sched.add(s)
    run_step(sched)  # both prefilled: 2 KV pages each, 2 of the 6 left
    burst(a, 12)  # 13 positions from 7: 3 more KV pages
    burst(b, 1)  # 2 positions: fits
    out = sched.schedule()
    assert [(c.seq.seq_id, c.num_tokens, c.num_burst_tokens) for c in out.chunks] == [
        ("a", 1, 0),
        ("b", 2, 1),
    ]
    assert out.preempted == []
    mgr.check_integrity()
