"""Detokenize a sequence's output as it grows and decide when it stops.

Order of the checks after each sampled token (vLLM's): a stop token id, EOS (unless
``ignore_eos``), a stop string in the new text, then the length limits. A matched stop
string is cut from the text (kept with ``include_stop_str_in_output``); a stop token id
stays in ``token_ids``. While a sequence runs, ``text`` holds back what may still change or
be cut: a trailing U+FFFD (half of a multi-byte character split across tokens) and the
last ``len(longest stop string) - 1`` characters (they may be the start of a stop string),
so streamed text only ever grows (vLLM does the same).
"""

from __future__ import annotations

from collections.abc import Collection

from hybridkv.models.tokenizer import Tokenizer
from hybridkv.sched.request import Sequence

REPLACEMENT_CHAR = "\ufffd"


PROMPT_CONTEXT_TOKENS = 6  # prompt tokens decoded with the output, then cut off


def decode_output(seq: Sequence, tokenizer: Tokenizer | None) -> str:
    """The output's text as it reads after the prompt.

    Decoding the output ids alone is wrong for SentencePiece-style decoders, which drop the
    space marker of the first token as if it started the text; so the last few prompt
    tokens are decoded with them and their text is cut off (vLLM's prefix offset).
    """
    if tokenizer is None:
        return ""
    skip = seq.params.skip_special_tokens
    context = seq.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
    if seq.prompt_context_text is None:  # the prompt never changes: decode it once
        seq.prompt_context_text = tokenizer.decode(context, skip_special_tokens=skip)
    prefix = seq.prompt_context_text
    full = tokenizer.decode(context + seq.output_token_ids, skip_special_tokens=skip)
    if prefix and full.startswith(prefix) and not prefix.endswith(REPLACEMENT_CHAR):
        return full[len(prefix) :]
    return tokenizer.decode(seq.output_token_ids, skip_special_tokens=skip)


def find_stop_string(text: str, stops: tuple[str, ...], search_from: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after ``search_from``."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, search_from - len(stop) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best


def update_and_check(
    seq: Sequence,
    token: int,
    *,
    tokenizer: Tokenizer | None,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> tuple[str, int | str | None] | None:
    """Refresh ``seq.text`` after ``token`` was appended; (finish_reason, stop_reason) or None."""
    params = seq.params
    previous = len(seq.text)
    full = decode_output(seq, tokenizer)
    if params.stop_token_ids and token in params.stop_token_ids:
        seq.text = full
        return "stop", token
    if not params.ignore_eos and token in eos_token_ids:
        seq.text = full
        return "stop", None
    if params.stop_strings:
        found = find_stop_string(full, params.stop_strings, previous)
        if found is not None:
            at, stop = found
            seq.text = full[: at + len(stop)] if params.include_stop_str_in_output else full[:at]
            return "stop", stop
    if params.max_tokens is not None and seq.num_outputs >= params.max_tokens:
        seq.text = full
        return "length", None
    if seq.num_tokens >= max_model_len:
        seq.text = full
        return "length", None
    seq.text = streamable_text(full, params.stop_strings)
    return None


def streamable_text(full: str, stops: tuple[str, ...]) -> str:
    """The part of a running sequence's text that no later token can change."""
    text = full.rstrip(REPLACEMENT_CHAR)
    hold = max((len(s) for s in stops), default=1) - 1
    return text[: len(text) - hold] if hold else text
