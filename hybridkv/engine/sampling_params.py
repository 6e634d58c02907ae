"""SamplingParams: how one prompt's completions are drawn, validated at construction.

The fields and defaults follow vLLM's ``SamplingParams`` so user code moves over unchanged
(``max_tokens=16``, ``temperature=1.0``; ``top_k`` 0 or -1 means off). Every bad value
raises ``ValueError`` naming the field, because these values arrive from users and HTTP
clients, and a bad one found later inside a batch would fail the other requests too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top alternatives returned per token, as OpenAI's API caps it
GREEDY_BELOW = 1e-5  # vLLM's rule: a smaller temperature is greedy (1/T would overflow)
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(kw_only=True)
class SamplingParams:
    """Sampling settings of one request.

    Attributes:
        n: completions per prompt (they share the prompt's prefix-cache pages).
        max_tokens: tokens to generate at most; None: until max_model_len.
        temperature: 0 (or below 1e-5) is greedy (argmax); higher flattens the distribution.
        top_p: nucleus sampling, keep the smallest set of tokens with mass >= top_p.
        top_k: keep the k most likely tokens; 0 or -1 keeps all.
        min_p: drop tokens less likely than min_p times the most likely one.
        seed: makes sampling of this request reproducible whatever else is batched.
        stop: strings that end the completion (excluded from the text by default).
        stop_token_ids: token ids that end the completion (kept in ``token_ids``).
        ignore_eos: keep generating past the end-of-sequence token.
        logprobs: return the log-probabilities of this many top tokens per step
            (plus the sampled one); None returns none.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: leave special tokens out of the decoded text.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            raise ValueError(f"seed must be a 64-bit integer or None, got {self.seed!r}")
        self.stop_strings = self._check_stop(self.stop)
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, list | tuple) or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
            self.stop_token_ids = list(ids)
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}"
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    @staticmethod
    def _check_stop(stop: object) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return tuple(items)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def child_seed(self, index: int) -> int | None:
        """Seed of the ``index``-th of n completions: distinct, and reproducible."""
        return None if self.seed is None else self.seed + index
