"""Prompt log-probabilities: how likely each prompt token was given the tokens before it.

vLLM's ``prompt_logprobs`` (and what OpenAI's completions ``echo`` + ``logprobs`` return for
the prompt): position 0 has none; position ``p`` gets the log-probability and rank of
``prompt[p]`` under the logits after ``prompt[:p]``, plus the ``k`` most likely tokens there.
The runner returns every row of a prompt chunk when asked; a chunk covering positions
``[start, end)`` yields the entries of positions ``start + 1 .. min(end, P - 1)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class PromptTokenLogprob(NamedTuple):
    position: int  # in the prompt, >= 1
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float, int]]  # (token id, logprob, rank), most likely first


def chunk_prompt_logprobs(
    rows: Tensor, prompt_ids: list[int], start: int, k: int
) -> list[PromptTokenLogprob]:
    """The entries a prompt chunk's logits give (``rows``: [chunk tokens, vocab] fp32)."""
    count = min(rows.shape[0], len(prompt_ids) - 1 - start)  # rows whose next token is prompt
    if count <= 0:
        return []
    logprobs = torch.log_softmax(rows[:count].float(), dim=-1)  # [count, vocab]
    targets = torch.tensor(prompt_ids[start + 1 : start + 1 + count], dtype=torch.int64)
    chosen = logprobs.gather(1, targets[:, None])[:, 0]  # [count]
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    top_values, top_ids = (
        torch.topk(logprobs, min(k, logprobs.shape[1]), dim=-1) if k > 0 else (None, None)
    )
    entries = []
    for j in range(count):
        top: list[tuple[int, float, int]] = []
        if top_values is not None and top_ids is not None:
            top = [
                (int(t), float(v), r + 1)
                for r, (v, t) in enumerate(zip(top_values[j], top_ids[j], strict=True))
            ]
        entries.append(
            PromptTokenLogprob(start + 1 + j, int(targets[j]), float(chosen[j]), int(ranks[j]), top)
        )
    return entries
