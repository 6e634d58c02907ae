"""What the engine returns: vLLM's RequestOutput / CompletionOutput shapes.

A ``RequestOutput`` is produced every step a request makes progress (so a server can
stream it) and once more when it finishes; ``text`` and ``token_ids`` are always the whole
completion so far, and a streaming client takes the difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Logprob(NamedTuple):
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a request's n completions.

    ``finish_reason``: None while running, then "stop" (EOS, a stop id or string),
    "length" (max_tokens or max_model_len) or "abort". ``stop_reason`` is the stop string
    or stop token id that ended it (None for EOS and length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic`` seconds) of one request's life.

    ``inter_token_latencies``: the time between two steps that gave the request new tokens,
    one entry per such step after the first (vLLM's ``inter_token_latency_seconds``).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish (None while running)."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    def record_token(self, now: float) -> None:
        """A step at ``now`` gave the request tokens (called once or more per step)."""
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None and now > self.last_token_time:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now


@dataclass
class RequestOutput:
    """The state of one request: its prompt, completions, and prefix-cache reuse.

    ``num_cached_tokens``: prompt tokens served from the prefix cache (for n > 1, the
    first completion's count; the others usually reuse the whole prompt).
    ``prompt_logprobs`` (when asked for): None for the first prompt token, then the
    token's and the top alternatives' log-probabilities given the tokens before it.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = field(default=None)  # set when the engine had to give up on it
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
