"""The sampler's batched greedy path gives what sampling each row on its own gives."""

from __future__ import annotations

import torch

from hybridkv.engine.logits_processors import RowContext
from hybridkv.engine.sampler import SampledToken, SamplingFailure, sample, sample_row
from hybridkv.sched.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def one_by_one(logits: torch.Tensor, rows: list[RowContext]) -> list[object]:
    """The reference: :func:`sample_row` on each row, a failure for a row it rejects."""
    out: list[object] = []
    for i, row in enumerate(rows):
        try:
            out.append(sample_row(logits[i].float(), row))
        except ValueError as exc:
            out.append(SamplingFailure(str(exc)))
    return out


def context(params: SamplingParams, seed: int = 0, **kwargs: object) -> RowContext:
    return RowContext(params=params, generator=torch.Generator().manual_seed(seed), **kwargs)  # type: ignore[arg-type]


def test_plain_greedy_rows_equal_the_per_row_argmax() -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0))
    logits[5, 17] = logits[5, 200] = logits[5].max() + 1  # a tie: the first index wins
    rows = [context(GREEDY) for _ in range(64)]
    got = sample(logits, rows)
    assert got == one_by_one(logits, rows)
    assert got[5] == SampledToken(17, None, [])


def test_unsampleable_rows_fail_alone() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    logits[1] = float("-inf")
    logits[2, 7] = float("nan")
    rows = [context(GREEDY) for _ in range(4)]
    got = sample(logits, rows)
    assert got == one_by_one(logits, rows)
    assert [type(r) for r in got] == [SampledToken, SamplingFailure, SamplingFailure, SampledToken]


def test_mixed_rows_keep_their_order_and_their_own_sampling() -> None:
    """Greedy rows with logprobs, a logit bias or penalties and random rows beside plain
    greedy ones: each row's result is the one sampling it alone gives, in row order."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2), dtype=torch.bfloat16)
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=4),
        SamplingParams(temperature=0.8, seed=3, max_tokens=4),
        SamplingParams(temperature=0.0, logit_bias={3: 100.0}, max_tokens=4),
        GREEDY,
        SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=4),
    ]
    got = sample(logits, [context(p, seed=i, output_ids=[1, 2]) for i, p in enumerate(params)])
    want = one_by_one(logits, [context(p, seed=i, output_ids=[1, 2]) for i, p in enumerate(params)])
    assert got == want
    assert isinstance(got[3], SampledToken) and got[3].token_id == 3
    assert isinstance(got[1], SampledToken) and got[1].logprob is not None
