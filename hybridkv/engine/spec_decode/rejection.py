"""Verification: the tokens a sequence keeps from one forward over its draft.

The verification forward scored ``[last token, d_1, ..., d_s]``; row ``i`` of its logits is
the model's next-token distribution after ``d_1..d_i``. Each row is processed exactly as a
normal decode step at that position would be (grammar-free sequences only: penalties,
bad words and min_tokens see the drafts before it as output), then, position by position::

    greedy     keep d_{i+1} while it is the argmax; the first mismatch is replaced by the
               argmax and ends the step (token for token what decoding one at a time gives)
    sampling   keep d_{i+1} with probability min(1, p(d)/q(d)); on rejection draw from
               norm(max(0, p - q)) and end the step (Leviathan et al. 2023, Chen et al.
               2023: every emitted token is distributed exactly as p)

where ``p`` is the target's filtered distribution (temperature, top-k/p, min-p) at that
position and ``q`` the draft's; n-gram and greedy draft models propose a point mass
(``q = 1`` at d), so d is kept with probability p(d) and the residual is p without d. When
every draft is kept, the last row gives one more token (the bonus). A step therefore emits
between 1 and s + 1 tokens. With no draft it is exactly :func:`sample_row`, randomness
included, so a sequence that is not speculating samples what it would without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from hybridkv.engine.logits_processors import RowContext, process
from hybridkv.engine.sampler import SampledToken, checked_probs, greedy_token, with_logprobs


def verify(
    logits: Tensor,
    drafts: Sequence[int],
    row: RowContext,
    draft_probs: Tensor | None = None,
) -> list[SampledToken]:
    """The tokens the sequence emits after a verification forward.

    Args:
        logits: [s + 1, vocab] fp32 raw rows, ``s = len(drafts)``.
        drafts: the draft tokens the forward scored after the sequence's last token.
        row: the sequence as the sampler sees it before this step.
        draft_probs: [s, vocab] the draft's distribution at each position; None for a
            point mass on each draft (n-gram, greedy draft model).

    Raises:
        ValueError: a row that cannot be sampled (see :func:`sample_row`).
    """
    assert logits.shape[0] == len(drafts) + 1, (logits.shape, len(drafts))
    assert not (drafts and row.matcher is not None), "grammar rows are never drafted"
    params = row.params
    out: list[SampledToken] = []
    for i in range(len(drafts) + 1):
        at = row if i == 0 else replace(row, output_ids=[*row.output_ids, *drafts[:i]])
        processed = process(logits[i], at)
        if i == len(drafts):  # every draft kept: the bonus token, drawn as usual
            token = _sample(processed, row)
        elif params.greedy:
            token = greedy_token(processed)
        else:
            q = None if draft_probs is None else draft_probs[i]
            token = _accept_or_resample(checked_probs(processed, params), drafts[i], q, row)
        out.append(with_logprobs(logits[i], token, params))
        if i < len(drafts) and token != drafts[i]:
            break
    return out


def _sample(processed: Tensor, row: RowContext) -> int:
    if row.params.greedy:
        return greedy_token(processed)
    probs = checked_probs(processed, row.params)
    return int(torch.multinomial(probs, 1, generator=row.generator))


def _accept_or_resample(p: Tensor, draft: int, q: Tensor | None, row: RowContext) -> int:
    """``draft`` with probability min(1, p/q), else a draw from the residual (p - q)+."""
    q_draft = 1.0 if q is None else float(q[draft])
    u = float(torch.rand((), generator=row.generator))
    if q_draft > 0 and u * q_draft < float(p[draft]):  # u < p/q without dividing
        return draft
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had probability ~0
        residual = p
    return int(torch.multinomial(residual, 1, generator=row.generator))
