"""Structured output: grammars compiled by llguidance, one matcher per sequence.

Why llguidance (``benchmarks/grammar_backends.py``, figures in docs/serving.md): on a
150k-token vocabulary it compiles a nested JSON schema in ~2 ms where xgrammar takes ~230 ms
and outlines-core ~2.3 s, its per-token mask is in the same range (tens of µs on CPU), and
it depends on nothing (xgrammar requires torch, transformers and triton).

How it is used: :meth:`StructuredOutputManager.compile` turns a request's
:class:`StructuredOutputsParams` into a matcher (cached by grammar text, so a server
compiles a schema once; it lets go of the GIL while it compiles). Each sequence gets its own
copy (:meth:`CompiledGrammar.matcher`), which masks the sequence's logits before sampling
and advances with every token the sequence accepts. Its state is a function of the output
tokens alone, so it survives preemption (recompute re-runs the model, never the sampler)
and each of n completions walks its own.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hybridkv.models.tokenizer import Tokenizer
from hybridkv.sched.sampling_params import StructuredOutputsParams

CACHE_ENTRIES = 256  # compiled grammars kept (LRU): a server sees the same schemas again
# Compact but readable JSON (what models write): ", " and ": ", no other whitespace. With
# free whitespace a weak model can pad forever and never close the object within max_tokens.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FLEXIBLE_JSON = {"whitespace_flexible": True}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of one structured-output request."""
    import llguidance

    matcher = llguidance.LLMatcher
    options = FLEXIBLE_JSON if params.whitespace_flexible else COMPACT_JSON
    if params.json is not None or params.json_object:
        schema: Any = {"type": "object"} if params.json_object else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict | bool):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        return matcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
    if params.regex is not None:
        return matcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return matcher.grammar_from_lark(choice_lark(params.choice))
    assert params.grammar is not None
    return matcher.grammar_from_lark(params.grammar)


def choice_lark(choices: Sequence[str]) -> str:
    """A Lark grammar matching exactly one of ``choices`` (JSON string literals)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarMatcher:
    """One sequence's walk through a grammar: masks its logits, accepts its tokens."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._bits = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> Tensor:
        """[vocab] bool: the tokens the grammar allows next.

        Raises:
            ValueError: the matcher is in an error state (it accepted a token it should
                not have, or a parser limit was hit).
        """
        words = (self.vocab_size + 31) // 32
        mask = torch.zeros(words, dtype=torch.int32)
        self._matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
        if self._matcher.is_error():
            raise ValueError(f"the output grammar failed: {self._matcher.get_error()}")
        bits = (mask.unsqueeze(1) >> self._bits) & 1  # [words, 32], bit i of word w = token 32w+i
        return bits.flatten()[: self.vocab_size].bool()

    def mask_logits(self, logits: Tensor) -> None:
        """Set the logits of tokens the grammar does not allow to -inf, in place."""
        allowed = self.allowed()
        n = min(allowed.numel(), logits.numel())
        logits[:n].masked_fill_(~allowed[:n], float("-inf"))
        logits[n:] = float("-inf")

    def accept(self, token: int) -> None:
        """Advance past a sampled token.

        Raises:
            ValueError: the grammar does not allow it (the mask was not applied).
        """
        if not self._matcher.consume_token(token):
            raise ValueError(f"the output grammar rejected token {token}")

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (only end of sequence)."""
        return bool(self._matcher.is_stopped()) and not self._matcher.is_error()


class CompiledGrammar:
    """A compiled grammar; :meth:`matcher` hands each sequence a fresh walk through it."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._template = matcher
        self.vocab_size = vocab_size

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self.vocab_size)


class StructuredOutputManager:
    """Compiles structured-output requests for one tokenizer (thread-safe, cached)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()

    def _llguidance_tokenizer(self) -> Any:
        """Built on first use (about a second for a 150k vocabulary), then kept."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None,
                )
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``params`` (from the cache when seen before).

        Raises:
            ValueError: the schema, regex, choice or grammar is invalid (the message says
                where), so a server can answer 400 before queueing anything.
        """
        import llguidance

        text = grammar_text(params)
        with self._lock:
            cached = self._cache.get(text)
            if cached is not None:
                self._cache.move_to_end(text)
                return cached
        matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured output grammar: {matcher.get_error()}")
        compiled = CompiledGrammar(matcher, self.vocab_size)
        try:  # some grammars fail only at their first mask ("start: start")
            compiled.matcher().allowed()
        except ValueError as exc:
            raise ValueError(f"invalid structured output grammar: {exc}") from None
        with self._lock:
            self._cache[text] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled
