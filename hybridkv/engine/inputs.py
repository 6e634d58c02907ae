"""Prompts in, validated token ids out: the checks every entry point shares.

``LLMEngine.add_request``, the batch APIs of ``LLM`` (which check every request before
queueing any), the server and ``hybridkv generate`` all go through :class:`InputProcessor`,
so a prompt is refused for the same reasons with the same message wherever it comes from.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

from hybridkv.engine.structured_output import GrammarMatcher, StructuredOutputManager
from hybridkv.models.tokenizer import Tokenizer
from hybridkv.sched.sampling_params import SamplingParams

PromptType = str | Seq[int] | Mapping[str, Any]


class InputProcessor:
    """Encodes prompts and checks requests against one model's vocabulary and length, and
    turns what a request asks for (bad words, a grammar) into what the sampler applies."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        structured: StructuredOutputManager | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.structured = structured

    def encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text, token ids, or a vLLM-style dict.

        Raises:
            ValueError: the prompt is empty, malformed, or text without a tokenizer.
        """
        text: str | None = None
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
            elif isinstance(prompt.get("prompt"), str):
                return self.encode(prompt["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass prompt_token_ids")
            text = prompt
            ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            ids = prompt
        if not isinstance(ids, Seq) or isinstance(ids, str):
            raise ValueError(
                f"prompt token ids must be a list of integers, got {type(ids).__name__}"
            )
        ids = list(ids)
        if not ids:
            raise ValueError("the prompt is empty")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt token id {t!r} is outside the vocabulary [0, {self.vocab_size})"
                )
        return text, ids

    def validate(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Every check a request must pass before it is queued: (text, token ids) of the prompt.

        Batch APIs call it on all requests before queueing any, so a bad one queues nothing.

        Raises:
            ValueError: a bad prompt, one that leaves no room to generate within
                max_model_len, stop strings or bad words without a tokenizer, a logit_bias
                token outside the vocabulary, or a grammar that does not compile.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.encode(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                f"no room left to generate"
            )
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        for token in params.logit_bias or {}:
            if token >= self.vocab_size:
                raise ValueError(
                    f"logit_bias token id {token} is outside the vocabulary [0, {self.vocab_size})"
                )
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer")
        if params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured outputs need a tokenizer")
            self.structured.compile(params.structured_outputs)  # a bad grammar raises here
        return text, ids

    def grammar_matchers(self, params: SamplingParams) -> list[GrammarMatcher | None]:
        """One grammar walk per completion (compiled once per grammar, then cached)."""
        if params.structured_outputs is None or self.structured is None:
            return [None] * params.n
        compiled = self.structured.compile(params.structured_outputs)
        return [compiled.matcher() for _ in range(params.n)]

    def bad_words_ids(self, params: SamplingParams) -> list[list[int]]:
        """Token ids of each bad word, alone and after a space (vLLM's rule: the spaced form
        counts only if it is a different first token of the same length)."""
        if not params.bad_words or self.tokenizer is None:
            return []
        result: list[list[int]] = []
        for word in params.bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            result.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                result.append(spaced)
        return [ids for ids in result if ids]
