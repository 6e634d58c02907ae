"""The engine's side of speculation: who drafts how much, the proposals, the statistics.

Each step, before scheduling, every running sequence that is decoding is given a number of
drafts (:meth:`Speculator.plan`); the scheduler verifies them with the sequence's last
token as one chunk (or a plain decode if the scratch states do not fit); once the step is
scheduled the drafts are filled in (:meth:`Speculator.fill`: the n-gram proposer already
has them, a draft model runs now); after the verification forward :meth:`record` counts
what was kept.

How many drafts (the fallback when acceptance is low): a step with ``s`` drafts costs
about ``1 + c * s`` plain decode steps (``c``: the cost of one more verified row, plus a
draft model's forward per draft) and emits ``1 + a + ... + a^s`` tokens on average when
each draft is kept with probability ``a`` (Leviathan et al. 2023, eq. 1). Each sequence
keeps a running estimate of ``a`` (kept vs rejected drafts, decayed so that it follows
the text) and asks for the ``s`` that maximises tokens per cost, which is 0 once ``a``
falls below about ``c``: then the sequence decodes plainly and only probes again after
1, 2, 4, ... 64 idle steps (every probe that fails doubles the wait), so text with nothing
to copy costs almost nothing. vLLM has no such rule for n-gram drafts (it always verifies
a match).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.sched.request import Sequence
from hybridkv.sched.scheduler import ScheduledChunk

DECAY = 0.8  # weight of the past in the acceptance estimate, per verification
PRIOR_KEPT, PRIOR_REJECTED = 2.0, 1.0  # a new sequence starts optimistic (a = 2/3)
MAX_PROBE_INTERVAL = 64  # idle steps between probes, at most


class Proposer(Protocol):
    """Where drafts come from (n-gram lookup, a draft model)."""

    def available(self, seq: Sequence, limit: int) -> int:
        """Drafts this proposer can offer ``seq`` now, at most ``limit`` (0: none)."""

    def fill(self, chunks: list[ScheduledChunk]) -> None:
        """Set ``seq.draft_token_ids`` (exactly ``chunk.num_draft_tokens``) of every chunk
        that verifies drafts."""

    def forget(self, seq_id: str) -> None:
        """A sequence finished or restarts: drop what is kept about it."""


@dataclass(slots=True)
class _Acceptance:
    kept: float = PRIOR_KEPT
    rejected: float = PRIOR_REJECTED
    idle_steps: int = 0
    probe_interval: int = 1

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.rejected)


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's counters: verification steps with drafts, draft tokens, kept drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        drafts, tokens, kept = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": tokens,
            "spec_decode_num_accepted_tokens": kept,
            "spec_decode_acceptance_rate": kept / tokens if tokens else 0.0,
            "spec_decode_mean_acceptance_length": 1 + kept / drafts if drafts else 0.0,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
        }


def best_num_drafts(rate: float, available: int, cost_per_draft: float) -> int:
    """The draft count in ``[0, available]`` with the most expected tokens per cost."""
    best, best_value = 0, 1.0
    expected, power = 1.0, 1.0
    for s in range(1, available + 1):
        power *= rate
        expected += power
        value = expected / (1.0 + cost_per_draft * s)
        if value > best_value:
            best, best_value = s, value
    return best


class Speculator:
    """Drafting for the engine; one per engine, used from the stepping thread only."""

    def __init__(
        self, proposer: Proposer, num_speculative_tokens: int, cost_per_draft: float
    ) -> None:
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.cost_per_draft = cost_per_draft
        self.stats = SpecDecodeStats(accepted_per_position=[0] * num_speculative_tokens)
        self._seqs: dict[str, _Acceptance] = {}

    def plan(self, running: Iterable[Sequence], limit: Callable[[Sequence], int]) -> None:
        """Give each decoding sequence its number of drafts for the next step."""
        for seq in running:
            seq.num_draft_tokens = 0
            if seq.num_computed != seq.num_tokens - 1:  # prefilling or recomputing
                continue
            cap = min(self.k, limit(seq))
            if cap <= 0:
                continue
            acc = self._seqs.setdefault(seq.seq_id, _Acceptance())
            wanted = best_num_drafts(acc.rate, cap, self.cost_per_draft)
            if wanted == 0:  # acceptance too low to pay: decode, probe now and then
                acc.idle_steps += 1
                if acc.idle_steps < acc.probe_interval:
                    continue
                acc.idle_steps = 0
                acc.probe_interval = min(2 * acc.probe_interval, MAX_PROBE_INTERVAL)
                wanted = 1
            seq.num_draft_tokens = self.proposer.available(seq, wanted)

    def fill(self, chunks: list[ScheduledChunk]) -> None:
        if any(c.num_draft_tokens for c in chunks):
            self.proposer.fill(chunks)

    def record(self, chunk: ScheduledChunk, num_kept: int) -> None:
        """``num_kept`` of the chunk's drafts were accepted."""
        drafts = chunk.num_draft_tokens
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += drafts
        stats.num_accepted_tokens += num_kept
        for position in range(num_kept):
            stats.accepted_per_position[position] += 1
        acc = self._seqs.setdefault(chunk.seq.seq_id, _Acceptance())
        acc.kept = DECAY * acc.kept + num_kept
        acc.rejected = DECAY * acc.rejected + (num_kept < drafts)
        if best_num_drafts(acc.rate, self.k, self.cost_per_draft) > 0:
            acc.probe_interval = 1  # pays again: no more waiting

    def restart(self, seq_id: str) -> None:
        """The sequence was preempted: its pages (a draft model's too) are gone."""
        self.proposer.forget(seq_id)

    def forget(self, seq_id: str) -> None:
        """The sequence finished."""
        self._seqs.pop(seq_id, None)
        self.proposer.forget(seq_id)
