"""Sampler: next tokens from the last-position logits, one row per sequence.

Each row first goes through the sequence's logits processors (grammar mask, bad words,
min_tokens, logit bias, penalties: :mod:`hybridkv.engine.logits_processors`). Greedy rows
then take the argmax, so a greedy row with nothing to process is comparable token for
token with transformers' greedy ``generate``. Random rows apply, in vLLM's order,
temperature, then top-k, top-p and min-p filters, and draw with the sequence's own
``torch.Generator``: a seeded request gives the same tokens whatever it is batched with.
Log-probabilities are those of the raw model distribution (before any processing).

Rows are sampled independently and a row that cannot be sampled (its filters left no
token, its logits are not finite) yields a :class:`SamplingFailure` for its own sequence:
the other rows of the step are not affected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from hybridkv.engine.logits_processors import RowContext, process
from hybridkv.sched.sampling_params import SamplingParams

NO_TOKEN_ALLOWED = "no token is allowed (every logit is -inf or NaN)"


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # of the sampled token; None when logprobs were not asked for
    top: list[tuple[int, float, int]]  # (token id, logprob, rank), most likely first
    rank: int = 0  # rank of the sampled token (1 = most likely); 0 when not computed


class SamplingFailure(NamedTuple):
    """A row that could not be sampled; only its own sequence fails."""

    message: str


def filtered_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (``logits``: [vocab] fp32)."""
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= params.top_p  # keep the smallest prefix reaching top_p
        drop[0] = False  # the most likely token stays: a top_p that rounds to 0 in fp32 keeps it
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_row(logits: Tensor, row: RowContext) -> SampledToken:
    params = row.params
    processed = process(logits, row)
    if params.greedy:
        token = greedy_token(processed)
    else:
        token = int(torch.multinomial(checked_probs(processed, params), 1, generator=row.generator))
    return with_logprobs(logits, token, params)


def greedy_token(processed: Tensor) -> int:
    """The argmax of a processed row.

    Raises:
        ValueError: every token is banned (-inf) or the row is NaN.
    """
    token = int(torch.argmax(processed))
    if not torch.isfinite(processed[token]):
        raise ValueError(NO_TOKEN_ALLOWED)
    return token


def checked_probs(processed: Tensor, params: SamplingParams) -> Tensor:
    """:func:`filtered_probs` of a processed row.

    Raises:
        ValueError: the filters left no token with a finite probability.
    """
    probs = filtered_probs(processed, params)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        raise ValueError("the sampling filters left no token with a finite probability")
    return probs


def with_logprobs(logits: Tensor, token: int, params: SamplingParams) -> SampledToken:
    """``token`` with its log-probability, rank and the top alternatives if asked for, all
    from the raw row ``logits`` (before any processing, as vLLM reports them)."""
    if params.logprobs is None:
        return SampledToken(token, None, [])
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = float(logprobs[token])
    rank = int((logprobs > logprobs[token]).sum()) + 1
    top: list[tuple[int, float, int]] = []
    if params.logprobs > 0:
        values, ids = torch.topk(logprobs, min(params.logprobs, logprobs.numel()))
        top = [(int(i), float(v), r + 1) for r, (v, i) in enumerate(zip(values, ids, strict=True))]
    return SampledToken(token, chosen, top, rank)


def sample(logits: Tensor, rows: list[RowContext]) -> list[SampledToken | SamplingFailure]:
    """One token per row of ``logits`` [R, vocab], or the reason that row failed.

    Plain greedy rows (nothing to process, no logprobs: most of a serving batch) take one
    batched argmax between them; the others are sampled one by one. Both give the tokens
    :func:`sample_row` gives (tests/engine/test_sampler.py).
    """
    values = logits.float().cpu()
    results: list[SampledToken | SamplingFailure | None] = [None] * len(rows)
    plain = [i for i, row in enumerate(rows) if is_plain_greedy(row)]
    if plain:
        for i, result in zip(plain, greedy_batch(values, plain), strict=True):
            results[i] = result
    for i, row in enumerate(rows):
        if results[i] is not None:
            continue
        try:
            results[i] = sample_row(values[i], row)
        except (ValueError, RuntimeError) as exc:  # this row only: its neighbours go on
            results[i] = SamplingFailure(str(exc))
    return [r for r in results if r is not None]


def is_plain_greedy(row: RowContext) -> bool:
    """A greedy row whose token is its raw argmax and reports no logprobs."""
    return row.params.greedy and row.params.logprobs is None and not row.needs_processing


def greedy_batch(values: Tensor, picked: list[int]) -> list[SampledToken | SamplingFailure]:
    """:func:`greedy_token` of the rows ``picked`` of ``values`` [R, vocab], in one argmax
    and one gather instead of a handful of ops and host syncs per row (a decode step's
    64 rows cost ~450 ops one by one)."""
    rows = values if len(picked) == values.shape[0] else values[picked]
    tokens = rows.argmax(dim=-1)
    finite = torch.isfinite(rows.gather(1, tokens[:, None]))[:, 0]
    return [
        SampledToken(token, None, []) if ok else SamplingFailure(NO_TOKEN_ALLOWED)
        for token, ok in zip(tokens.tolist(), finite.tolist(), strict=True)
    ]
