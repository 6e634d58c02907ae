"""Verification of drafts: greedy is exact, sampling keeps the target's distribution.

The statistical tests draw many times with fixed seeds (deterministic, no flakiness) and
compare the emitted tokens with the target distribution by a chi-square test; a deliberately
wrong resampling rule run through the same test fails it, so the test has the power to see
a real mistake.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hybridkv.engine.logits_processors import RowContext
from hybridkv.engine.sampler import sample_row
from hybridkv.engine.spec_decode import rejection
from hybridkv.engine.spec_decode.rejection import verify
from hybridkv.sched.sampling_params import SamplingParams

VOCAB = 6
DRAWS = 6_000
ALPHA = 1e-3


def chi_square_pvalue(counts: Counter[int], probs: torch.Tensor) -> float:
    """Upper-tail p-value of Pearson's statistic for ``counts`` drawn from ``probs``."""
    total = sum(counts.values())
    support = [t for t in range(len(probs)) if probs[t] > 0]
    assert all(t in support for t in counts), "a token with probability 0 was emitted"
    stat = sum(
        (counts.get(t, 0) - total * float(probs[t])) ** 2 / (total * float(probs[t]))
        for t in support
    )
    dof = len(support) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def rows(seed: int) -> torch.Tensor:
    return torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


def row_context(params: SamplingParams, seed: int) -> RowContext:
    return RowContext(params=params, generator=torch.Generator().manual_seed(seed))


def test_without_drafts_it_is_the_ordinary_sampler() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, logprobs=2, max_tokens=4)
    logits = rows(1)[:1]
    for seed in range(20):
        got = verify(logits, [], row_context(params, seed))
        assert got == [sample_row(logits[0], row_context(params, seed))]


def test_greedy_keeps_drafts_while_they_are_the_argmax() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    logits = rows(2)
    best = logits.argmax(dim=-1).tolist()
    other = next(t for t in range(VOCAB) if t not in best[:2])
    row = row_context(params, 0)
    all_kept = verify(logits, best[:2], row)
    assert [t.token_id for t in all_kept] == best  # both drafts and the bonus
    first_wrong = verify(logits, [other, best[1]], row)
    assert [t.token_id for t in first_wrong] == [best[0]]
    second_wrong = verify(logits, [best[0], other], row)
    assert [t.token_id for t in second_wrong] == best[:2]  # the mismatch becomes the argmax


def test_each_position_is_processed_with_the_drafts_before_it_as_output() -> None:
    # Token 3 wins every row; a presence penalty bans it once it is in the output, so
    # decoding one token at a time gives 3, then the runner-up. Verification must agree.
    logits = torch.zeros(3, VOCAB)
    logits[:, 3] = 5.0
    logits[:, 1] = 4.0
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, max_tokens=8)
    got = verify(logits, [3, 3], row_context(params, 0))
    assert [t.token_id for t in got] == [3, 1]
    min_tokens = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=8)
    row = RowContext(params=min_tokens, stop_ids={3})
    assert [t.token_id for t in verify(logits, [1, 1], row)] == [1, 1, 3]  # EOS allowed at 2


def test_logprobs_are_the_raw_rows() -> None:
    params = SamplingParams(temperature=0.0, logprobs=1, max_tokens=8)
    logits = rows(3)
    best = logits.argmax(dim=-1).tolist()
    got = verify(logits, best[:2], row_context(params, 0))
    for i, token in enumerate(got):
        assert token.logprob == pytest.approx(float(torch.log_softmax(logits[i], -1)[best[i]]))
        assert token.rank == 1


def emitted(params: SamplingParams, logits: torch.Tensor, drafts: list[int], q=None):
    """First and second emitted tokens (the second only when the first draft was kept).

    With draft probabilities ``q`` the drafts are drawn from them, as a draft model would
    (rejection sampling is exact only for drafts distributed as ``q``)."""
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    draw = torch.Generator().manual_seed(12345)
    for seed in range(DRAWS):
        if q is not None:
            drafts = [int(torch.multinomial(q[i], 1, generator=draw)) for i in range(len(q))]
        out = verify(logits, drafts, row_context(params, seed), q)
        first[out[0].token_id] += 1
        if len(out) > 1:  # the first draft was kept
            second[out[1].token_id] += 1
    return first, second


def target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from hybridkv.engine.sampler import filtered_probs

    return torch.stack([filtered_probs(r, params) for r in logits])


@pytest.mark.parametrize("point_mass", [True, False], ids=["ngram", "draft-probs"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_tokens=8),
        SamplingParams(temperature=0.7, top_k=4, top_p=0.9, max_tokens=8),
    ],
    ids=["plain", "filtered"],
)
def test_sampling_keeps_the_target_distribution(point_mass: bool, params: SamplingParams) -> None:
    logits = rows(4)
    p = target(logits, params)
    drafts = [int(p[0].argmax()), int(p[1].argmin())]  # a likely and an unlikely draft
    q = None
    if not point_mass:
        q = torch.softmax(torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(9)), -1)
    first, second = emitted(params, logits, drafts, q)
    assert chi_square_pvalue(first, p[0]) > ALPHA, (first, p[0])
    assert chi_square_pvalue(second, p[1]) > ALPHA, (second, p[1])


def test_the_chi_square_test_rejects_a_wrong_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resampling from p itself (instead of p without the rejected draft) is a classic bug:
    the rejected token comes back too often. The same test must catch it."""

    def wrong(p, draft, q, row):
        u = float(torch.rand((), generator=row.generator))
        if u < float(p[draft]):
            return draft
        return int(torch.multinomial(p, 1, generator=row.generator))

    monkeypatch.setattr(rejection, "_accept_or_resample", wrong)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    logits = rows(4)
    p = target(logits, params)
    first, _ = emitted(params, logits, [int(p[0].argmax()), 0])
    assert chi_square_pvalue(first, p[0]) < 1e-6
