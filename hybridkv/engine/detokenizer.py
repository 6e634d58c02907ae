"""A sequence's output text, grown one sampled token at a time.

Why: decoding the whole output again after every token (what the engine did up to 7c50ae8)
costs O(n) per token and O(n^2) per sequence: ~21 µs a token at 300 output ids with the
tests' byte tokenizer, the largest Python cost of a decode step. ``tokenizers``' DecodeStream
(:class:`~hybridkv.models.tokenizer.TextStream`) decodes only a short window, the ids of the
chunk of text it gave last plus the new ones, in one call into Rust per token, whatever the
output's length (vLLM's FastIncrementalDetokenizer uses it the same way).

What ``text`` is:

- The output as it reads after the prompt. The stream is first fed the prompt's last
  :data:`PROMPT_CONTEXT_TOKENS` ids and their text is dropped, so a SentencePiece-style
  decoder keeps the space marker of the first output token (decoding the output alone
  strips it as if it began the text). When that context decodes to nothing, or ends inside
  a character (its text ends in U+FFFD), the output is decoded alone, as the whole decode
  always did: a character the prompt left unfinished is not finished by the output.
- Never half a character: while the ids end inside a multi-byte character the stream gives
  nothing and holds them back. :meth:`IncrementalDetokenizer.final_text` adds what the held
  ids decode to (U+FFFD for bytes that never became a character), so a finished sequence
  reads as the whole decode of context + output, less the context's text.
- Equal to that whole decode whenever the decoder is prefix-stable, i.e. decoding more ids
  never changes the text of fewer: byte-level BPE decoders (GPT-2, Qwen, Llama 3, the tests'
  byte tokenizer) are, for any ids, valid UTF-8 or not; Metaspace / SentencePiece ones are
  for valid UTF-8. A byte-fallback decoder is not on invalid bytes: a run of ``<0x..>``
  tokens that is no valid UTF-8 becomes one U+FFFD per token, a byte it had decoded alone
  (a space, say) included. The stream then raises :class:`InvalidStreamPrefix`; the text
  given so far stays and a fresh stream decodes the held ids and the new one, so the text
  only grows (what was streamed stays true) and may differ from a whole decode in those
  characters. The whole decode is no better there: it rewrites text already streamed.
- Bounded work on any ids: if :data:`MAX_HELD_IDS` ids in a row give no text (bytes that
  never form a character, skipped special tokens), their text is given as it decodes then
  (U+FFFD for unfinished bytes) and the stream starts again from the last chunk, so the
  window never grows with the output. No character spans that many ids unless ids that
  decode to nothing sit inside it, so the text is still the whole decode in practice.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.models.tokenizer import InvalidStreamPrefix, TextStream, Tokenizer

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 6  # prompt ids decoded before the output, their text dropped
MAX_HELD_IDS = 16  # ids in a row without text before they are given as they decode


class IncrementalDetokenizer:
    """The text of one sequence's output ids, fed one id at a time with :meth:`push`.

    Where it lives: ``LLMEngine`` makes it at a sequence's first sampled token and keeps it
    in its per-request record (``_Request.detokenizers``, by sequence index) beside the
    sequence's grammar matcher and generator, not on the scheduler's
    :class:`~hybridkv.sched.request.Sequence`, which stays model- and tokenizer-free (only
    the resulting ``text`` is written there). It lives as long as the request: a preempted
    sequence keeps its output ids, so its text goes on where it was.
    """

    __slots__ = ("_held", "_last_chunk", "_skip_special_tokens", "_stream", "_tokenizer", "text")

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream: TextStream = tokenizer.text_stream(skip_special_tokens)
        # The stream's window: the ids of the last text it gave, then the ids it holds back.
        self._last_chunk: list[int] = []
        self._held: list[int] = []
        self.text = ""  # everything given so far; never ends inside a character
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if context:
            context_text = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
            if context_text and not context_text.endswith(REPLACEMENT_CHAR):
                for token_id in context:
                    self._feed(token_id)

    def push(self, token_id: int) -> str:
        """Feed the next output id; the text it adds to :attr:`text` ("" while held back)."""
        piece = self._feed(token_id)
        if piece:
            self.text += piece
        return piece

    def final_text(self) -> str:
        """:attr:`text` and what the held ids decode to: the text of a finished sequence.

        Costs two decodes of the window (a few ids), and only when ids are held.
        """
        return self.text + self._held_text() if self._held else self.text

    def _feed(self, token_id: int) -> str:
        try:
            piece = self._stream.step(token_id)
        except InvalidStreamPrefix:
            return self._restart([*self._held, token_id])
        self._held.append(token_id)
        if piece is not None:
            self._last_chunk, self._held = self._held, []
            return piece
        if len(self._held) < MAX_HELD_IDS:
            return ""
        piece = self._held_text()  # bytes that will not become a character: give them now
        context, self._last_chunk, self._held = self._last_chunk, [], []
        self._stream = self._tokenizer.text_stream(self._skip_special_tokens)
        for old in context:  # the window's start again, so the next id reads after it
            self._feed(old)
        return piece

    def _restart(self, token_ids: list[int]) -> str:
        """The decoder rewrote text the stream gave: the text stays as given, and a fresh
        stream (no context) decodes the held ids and the new one. Each nested restart
        gets fewer ids (a fresh stream's first text cannot fail), so this ends."""
        self._stream = self._tokenizer.text_stream(self._skip_special_tokens)
        self._last_chunk, self._held = [], []
        return "".join([self._feed(token_id) for token_id in token_ids])

    def _held_text(self) -> str:
        """What the held ids add after the last chunk's text, U+FFFD and all (the stream's
        own rule, without its wait for a whole character)."""
        skip = self._skip_special_tokens
        before = self._tokenizer.decode(self._last_chunk, skip_special_tokens=skip)
        after = self._tokenizer.decode(self._last_chunk + self._held, skip_special_tokens=skip)
        if after.startswith(before):
            return after[len(before) :]
        return self._tokenizer.decode(self._held, skip_special_tokens=skip)


def whole_text(
    tokenizer: Tokenizer,
    prompt_token_ids: Sequence[int],
    output_ids: Sequence[int],
    skip_special_tokens: bool,
) -> str:
    """A finished output's text decoded at once: the prompt's last
    :data:`PROMPT_CONTEXT_TOKENS` ids and the output, less the context's text (the output
    alone where that context decodes to nothing or ends inside a character). What
    :meth:`IncrementalDetokenizer.final_text` gives wherever the decoder is
    prefix-stable (module doc), for two decodes in place of one per token: the text of
    a request nobody reads before it finishes (``RequestOutputKind.FINAL_ONLY``)."""
    context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
    decode = tokenizer.decode
    if context:
        context_text = decode(context, skip_special_tokens=skip_special_tokens)
        if context_text and not context_text.endswith(REPLACEMENT_CHAR):
            full = decode(context + list(output_ids), skip_special_tokens=skip_special_tokens)
            if full.startswith(context_text):
                return full[len(context_text) :]
    return decode(list(output_ids), skip_special_tokens=skip_special_tokens)
