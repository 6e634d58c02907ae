"""Decide when a sequence stops, on its ids and on its text as it grows.

Order of the checks after each sampled token (vLLM's): a stop token id, EOS (unless
``ignore_eos``), a stop string in the new text, then the length limits. A matched stop
string is cut from the text (kept with ``include_stop_str_in_output``); a stop token id
stays in ``token_ids``. While a sequence runs, ``text`` holds back what may still change or
be cut: a trailing U+FFFD and the last ``len(longest stop string) - 1`` characters (they
may be the start of a stop string), so streamed text only ever grows (vLLM does the same).
The text comes from the sequence's :class:`IncrementalDetokenizer`, which never gives half a
character: a token that ends a stop string and also begins a multi-byte character (one BPE
token ``"x\xe2"``, say) gives its text with the next token only, so such a stop is found
one token later than the whole decode of 7c50ae8 found it: one more id in ``token_ids``,
the text cut at the same place (vLLM's DecodeStream detokenizer behaves the same).
"""

from __future__ import annotations

from collections.abc import Collection

from hybridkv.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from hybridkv.sched.request import Sequence


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
    detokenizer: IncrementalDetokenizer | None,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> tuple[str, int | str | None] | None:
    """Feed ``token`` (just appended to ``seq``) to the sequence's detokenizer (None: no
    tokenizer, the text stays ""), refresh ``seq.text``; (finish_reason, stop_reason) or
    None."""
    params = seq.params
    if detokenizer is None:
        searched, text = 0, ""
    else:
        searched = len(detokenizer.text)  # stop strings were looked for up to here
        detokenizer.push(token)
        text = detokenizer.text
    if params.stop_token_ids and token in params.stop_token_ids:
        seq.text = final_text(detokenizer)
        return "stop", token
    if not params.ignore_eos and token in eos_token_ids:
        seq.text = final_text(detokenizer)
        return "stop", None
    if params.stop_strings and len(text) > searched:
        found = find_stop_string(text, params.stop_strings, searched)
        if found is not None:
            at, stop = found
            seq.text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
            return "stop", stop
    if params.max_tokens is not None and seq.num_outputs >= params.max_tokens:
        seq.text = final_text(detokenizer)
        return "length", None
    if seq.num_tokens >= max_model_len:
        seq.text = final_text(detokenizer)
        return "length", None
    seq.text = streamable_text(text, params.stop_strings)
    return None


def final_text(detokenizer: IncrementalDetokenizer | None) -> str:
    """A finished sequence's text: all of it, held-back ids included ("" without a
    tokenizer)."""
    return detokenizer.final_text() if detokenizer is not None else ""


def streamable_text(full: str, stops: tuple[str, ...]) -> str:
    """The part of a running sequence's text that no later token can change."""
    text = full.rstrip(REPLACEMENT_CHAR)
    hold = max((len(s) for s in stops), default=1) - 1
    return text[: len(text) - hold] if hold else text
