"""N-gram drafts (prompt lookup decoding): the sequence's own text predicts its next tokens.

A sequence that is copying (editing a given text, quoting a document, repeating a loop) has
its last few tokens somewhere earlier in its prompt or output; what followed them there is
the draft. For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the suffix
of ``n`` tokens is looked up among the sequence's earlier n-grams; the most recent
occurrence wins (the nearest context is the likeliest to be continued), and the tokens
after it are the draft::

    tokens   ... a b c d e ... x a b c        suffix "a b c" (n = 3) matched at e
                   ^^^^^ ~~~                  draft "d e ..." (up to k tokens)

When the continuation runs into the suffix itself (a loop of period ``p < k``: ``... a b a
b a b``), the draft goes on around the loop: the sequence repeated itself from the match to
its end, so the best guess is that it keeps doing so.

Every n-gram of a sequence is indexed once, when the sequence grows past it (one dict per
``n``: n-gram -> end of its latest occurrence), so a proposal costs O(max - min + k) dict
work per step, not a scan of the sequence. Pure Python; no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.sched.request import Sequence as Seq
    from hybridkv.sched.scheduler import ScheduledChunk


@dataclass(slots=True)
class _Index:
    """The n-grams of one sequence that end before its last token, by size."""

    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending at positions < indexed (exclusive ends) are in


class NgramProposer:
    """Drafts of up to ``num_speculative_tokens`` tokens copied from a sequence's history."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens
        self._indexes: dict[str, _Index] = {}

    def propose(
        self, seq_id: str, prompt: Sequence[int], output: Sequence[int], max_tokens: int
    ) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft tokens following ``prompt + output``; [] if no
        suffix of at least ``prompt_lookup_min`` tokens occurred before."""
        limit = min(self.num_speculative_tokens, max_tokens)
        tokens = _Concat(prompt, output)
        length = len(tokens)
        if limit <= 0 or length <= self.min_n:
            return []
        index = self._indexes.setdefault(seq_id, _Index())
        self._extend(index, tokens, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index.ends.get(n, {}).get(tokens.slice(length - n, length))
            if end is not None:
                period = length - end  # the sequence repeated itself from end to length
                return [tokens[end + i % period] for i in range(limit)]
        return []

    def forget(self, seq_id: str) -> None:
        """Drop a finished sequence's index."""
        self._indexes.pop(seq_id, None)

    def _extend(self, index: _Index, tokens: _Concat, upto: int) -> None:
        """Index every n-gram that ends (exclusively) at positions up to ``upto``."""
        for end in range(max(index.indexed, self.min_n), upto + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index.ends.setdefault(n, {})[tokens.slice(end - n, end)] = end
        index.indexed = max(index.indexed, upto + 1)


class _Concat:
    """``prompt + output`` without copying either (a sequence's tokens grow every step)."""

    __slots__ = ("_output", "_prompt", "_split")

    def __init__(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        self._prompt, self._output, self._split = prompt, output, len(prompt)

    def __len__(self) -> int:
        return self._split + len(self._output)

    def __getitem__(self, i: int) -> int:
        return self._prompt[i] if i < self._split else self._output[i - self._split]

    def slice(self, start: int, stop: int) -> tuple[int, ...]:
        split = self._split
        if stop <= split:
            return tuple(self._prompt[start:stop])
        if start >= split:
            return tuple(self._output[start - split : stop - split])
        return tuple(self._prompt[start:]) + tuple(self._output[: stop - split])


class NgramDrafts:
    """:class:`NgramProposer` as the engine's proposer: the draft found when the step is
    planned is the one verified. Its guesses cost no forward (``free_guess``)."""

    free_guess = True

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer
        self._found: dict[str, list[int]] = {}

    def available(self, seq: Seq, limit: int) -> int:
        found = self.proposer.propose(seq.seq_id, seq.prompt_token_ids, seq.output_token_ids, limit)
        self._found[seq.seq_id] = found
        return len(found)

    def guess(self, seq_id: str) -> int | None:
        found = self._found.get(seq_id)
        return found[0] if found else None

    def fill(self, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            if chunk.num_draft_tokens:
                seq = chunk.seq
                seq.draft_token_ids = self._found[seq.seq_id][: chunk.num_draft_tokens]

    def forget(self, seq_id: str) -> None:
        self._found.pop(seq_id, None)
        self.proposer.forget(seq_id)
