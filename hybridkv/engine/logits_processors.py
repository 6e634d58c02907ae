"""What changes one sequence's next-token logits before sampling, in vLLM's order.

For one row (``[vocab]`` fp32, a copy: the raw row stays for the log-probabilities)::

    grammar mask      tokens the structured-output grammar does not allow -> -inf
    bad words         a banned word's last token, once the rest of it was generated -> -inf
    min tokens        EOS and the stop token ids -> -inf until min_tokens were generated
    logit bias        + bias[token]
    penalties         repetition (prompt + output), then frequency and presence (output)

Greedy sampling takes the argmax of the result, so with nothing to apply a greedy row is
the argmax of the raw logits, token for token what transformers picks. Each step is a
plain function, tested against values computed by hand.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hybridkv.sched.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybridkv.engine.structured_output import GrammarMatcher


@dataclass(slots=True)
class RowContext:
    """One sequence as the sampler sees it (built by the engine for every sampled row)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    stop_ids: Collection[int] = ()  # EOS (unless ignore_eos) and stop_token_ids
    bad_words: Sequence[Sequence[int]] = ()  # token ids of each banned word
    matcher: GrammarMatcher | None = None

    @property
    def needs_processing(self) -> bool:
        p = self.params
        return bool(
            self.matcher is not None
            or self.bad_words
            or (p.min_tokens and len(self.output_ids) < p.min_tokens)
            or p.logit_bias
            or p.has_penalties
        )


def apply_bad_words(
    logits: Tensor, bad_words: Sequence[Sequence[int]], output_ids: Sequence[int]
) -> None:
    """Ban each word's last token where the output ends with the rest of the word (vLLM:
    only generated tokens count, so a prompt ending in a word's prefix does not ban)."""
    for word in bad_words:
        prefix = list(word[:-1])
        if len(prefix) > len(output_ids):
            continue
        if not prefix or list(output_ids[len(output_ids) - len(prefix) :]) == prefix:
            logits[word[-1]] = float("-inf")


def apply_min_tokens(
    logits: Tensor, num_outputs: int, min_tokens: int, stop_ids: Collection[int]
) -> None:
    if num_outputs < min_tokens and stop_ids:
        logits[list(stop_ids)] = float("-inf")


def apply_logit_bias(logits: Tensor, bias: dict[int, float]) -> None:
    if bias:
        ids = torch.tensor(list(bias), dtype=torch.int64)
        logits[ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)


def apply_penalties(
    logits: Tensor,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    params: SamplingParams,
) -> None:
    """vLLM's penalties: repetition over prompt and output tokens (positive logits divided
    by it, negative ones multiplied), then ``frequency * count`` and ``presence * [count >
    0]`` subtracted for tokens of the output."""
    vocab = logits.numel()
    counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.int64), minlength=vocab)
    counts = counts[:vocab].to(logits.dtype)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_ids:
            seen[torch.tensor(list(prompt_ids), dtype=torch.int64)] = True
        penalty = params.repetition_penalty
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, scaled, logits))
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty:
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)


def process(logits: Tensor, row: RowContext) -> Tensor:
    """The row's logits after every processor that applies (a new tensor if any does).

    Raises:
        ValueError: the grammar allows no token (the matcher is in an error state).
    """
    if not row.needs_processing:
        return logits
    out = logits.clone()
    if row.matcher is not None:
        row.matcher.mask_logits(out)
    apply_bad_words(out, row.bad_words, row.output_ids)
    apply_min_tokens(out, len(row.output_ids), row.params.min_tokens, row.stop_ids)
    apply_logit_bias(out, row.params.logit_bias or {})
    if row.params.has_penalties:
        apply_penalties(out, row.prompt_ids, row.output_ids, row.params)
    return out
