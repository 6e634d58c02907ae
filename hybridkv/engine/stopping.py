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
from collections.abc import Sequence as Sequence_

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


def append_and_check(
    seq: Sequence,
    tokens: Sequence_[int],
    *,
    detokenizer: IncrementalDetokenizer | None,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> tuple[int, tuple[str, int | str | None] | None]:
    """Append ``tokens`` to ``seq``'s output one by one, each fed to the sequence's
    detokenizer (None: no tokenizer, the text stays "") and checked by the stop rules,
    until one stops it: (how many were appended, (finish_reason, stop_reason) or None).
    ``seq.text`` is set once, after the last (what a running sequence shows: a burst's or
    a speculative step's tokens need no text in between unless stop strings are looked
    for, which happens after each token)."""
    params = seq.params
    stop_ids = params.stop_token_ids
    eos = () if params.ignore_eos else eos_token_ids
    stops = params.stop_strings
    for count, token in enumerate(tokens, 1):
        seq.output_token_ids.append(token)
        searched = 0
        if detokenizer is not None:
            searched = len(detokenizer.text)  # stop strings were looked for up to here
            detokenizer.push(token)
        if stop_ids and token in stop_ids:
            seq.text = final_text(detokenizer)
            return count, ("stop", token)
        if token in eos:
            seq.text = final_text(detokenizer)
            return count, ("stop", None)
        if stops and detokenizer is not None and len(detokenizer.text) > searched:
            found = find_stop_string(detokenizer.text, stops, searched)
            if found is not None:
                at, stop = found
                text = detokenizer.text
                seq.text = (
                    text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
                )
                return count, ("stop", stop)
        if (params.max_tokens is not None and seq.num_outputs >= params.max_tokens) or (
            seq.num_tokens >= max_model_len
        ):
            seq.text = final_text(detokenizer)
            return count, ("length", None)
    seq.text = streamable_text(detokenizer.text if detokenizer else "", stops)
    return len(tokens), None


def final_text(detokenizer: IncrementalDetokenizer | None) -> str:
    """A finished sequence's text: all of it, held-back ids included ("" without a
    tokenizer)."""
    return detokenizer.final_text() if detokenizer is not None else ""


def streamable_text(full: str, stops: tuple[str, ...]) -> str:
    """The part of a running sequence's text that no later token can change."""
    text = full.rstrip(REPLACEMENT_CHAR)
    hold = max((len(s) for s in stops), default=1) - 1
    return text[: len(text) - hold] if hold else text
