"""Sampler: next tokens from the last-position logits, one row per sequence.

Greedy rows take the argmax of the raw logits, so a greedy engine run is comparable token
for token with transformers' greedy ``generate``. Random rows apply, in vLLM's order,
temperature, then top-k, top-p and min-p filters, and draw with the sequence's own
``torch.Generator``: a seeded request gives the same tokens whatever it is batched with.
Log-probabilities are those of the raw model distribution (before the filters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hybridkv.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # of the sampled token; None when logprobs were not asked for
    top: list[tuple[int, float, int]]  # (token id, logprob, rank), most likely first
    rank: int = 0  # rank of the sampled token (1 = most likely); 0 when not computed


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
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_row(
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None
) -> SampledToken:
    if params.greedy:
        token = int(torch.argmax(logits))
    else:
        probs = filtered_probs(logits, params)
        token = int(torch.multinomial(probs, 1, generator=generator))
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


def sample(
    logits: Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[SampledToken]:
    """One token per row of ``logits`` [R, vocab]."""
    rows = logits.float().cpu()
    return [
        sample_row(rows[i], p, g) for i, (p, g) in enumerate(zip(params, generators, strict=True))
    ]
