"""A sequence the scheduler runs: one completion of one prompt.

A prompt with ``n`` completions becomes ``n`` sequences (engine-made ids
``"<arrival order>.<i>"``) that the scheduler treats independently; the shared prompt is
found in the prefix cache by whichever runs second. Pure Python, like the core:
the scheduler is model-free.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hybridkv.core.ids import ReqId
from hybridkv.sched.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token state of one completion; ``num_computed`` tokens are in the cache."""

    seq_id: ReqId
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens the first admission found cached
    # Prompt log-probabilities are still to be computed: the prompt must run in full (no
    # prefix-cache hit), since a hit skips the positions whose logits are wanted.
    needs_prompt_logits: bool = False
    admitted_once: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Detokenized text (stop strings are matched on it) and per-token logprobs.
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, object]] = field(default_factory=list)
    # Speculative decoding: drafts the engine wants verified in the next step (0: a plain
    # decode), and the draft tokens themselves, filled in once the step is scheduled.
    num_draft_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    # A decode burst: tokens the engine wants the next step to produce after the first by
    # feeding its own samples back (0: one token; see Scheduler, "Decode bursts").
    num_burst_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
