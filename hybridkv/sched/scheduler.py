"""Continuous batching over the CacheManager: which sequences run this step, and how far.

One step (the shape of vLLM v1 and nano-vllm)::

    running first, oldest first     a decode token or the next prefill chunk, cut by the
                                    step's token budget and by ``CacheManager.next_split``
                                    so that a chunk ends where a state snapshot is due;
                                    when ``allocate`` fails the NEWEST running sequence is
                                    preempted (freed: its hashed pages stay in the prefix
                                    cache, it is recomputed later) until the allocation fits
    then waiting, in arrival order  the prefix hit first (KV pages and a state snapshot at
                                    exactly the same length), then as much of the rest as
                                    the budget allows; stops at the first one that does not
                                    fit (FCFS), so a long prompt is never starved; one
                                    whose prefix a running sequence is computing and will
                                    snapshot is passed over (it resumes there a step or
                                    two later instead of computing the prefix again) and
                                    the ones behind it are admitted meanwhile

Waiting prompts are announced to the manager, so the first of many requests behind one
shared prefix snapshots where they branch off it (``CacheManager.announce``). Each step
also tells it how many waiting sequences it may admit (waiting ones, up to the free
seats: ``CacheManager.expect_admissions``), so the running sequences' KV growth leaves
the chunks their live states need.

Speculative decoding: a decoding sequence the engine gave ``num_draft_tokens`` runs its last
token and that many drafts as one chunk (they count against the token budget), with a
scratch state per draft (``allocate(num_speculative_tokens=)``); if that does not fit it
runs a plain decode instead: speculation never preempts anyone.

Decode bursts: a decoding sequence the engine gave ``num_burst_tokens`` runs as a chunk of
``1 + num_burst_tokens`` positions of which only the first token is known; the step feeds
each token it samples back as the next position's input (the engine's runner, through its
decode graph), so one scheduling round produces that many tokens more. The chunk takes the
pages of all its positions up front (cut at the next split, like a prefill chunk) and
counts one token against the budget, since each forward of the burst computes one token of
it; if the pages do not fit it runs a plain decode instead. A burst ends before any
snapshot position past its first token (``CacheManager.burst_end``: a stop short of it
would lose the request's parked snapshot with it). A round holding a burst
admits nobody: every chunk of it is a decode, the shape the burst's forwards run, and a
waiting sequence (the engine bursts with nobody waiting who could be admitted: every seat
taken, or none waiting) joins a round later. The step keeps every sampled token up to a
stop. A burst is cut short by its sequence's stop token, or by another's while requests
wait for a seat (the engine's runner ends the round there); the sequence then keeps the
tokens it has, and the state and snapshots past them are never used.

Admission allocates the sequence's live state page up front, so a sequence is only ever
admitted when its state fits, and running sequences make progress or are preempted: the
loop cannot deadlock. A sequence that does not fit even with nothing else running is
rejected (the engine checks at start-up that one max_model_len sequence fits, so this is
a safety net, not a normal path).

Pure Python (no torch, no model): the engine adds the model, the sampler and the stop
rules; the simulator (:mod:`hybridkv.sim.loop`) adds a cost model instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybridkv.core.ids import ReqId
from hybridkv.core.manager import Allocation, CacheManager, Hit
from hybridkv.sched.request import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at ``start`` run in this step; the last
    ``num_draft_tokens`` of them are drafts (``seq.draft_token_ids``) to verify, or the
    last ``num_burst_tokens`` are tokens the step samples itself (a decode burst)."""

    seq: Sequence
    start: int
    num_tokens: int
    allocation: Allocation
    samples: bool  # the chunk reaches the end of the known tokens: sample the next one
    num_draft_tokens: int = 0
    num_burst_tokens: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def known_end(self) -> int:
        """End of the sequence's own tokens in the chunk (drafts or a burst's follow)."""
        return self.end - self.num_draft_tokens - self.num_burst_tokens

    @property
    def token_ids(self) -> list[int]:
        seq, known = self.seq, self.known_end
        drafts = seq.draft_token_ids[: self.num_draft_tokens]
        assert len(drafts) == self.num_draft_tokens, "drafts are filled in before the run"
        return seq.all_token_ids[self.start : known] + drafts


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Waiting and running sequences over one :class:`CacheManager`."""

    def __init__(
        self, manager: CacheManager, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ membership

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.manager.announce(seq.seq_id, seq.all_token_ids)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence (done or aborted) and release its pages to the prefix cache."""
        if seq.status is SequenceStatus.RUNNING:
            self.manager.free(seq.seq_id)
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.manager.withdraw(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        seats = max(0, self.max_num_seqs - len(self.running))
        self.manager.expect_admissions(min(len(self.waiting), seats))
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            chunk = self._schedule_running(seq, budget, out)
            if chunk is not None:
                out.chunks.append(chunk)
                budget -= chunk.num_tokens - chunk.num_burst_tokens
        if any(c.num_burst_tokens for c in out.chunks):
            return out  # a burst round admits nobody (module doc)
        index = 0  # the first waiting sequence not passed over this step
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            if self._sibling_prefilling(seq) or self._prefix_coming(seq):
                index += 1  # its prefix is on the way: admit the ones behind it meanwhile
                continue
            chunk = self._admit(seq, budget, busy=bool(out.chunks), out=out)
            if chunk is None:
                break
            out.chunks.append(chunk)
            budget -= chunk.num_tokens
        return out

    def _sibling_prefilling(self, seq: Sequence) -> bool:
        """Another completion of the same prompt is still computing it (n > 1).

        Waiting for it costs a step or two and turns the rest of the prompt into a prefix
        hit for this one; admitting now would compute the same prompt twice.
        """
        if not self.manager.config.enable_prefix_caching:
            return False
        return any(
            other.request_id == seq.request_id and other.num_computed < len(other.prompt_token_ids)
            for other in self.running
        )

    def _prefix_coming(self, seq: Sequence) -> bool:
        """A running sequence is computing this one's prefix and will snapshot its end."""
        return not seq.needs_prompt_logits and self.manager.awaits_prefix(seq.seq_id)

    def _chunk_end(self, seq: Sequence, start: int, budget: int) -> int:
        end = start + min(seq.num_tokens - start, budget)
        return self.manager.next_split(seq.seq_id, start, end)

    def _schedule_running(
        self, seq: Sequence, budget: int, out: SchedulerOutput
    ) -> ScheduledChunk | None:
        start = seq.num_computed
        drafts = min(seq.num_draft_tokens, budget - 1)
        if drafts > 0 and start == seq.num_tokens - 1:
            n = 1 + drafts
            alloc = self.manager.allocate(seq.seq_id, n, num_speculative_tokens=drafts)
            if alloc is not None:
                return ScheduledChunk(seq, start, n, alloc, True, drafts)
        if seq.num_burst_tokens > 0 and start == seq.num_tokens - 1:
            end = self.manager.burst_end(seq.seq_id, start, start + 1 + seq.num_burst_tokens)
            end = self.manager.next_split(seq.seq_id, start, end)
            alloc = self.manager.allocate(seq.seq_id, end - start)
            if alloc is not None:
                n = end - start
                return ScheduledChunk(seq, start, n, alloc, True, num_burst_tokens=n - 1)
        end = self._chunk_end(seq, start, budget)
        while True:
            alloc = self.manager.allocate(seq.seq_id, end - start)
            if alloc is not None:
                return ScheduledChunk(seq, start, end - start, alloc, end == seq.num_tokens)
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return None

    def _preempt(self, seq: Sequence) -> None:
        self.manager.announce(seq.seq_id, seq.all_token_ids)  # before free: reuses its hashes
        self.manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.num_draft_tokens = 0
        seq.num_burst_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _admit(
        self, seq: Sequence, budget: int, *, busy: bool, out: SchedulerOutput
    ) -> ScheduledChunk | None:
        rid: ReqId = seq.seq_id
        self.manager.add_request(rid, seq.all_token_ids)
        hit = Hit(0) if seq.needs_prompt_logits else self.manager.find_hit(rid)
        start = hit.num_tokens
        end = self._chunk_end(seq, start, budget)
        alloc = self.manager.allocate(rid, end - start, hit)
        if alloc is None:
            rejected = not busy and not self.running  # alone and still too big: never fits
            if not rejected:  # it still waits (announced before free: reuses its hashes)
                self.manager.announce(rid, seq.all_token_ids)
            self.manager.free(rid)
            if rejected:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
                out.rejected.append(seq)
            return None
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        num_new = end - start
        start = alloc.num_computed_tokens  # the hit as re-checked by allocate
        seq.num_computed = start
        if not seq.admitted_once:
            seq.admitted_once = True
            seq.num_cached_tokens = alloc.num_cached_tokens
        return ScheduledChunk(seq, start, num_new, alloc, start + num_new == seq.num_tokens)

    # ------------------------------------------------------------------ after the step

    def advance(self, chunk: ScheduledChunk) -> None:
        """Record that ``chunk`` ran, and the tokens the caller appended to the sequence's
        output after it (none after a prefill chunk).

        After a speculative chunk those are the drafts it kept, then the token that
        followed them; the cache keeps the tokens up to the last of them, and the state
        after exactly that many (the manager rolls the rest back). After a burst, the
        tokens it kept: all of them, or those up to a stop, or those before the forward at
        which another sequence's stop ended the round.
        """
        seq = chunk.seq
        new = seq.all_token_ids[chunk.known_end :] if chunk.samples else []
        seq.num_computed = chunk.known_end - 1 + len(new) if new else chunk.known_end
        seq.num_draft_tokens = 0
        seq.num_burst_tokens = 0
        seq.draft_token_ids = []
        self.manager.commit(seq.seq_id, seq.num_computed, new)
