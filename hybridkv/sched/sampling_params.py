"""SamplingParams: how one prompt's completions are drawn, validated at construction.

The fields and defaults follow vLLM's ``SamplingParams`` so user code moves over unchanged
(``max_tokens=16``, ``temperature=1.0``; ``top_k`` 0 or -1 means off). Every bad value
raises ``ValueError`` naming the field, because these values arrive from users and HTTP
clients, and a bad one found later inside a batch would fail the other requests too.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20  # top alternatives returned per token, as OpenAI's API caps it
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty
GREEDY_BELOW = 1e-5  # vLLM's rule: a smaller temperature is greedy (1/T would overflow)
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts


class RequestOutputKind(enum.Enum):
    """Which outputs a running request gives (vLLM's enum and values).

    CUMULATIVE: after every step that moved it, all its tokens and text so far.
    FINAL_ONLY: one output, when it finishes; ``LLM.generate`` and ``LLM.chat`` ask for
    it. Without stop strings or a grammar, which read the text as it grows, its text is
    then decoded once, at the end (``detokenizer.whole_text``), not a token at a time.
    DELTA (vLLM's new-tokens-only outputs) is refused: nothing here gives it yet.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """A grammar the output must follow: exactly one of the fields (vLLM's names).

    Attributes:
        json: a JSON schema (a dict, or its text).
        json_object: any JSON object (OpenAI's ``response_format: json_object``).
        regex: a regular expression the whole output matches.
        choice: the output is one of these strings.
        grammar: a grammar in Lark syntax (llguidance's, which takes GBNF-like rules too).
        whitespace_flexible: JSON may have any whitespace between its tokens. Off (the
            default), JSON is written with ", " and ": " and no other whitespace, as models
            usually write it: free whitespace lets a weak model pad until max_tokens.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(f"structured_outputs.json must be a schema object, got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")


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
        prompt_logprobs: the same for every prompt token after the first (the prompt is
            then computed in full: no prefix-cache hit for this request).
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: leave special tokens out of the decoded text.
        repetition_penalty: divides the positive logits (multiplies the negative ones) of
            every token already in the prompt or the output; 1 is off (CTRL's penalty).
        presence_penalty: subtracted from the logit of every token already generated.
        frequency_penalty: subtracted once per earlier occurrence in the output.
        logit_bias: token id -> value added to its logit (in [-100, 100]).
        min_tokens: EOS and the stop token ids are not sampled before this many tokens.
        bad_words: words never generated (each as tokenized alone and after a space;
            a multi-token word's last token is banned once the others were generated).
        structured_outputs: a grammar the output must follow (JSON schema, regex,
            choice, grammar); see :class:`StructuredOutputsParams`.
        output_kind: every step's output, or only the final one
            (:class:`RequestOutputKind`).
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
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}"
                )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.output_kind not in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            raise ValueError(
                "output_kind must be RequestOutputKind.CUMULATIVE or FINAL_ONLY (DELTA is not "
                f"supported), got {self.output_kind!r}"
            )
        self._check_logits_processors()

    def _check_logits_processors(self) -> None:
        rep = self.repetition_penalty
        if not _is_number(rep) or not math.isfinite(rep) or rep <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {rep!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or not all(
                _is_int(k) and k >= 0 and _is_number(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS
                for k, v in bias.items()
            ):
                raise ValueError(
                    f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {bias!r}"
                )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        words = self.bad_words
        if words is not None and (
            not isinstance(words, list | tuple)
            or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {words!r}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be StructuredOutputsParams, got {type(so).__name__}"
            )

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

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def child_seed(self, index: int) -> int | None:
        """Seed of the ``index``-th of n completions: distinct, and reproducible."""
        return None if self.seed is None else self.seed + index
